"""results.md's figures: which apply to a run (`figures`), the link and caption results.md gives each
(`figure_lines`), and the PNGs themselves (matplotlib, headless)."""

from __future__ import annotations

import pathlib

import numpy as np

from specjax.eval import tradeoff
from specjax.eval.systems import BREAKDOWN_KEYS

TRADEOFF_PNG = "tradeoff.png"
TTFT_PNG = "ttft_breakdown.png"
RETENTION_PNG = "accuracy_vs_retention.png"
LAYERS_PNG = "layers.png"

# each figure's alt text and the one-line caption results.md gives it
FIGURES = {
    TRADEOFF_PNG: ("accuracy vs mean TTFT", f"accuracy against mean TTFT, one point per run (labelled with its "
                                            f"retention where it prunes); the grey band: within {tradeoff.BAND_PP:g} "
                                            f"accuracy points of the reference."),
    TTFT_PNG: ("TTFT by phase", "each run's mean TTFT by phase: in ms on one scale with its p99 (left), and as "
                                "shares of the run's own mean, so every run's phases show (right)."),
    RETENTION_PNG: ("accuracy vs retention", "accuracy against retention, a line per pruning system (each its own "
                                             "marker and line style, set slightly apart so equal values stay "
                                             "visible); recompute dashed."),
    LAYERS_PNG: ("per-layer KV loaded and fallback rate", "per layer, the KV loaded (fraction of the prefix) and the "
                                                          "fallback rate (the layer loaded every key and used per-head "
                                                          "sets)."),
}
LAYERS_PER_HEAD = " `as_h2o_*` take per-head H2O sets on every layer, so their fallback rate is 1.0 by construction."


def figures(results: dict) -> list[str]:
    """The PNGs `write_all` writes for `results`, in the order results.md shows them."""
    out = []
    if tradeoff.worth_plotting(results):
        out.append(TRADEOFF_PNG)
    out.append(TTFT_PNG)
    if len({s.get("retention") for s in results["systems"].values()} - {None}) > 1:
        out.append(RETENTION_PNG)
    if _layer_panels(layer_series(results)):
        out.append(LAYERS_PNG)
    return out


def figure_lines(results: dict, name: str) -> list[str]:
    """A figure's link and caption, where `write_all` writes it."""
    if name not in figures(results):
        return []
    alt, caption = FIGURES[name]
    if name == LAYERS_PNG and _has_per_head(results):
        caption += LAYERS_PER_HEAD
    return [f"![{alt}]({name})", "", f"*{name}: {caption}*", ""]


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PHASE_COLOURS = {"probe_io": "tab:blue", "identify": "tab:orange", "kv_io_stall": "tab:green", "compute": "tab:red"}


def ttft_shares(results: dict) -> dict[str, dict[str, float]]:
    """Per run, each TTFT phase's share of the run's own mean TTFT (the phases' sum; 0 where it has none)."""
    out = {}
    for key, s in results["systems"].items():
        total = sum(s["breakdown_ms"][p] for p in BREAKDOWN_KEYS)
        out[key] = {p: (s["breakdown_ms"][p] / total if total else 0.0) for p in BREAKDOWN_KEYS}
    return out


def ttft_figure(results: dict):
    """Two panels, one row per run: on the left the mean TTFT in ms stacked by phase (one scale for every run, with
    its p99), on the right each run's phases as shares of its own mean, so a run much faster than the slowest one
    (recompute) still shows every phase; each row there names its mean TTFT."""
    plt = pyplot()
    systems = results["systems"]
    keys = list(systems)
    shares = ttft_shares(results)
    y = np.arange(len(keys))[::-1]  # the first run on top
    fig, (ax_ms, ax_share) = plt.subplots(1, 2, figsize=(11, 1.4 + 0.38 * len(keys)), sharey=True,
                                          gridspec_kw={"width_ratios": [1, 1.3]})
    left_ms = np.zeros(len(keys))
    left_share = np.zeros(len(keys))
    for part in BREAKDOWN_KEYS:
        values = np.array([systems[k]["breakdown_ms"][part] for k in keys])
        share = np.array([shares[k][part] for k in keys])
        ax_ms.barh(y, values, left=left_ms, color=PHASE_COLOURS[part], label=part, height=0.7)
        bars = ax_share.barh(y, 100 * share, left=left_share, color=PHASE_COLOURS[part], height=0.7)
        for bar, f in zip(bars, share):
            if f >= 0.08:  # wide enough for its figure
                ax_share.text(bar.get_x() + bar.get_width() / 2, bar.get_y() + bar.get_height() / 2,
                              f"{100 * f:.0f}%", ha="center", va="center", fontsize=7, color="white")
        left_ms += values
        left_share += 100 * share
    p99 = [systems[k]["ttft_ms"]["p99"] for k in keys]
    ax_ms.scatter(p99, y, marker="|", s=160, color="black", label="p99", zorder=3)
    ax_ms.set_xlim(0, 1.05 * max([*p99, *left_ms, 1e-9]))
    ax_ms.set_yticks(y, keys)
    ax_ms.set_xlabel("TTFT (ms): mean, stacked by phase; | p99")
    ax_ms.grid(axis="x", alpha=0.3)
    ax_share.set_xlim(0, 100)
    ax_share.set_xlabel("share of the run's own mean TTFT (%)")
    ax_share.tick_params(axis="y", length=0)
    twin = ax_share.twinx()  # each row's mean TTFT, on the right
    twin.set_ylim(ax_share.get_ylim())
    twin.set_yticks(y, [f"{systems[k]['ttft_ms']['mean']:.1f} ms" for k in keys], fontsize=8)
    twin.tick_params(axis="y", length=0)
    twin.set_ylabel("mean TTFT", fontsize=8)
    handles, labels = ax_ms.get_legend_handles_labels()
    height = fig.get_figheight()
    fig.suptitle(f"{results['model']} / {results['task']} ({results['weights']} weights): TTFT by phase",
                 fontsize=10, y=1 - 0.06 / height, va="top")
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.26 / height))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / height))
    return fig


def plot_ttft(results: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    fig = ttft_figure(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)


SERIES_MARKERS = "osD^vP*Xh<>"
SERIES_LINESTYLES = ("-", "--", "-.", ":")


def retention_series(results: dict) -> list[dict]:
    """accuracy_vs_retention.png's series, one per pruning system (sorted by name): its points (retention, acc,
    stderr), its marker, marker size, line style and x offset (a factor: series side by side, so equal values stay
    visible), and the earlier series whose every point it shares (`same_as`; None where it shares none)."""
    by_system: dict[str, list[tuple[float, float, float]]] = {}
    for s in results["systems"].values():
        if s.get("retention") is not None:
            a = s["accuracy"]
            by_system.setdefault(s["system"], []).append((s["retention"], a["acc"], a["stderr"]))
    names = sorted(by_system)
    out = []
    for i, name in enumerate(names):
        points = sorted(by_system[name])
        same = next((o["name"] for o in out if len(o["points"]) == len(points) and all(
            abs(p[0] - q[0]) < 1e-12 and abs(p[1] - q[1]) < 1e-12 for p, q in zip(points, o["points"]))), None)
        out.append({"name": name, "points": points, "marker": SERIES_MARKERS[i % len(SERIES_MARKERS)],
                    "markersize": max(4.0, 10.0 - 2.0 * i), "linestyle": SERIES_LINESTYLES[i % len(SERIES_LINESTYLES)],
                    "offset": 10 ** (0.012 * (i - (len(names) - 1) / 2)), "same_as": same})
    return out


def accuracy_figure(results: dict):
    """Accuracy against retention, a series per pruning system: each its own marker (shape and size, the first
    largest), line style and a slight sideways offset, so a series equal to another still shows; the legend, outside
    the axes, says which series coincide."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    series = retention_series(results)
    for i, sr in enumerate(series):
        x, y, e = zip(*sr["points"])
        label = sr["name"] + (f" (same values as {sr['same_as']})" if sr["same_as"] else "")
        ax.errorbar(np.array(x) * sr["offset"], np.array(y) * 100, yerr=np.array(e) * 100, marker=sr["marker"],
                    markersize=sr["markersize"], linestyle=sr["linestyle"], capsize=3, label=label,
                    markeredgecolor="white" if i else None, markeredgewidth=0.6, zorder=2 + i)
    ref = results["systems"].get("recompute")
    if ref:
        ax.axhline(100 * ref["accuracy"]["acc"], color="gray", linestyle="--", label="recompute", zorder=1)
    ax.set_xscale("log")
    ticks = sorted({p[0] for sr in series for p in sr["points"]})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    if len(ticks) > 1:  # room for the offsets and the markers at both ends
        ax.set_xlim(ticks[0] / 1.15 ** (1 + 0.1 * len(series)), ticks[-1] * 1.15 ** (1 + 0.1 * len(series)))
    ax.set_xlabel("retention (fraction of prefix tokens kept; series set slightly apart)")
    ax.set_ylabel("accuracy (%), ± one standard error")
    ax.set_title(f"{results['model']} / {results['task']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def plot_accuracy_vs_retention(results: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    fig = accuracy_figure(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _always_per_head(system: str) -> bool:
    """Systems that take per-head H2O sets on every layer (AttentionStore + H2O): their `fallback` is 1.0 on every
    layer by construction, not a failed identification."""
    return system.startswith("as_h2o")


LAYERS_CAPTION = ("fallback rate: the share of requests in which the layer loaded every key and used per-head sets "
                  "instead of one shared set.")
PER_HEAD_CAPTION = "as_h2o_* take per-head H2O sets on every layer, so theirs is 1.0 on every layer by construction."


def _has_per_head(results: dict) -> bool:
    return any(_always_per_head(s.get("system", k)) for k, s in results["systems"].items() if s.get("layers"))


def layer_series(results: dict) -> list[dict]:
    """layers.png's series, one per run with per-layer records: its colour index (one per system), marker, marker
    size (the first of lines that may coincide largest) and line style (one per retention), and its legend label,
    which for an as_h2o_* run says why its fallback rate is 1.0."""
    entries = [(k, s) for k, s in results["systems"].items() if s.get("layers")]
    systems = list(dict.fromkeys(s.get("system", k) for k, s in entries))
    retentions = sorted({s.get("retention") for _, s in entries if s.get("retention") is not None})
    out = []
    for i, (key, s) in enumerate(entries):
        system = s.get("system", key)
        r = s.get("retention")
        style = 0 if r is None else 1 + retentions.index(r)
        label = key + (" (per-head H2O: fallback 1.0)" if _always_per_head(system) else "")
        out.append({"key": key, "layers": s["layers"], "label": label, "colour": systems.index(system),
                    "marker": SERIES_MARKERS[style % len(SERIES_MARKERS)],
                    "linestyle": SERIES_LINESTYLES[style % len(SERIES_LINESTYLES)],
                    "markersize": max(3.0, 9.0 - 6.0 * i / max(1, len(entries) - 1))})
    return out


def _layer_panels(series: list[dict]) -> list[str]:
    """The per-layer records layers.png plots (none: no layers.png)."""
    return [name for name in ("retained", "fallback") if any(name in sr["layers"] for sr in series)]


def layers_figure(results: dict):
    """Per layer, the KV loaded (kept fraction of the prefix) and the fallback rate, a line per run: colour per
    system, marker and line style per retention, marker sizes shrinking run by run so equal lines all show; the
    legend, outside the axes, and a caption under them say what fallback means and why as_h2o_*'s is 1.0. None
    where no run has per-layer records."""
    series = layer_series(results)
    panels = _layer_panels(series)
    if not panels:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.6 + 2.4 * len(panels)), sharex=True, squeeze=False)
    axes = axes[:, 0]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes, panels):
        for z, sr in enumerate(series):
            if name in sr["layers"]:
                ax.plot(sr["layers"][name], marker=sr["marker"], markersize=sr["markersize"],
                        linestyle=sr["linestyle"], color=colours[sr["colour"] % len(colours)], label=sr["label"],
                        markeredgecolor="white", markeredgewidth=0.4, zorder=2 + z)
        ax.set_ylabel({"retained": "KV loaded / prefix", "fallback": "fallback rate"}[name])
        ax.set_ylim(-0.05, 1.08)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("layer")
    axes[0].set_title(f"{results['model']} / {results['task']}: per layer, mean over requests", fontsize=10)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    caption = ""
    if "fallback" in panels:
        caption = LAYERS_CAPTION + (" " + PER_HEAD_CAPTION if _has_per_head(results) else "")
    if caption:
        fig.text(0.01, 0.01, caption, fontsize=7.5, ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.06 if caption else 0, 1, 1))
    return fig


def plot_layers(results: dict, path: pathlib.Path) -> bool:
    fig = layers_figure(results)
    if fig is None:
        return False
    plt = pyplot()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
