"""`python -m specjax.eval.cake_sweep`: recompute, as_full and cake on one workload under several emulated disk
bandwidths, in one process; where cake meets its loader moves with the bandwidth.

    python -m specjax.eval.cake_sweep --bandwidths 4MB/s,8MB/s,16MB/s,32MB/s --task needle \\
        --prefix_tokens 1024 --cake_chunk_tokens 128 --limit 4 --output_dir results/cake-sweep

Takes every flag of `python -m specjax.eval` (the same workload, model and store machinery: each bandwidth is
one `run_task`, whose full results land in OUTPUT_DIR/<bandwidth>/), and writes OUTPUT_DIR/sweep.json (TTFT
per system per bandwidth, cake's computed fraction, whether cake <= min(recompute, as_full) within 5%),
sweep.md and sweep.png.
"""

from __future__ import annotations

import json
import pathlib
import shlex
import sys

from absl import flags

from specjax.eval import __main__ as eval_cli
from specjax.eval import folders
from specjax.eval.errors import EvalError
from specjax.eval.units import parse_bandwidth

flags.DEFINE_list("bandwidths", ["4MB/s", "8MB/s", "16MB/s", "32MB/s"], "Emulated disk bandwidths to sweep.")
flags.DEFINE_bool("summarize_only", False, "Run nothing: rebuild sweep.json / .md / .png from the results.json "
                  "files already in OUTPUT_DIR/disk-*/ (e.g. after an interrupted sweep).")
FLAGS = flags.FLAGS

SYSTEMS = ("recompute", "as_full", "cake")
SWEEP_FILES = ("sweep.json", "sweep.md", "sweep.png")
TOLERANCE = 1.05  # cake's TTFT may exceed the better of the two others by this factor ("within 5%")


def summarize(per_bandwidth: dict[float, dict]) -> dict:
    """Rows of mean TTFT per system and cake's split, from each bandwidth's results.json."""
    rows = []
    for bandwidth, results in sorted(per_bandwidth.items()):
        s = results["systems"]
        ttft = {name: s[name]["ttft_ms"]["mean"] for name in SYSTEMS}
        best_other = min(ttft["recompute"], ttft["as_full"])
        rows.append({"disk_bandwidth": bandwidth, "ttft_ms_mean": ttft,
                     "ttft_ms_p50": {name: s[name]["ttft_ms"]["p50"] for name in SYSTEMS},
                     "cake_computed_fraction": s["cake"]["split"]["computed_fraction"],
                     "cake_breakdown_ms": s["cake"]["breakdown_ms"],
                     "cake_vs_best_other": ttft["cake"] / best_other,
                     "cake_within_5pct_of_best": ttft["cake"] <= TOLERANCE * best_other})
    return {"systems": list(SYSTEMS), "rows": rows, "tolerance": TOLERANCE,
            "all_within": all(r["cake_within_5pct_of_best"] for r in rows)}


def markdown(sweep: dict) -> str:
    lines = ["| disk (MB/s, emulated) | recompute ms | as_full ms | cake ms | cake / min(others) | within 5% "
             "| cake computed fraction |", "|---|---|---|---|---|---|---|"]
    for r in sweep["rows"]:
        t = r["ttft_ms_mean"]
        lines.append(f"| {r['disk_bandwidth'] / 1e6:g} | {t['recompute']:.0f} | {t['as_full']:.0f} | "
                     f"{t['cake']:.0f} | {r['cake_vs_best_other']:.2f} | "
                     f"{'yes' if r['cake_within_5pct_of_best'] else 'NO'} | {r['cake_computed_fraction']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(sweep: dict, path: pathlib.Path) -> None:
    from specjax.eval.report_figures import pyplot

    plt = pyplot()
    rows = sweep["rows"]
    mbps = [r["disk_bandwidth"] / 1e6 for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in sweep["systems"]:
        ax1.plot(mbps, [r["ttft_ms_mean"][name] for r in rows], marker="o", label=name)
    ax1.set_xscale("log")
    ax1.set_xlabel("disk bandwidth (MB/s, emulated)")
    ax1.set_ylabel("TTFT mean (ms)")
    ax1.legend()
    ax2.plot(mbps, [r["cake_computed_fraction"] for r in rows], marker="o", color="C2")
    ax2.set_xscale("log")
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("disk bandwidth (MB/s, emulated)")
    ax2.set_ylabel("cake: stored prefix computed on the device")
    ax2.set_title("split point (rest loaded)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bandwidth(text: str) -> float:
    try:
        return parse_bandwidth(text)
    except ValueError as e:
        raise EvalError(f"--bandwidths: {e}") from None


def main(argv):
    if len(argv) > 1:
        raise EvalError(f"unexpected arguments {argv[1:]}")
    bandwidths = [_bandwidth(b) for b in FLAGS.bandwidths]
    settings = eval_cli.flag_settings().replace(systems=",".join(SYSTEMS))
    out = pathlib.Path(settings.run.output_dir or f"results/cake-sweep-{pathlib.Path(settings.model.model).name}")
    per_bandwidth = {}
    if FLAGS.summarize_only:
        for path in sorted(out.glob("disk-*/results.json")):
            results = json.loads(path.read_text())
            per_bandwidth[results["emulation"]["disk_bandwidth"]] = results
        if not per_bandwidth:
            raise EvalError(f"no {out}/disk-*/results.json to summarize; run the sweep first")
        _write(per_bandwidth, out)
        return
    with folders.OutputFolder(out, results=SWEEP_FILES) as claimed:  # never over an earlier sweep's
        m = settings.model
        model = eval_cli.load_model(m.model, m.dtype, m.init, settings.workload.seed, m.revision)
        for bandwidth in bandwidths:
            per_bandwidth[bandwidth] = eval_cli.run_task(model, settings.replace(disk_bandwidth=f"{bandwidth:g}"),
                                                         claimed.path / f"disk-{bandwidth / 1e6:g}MBps")
        _write(per_bandwidth, claimed.path)


def _write(per_bandwidth: dict, out: pathlib.Path) -> None:
    first = next(iter(per_bandwidth.values()))
    sweep = summarize(per_bandwidth)
    sweep.update(command=shlex.join(sys.argv), model=first["model"], task=first["task"], device=first["device"],
                 emulated="disk bandwidth (throttled link, demand reads first)",
                 runs={f"{b / 1e6:g}MB/s": r.get("command") for b, r in per_bandwidth.items()})
    (out / "sweep.json").write_text(json.dumps(sweep, indent=2) + "\n")
    (out / "sweep.md").write_text(markdown(sweep))
    plot(sweep, out / "sweep.png")
    print(markdown(sweep))
    print(f"wrote {out / 'sweep.json'}, {out / 'sweep.md'}, {out / 'sweep.png'}")


if __name__ == "__main__":
    from specjax.cli import run as run_cli

    run_cli(main)
