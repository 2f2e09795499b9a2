"""Does a replayed run behave as the run it replays? Per system: ITF's pass rate per layer (the share of requests
whose layer kept the probes' shared set), disk bytes, cache hits and TTFT, side by side (issue 40).

    python benchmarks/replay_check.py RECORDED_DIR REPLAYED_DIR [--points 5] [--bytes 0.10] [--output FILE.md]

RECORDED_DIR: the results of a run with --record_selections; REPLAYED_DIR: a run with --replay_selections of that
trace. Exits 1 when a system's pass rate differs by more than --points on any layer or its disk bytes by more than
--bytes (a fraction), when both runs have the same number of layers; onto another shape the figures are printed
only (layers then map by relative depth: no per-layer comparison).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def load(folder: str) -> dict:
    return json.loads((pathlib.Path(folder) / "results.json").read_text())


def compare(recorded: dict, replayed: dict, points: float, bytes_share: float) -> tuple[list[str], bool]:
    lines = [f"recorded: {recorded['model']} ({recorded['weights']} weights) on {recorded['task']}; replayed: "
             f"{replayed['model']} ({replayed['weights']} weights)", "",
             "| system | layers | ITF pass rate, recorded / replayed | largest layer gap (points) | disk MB / request, "
             "recorded / replayed (ratio) | device / host hits, recorded / replayed | TTFT ms, recorded / replayed |",
             "|---|---|---|---|---|---|---|"]
    ok = True
    for key, rep in replayed["systems"].items():
        rec = recorded["systems"].get(key)
        if rec is None:
            continue
        n_rec, n_rep = rec["accuracy"]["n"], rep["accuracy"]["n"]
        mb_rec = rec["io"]["disk_bytes"] / n_rec / 1e6
        mb_rep = rep["io"]["disk_bytes"] / n_rep / 1e6
        ratio = mb_rep / mb_rec if mb_rec else float("nan")
        pass_rec = [1 - f for f in rec.get("layers", {}).get("fallback", [])]
        pass_rep = [1 - f for f in rep.get("layers", {}).get("fallback", [])]
        measured = rec.get("itf") is not None and pass_rec and len(pass_rec) == len(pass_rep)
        gap = max(abs(a - b) for a, b in zip(pass_rec, pass_rep)) * 100 if measured else None
        if measured:
            ok &= gap <= points
        if len(pass_rec) == len(pass_rep):
            ok &= abs(ratio - 1) <= bytes_share
        mean = (lambda xs: sum(xs) / len(xs) if xs else float("nan"))
        c_rec, c_rep = rec["cache"], rep["cache"]
        lines.append(
            f"| {key} | {len(pass_rec)} / {len(pass_rep)} | "
            + (f"{100 * mean(pass_rec):.1f}% / {100 * mean(pass_rep):.1f}%" if rec.get("itf") else "-")
            + f" | {'-' if gap is None else f'{gap:.1f}'} | {mb_rec:.2f} / {mb_rep:.2f} ({ratio:.3f}) | "
            f"{c_rec['device_hit_ratio']:.2f} / {c_rec['host_hit_ratio']:.2f} -> "
            f"{c_rep['device_hit_ratio']:.2f} / {c_rep['host_hit_ratio']:.2f} | "
            f"{rec['ttft_ms']['mean']:.0f} / {rep['ttft_ms']['mean']:.0f} |")
    return lines, ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/replay_check.py", description=__doc__.splitlines()[0])
    p.add_argument("recorded")
    p.add_argument("replayed")
    p.add_argument("--points", type=float, default=5.0, help="largest allowed pass-rate gap on a layer, in points")
    p.add_argument("--bytes", type=float, default=0.10, help="largest allowed disk-bytes difference, a fraction")
    p.add_argument("--output", default=None, help="also write the table (markdown) here")
    args = p.parse_args(argv)
    lines, ok = compare(load(args.recorded), load(args.replayed), args.points, args.bytes)
    text = "\n".join(lines) + "\n"
    print(text + ("within the bounds" if ok else "OUTSIDE the bounds"))
    if args.output:
        pathlib.Path(args.output).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
