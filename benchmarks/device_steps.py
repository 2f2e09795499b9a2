"""Where a timed request's device time goes, step by step: an evaluation run with each timed request's prefill traced
by `jax.profiler`, summed per jitted step (XLA's `hlo_module`) and per system.

    python benchmarks/device_steps.py --out DIR -- --model timing-qwen2.5-7b --init random --dtype bfloat16 \
        --task needle --prefix_tokens 4096 --limit 3 --systems as_full,spec --retention 0.25 \
        --replay_selections TRACE --direct_io --interleave --progress=false --output_dir DIR/eval
    python benchmarks/device_steps.py --out DIR --summarise     # again from the traces already in DIR

The arguments after `--` are `python -m specjax.eval`'s. Each timed request's prefill (from its start to its first
token's logits) is traced into DIR/traces/SYSTEM-N; warm-up and compilation are not. DIR/device_steps.txt gets, per
system and per request on average: the traced span, the time the device ran anything (the union of XLA's thunks over
its threads: a CPU device runs them on the host's cores), that time per jitted step, and the most costly ops.

Tracing slows a run (on the project's 2-core CPU, as_full's TTFT 1.5-2x), so the spans are not TTFTs: compare
steps and systems within one run. `jax.profiler` needs no extra package for these traces (`vm.trace.json.gz`).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json
import os
import pathlib
import sys


def trace_events(folder: pathlib.Path) -> list[dict]:
    """The complete ('X') events of one request's trace."""
    found = sorted(folder.glob("plugins/profile/*/*.trace.json.gz"))
    if not found:
        raise SystemExit(f"no trace in {folder}")
    with gzip.open(found[-1]) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def outermost(events: list[dict]) -> list[dict]:
    """The XLA thunks not inside another thunk of their thread (a loop's body is its loop's time)."""
    out = []
    by_thread = collections.defaultdict(list)
    for e in events:
        if "hlo_module" in e.get("args", {}):
            by_thread[e["tid"]].append(e)
    for thread in by_thread.values():
        end = float("-inf")
        for e in sorted(thread, key=lambda e: (e["ts"], -e["dur"])):
            if e["ts"] >= end:
                out.append(e)
                end = e["ts"] + e["dur"]
    return out


def union_ms(events: list[dict]) -> float:
    """The time at least one of `events` ran (ms)."""
    total, reach = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        a, b = e["ts"], e["ts"] + e["dur"]
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total / 1e3


def summarise(traces: pathlib.Path, top: int = 8) -> str:
    by_system = collections.defaultdict(list)
    for folder in sorted(traces.iterdir()):
        by_system[folder.name.rsplit("-", 1)[0]].append(folder)
    lines = []
    for system, folders in by_system.items():
        steps, ops = collections.Counter(), collections.Counter()
        span = busy = 0.0
        for folder in folders:
            events = trace_events(folder)
            thunks = outermost(events)
            span += (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3
            busy += union_ms(thunks)
            for e in thunks:
                steps[e["args"]["hlo_module"]] += e["dur"] / 1e3
                ops[(e["args"]["hlo_module"], e["args"]["hlo_op"])] += e["dur"] / 1e3
        n = len(folders)
        lines.append(f"{system}: {n} requests; per request: traced span {span / n:.1f} ms, device busy "
                     f"{busy / n:.1f} ms ({busy / span:.0%}), thunk time {sum(steps.values()) / n:.1f} ms")
        lines += [f"    {ms / n:8.1f} ms  {name}" for name, ms in steps.most_common() if ms / n >= 0.05]
        lines.append("  costliest ops:")
        lines += [f"    {ms / n:8.1f} ms  {name} / {op}" for (name, op), ms in ops.most_common(top)]
    return "\n".join(lines) + "\n"


def run_traced(traces: pathlib.Path, eval_args: list[str]) -> None:
    """`python -m specjax.eval eval_args`, each timed request's prefill traced into traces/SYSTEM-N."""
    import jax

    from specjax.engine import engine as engine_lib
    from specjax.eval import runner

    timed = [False]
    time_requests = runner._time

    def traced_time(*args, **kwargs):
        timed[0] = True
        try:
            return time_requests(*args, **kwargs)
        finally:
            timed[0] = False

    prefill, count = engine_lib.Engine.prefill, itertools.count()

    def traced_prefill(self, *args, **kwargs):
        if not timed[0]:
            return prefill(self, *args, **kwargs)
        with jax.profiler.trace(str(traces / f"{self.system.name}-{next(count)}")):
            out = prefill(self, *args, **kwargs)
            jax.block_until_ready(out.logits)
        return out

    runner._time, engine_lib.Engine.prefill = traced_time, traced_prefill
    from specjax.eval.__main__ import run

    sys.argv = ["specjax.eval", *eval_args]
    try:
        run()
    except SystemExit as e:
        if e.code:
            raise


def main() -> None:
    argv = sys.argv[1:]
    eval_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="python benchmarks/device_steps.py --out DIR [--summarise] -- EVAL_ARGS")
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--summarise", action="store_true", help="only summarise the traces already in --out")
    parser.add_argument("--top", type=int, default=8, help="ops listed per system")
    args = parser.parse_args(own)
    traces = args.out / "traces"
    if not args.summarise:
        if not eval_args:
            parser.error("give the evaluation's arguments after --")
        if traces.exists() and any(traces.iterdir()):
            parser.error(f"{traces} holds traces already: choose another --out, or --summarise them")
        traces.mkdir(parents=True, exist_ok=True)
        run_traced(traces, eval_args)
    text = summarise(traces, args.top)
    (args.out / "device_steps.txt").write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
