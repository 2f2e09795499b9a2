"""What a layer's identification policy and the layer loop say to each other (`specjax.engine.identify`'s policies
yield these steps; `LayerIO.select` carries them out and sends each one's result back):

    Take(kind, positions, pad_to)   vectors of the reused prefix [heads, pad_to, d], read through the caches
    TakeChosen(kinds, rows, ...)    the vectors of rows a device step chose, from the caches' pages, or None
    Decide(fn, args, kwargs)        a pure device step of the decision (`specjax.engine.state`, `kernels.quest`)
    Score(...)                      a scoring step, which a selection trace may record or stand in for
    Locate(positions), Summaries(chunks), Credit(...), PlanPeriod(chosen)
                                    where positions lie, their chunks' key summaries, ContiguousKV's feedback and reads

A policy knows the model and system as `Facts` (SPEC's probe heads among them), sees its request's layer as a
`Layer` and returns a `Selected`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Generator, NamedTuple

import jax
import numpy as np

from specjax.engine import state as st
from specjax.kernels import PerHeadIndices, SharedIndices

if TYPE_CHECKING:
    from specjax.config import ModelConfig


def probe_query_heads(cfg, count: int = 3) -> tuple[int, ...]:
    """The first `count` query heads (SPEC: which ones does not matter). With grouped-query attention they
    share as few KV heads as possible, so the probe keys read are fewest (docs/systems.md)."""
    return tuple(range(min(count, cfg.num_heads)))


def probe_kv_heads(cfg, count: int = 3) -> tuple[int, ...]:
    """The KV heads of `probe_query_heads`: the heads of the store's probe kind."""
    group = cfg.q_per_kv
    return tuple(sorted({h // group for h in probe_query_heads(cfg, count)}))


@dataclasses.dataclass(frozen=True)
class Facts:
    """What identification knows, fixed for an engine (`Facts.of`): the model's heads, the system, the store's chunk
    size, the kernels' implementation, and SPEC's probe heads."""

    cfg: ModelConfig
    system: Any  # the engine's `specjax.engine.systems.System`
    chunk_tokens: int | None
    kernel_impl: str
    probe_q: tuple[int, ...]  # SPEC's probe query heads (`probe_query_heads`)
    probe_kv: tuple[int, ...]  # their KV heads: the heads of the store's probe kind
    kv_of_probe: tuple[int, ...]  # for each probe query head, its KV head's row among the probe keys
    kv_of_head: tuple[int, ...]  # for each query head, its KV head
    # the probe heads' keys are every KV head's, in order (e.g. tiny-llama: 3 probe heads over its 2 KV heads; not
    # smollm2, whose 3 probe heads share one KV head): the probe keys a layer reads are then its K
    probe_is_k: bool

    @classmethod
    def of(cls, cfg: ModelConfig, system, chunk_tokens: int | None = None,
           kernel_impl: str = "auto") -> "Facts":
        probe_q = probe_query_heads(cfg, system.num_probe_heads)
        probe_kv = probe_kv_heads(cfg, system.num_probe_heads)
        group = cfg.q_per_kv
        return cls(cfg, system, chunk_tokens, kernel_impl, probe_q, probe_kv,
                   kv_of_probe=tuple(probe_kv.index(h // group) for h in probe_q),
                   kv_of_head=tuple(h // group for h in range(cfg.num_heads)),
                   probe_is_k=probe_kv == tuple(range(cfg.num_kv_heads)))


@dataclasses.dataclass(frozen=True, eq=False)
class Layer:
    """One layer of one request, as its identification sees it: the new tokens' queries and keys, how many prefix
    tokens it keeps, and the reused prefix (m positions, `positions` in the match, padded to m_pad)."""

    index: int
    q: jax.Array  # [H, n_pad, d] the new tokens' queries
    own_k: jax.Array  # [H_kv, n_pad, d] their keys
    n: int  # new tokens
    k: int  # prefix tokens kept
    k_cap: int  # bucket of k: the selection's padded size
    m: int
    m_pad: int
    positions: np.ndarray


class Selected(NamedTuple):
    """What a layer's identification returns."""

    state: st.ImportanceState
    keys: jax.Array  # [H_kv, rows, d] the prefix keys the layer attends to
    values: jax.Array
    selection: SharedIndices | PerHeadIndices  # which rows each head attends to
    # [m] importance of every reused position (for reordering), made when called: after the first token, since
    # nothing before it needs it (its scores' transfer and normalisation stay off that path)
    importance: Callable[[], np.ndarray]
    chosen: np.ndarray  # [1 or H, k] the chosen positions
    # the layer's scoring logits, where every query head scored the rows the selection indexes and the logits were
    # kept (`steps.ScoredLogits`): the attention then weighs the values by them and computes no key products
    logits: Any = None
    # [H_kv, m_pad, d] every reused position's keys, where a shared set's layer holds them whatever it selects (its
    # probe keys are every KV head's keys; `takes_every_key`): spec_mixed's rest then reads no keys of its own
    all_keys: Any = None


# -- the steps a policy yields ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Take:
    """`kind`'s vectors of `positions` [heads, pad_to, d], zeros after them (positions None: every position of the
    reused prefix, padded to m_pad). `phase`: the breakdown's wait it counts as; `importance` (per position) feeds
    the attention-score cache."""

    kind: int
    positions: np.ndarray | None = None
    pad_to: int | None = None
    phase: str = "kv_io_stall"
    importance: np.ndarray | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class TakeChosen:
    """`kinds`' vectors of the rows a device step chose (`rows` [pad_to], indices into the layer's `positions`, the
    first `count` valid; a device array), each [heads, pad_to, d], zeros after `count`, taken on the device from the
    caches' pages without the host reading `rows` first: a tuple of them, or None unless `when` (a device bool,
    e.g. the decision's own test) holds and every row lies in a page the device reads. On None nothing was taken:
    the policy takes its set as it would have."""

    kinds: tuple
    rows: Any
    count: int
    pad_to: int
    when: Any = True


@dataclasses.dataclass(frozen=True, eq=False)
class Decide:
    """fn(*args, **kwargs): a pure device step of the decision, run once the device has done the work its inputs
    come from, and timed as identification."""

    fn: Callable
    args: tuple
    kwargs: dict


@dataclasses.dataclass(frozen=True, eq=False)
class Score(Decide):
    """A scoring step whose rows [len(heads), >= len(columns)] a selection trace records or stands in for
    (`specjax.engine.replay`). `role`: "probes" (a policy's probe heads) or "heads" (every head); `columns`: the
    positions of the reused prefix the first columns score (None: every position)."""

    heads: tuple = ()
    role: str = "heads"
    columns: np.ndarray | None = None

    @property
    def logits(self) -> bool:
        """fn is asked for its logits too (`steps.scores(..., with_logits=True)`): it returns (scores, logits or
        None), and so does the step, a trace standing in for the scores alone."""
        return bool(self.kwargs.get("with_logits"))


@dataclasses.dataclass(frozen=True, eq=False)
class Locate:
    """Where `positions` lie in the store (`stores.Locations`)."""

    positions: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class Summaries:
    """The key summaries of `chunks` of this layer's keys (`stores.summaries`), in their order."""

    chunks: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class Credit:
    """Feed `importance` (per position) of `positions` to their cached chunks of `kind` without reading them."""

    kind: int
    positions: np.ndarray
    importance: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class PlanPeriod:
    """ContiguousKV's reads once a period's first layer has chosen (`LayerIO.plan_period`)."""

    chosen: np.ndarray


Steps = Generator[Any, Any, Selected]


def decide(fn, *args, **kwargs) -> Decide:
    return Decide(fn, args, kwargs)
