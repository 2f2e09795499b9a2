"""The engine's settings, what a request is, and what running it returns."""

from __future__ import annotations

import collections.abc
import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    retention: float = 0.25  # fraction of the reused prefix kept per layer (k = ceil(r * |R|))
    gpu_cache_bytes: int = 0  # the device cache tier's budget (the eval's --gpu_cache, in bytes)
    cpu_cache_bytes: int = 0  # the host cache tier's budget (--cpu_cache, in bytes)
    pcie_bandwidth: float | None = None  # bytes/s of emulated host->device copies (None: not throttled)
    kernel_impl: str = "auto"  # kernels: "auto" (Pallas on GPU), "pallas", "reference"
    reorder_every: int = 0  # run a reordering pass after every N requests (systems with reorder); 0: never
    cake_chunk_tokens: int = 512  # cake: tokens per chunk of its compute / load schedule (a multiple of the store's)
    # chunked prefill: with no reused prefix (recompute, a cold request), more new tokens than this are computed
    # in chunks of this many, each attending to the earlier chunks' KV (exact); 0: one block, as the plain forward
    # (attention is blocked, so one block never holds a [heads, tokens, tokens] score tensor)
    prefill_chunk_tokens: int = 0
    trace: bool = False  # keep every layer's selected token sets in the result (tests, analysis)


@dataclasses.dataclass
class Request:
    prefix: list[int]  # shared prefix (system prompt); its KV is stored and reused
    query: list[int]  # the request's own tokens; computed, never stored
    continuations: list[list[int]] = dataclasses.field(default_factory=list)  # scored against the same KV
    # the prefix as independently cached text chunks (CacheBlend, full KV reuse); empty: one prefix
    chunks: list[list[int]] = dataclasses.field(default_factory=list)
    index: int | None = None  # its place in its workload (a selection trace is recorded and replayed by it)


@dataclasses.dataclass(frozen=True)
class LayerRecord(collections.abc.Mapping):
    """What a request did per layer, the same fields whatever the system (`RequestResult.layers`); NaN where a system
    does not measure a field. A read-only mapping of its fields, as results.json keeps them."""

    prefix_tokens: int  # stored tokens the layers took theirs from (m; after a planner's computed head, the rest)
    retained: list[float]  # share of the m whose stored KV the layer attended to (the rest: skipped or computed)
    loaded_tokens: list[int]  # of the m, those the layer took from storage (caches or disk)
    recomputed: list[float]  # share of the stored prefix computed instead of loaded (1 where nothing was stored)
    fallback: list[bool]  # identification fell back to every key (per-head sets)
    jaccard: list[float]  # probe heads' mean pairwise Jaccard (SPEC's ITF)
    threshold: list[float]  # SPEC's t = j^alpha
    head_share: list[float]  # least share of a head's own top-k the shared set keeps (spec_gqa)

    @classmethod
    def split(cls, num_layers: int, m: int, computed: int) -> "LayerRecord":
        """Every layer used all m stored tokens: the first `computed` computed, the rest loaded whole (cake; the
        planner's plan that computes them all)."""
        nan = [float("nan")] * num_layers
        return cls(m, [(m - computed) / max(m, 1)] * num_layers, [m - computed] * num_layers,
                   [computed / max(m, 1) if m else 1.0] * num_layers, [False] * num_layers, nan, nan, nan)

    def __getitem__(self, key: str):
        if key not in _LAYER_FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(_LAYER_FIELDS)

    def __len__(self) -> int:
        return len(_LAYER_FIELDS)


_LAYER_FIELDS = tuple(f.name for f in dataclasses.fields(LayerRecord))


@dataclasses.dataclass
class RequestResult:
    first_token_logits: np.ndarray  # fp32 [vocab]: logits after prefix + query
    continuation_logprobs: list[tuple[float, bool]]  # (sum logprob, greedy) per continuation
    ttft_ms: float
    breakdown_ms: dict[str, float]  # probe_io, identify, kv_io_stall, compute
    reused_tokens: int
    computed_tokens: int
    io: dict  # store metrics accumulated during the request (disk bytes, chunks, hits, ...)
    layers: LayerRecord
    prefetch: dict  # prefetch_report: speculative prefetch in tokens
    recomputed_bad_chunks: bool = False
    # what damaged stored KV cost the request beyond `io` (engine.REPAIR_COUNTS): the reads of its attempt abandoned
    # at a bad chunk, the reads and writes of the repair after it, the damaged chunks that repair found
    repair_io: dict = dataclasses.field(default_factory=dict)
    # tensor parallel: disk bytes each device's reader read of its own heads during the request (empty when no
    # read was split over devices; heads every device holds are read once and counted in io["disk_bytes"] only)
    disk_bytes_by_device: list[int] = dataclasses.field(default_factory=list)
    selections: list | None = None  # with EngineConfig.trace: per layer, int arrays [heads or 1, k] of R positions
    split: dict | None = None  # cake: where computing from the front met loading from the back (see engine.cake)
    # the request's host time that no disk read, device wait or device work overlapped
    # (clock.Clock.exposed_host_ms); None where the engine does not measure it
    host_exposed_ms: float | None = None
    # the process's CPU time, every thread's, from the request's start to its first token (clock.Clock.cpu_ms)
    cpu_ms: float | None = None
    # the planner (specjax.engine.planner): the stored head computed instead of loaded, its predicted TTFT and every
    # candidate plan's prediction
    plan: dict | None = None


@dataclasses.dataclass
class LayerKV:
    """What one layer's attention saw: prefix arrays + selection, and the computed tokens' own K/V."""

    prefix_k: jax.Array
    prefix_v: jax.Array
    selection: object
    own_k: jax.Array
    own_v: jax.Array
