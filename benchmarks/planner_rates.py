"""The planner against the single strategies at several disk rates (issue 39): one evaluation per rate, then a table.

    python benchmarks/planner_rates.py --out benchmarks/results/cpu/planner-piqa40-prefix1024

runs `python -m specjax.eval --task piqa --prefix_tokens 1024 --limit 40 --retention 0.25 --systems
recompute,as_full,spec,cake,planner` once per `--rates` entry (an emulated `--disk_bandwidth`, or `disk`: the real,
page-cached disk) into `<out>/<rate>/`, then writes `<out>/README.md`: per rate, every system's mean TTFT, the
planner's against the fastest other, its paired accuracy against spec's, its plans and prediction error, and the
crossover rate the planner's model predicts next to the one the runs measure (where spec's TTFT meets recompute's,
interpolated in 1 / rate). `--summarize` only rewrites the README from runs already there.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
from absl import app, flags

flags.DEFINE_string("out", None, "folder for the runs and the README", required=True)
flags.DEFINE_list("rates", ["10MB/s", "50MB/s", "200MB/s", "disk"], "emulated disk rates; `disk`: the real disk")
flags.DEFINE_list("systems", ["recompute", "as_full", "spec", "cake", "planner"], "systems")
flags.DEFINE_integer("limit", 40, "requests")
flags.DEFINE_string("data_dir", None, "The tasks' data folder (docs/data.md); default $SPECJAX_DATA, then the hub.")
flags.DEFINE_bool("summarize", False, "only rewrite the README from the runs already in --out")
FLAGS = flags.FLAGS

PLANNER, BAR = "planner", 1.05


def _folder(rate: str) -> str:
    return "disk" if rate == "disk" else rate.replace("/", "p")


def _command(rate: str, out: pathlib.Path) -> list[str]:
    cmd = [sys.executable, "-m", "specjax.eval", "--task", "piqa", "--limit", str(FLAGS.limit), "--prefix_tokens",
           "1024", "--retention", "0.25", "--systems", ",".join(FLAGS.systems),
           "--output_dir", str(out / _folder(rate))]
    cmd += ["--data_dir", FLAGS.data_dir] if FLAGS.data_dir else []
    return cmd + ([] if rate == "disk" else ["--disk_bandwidth", rate])


def _requests(folder: pathlib.Path) -> dict[str, list[dict]]:
    by_system: dict[str, list[dict]] = {}
    for line in (folder / "requests.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_system.setdefault(row["system"], []).append(row)
    return by_system


def _correct(rows: list[dict]) -> np.ndarray:
    return np.asarray([int(np.argmax(r["choice_logprobs"]) == r["gold"]) for r in rows], float)


def _rate_of(rate: str, results: dict) -> float | None:
    """The disk rate of a run in bytes/s: the emulated one, else what the planner's scheduler measured."""
    if rate != "disk":
        number, unit = rate[:-len("MB/s")], 1e6
        return float(number) * unit
    model = (results["systems"].get(PLANNER, {}).get("planner") or {}).get("model") or {}
    return model.get("disk_rate_bytes_per_s")


def summarize(out: pathlib.Path) -> str:
    lines = ["# The planner against recompute, as_full, spec and cake at several disk rates (issue 39)", "",
             "Command: `python benchmarks/planner_rates.py --out " + str(out) + "` (each rate: `" +
             " ".join(_command("<rate>", out)[1:]).replace(str(out / "<rate>"), "<out>/<rate>") + "`).", "",
             "| disk | " + " | ".join(f"{s} ms" for s in FLAGS.systems) +
             " | planner / fastest other | strictly fastest | Δacc planner vs spec (pp) | plans (computed share: "
             "requests) | loaded whole | held share | prediction error median | predicted crossover MB/s |",
             "|---" * (len(FLAGS.systems) + 9) + "|"]
    points = []
    for rate in FLAGS.rates:
        folder = out / _folder(rate)
        if not (folder / "results.json").is_file():
            lines.append(f"| {rate} | (not run) |")
            continue
        results = json.loads((folder / "results.json").read_text())
        systems = results["systems"]
        ttft = {s: systems[s]["ttft_ms"]["mean"] for s in FLAGS.systems if s in systems}
        others = {s: t for s, t in ttft.items() if s != PLANNER}
        fastest = min(others.values())
        rows = _requests(folder)
        diff = (_correct(rows[PLANNER]) - _correct(rows["spec"])).mean() * 100
        planner = systems[PLANNER].get("planner") or {}
        crossover = [c for c in ((planner.get("model") or {}).get("crossover_bytes_per_s") or {}).values()
                     if c is not None]
        error = planner.get("prediction_error_median")
        lines.append(
            f"| {rate} | " + " | ".join(f"{ttft.get(s, float('nan')):.0f}" for s in FLAGS.systems) +
            f" | {ttft[PLANNER] / fastest:.3f}x ({'<=' if ttft[PLANNER] <= BAR * fastest else '>'} {BAR}x) | "
            f"{'yes' if ttft[PLANNER] < fastest else 'no'} | {diff:+.1f} | {planner.get('computed_share_counts')} | "
            f"{planner.get('load_all_requests', '-')} | {planner.get('held_share_mean', float('nan')):.2f} | "
            f"{'-' if error is None else f'{error:.1%}'} | "
            f"{', '.join(f'{c / 1e6:.1f}' if c else 'any' for c in crossover) or '-'} |")
        measured_rate = _rate_of(rate, results)
        if measured_rate and "spec" in ttft and "recompute" in ttft:
            points.append((measured_rate, ttft["spec"], ttft["recompute"]))
    lines += ["", _measured_crossover(points), "",
              "`planner / fastest other`: its mean TTFT over the fastest mean of the other systems in the same run; "
              "`plans`: how many requests computed what share of their stored prefix (0: loaded, 1: recompute); "
              "`loaded whole`: how many of them loaded the whole stored prefix (as_full's way) rather than SPEC's "
              "selection; `held share`: the mean share of a plan's loaded tokens the caches held when it was planned; "
              "prediction error: |predicted - measured| / measured per request; predicted crossover: the disk rate "
              "above which loading a stored prefix the caches do not hold (SPEC's plan or everything) is predicted to "
              "beat recomputing it, per stored prefix length (the model at the run's end; `any`: its waits do not grow "
              "with the bytes, so loading wins at every rate)."]
    return "\n".join(lines) + "\n"


def _measured_crossover(points: list[tuple[float, float, float]]) -> str:
    """Where spec's mean TTFT meets recompute's: spec's TTFT is close to linear in 1 / rate, so interpolate there."""
    points = sorted(points)
    for (r0, s0, c0), (r1, s1, c1) in zip(points, points[1:]):
        d0, d1 = s0 - c0, s1 - c1
        if d0 >= 0 >= d1:
            x0, x1 = 1 / r0, 1 / r1
            x = x0 + (x1 - x0) * d0 / (d0 - d1)
            return f"Measured crossover: spec meets recompute at {1 / x / 1e6:.1f} MB/s (interpolated in 1 / rate)."
    if points and all(s < c for _, s, c in points):
        slowest = points[0]
        # extrapolate spec's TTFT as a + b / rate through the two slowest rates
        if len(points) > 1:
            (r0, s0, c0), (r1, s1, _) = points[0], points[1]
            b = (s0 - s1) / (1 / r0 - 1 / r1)
            a = s0 - b / r0
            if b > 0 and c0 > a:
                return (f"Measured crossover: spec is faster than recompute at every rate run (down to "
                        f"{slowest[0] / 1e6:.0f} MB/s); extrapolating its TTFT as a + b / rate through the two slowest "
                        f"rates, it meets recompute's {c0:.0f} ms at {b / (c0 - a) / 1e6:.1f} MB/s.")
        return (f"Measured crossover: spec is faster than recompute at every rate run (down to "
                f"{slowest[0] / 1e6:.0f} MB/s).")
    return "Measured crossover: not bracketed by the rates run."


def main(argv) -> None:
    del argv
    out = pathlib.Path(FLAGS.out)
    if not FLAGS.summarize:
        for rate in FLAGS.rates:
            print("running", rate, flush=True)
            subprocess.run(_command(rate, out), check=True)
    (out / "README.md").write_text(summarize(out))
    print((out / "README.md").read_text())


if __name__ == "__main__":
    app.run(main)
