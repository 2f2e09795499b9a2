"""Selection traces: what identification saw in a run of a real model, recorded, and replayed in a timing
run of another shape, so that a random-weight run at 7B scale selects the way a trained model does.

Identification decides from attention scores: every policy of `specjax.engine.identify` turns the H2O scores of
some query heads over the reused prefix into its agreement test (ITF's Jaccard, spec_gqa's guard), its selected
positions and the per-token importance the store's reordering and the caches use. A `Recorder` keeps, per request
and layer, every score row a policy computed; a `Replay` gives a policy, in place of the rows it computed, the
recorded rows mapped onto its own shape:

- requests by index in the workload (`Request.index`): request i replays the i-th (mod N) of the N recorded
  requests that identified (the planner may have computed one's whole prefix: it has no scores),
- layers by relative depth (layer l of L replays recorded layer floor(l * L' / L)),
- positions by relative offset in the reused prefix (position p of r replays recorded position floor(p * r' / r)),
- heads by role: a policy's P probe heads replay the recorded run's P' probe rows of that layer by relative rank
  (probe i: floor(i * P' / P)); every-head scores replay the recorded every-head rows (head h of H:
  floor(h * H' / H)), or the probe rows by relative rank where the recorded layer scored only its probes.

The policy still computes its own scores (the device work, the reads it needs) and then decides from the replayed
ones: the decisions, reads, caches, speculation and reordering that follow are the engine's own. Replayed onto the
model that recorded them, with the same system and workload, the decisions are the recorded ones. A candidate stage
(spec_gqa with `--gqa_candidates`) chooses its candidates from the key summaries of the store it reads; those are
not replayed.

A trace is one `.npz` file per system and retention (`trace_name`), written by the recording run.
"""

from __future__ import annotations

import collections
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax.distributed import to_host
from specjax.errors import SpecjaxError
from specjax.shapes import padded

FORMAT = 1
PROBES, HEADS = 0, 1  # roles of a score row: a policy's probe heads, or every query head
ROLES = {"probes": PROBES, "heads": HEADS}


def trace_name(system: str, retention: float) -> str:
    """The file a system's trace is kept in, in a trace folder."""
    return f"{system}@r={retention:g}.npz"


def source_of(model, system: str, retention: float, task: str, prefix_tokens: int | None) -> dict:
    """What a trace says of the run that recorded it (checked when it is replayed)."""
    c = model.config
    return {"format": FORMAT, "model": model.name, "weights": getattr(model, "weights", "pretrained"),
            "weights_digest": model.weights_digest, "num_layers": c.num_layers, "num_heads": c.num_heads,
            "num_kv_heads": c.num_kv_heads, "system": system, "retention": retention, "task": task,
            "prefix_tokens": prefix_tokens}


class NoScores(SpecjaxError):
    """A selection trace that is missing, or whose recording run never identified."""


class Recorder:
    """Keeps every score row identification computes, per request (by workload index) and layer. A request run
    again (the evaluation's warm-up, then its timed pass) keeps its last run's rows."""

    def __init__(self, source: dict):
        self.source = source
        self.rows: dict[int, dict] = {}  # request -> {(layer, head, role): scores over the reused prefix}
        self.reused: dict[int, int] = {}  # request -> its reused prefix length r
        self._request = None

    def begin(self, index: int | None) -> None:
        if index is None:
            raise SpecjaxError("recording selections needs each request's index in its workload (Request.index)")
        self._request = index
        self.rows[index] = {}
        self.reused.pop(index, None)

    def scores(self, layer: int, heads, role: str, columns: np.ndarray, r: int, scores):
        """Keep `scores` [len(heads), >= len(columns)] (columns: positions of the reused prefix, of r); returns
        them unchanged."""
        host = to_host(scores).astype(np.float32)[:, : len(columns)]
        rows = self.rows[self._request]
        self.reused[self._request] = r
        for i, head in enumerate(heads):
            row = rows.setdefault((layer, int(head), ROLES[role]), np.full(r, np.nan, np.float32))
            row[columns] = host[i]
        return scores

    def save(self, path: pathlib.Path) -> pathlib.Path:
        """Write the trace (compressed npz); a request that scored nothing is kept with no rows."""
        requests = sorted(self.rows)
        keys = [(q, key) for q in requests for key in sorted(self.rows[q])]
        width = max((len(self.rows[q][key]) for q, key in keys), default=0)
        # (request, layer, head, role) and the row, NaN past the request's reused prefix
        index = np.asarray([(q, *key) for q, key in keys], np.int32).reshape(-1, 4)
        table = np.full((len(keys), width), np.nan, np.float32)
        for i, (q, key) in enumerate(keys):
            row = self.rows[q][key]
            table[i, : len(row)] = row
        reused = np.asarray([[q, self.reused.get(q, 0)] for q in requests], np.int64).reshape(-1, 2)
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez_compressed(f, source=np.asarray(json.dumps(self.source)), index=index, scores=table,
                                reused=reused)
        tmp.replace(path)
        return path


@jax.jit
def _gathered(table, rows, positions, count):
    """table[rows][:, positions] in the first `count` columns, zeros after (positions: padded to the scores' width,
    so the program's shape is the bucketed one of the scores, not the prefix's length)."""
    return jnp.where(jnp.arange(positions.shape[0]) < count, table[rows][:, positions], 0.0)


@functools.lru_cache(maxsize=4)
def _read(path: pathlib.Path, mtime_ns: int, size: int) -> tuple:
    """A trace file's arrays, read once per version of the file (the evaluation checks every trace before it runs,
    then each run loads its own; a `Replay` never changes them)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            return json.loads(str(f["source"])), f["index"], f["scores"], f["reused"]
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise SpecjaxError(f"{path} is not a selection trace ({type(e).__name__}: {e})") from None


class Replay:
    """A recorded trace given to identification in place of the scores it computes (see the module's docstring)."""

    def __init__(self, path: pathlib.Path, source: dict, index: np.ndarray, scores: np.ndarray, reused: np.ndarray):
        self.path, self.source = pathlib.Path(path), source
        self._scores = scores
        self._reused = {int(q): int(r) for q, r in reused}
        # (request, layer) -> {role: [(head, row number)] in head order}; request -> its row numbers
        self._rows: dict[tuple[int, int], dict[int, list]] = {}
        self._request_rows: dict[int, list[int]] = collections.defaultdict(list)
        for row, (q, layer, head, role) in enumerate(index.tolist()):
            self._rows.setdefault((q, layer), {}).setdefault(role, []).append((head, row))
            self._request_rows[q].append(row)
        for roles in self._rows.values():
            for rows in roles.values():
                rows.sort()
        # the requests whose recorded run identified (the planner may have computed a request's whole prefix)
        self.requests = sorted(self._request_rows)
        # one shape for every request's rows on the device (the most rows a request has), so replay compiles once
        self._rows_cap = max(map(len, self._request_rows.values()))
        self._request = None
        self._num_layers = self._num_heads = None  # the model replayed onto (`bind`)

    @classmethod
    def load(cls, path) -> "Replay":
        path = pathlib.Path(path)
        if not path.is_file():
            raise NoScores(f"no selection trace at {path}: record one with --record_selections")
        stat = path.stat()
        source, index, scores, reused = _read(path.resolve(), stat.st_mtime_ns, stat.st_size)
        if source.get("format") != FORMAT:
            raise SpecjaxError(f"{path} is a selection trace of format {source.get('format')!r}; this code reads "
                               f"format {FORMAT}: record it again")
        if not len(index):
            raise NoScores(f"{path} holds no scores: its recording run identified in no request")
        return cls(path, source, index, scores, reused)

    @classmethod
    def find(cls, folder, systems: list[str], retention: float) -> "Replay":
        """The first of `systems`' traces at `retention` in `folder` that holds scores (a system may stand in for
        another that identifies alike: the planner's loaded part is SPEC's)."""
        tried = []
        for system in systems:
            try:
                return cls.load(pathlib.Path(folder) / trace_name(system, retention))
            except NoScores as e:  # a damaged trace or one of another format is not passed over
                tried.append(str(e))
        raise NoScores("; ".join(tried))

    def check(self, model, task: str) -> None:
        """Refuse a replay that would not mean what it says: onto another task (its prefixes and questions are what
        the recorded attention was over), or onto a trained model other than the one that recorded it (its own
        attention decides; replay stands in for attention only where the weights are random)."""
        s = self.source
        if s["task"] != task:
            raise SpecjaxError(f"the selection trace {self.path} was recorded on task {s['task']!r}; this run is "
                               f"{task!r}: record a trace of {task!r}")
        same = s["weights_digest"] == model.weights_digest
        if same and (s["num_layers"], s["num_heads"]) != (model.config.num_layers, model.config.num_heads):
            raise SpecjaxError(f"the selection trace {self.path} names these weights but {s['num_layers']} layers "
                               f"of {s['num_heads']} heads; the model has {model.config.num_layers} of "
                               f"{model.config.num_heads}: the trace is damaged")
        if not same and getattr(model, "weights", "pretrained") != "random":
            raise SpecjaxError(f"the selection trace {self.path} was recorded by {s['model']} ({s['weights']} "
                               f"weights); {model.name} has trained weights of its own, so its selections are its "
                               f"own: replay onto random weights (--init random) or onto {s['model']}")

    def describe(self) -> dict:
        """What results say of a replayed run's selections."""
        s = self.source
        return {"trace": str(self.path), "recorded_by": s["model"], "weights": s["weights"], "system": s["system"],
                "retention": s["retention"], "task": s["task"], "prefix_tokens": s["prefix_tokens"],
                "requests": len(self.requests), "layers": s["num_layers"], "heads": s["num_heads"]}

    def begin(self, index: int | None) -> None:
        if index is None:
            raise SpecjaxError("replaying selections needs each request's index in its workload (Request.index)")
        if self._num_layers is None:
            raise SpecjaxError(f"the selection trace {self.path} is not bound to a model (Replay.bind)")
        request = self.requests[index % len(self.requests)]
        if request != self._request:
            # The request's recorded rows go to the device before its clock starts (`Engine.run` calls this first),
            # so a layer's replay is one gather dispatched on the device, with no host work on the request's path.
            rows = self._request_rows[request]
            self._local = {row: i for i, row in enumerate(rows)}
            table = np.zeros((self._rows_cap, self._scores.shape[1]), np.float32)
            table[: len(rows)] = np.nan_to_num(self._scores[np.asarray(rows, np.int64)], nan=0.0)
            self._device_rows = jnp.asarray(table)
            self._positions: dict = {}
            self._request = request

    def scores(self, layer: int, heads, role: str, columns: np.ndarray, r: int, scores):
        """The recorded rows for `heads` of `layer`, mapped onto `columns` of a reused prefix of r positions, in
        the shape and dtype of the computed `scores` (zeros past the columns)."""
        s = self.source
        layer_s = layer * s["num_layers"] // self._num_layers
        roles = self._rows.get((self._request, layer_s), {})
        r_s = self._reused[self._request]
        if not roles:
            raise SpecjaxError(f"the selection trace {self.path} has no scores for request {self._request}, layer "
                               f"{layer_s}: its recording run did not identify there")
        rows = np.asarray([self._local[row] for _, row in self._source_rows(roles, heads, ROLES[role])], np.int32)
        columns = np.asarray(columns, np.int64)
        width = scores.shape[-1]
        key = (r, width, len(columns), hash(columns.tobytes()))
        positions = self._positions.get(key)
        if positions is None:  # the recorded position each column stands for, kept for the request's other layers
            positions = self._positions[key] = jnp.asarray(padded(columns * r_s // r, width, 0))
        return _gathered(self._device_rows, jnp.asarray(rows), positions, len(columns)).astype(scores.dtype)

    def _source_rows(self, roles: dict, heads, role: int) -> list:
        """The recorded (head, row) standing for each of `heads`: every head by relative index among every head;
        probes by relative rank among the recorded probes (so fewer probes than were recorded spread over them, as
        one per KV group when spec_gqa's probes were groups of query heads)."""
        probes, every = roles.get(PROBES), roles.get(HEADS)
        if role == HEADS and every is not None and len(every) == self.source["num_heads"]:
            return [every[int(h) * len(every) // self._num_heads] for h in heads]
        pool = probes or every
        return [pool[i * len(pool) // len(heads)] for i in range(len(heads))]

    def bind(self, cfg) -> "Replay":
        """The model config replayed onto (its layers and query heads)."""
        self._num_layers, self._num_heads = cfg.num_layers, cfg.num_heads
        return self
