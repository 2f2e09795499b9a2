"""Log every ChunkReader.read_runs call of an eval (its layer, kind, priority and runs) to $GAPLOG as JSON lines;
the arguments are python -m specjax.eval's."""
import os, sys, runpy, json, threading
from specjax.stores import reads
orig = reads.ChunkReader.read_runs
log = open(os.environ.get("GAPLOG", "/tmp/runs/gaps.jsonl"), "w")
lock = threading.Lock()
def patched(self, layer, kind, chunks, *, speculative=False, background=False):
    max_bytes = self.max_read_bytes or self._arrays.scheduler.max_read_bytes()
    max_chunks = max(1, max_bytes // self.layout.chunk_nbytes(kind))
    runs = self.index.segment_runs(chunks, max_chunks)
    with lock:
        log.write(json.dumps({"layer": layer, "kind": kind, "spec": speculative, "bg": background,
                              "runs": [(s.seg_id, f, n) for s, f, n in runs],
                              "chunk_bytes": self.layout.chunk_nbytes(kind)}) + "\n")
    return orig(self, layer, kind, chunks, speculative=speculative, background=background)
reads.ChunkReader.read_runs = patched
sys.argv = ["specjax.eval"] + sys.argv[1:]
runpy.run_module("specjax.eval", run_name="__main__", alter_sys=True)
