"""How close each system's answers are to a reference system's on the same requests, pooled over task folders:
python drivers/agreement.py FOLDER [--reference as_full]

FOLDER holds a requests.jsonl, or one folder per task with one (`python -m specjax.eval`, or merged by merge.py). Per system:
the mean absolute change of its choices' log-probabilities against the reference's, and the share of requests whose
answer (the choice of highest log-probability) is the reference's."""

import argparse
import collections
import json
import pathlib

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("folder", type=pathlib.Path)
    ap.add_argument("--reference", default="as_full")
    args = ap.parse_args()
    changes, same = collections.defaultdict(list), collections.defaultdict(list)
    for requests in [args.folder / "requests.jsonl"] if (args.folder / "requests.jsonl").exists() else \
            sorted(args.folder.glob("*/requests.jsonl")):
        rows = [json.loads(line) for line in requests.read_text().splitlines()]
        reference = {r["request_id"]: np.asarray(r["choice_logprobs"]) for r in rows if r["system"] == args.reference}
        for r in rows:
            ref = reference[r["request_id"]]
            got = np.asarray(r["choice_logprobs"])
            changes[r["system"]].extend(np.abs(got - ref).tolist())
            same[r["system"]].append(int(np.argmax(got) == np.argmax(ref)))
    print(f"{'system':28s} {'requests':>8s} {'mean |d log p|':>15s} {'same answer':>12s}")
    for system in changes:
        print(f"{system:28s} {len(same[system]):8d} {np.mean(changes[system]):15.3f} {np.mean(same[system]):12.3f}")


if __name__ == "__main__":
    main()
