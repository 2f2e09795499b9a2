"""Each step of the engine's layer loop blocked until its device work is done, summed per request: what every step
costs when nothing overlaps it (the eval's own TTFT phases split overlapped time). Runs `python -m specjax.eval` with
its arguments in this process and prints, per system, the mean over its last two requests (timed ones).

    python benchmarks/results/cpu/selection-masks/drivers/step_costs.py --model timing-qwen2.5-7b --init random \
      --dtype bfloat16 --task needle --prefix_tokens 4096 --limit 3 --systems as_full,spec,spec_gqa --retention 0.25 \
      --replay_selections /tmp/traces/smollm2-needle --direct_io --interleave --progress=false --output_dir /tmp/steps

Take[k]: a take of kind k (0 K, 1 V, 2 probe keys); Score:/Decide: the identification's device steps by function;
finish / project: the layer's attention and MLP, its projections; ttft: the request's as the eval measured it with
the blocking in place (so higher than the eval's own).
"""
import collections
import runpy
import sys
import time

import jax

from specjax.engine import engine as E
from specjax.engine import identify as I
from specjax.engine import layer_io as L
from specjax.engine import steps as S

records = []  # per request (a Clock): step -> ms
current = {"d": None}


def _clock_init(orig):
    def init(self):
        orig(self)
        current["d"] = collections.defaultdict(float)
        records.append(current["d"])
    return init


def _clock_finish(orig):
    def finish(self):
        out = orig(self)
        current["d"]["ttft"] += out[0]
        current["d"] = None  # continuation scoring after the first token is no request's TTFT
        return out
    return finish


def blocked(name, fn):
    def run(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        if not isinstance(out, I.Selected):
            jax.block_until_ready(out)
        if current["d"] is not None:
            current["d"][name] += (time.perf_counter() - t) * 1e3
        return out
    return run


def _carry_out(orig):
    def carry(self, layer, step):
        if current["d"] is not None:
            current["d"]["system:" + self.engine.system.name] = 1
        name = type(step).__name__
        if isinstance(step, I.Take):
            name += f"[{step.kind}]"
        if isinstance(step, (I.Score, I.Decide)):
            name += ":" + getattr(step.fn, "__name__", "?")
        return blocked(name, orig)(self, layer, step)
    return carry


L.Clock.__init__ = _clock_init(L.Clock.__init__)
L.Clock.finish = _clock_finish(L.Clock.finish)
L.LayerIO._carry_out = _carry_out(L.LayerIO._carry_out)
L.LayerIO.select = blocked("select_total", L.LayerIO.select)
E.S.finish = S.finish = blocked("finish", S.finish)
E.S.project = S.project = blocked("project", S.project)

sys.argv = ["specjax.eval"] + sys.argv[1:]
try:
    runpy.run_module("specjax.eval", run_name="__main__")
except SystemExit:
    pass
finally:
    by_system = collections.defaultdict(list)
    for r in records:
        name = next((k[len("system:"):] for k in r if k.startswith("system:")), None)
        if name:
            by_system[name].append({k: v for k, v in r.items() if not k.startswith("system:")})
    for name, requests in by_system.items():
        last = requests[-2:]
        print(f"{name}: mean of its last {len(last)} requests, ms")
        for key in sorted(set().union(*last)):
            print(f"   {key:28s} {sum(r.get(key, 0.0) for r in last) / len(last):9.1f}")
