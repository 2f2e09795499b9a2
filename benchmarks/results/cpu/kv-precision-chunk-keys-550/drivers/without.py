"""A copy of a run folder's tasks without one system: python drivers/without.py SRC DST SYSTEM (so that the pooled
figures of the other systems cover every task, where SYSTEM ran on only some)."""

import json
import pathlib
import shutil
import sys

src, dst, system = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
shutil.rmtree(dst, ignore_errors=True)
for task in sorted(p.name for p in src.iterdir() if (p / "requests.jsonl").exists()):
    (dst / task).mkdir(parents=True)
    rows = [line for line in (src / task / "requests.jsonl").read_text().splitlines()
            if json.loads(line)["system"] != system]
    (dst / task / "requests.jsonl").write_text("".join(line + "\n" for line in rows))
    results = json.loads((src / task / "results.json").read_text())
    results["systems"] = {k: v for k, v in results["systems"].items() if not k.startswith(system)}
    (dst / task / "results.json").write_text(json.dumps(results, indent=1))
