"""Compare an evaluation run in one process (ONE) with the same run over several processes (TWO): every request's
answer and choice log-probabilities, every system's per-layer record (retained share, fallbacks, Jaccard: what the
selections were), and each process's disk bytes against one process's.

    python compare.py ONE_OUTPUT_DIR TWO_OUTPUT_DIR
"""

import json
import sys

import numpy as np


def main(one: str, two: str) -> None:
    ra = [json.loads(line) for line in open(f"{one}/requests.jsonl")]
    rb = [json.loads(line) for line in open(f"{two}/requests.jsonl")]
    assert [(x["system"], x["request_id"]) for x in ra] == [(y["system"], y["request_id"]) for y in rb]
    worst = max(float(np.abs(np.subtract(x["choice_logprobs"], y["choice_logprobs"])).max()) for x, y in zip(ra, rb))
    same = all(np.argmax(x["choice_logprobs"]) == np.argmax(y["choice_logprobs"]) for x, y in zip(ra, rb))
    print(f"{len(ra)} requests x systems; same answers: {same}; largest log-prob difference {worst:.2e}")
    a, b = json.load(open(f"{one}/results.json")), json.load(open(f"{two}/results.json"))
    print("system: accuracy one / two; per-layer record differences; disk bytes one process / each process")
    for key, system in a["systems"].items():
        la, lb = system.get("layers") or {}, b["systems"][key].get("layers") or {}
        layers = {f: float(np.nanmax(np.abs(np.subtract(la[f], lb[f], dtype=float)))) for f in la
                  if isinstance(la[f], list) and la[f]}
        each = [int(p["io"][key]["disk_bytes"]) for p in b["processes"]]
        split = ""
        if "split" in system:  # cake, the planner: the share of the stored prefix computed (the rest was loaded)
            split = (f"; computed {system['split']['computed_fraction']:.3f} / "
                     f"{b['systems'][key]['split']['computed_fraction']:.3f}, process 0's bytes by device "
                     f"{b['systems'][key]['io'].get('disk_bytes_by_device')}")
        print(f"{key}: {system['accuracy']['acc']:.4f} / {b['systems'][key]['accuracy']['acc']:.4f}; "
              f"{', '.join(f'{f} {d:.3g}' for f, d in layers.items()) or '-'}; "
              f"{system['io']['disk_bytes']} / {each}{split}")


if __name__ == "__main__":
    main(*sys.argv[1:])
