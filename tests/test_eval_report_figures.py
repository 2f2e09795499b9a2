"""results.md's figures and wording, and the plots' readability, from made-up results (no model, no run)."""

import pathlib
import re

import pytest

from specjax.eval import report, report_figures as figures, report_markdown as report_md

REPO = pathlib.Path(__file__).resolve().parents[1]
PHASES = ("probe_io", "identify", "kv_io_stall", "compute")


def _entry(system, retention, acc, ttft, phases, layers=None):
    breakdown = dict(zip(PHASES, phases))
    entry = {
        "system": system, "retention": retention,
        "accuracy": {"acc": acc, "acc_norm": acc, "stderr": 0.1, "n": 16, "acc_norm_stderr": 0.1},
        "ttft_ms": {"mean": ttft, "p50": ttft, "p95": 1.2 * ttft, "p99": 1.3 * ttft},
        "breakdown_ms": breakdown,
        "io": {"disk_bytes": 1000, "host_to_device_bytes": 1000, "chunks_read": 4, "read_amplification": 1.0,
               "read_requests_per_request": 2.0, "bytes_per_read": None, "host_to_device_transfers_per_request": 1.0},
        "cache": {"device_hit_ratio": 0.0, "host_hit_ratio": 0.0},
        "itf": None, "prefetch": None, "compilations_timed": 0,
    }
    if layers:
        entry["layers"] = layers
    return entry


def _sweep(emulation=None):
    """The default run's shape: recompute far slower than the rest, two pruning systems equal at every retention."""
    n = 6
    systems = {
        "recompute": _entry("recompute", None, 0.875, 3069.0, (0, 0, 0, 3069.0)),
        "as_full": _entry("as_full", None, 0.875, 513.6, (0, 0, 306.0, 207.6), {"retained": [1.0] * n,
                                                                            "fallback": [0.0] * n}),
    }
    for r in (0.1, 0.25, 0.75):
        layers = {"retained": [r] * n, "fallback": [1.0] * n}
        for system in ("as_h2o_lru", "as_h2o_lfu"):
            systems[f"{system}@r={r:g}"] = _entry(system, r, 0.3 + r / 2, 520.0, (0, 100.0, 150.0, 270.0), layers)
        systems[f"spec@r={r:g}"] = _entry("spec", r, 0.3 + r / 3, 940.0, (90.0, 120.0, 280.0, 450.0),
                                          {"retained": [r] * n, "fallback": [0.0, 1.0] * (n // 2)})
    return {"model": "m", "task": "needle", "weights": "pretrained", "device": "cpu",
            "emulation": emulation or {"disk_bandwidth": None, "pcie_bandwidth": None, "direct_io": False},
            "config": {"seed": 0}, "systems": systems}


def _linked(md):
    return re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", md)


@pytest.mark.parametrize("which", ["sweep", "recompute only"])
def test_results_md_links_every_figure_written_with_a_caption(tmp_path, which):
    results = _sweep()
    if which == "recompute only":
        results["systems"] = {"recompute": results["systems"]["recompute"]}
    written = [p.name for p in report.write_all(results, tmp_path) if p.suffix == ".png"]
    md = (tmp_path / "results.md").read_text()
    assert sorted(_linked(md)) == sorted(written) == sorted(figures.figures(results))
    lines = md.splitlines()
    for name in written:
        link = next(i for i, line in enumerate(lines) if line.endswith(f"]({name})"))
        caption = lines[link + 2]
        assert caption.startswith(f"*{name}: ") and caption.endswith("*") and len(caption) > 40
    if which == "sweep":
        assert set(written) == {"tradeoff.png", "ttft_breakdown.png", "accuracy_vs_retention.png", "layers.png"}
    else:
        assert written == ["ttft_breakdown.png"]


def test_no_unknown_rate_is_printed_as_none(tmp_path):
    md = report_md.markdown(_sweep())
    assert "None B/s" not in md and "None" not in md.split("## Settings")[0]
    assert ("- emulation: off (disk: the real disk, not emulated; PCIe: the real link, not emulated; direct I/O off)"
            in md)
    emulated = report_md.markdown(_sweep({"disk_bandwidth": 2e7, "pcie_bandwidth": None, "direct_io": True}))
    assert ("- emulation: on (disk 20 MB/s (emulated); PCIe: the real link, not emulated; direct I/O on)"
            in emulated)


def test_ttft_definition_is_the_readmes():
    assert report_md.TTFT_DEFINITION in (REPO / "README.md").read_text().replace("\n", " ")
    md = report_md.markdown(_sweep())
    assert report_md.TTFT_DEFINITION in md
    assert "8 runs of 5 systems" not in md and md.count("11 runs of 5 systems (as_full and recompute once each; "
                                                         "as_h2o_lfu, as_h2o_lru and spec at retention 0.1, 0.25 "
                                                         "and 0.75)") == 1


def _close(fig):
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_ttft_breakdown_shows_every_runs_phases_at_its_own_scale():
    """Scaled by recompute's 3 s bar, as_full's phases were slivers: the right panel gives every run the whole
    width, so each phase of each run is as wide as its share."""
    results = _sweep()
    fig = figures.ttft_figure(results)
    try:
        share_ax = fig.axes[1]
        rows: dict[float, float] = {}
        for bar in share_ax.patches:
            rows[round(bar.get_y(), 6)] = rows.get(round(bar.get_y(), 6), 0.0) + bar.get_width()
        assert len(rows) == len(results["systems"]) and all(w == pytest.approx(100.0) for w in rows.values())
        shares = figures.ttft_shares(results)
        assert shares["as_full"]["kv_io_stall"] == pytest.approx(306.0 / 513.6)
        labels = [t.get_text() for t in fig.axes[-1].get_yticklabels()]
        assert "513.6 ms" in labels and "3069.0 ms" in labels  # each row's mean written beside it
    finally:
        _close(fig)


def _legend_clear_of_axes(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer))


def test_coinciding_accuracy_series_stay_visible():
    """as_h2o_lru and as_h2o_lfu have equal accuracy at every retention: one hid the other."""
    results = _sweep()
    series = {s["name"]: s for s in figures.retention_series(results)}
    assert series["as_h2o_lru"]["same_as"] == "as_h2o_lfu" and series["as_h2o_lfu"]["same_as"] is None
    fig = figures.accuracy_figure(results)
    try:
        lines = [c.lines[0] for c in fig.axes[0].containers]  # each series' data line
        drawn = [tuple(line.get_xdata()) for line in lines]
        assert len(drawn) == 3 and len(set(drawn)) == 3  # set side by side, never on one another
        assert len({line.get_marker() for line in lines}) == len(lines)
        assert len({line.get_markersize() for line in lines}) == len(lines)
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert "as_h2o_lru (same values as as_h2o_lfu)" in labels
        _legend_clear_of_axes(fig)
    finally:
        _close(fig)


def test_layers_legend_is_clear_of_the_data_and_explains_as_h2o_fallback():
    fig = figures.layers_figure(_sweep())
    try:
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert "as_h2o_lfu@r=0.25 (per-head H2O: fallback 1.0)" in labels
        assert "spec@r=0.25" in labels and "as_full" in labels
        assert any("as_h2o_* take per-head H2O sets on every layer" in t.get_text() for t in fig.texts)
        _legend_clear_of_axes(fig)
    finally:
        _close(fig)
    assert figures.layers_figure({"systems": {"recompute": {}}}) is None
    md = report_md.markdown(_sweep())
    assert "`as_h2o_*` take per-head H2O sets on every layer, so their fallback rate is 1.0" in md
    without = _sweep()
    without["systems"] = {k: s for k, s in without["systems"].items() if not k.startswith("as_h2o")}
    fig = figures.layers_figure(without)
    try:  # no as_h2o_* run: nothing to explain about them
        assert fig.texts and not any("as_h2o" in t.get_text() for t in fig.texts)
    finally:
        _close(fig)
    assert "as_h2o" not in report_md.markdown(without)
