"""Count read_runs calls per (kind, speculative, caller chain) during an eval; print per timed request."""
import atexit, collections, sys, runpy, traceback
from specjax.stores import reads as R
C = collections.Counter(); B = collections.Counter()
orig = R.ChunkReads.read_runs
def rr(self, layer, kind, chunks, *, speculative=False, background=False):
    st = traceback.extract_stack(limit=12)
    chain = ">".join(f.name for f in st[:-1] if f.name in ("take", "_speculate", "_issue_plan", "_request_certain", "request", "_hold", "select", "_union_values", "plan_reads", "warm", "warm_up"))
    key = (kind, speculative, background, chain)
    C[key] += 1; B[key] += len(chunks)
    return orig(self, layer, kind, chunks, speculative=speculative, background=background)
R.ChunkReads.read_runs = rr
def report():
    for k, v in sorted(C.items(), key=lambda kv: -kv[1]):
        print(f"{v:7d} calls {B[k]:8d} chunks  kind={k[0]} spec={k[1]} bg={k[2]} {k[3]}", file=sys.stderr)
atexit.register(report)
sys.argv = ["specjax.eval"] + sys.argv[1:]
runpy.run_module("specjax.eval", run_name="__main__", alter_sys=True)
