"""Mean ms per request of each comparison's take_path.py rows: python summarise.py (in this folder)."""
import glob
import json
import pathlib
import statistics

here = pathlib.Path(__file__).resolve().parent
rounds = {}
for f in sorted(glob.glob(str(here / "*.json"))):
    name = pathlib.Path(f).stem.split("-")  # round, tree, repetition[, shape]
    shape = name[3] if len(name) > 3 else "smol"
    for row in json.loads(pathlib.Path(f).read_text())["rows"]:
        rounds.setdefault((name[0], shape, row["chunk_tokens"]), {}).setdefault(name[1], []).append(
            row["ms_per_request"])
for (rnd, shape, chunk), trees in sorted(rounds.items()):
    cells = "  ".join(f"{t} {statistics.mean(v):6.1f} ({', '.join(f'{x:.0f}' for x in v)})" for t, v in trees.items())
    print(f"{rnd:5s} {shape:5s} chunk {chunk:2d}: {cells}")
