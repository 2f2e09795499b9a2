"""Where low-bit prefix KV's error comes from (issue 70): a stored prefix's attention at fewer bits, layer by layer and
end to end, against the same attention at the model's precision.

For the first `--requests` requests of a task's workload, ordered by prefix (the eval's: few-shot prefixes lengthened
to `--prefix_tokens`), the model's own forward gives every layer's queries, keys and values. The prefix's keys and
values are then encoded as a store encodes them (`kernels.quant`: keys per channel against each `--chunk_tokens`-token
chunk's range, chunks from the prefix's start; values per token over `--value_group` channels) and decoded, and every
layer's attention of the query's tokens and then the gold choice's (over the prefix and, causally, themselves; their
queries and own keys exact) is computed again with them:

- `K{b}`, `V{b}`, `KV{b}`: keys, values, or both at b bits (`--bits`), every prefix row;
- `drop`: only the selected rows, exact (spec: the rest dropped); `mixed`: the selected rows at `--selected_bits`,
  the rest at `--rest_bits` (spec_mixed; their keys at `--rest_key_bits` where given). The selection: per KV head,
  the `--retention` of the prefix rows with the most attention from the query (its tokens' and its group's query
  heads' mean softmax weight at full precision; the choice's tokens do not choose, as in the engine, where a
  continuation attends to the set its prefill chose); or (` shared`) the rows with the most over every head, one set
  for all as spec's shared sets are. Both are oracles, which SPEC's probes estimate. ` engine`: the sets the engine
  itself chose for the request (`--engine_system` at these bits, over a store of the prefix alone in a temporary
  folder, caches off): a shared set, or a fallback layer's per-head sets, whose keys then all load at
  `--selected_bits`; in `mixed engine` the rows at `--selected_bits` are every row of the chunks the set (or the
  per-head sets' union) touches, as spec_mixed's `WithRest` loads them;
- `... -var/2`: the same with each low-bit row's score lowered by half its variance from rounding, var = scale^2 *
  sum_c q_c^2 step_c^2 / 12 (step_c: its chunk's code step in channel c). A softmax over noisy scores weighs those
  rows up by exp(var / 2) on average (Jensen), so a mix of precisions shifts weight from the exact rows to the noisy
  ones; this corrects that bias in expectation.

Reported per variant, means over layers, query heads and tokens: the attention output's error ||o' - o|| / ||o|| of
the query's tokens (whose attention chose the set) and of the choice's (whose answer the task scores); for variants
with low-bit keys, the bias of the low-bit rows' softmax mass, log(sum exp s' / sum exp s) over those rows, and the
mean var / 2 that predicts it. The variants of `--chains` also run end to end: the query's and the choice's tokens go
through every layer attending through the variant (their queries and own K/V from their own hidden states), and the
gold choice's log-probability is compared with the model's (`logprob_change`, per request). Nothing here is timed.

    python benchmarks/attention_error.py --task needle --requests 32 --data_dir DATA --out DIR

Writes DIR/attention_error.json and DIR/attention_error.md.
"""

from __future__ import annotations

import functools
import math
import pathlib
import sys
import tempfile

import jax.numpy as jnp
import numpy as np
from absl import app, flags

import specjax
from specjax.eval import tasks as tasks_lib, workload as workload_lib
from specjax.eval.fallback_tokenizer import tokenizer_for
from specjax.eval.observe_measure import ordered_by_prefix
from specjax.engine.types import Request
from specjax.kernels import quant
from specjax.models import transformer as T

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import stored_keys, write_report  # noqa: E402  (benchmarks/_common.py)


def define_flags() -> None:
    """The script's flags (defined when it runs, not when a test imports it beside the eval's own)."""
    flags.DEFINE_string("model", "smollm2-135m", "Model.")
    flags.DEFINE_string("task", "needle", "Task (docs/data.md).")
    flags.DEFINE_string("data_dir", None, "Task data folder (docs/data.md); default $SPECJAX_DATA.")
    flags.DEFINE_integer("limit", None, "Task items the workload is built from (as the eval's --limit; default: "
                         "--requests).")
    flags.DEFINE_integer("requests", 8, "Requests measured: the workload's first, ordered by prefix.")
    flags.DEFINE_integer("prefix_tokens", 1024, "Lengthen every few-shot prefix to at least this many tokens.")
    flags.DEFINE_list("bits", ["8", "4", "2"], "Precisions of the K / V / KV variants.")
    flags.DEFINE_integer("selected_bits", 8, "mixed: the selected rows' bits.")
    flags.DEFINE_integer("rest_bits", 4, "mixed: the other rows' bits.")
    flags.DEFINE_integer("rest_key_bits", None, "mixed: the other rows' keys' bits (default: --rest_bits).")
    flags.DEFINE_float("retention", 0.25, "The share of the prefix's rows selected (per KV head).")
    flags.DEFINE_integer("chunk_tokens", 64, "Tokens a key range covers (the store's chunk).")
    flags.DEFINE_integer("value_group", 32, "Channels a value row's scale covers (the store's default).")
    flags.DEFINE_string("engine_system", "spec_mixed", "The system whose own sets are measured too (` engine`; "
                        "its selection and probe keys at --selected_bits, as spec_mixed-kv8's); empty: none.")
    flags.DEFINE_list("chains", ["KV4", "KV4 -var/2", "drop engine", "mixed engine", "mixed engine -var/2",
                                 "mixed shared"],
                      "Variants also run end to end (the gold choice's log-probability against the model's).")
    flags.DEFINE_string("out", None, "Folder for attention_error.json and attention_error.md (printed either way).")


FLAGS = flags.FLAGS


def encoded(k, v, bits: int, chunk_tokens: int, value_group: int):
    """(keys, their rounding variance per channel, values) float64 [H_kv, m, d] of prefix k / v after a round trip
    through the store's `bits`-bit codes."""
    keys, step, _ = stored_keys(k, bits, chunk_tokens)
    rows = quant.encode_rows(v, bits=bits, group=value_group)
    values = quant.decode_rows(jnp.asarray(rows), bits=bits, group=value_group, head_dim=k.shape[-1])
    return keys.astype(np.float64), step.astype(np.float64) ** 2 / 12, np.asarray(values, np.float64)


def logsumexp(x, axis=-1):
    top = np.max(x, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    return np.squeeze(top, axis) + np.log(np.sum(np.exp(x - top), axis=axis))


class Layer:
    """One layer's attention of the computed tokens, exact and with prefix rows replaced. q [H_kv, G, n, d] (the
    computed tokens, grouped by KV head; the first `choosing` of them choose the selection), prefix k / v [H_kv, m,
    d], own k / v [H_kv, n, d]; float64."""

    def __init__(self, q, k, v, own_k, own_v, scale: float, choosing: int):
        self.q, self.k, self.v, self.own_k, self.own_v = q, k, v, own_k, own_v
        self.scale, self.choosing = scale, choosing
        n = q.shape[2]
        own = np.einsum("hgnd,htd->hgnt", q, own_k) * scale
        self.own = np.where(np.tril(np.ones((n, n), bool)), own, -np.inf)
        self.s = self.scores(k)
        self.o = self.output(self.s, v)

    def scores(self, keys):
        return np.einsum("hgnd,hmd->hgnm", self.q, keys) * self.scale

    def variance(self, noise):
        """Each score's variance from rounding its key's channels: scale^2 sum_c q_c^2 noise_c."""
        return np.einsum("hgnd,hmd->hgnm", self.q ** 2, noise) * self.scale ** 2

    def output(self, s, values, keep=None):
        """The attention output [H_kv, G, n, d] over prefix scores `s` (rows where `keep` [H_kv, 1 or G, m] is False
        left out) and the own tokens."""
        if keep is not None:
            s = np.where(keep[:, :, None, :], s, -np.inf)
        full = np.concatenate([s, self.own], axis=-1)
        w = np.exp(full - np.max(full, axis=-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        m = s.shape[-1]
        return np.einsum("hgnm,hmd->hgnd", w[..., :m], values) + np.einsum("hgnt,htd->hgnd", w[..., m:], self.own_v)

    def error(self, out):
        """||out - o|| / ||o|| per query head and token."""
        return np.linalg.norm(out - self.o, axis=-1) / np.maximum(np.linalg.norm(self.o, axis=-1), 1e-30)

    def mass_bias(self, s, rows):
        """log(sum exp s / sum exp (exact s)) over the prefix rows `rows` [H_kv, m], per query head and token."""
        mask = rows[:, None, None, :]
        return logsumexp(np.where(mask, s, -np.inf)) - logsumexp(np.where(mask, self.s, -np.inf))

    def selected(self, retention: float, shared: bool):
        """[H_kv, 1, m] bool: per KV head (`shared`: one set for every head), the rows with the most mean attention
        weight from its query heads and its choosing tokens."""
        full = np.concatenate([self.s, self.own], axis=-1)[:, :, : self.choosing]
        w = np.exp(full - np.max(full, axis=-1, keepdims=True))
        w = (w / w.sum(-1, keepdims=True))[..., : self.s.shape[-1]].mean(axis=(1, 2))
        if shared:
            w = np.broadcast_to(w.mean(axis=0), w.shape)
        count = max(1, math.ceil(retention * self.s.shape[-1]))
        keep = np.zeros(w.shape, bool)
        np.put_along_axis(keep, np.argsort(-w, axis=-1, kind="stable")[:, :count], True, axis=-1)
        return keep[:, None]


def engine_keep(chosen, kv_heads: int, group: int, m: int, chunk_tokens: int):
    """The engine's chosen positions [1 or H, k] of a layer as (keep [H_kv, 1 or G, m], the rows whose keys are at
    the selected bits, the rows whose values are: [H_kv, m]): a shared set for every head, or per-head sets. Rows at
    the selected bits are whole chunks (`chunk_tokens`, from the prefix's start), every chunk the set or the
    per-head sets' union touches; a per-head layer's keys are all at them."""
    chosen = np.asarray(chosen)
    chunk = np.arange(m) // chunk_tokens
    if chosen.shape[0] == 1:
        keep = np.zeros((kv_heads, 1, m), bool)
        keep[:, :, chosen[0]] = True
        whole = np.broadcast_to(np.isin(chunk, chunk[chosen[0]]), (kv_heads, m))
        return keep, whole, whole
    keep = np.zeros((chosen.shape[0], m), bool)
    np.put_along_axis(keep, chosen, True, axis=-1)
    whole = np.broadcast_to(np.isin(chunk, chunk[keep.any(axis=0)]), (kv_heads, m))
    return keep.reshape(kv_heads, group, m), np.ones((kv_heads, m), bool), whole


def variants(layer: Layer, codes: dict, bits: list, selected_bits: int, rest_bits: tuple, retention: float,
             chosen=None, chunk_tokens: int = 64) -> dict:
    """Every variant of one layer by name (`rest_bits`: the mixed rest's keys' and values' bits): a function giving
    (prefix scores, prefix values, keep or None, (the low-bit rows [H_kv, m], their score variance) or None), computed
    when called."""
    every = np.ones(layer.k.shape[:2], bool)
    out = {}
    for b in bits:
        @functools.cache
        def low_bit(b=b):
            keys, noise, values = codes[b]
            return layer.scores(keys), layer.variance(noise), values
        out[f"K{b}"] = lambda low_bit=low_bit: (low_bit()[0], layer.v, None, (every, low_bit()[1]))
        out[f"V{b}"] = lambda b=b: (layer.s, codes[b][2], None, None)
        out[f"KV{b}"] = lambda low_bit=low_bit: (low_bit()[0], low_bit()[2], None, (every, low_bit()[1]))
        out[f"KV{b} -var/2"] = lambda low_bit=low_bit: (low_bit()[0] - low_bit()[1] / 2, low_bit()[2], None,
                                                        (every, low_bit()[1]))

    @functools.cache
    def both():
        (k_sel, n_sel, v_sel), (k_rest, n_rest, _), v_rest = codes[selected_bits], codes[rest_bits[0]], \
            codes[rest_bits[1]][2]
        return (layer.scores(k_sel), layer.scores(k_rest), layer.variance(n_sel), layer.variance(n_rest), v_sel,
                v_rest)

    sets = {"": functools.cache(lambda: (layer.selected(retention, False),) * 2 + (None,)),
            " shared": functools.cache(lambda: (layer.selected(retention, True),) * 2 + (None,))}
    if chosen is not None:
        @functools.cache
        def engine():
            keep, keys_at, values_at = engine_keep(chosen, *layer.q.shape[:2], layer.k.shape[1], chunk_tokens)
            return keep, keys_at[:, None], values_at
        sets[" engine"] = engine
    for name, make in sets.items():
        out[f"drop{name}"] = lambda make=make: (layer.s, layer.v, make()[0], None)

        def mixed(make=make, corrected=False):
            _, keys_at, values_at = make()
            values_at = keys_at[:, 0] if values_at is None else values_at
            s_sel, s_rest, var_sel, var_rest, v_sel, v_rest = both()
            pick = keys_at[:, :, None, :]
            s, var = np.where(pick, s_sel, s_rest), np.where(pick, var_sel, var_rest)
            values = np.where(values_at[..., None], v_sel, v_rest)
            return s - var / 2 if corrected else s, values, None, (~keys_at[:, 0], var)
        out[f"mixed{name}"] = mixed
        out[f"mixed{name} -var/2"] = functools.partial(mixed, corrected=True)
    return out


def measure_layer(layer: Layer, made: dict, into: dict) -> None:
    """Every variant's errors (and mass biases) of one layer, appended to `into[name]`."""
    split = layer.choosing
    for name, make in made.items():
        s, values, keep, low = make()
        got = into.setdefault(name, {"error": [], "error_choice": [], "mass_bias": [], "predicted": []})
        error = layer.error(layer.output(s, values, keep))
        got["error"].append(error[..., :split].ravel())
        got["error_choice"].append(error[..., split:].ravel())
        if low is not None and low[0].any():  # a fallback layer of the engine's set loads no key at low bits
            rows, var = low
            got["mass_bias"].append(layer.mass_bias(s, rows).ravel())
            got["predicted"].append(mean_over(var / 2, rows))


def mean_over(x, rows):
    """Mean of x [H_kv, G, n, m] over the rows `rows` [H_kv, m] of each head and token."""
    mask = np.broadcast_to(rows[:, None, None, :], x.shape)
    return float(np.sum(np.where(mask, x, 0.0)) / max(mask.sum(), 1))


def engine_sets(model, system: str, request, selected_bits: int, rest_bits: tuple, retention: float,
                chunk_tokens: int) -> list:
    """Per layer, the positions [1 or H, k] `system` (its selection and probe keys at `selected_bits`, the rest's keys
    and values at `rest_bits`) chose for `request`, over a store of its prefix in a temporary folder, caches off."""
    options = {"kv_bits": selected_bits, "rest_bits": rest_bits[1], "rest_key_bits": rest_bits[0]}
    with tempfile.TemporaryDirectory() as folder:
        bits = tuple(sorted({selected_bits, *rest_bits}, reverse=True))
        store = specjax.open_store(model, folder, chunk_tokens=chunk_tokens, kv_bits=bits)
        try:
            engine = specjax.prefill_engine(model, system, store, options=options, retention=retention, trace=True)
            engine.warm(list(request.prefix_ids))
            got = engine.run(Request(list(request.prefix_ids), list(request.query_ids)))
        finally:
            store.close()
    if got.reused_tokens != len(request.prefix_ids):
        raise SystemExit(f"the engine reused {got.reused_tokens} of the prefix's {len(request.prefix_ids)} tokens")
    return got.selections


def run(model, requests, bits: list, selected_bits: int, rest_bits: tuple, retention: float, chunk_tokens: int,
        value_group: int, system: str | None, chains: list) -> dict:
    cfg, params = model.config, model.params
    group = cfg.num_heads // cfg.num_kv_heads
    scale = cfg.head_dim ** -0.5
    into, answers = {}, {name: [] for name in chains}
    for r in requests:
        choice = list(r.choice_ids[r.gold])
        ids = list(r.prefix_ids) + list(r.query_ids) + choice
        m, n, asked = len(r.prefix_ids), len(ids), len(r.query_ids)
        tokens = T.tokens_at(cfg, params, ids)
        h, positions = tokens.hidden, tokens.positions
        valid = jnp.ones(n, bool)
        chosen = (engine_sets(model, system, r, selected_bits, rest_bits, retention, chunk_tokens) if system
                  else [None] * cfg.num_layers)
        # each chain: the computed tokens' hidden states with every layer attending through its variant
        hidden = {name: h[m:] for name in ["exact", *chains]}
        for lp, layer_chosen in zip(params["layers"], chosen):
            q, k, v = (np.asarray(x, np.float64) for x in T.project(cfg, lp, h, positions))
            prefix_k, prefix_v = k[:, :m], v[:, :m]
            codes = {b: encoded(prefix_k.astype(np.float32), prefix_v.astype(np.float32), b, chunk_tokens,
                                value_group) for b in {*bits, selected_bits, *rest_bits}}

            def layer_of(q, own_k, own_v):
                grouped = q.reshape(cfg.num_kv_heads, group, n - m, cfg.head_dim)
                return Layer(grouped, prefix_k, prefix_v, own_k, own_v, scale, asked)

            def made_of(layer):
                return variants(layer, codes, bits, selected_bits, rest_bits, retention, layer_chosen, chunk_tokens)

            layer = layer_of(q[:, m:], k[:, m:], v[:, m:])
            measure_layer(layer, made_of(layer), into)
            for name, x in hidden.items():
                cq, ck, cv = (np.asarray(y, np.float64) for y in T.project(cfg, lp, x, positions[m:]))
                chain = layer_of(cq, ck, cv)
                s, values, keep, _ = (chain.s, prefix_v, None, None) if name == "exact" else made_of(chain)[name]()
                attn = chain.output(s, values, keep).reshape(cfg.num_heads, n - m, cfg.head_dim)
                hidden[name] = T.output_and_mlp(cfg, lp, x, jnp.asarray(attn, x.dtype))
            h = T.self_attention_layer(cfg, lp, h, positions, valid)[0]
        exact = answer(cfg, params, hidden["exact"], asked, choice)
        want = float(model.loglikelihood(ids[:m + asked], choice)[0])
        if not np.isclose(exact, want, rtol=1e-4, atol=2e-3):
            raise SystemExit(f"the exact chain's log-probability {exact:.4f} is not the model's ({want:.4f})")
        for name in chains:
            answers[name].append(answer(cfg, params, hidden[name], asked, choice) - exact)
        print(f"  request {len(answers[chains[0]]) if chains else '-'} of prefix {r.prefix_id}: {m} tokens, query "
              f"{asked}, choice {n - m - asked}", flush=True)
    out = {}
    for name, got in into.items():
        err, choice = np.concatenate(got["error"]), np.concatenate(got["error_choice"])
        row = {"error": float(err.mean()), "error_p90": float(np.quantile(err, 0.9)),
               "error_choice": float(choice.mean()), "error_choice_p90": float(np.quantile(choice, 0.9))}
        if got["mass_bias"]:
            bias = np.concatenate(got["mass_bias"])
            row.update(mass_bias=float(bias.mean()), mass_bias_abs=float(np.abs(bias).mean()),
                       predicted=float(np.mean(got["predicted"])))
        if name in answers:
            change = np.asarray(answers[name])
            row.update(logprob_change=change.tolist(), logprob_change_abs=float(np.abs(change).mean()))
        out[name] = row
    return out


def answer(cfg, params, hidden, asked: int, choice: list) -> float:
    """log p(choice | prefix, query) from the computed tokens' last hidden states (the query's, then the choice's)."""
    logits = np.asarray(T.head(cfg, params, hidden), np.float64)
    rows = logits[asked - 1: asked - 1 + len(choice)]
    rows = rows - logsumexp(rows)[:, None]
    return float(rows[np.arange(len(choice)), choice].sum())


def markdown(out: dict) -> str:
    keys = out.get("rest_key_bits", out["rest_bits"])
    rest_keys = f" (their keys at {keys})" if keys != out["rest_bits"] else ""
    lines = [f"# {out['model']}: attention error of low-bit prefix KV ({out['task']}, {out['requests']} requests over "
             f"{out['prefixes']} prefixes of {out['prefix_tokens']}+ tokens)", "",
             f"Keys per channel over {out['chunk_tokens']}-token chunks, values per token over {out['value_group']} "
             f"channels; mixed: the top {out['retention']:g} of rows by attention at {out['selected_bits']} bits, the "
             f"rest at {out['rest_bits']}{rest_keys}. Means over layers, query heads and tokens; the mass bias over "
             "the query's and the choice's tokens.", "",
             "`|Δ log p|`: run end to end, the mean |change| of the gold choice's log-probability.", "",
             "| variant | error ‖o'-o‖/‖o‖, query | p90 | error, choice | p90 | low-bit rows' mass bias (log) | "
             "mean abs | predicted var/2 | \\|Δ log p\\| |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in out["variants"].items():
        bias = (f"{r['mass_bias']:+.4f} | {r['mass_bias_abs']:.4f} | {r['predicted']:.4f}" if "mass_bias" in r
                else "- | - | -")
        change = f"{r['logprob_change_abs']:.3f}" if "logprob_change_abs" in r else "-"
        lines.append(f"| {name} | {r['error']:.4f} | {r['error_p90']:.4f} | {r['error_choice']:.4f} | "
                     f"{r['error_choice_p90']:.4f} | {bias} | {change} |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    bits = [int(b) for b in FLAGS.bits]
    model = specjax.load_model(FLAGS.model)
    if model.config.head_dim % FLAGS.value_group:
        raise SystemExit(f"--value_group {FLAGS.value_group} does not divide the head dim {model.config.head_dim}")
    sets = ["", " shared"] + ([" engine"] if FLAGS.engine_system else [])
    known = {f"{kind}{b}{fix}" for kind in ("K", "V", "KV") for b in bits for fix in ("", " -var/2")
             if kind == "KV" or not fix}
    known |= {f"{kind}{name}{fix}" for kind in ("drop", "mixed") for name in sets for fix in ("", " -var/2")
              if kind == "mixed" or not fix}
    unknown = [c for c in FLAGS.chains if c not in known]
    if unknown:
        raise SystemExit(f"--chains: no variant {', '.join(map(repr, unknown))}; there are {', '.join(sorted(known))}")
    tokenizer, _ = tokenizer_for(model)
    task = tasks_lib.load_task(FLAGS.task, FLAGS.data_dir)
    spec = workload_lib.WorkloadSpec(limit=FLAGS.limit or FLAGS.requests, prefix_tokens=FLAGS.prefix_tokens)
    requests = ordered_by_prefix(workload_lib.build_workload(task, tokenizer, spec).requests)[: FLAGS.requests]
    rest = (FLAGS.rest_key_bits or FLAGS.rest_bits, FLAGS.rest_bits)
    variants = run(model, requests, bits, FLAGS.selected_bits, rest, FLAGS.retention, FLAGS.chunk_tokens,
                   FLAGS.value_group, FLAGS.engine_system or None, FLAGS.chains)
    out = {"model": FLAGS.model, "task": FLAGS.task, "requests": len(requests),
           "prefixes": len({r.prefix_id for r in requests}), "prefix_tokens": FLAGS.prefix_tokens,
           "chunk_tokens": FLAGS.chunk_tokens, "value_group": FLAGS.value_group, "retention": FLAGS.retention,
           "selected_bits": FLAGS.selected_bits, "rest_bits": FLAGS.rest_bits, "rest_key_bits": rest[0],
           "engine_system": FLAGS.engine_system or None, "variants": variants}
    write_report(FLAGS.out, "attention_error", out, markdown(out))


if __name__ == "__main__":
    define_flags()
    app.run(main)
