"""The accuracy-TTFT trade-off that leads results.md: text, table and plot from made-up results."""

import pytest

from specjax.eval import tradeoff


def _entry(system, retention, acc, ttft_ms, phase="compute", n=40, stderr=0.05, paired_pp=None):
    breakdown = {k: 0.0 for k in ("probe_io", "identify", "kv_io_stall", "compute")}
    breakdown[phase] = 0.7 * ttft_ms
    breakdown["compute" if phase != "compute" else "identify"] += 0.3 * ttft_ms
    entry = {"system": system, "retention": retention, "accuracy": {"acc": acc, "stderr": stderr, "n": n},
             "ttft_ms": {"mean": ttft_ms}, "breakdown_ms": breakdown}
    if paired_pp is not None:
        entry["paired_vs_recompute"] = {"acc_diff": paired_pp[0] / 100, "stderr": paired_pp[1] / 100}
    return entry


def _results(*rows):
    systems = {}
    for system, retention, *rest in rows:
        key = system if retention is None else f"{system}@r={retention:g}"
        systems[key] = _entry(system, retention, *rest)
    return {"model": "m", "task": "needle", "systems": systems}


SWEEP = _results(
    ("recompute", None, 0.95, 1000.0),
    ("as_full", None, 0.95, 300.0, "kv_io_stall"),
    ("spec", 0.1, 0.40, 100.0, "probe_io"),
    ("spec", 0.25, 0.60, 150.0, "probe_io"),
    ("spec", 0.5, 0.92, 200.0, "kv_io_stall"),
    ("as_h2o_lfu", 0.5, 0.55, 180.0, "kv_io_stall"),
)


def test_a_pruning_run_fastest_within_the_band_is_named_with_its_breakdown():
    text = " ".join(tradeoff.summary(SWEEP))
    assert ("6 runs of 4 systems (as_full and recompute once each; as_h2o_lfu at retention 0.5; spec at retention "
            "0.1, 0.25 and 0.5), each on the same 40 requests") in text
    assert ("Fastest within 5 points of recompute's accuracy: spec@r=0.5 (SPEC: IMPRESS + layer-aware speculative "
            "prefetch), 92.0% ± 5.0 (-3.0 pp vs recompute) at 200.0 ms, 5.00x faster than recompute; its TTFT is "
            "mostly waiting on KV I/O (140 ms, 70%), then compute (60 ms, 30%).") in text
    assert "recompute: 95.0% ± 5.0 at 1000.0 ms, mostly compute (700 ms, 70%)" in text
    even = _results(("recompute", None, 0.9, 100.0), ("spec", 0.25, 0.5, 50.0, "probe_io"))
    even["systems"]["spec@r=0.25"]["breakdown_ms"] = {"probe_io": 20.0, "identify": 15.0, "kv_io_stall": 5.0,
                                                      "compute": 10.0}
    lines = tradeoff.summary(even)
    assert lines[2].endswith("2.00x faster than recompute; its TTFT is led by probe-key I/O (20 ms, 40%), then "
                             "identification (15 ms, 30%).")
    assert lines[3].startswith("Of the 1 run that keeps only part of the prefix KV, 0 are") and len(lines) == 4
    assert "Fastest of all: spec@r=0.1 at 100.0 ms, 10.00x faster than recompute, but 40.0% ± 5.0" in text
    assert "Of the 4 runs that keep only part of the prefix KV, 1 is within 5 points" in text
    assert "the most accurate is spec@r=0.5" in text
    assert tradeoff.frontier(tradeoff.points(SWEEP)) == {"spec@r=0.1", "spec@r=0.25", "spec@r=0.5", "as_full"}
    # a narrower band leaves only as_full, the faster of the exact-accuracy runs
    narrow = " ".join(tradeoff.summary(SWEEP, band_pp=2))
    assert "Fastest within 2 points of recompute's accuracy: as_full (" in narrow and "3.33x faster" in narrow


def test_no_run_within_the_band_names_the_most_accurate_faster_one():
    results = _results(
        ("recompute", None, 0.975, 1800.0),
        ("as_h2o_lfu", 0.1, 0.35, 400.0, "kv_io_stall", 40, 0.075, (-62.5, 7.8)),
        ("as_h2o_lfu", 0.5, 0.575, 440.0, "kv_io_stall", 40, 0.079, (-40.0, 7.8)),
        ("spec", 0.5, 0.325, 880.0, "probe_io"),
    )
    text = " ".join(tradeoff.summary(results))
    assert ("No run is faster than recompute within 5 points of recompute's accuracy; the most accurate faster "
            "run is as_h2o_lfu@r=0.5, 57.5% ± 7.9 (-40.0 ± 7.8 pp vs recompute on the same requests) at 440.0 ms, "
            "4.09x faster than recompute; its TTFT is mostly waiting on KV I/O (308 ms, 70%), then compute (132 ms, "
            "30%).") in text
    assert "Fastest of all: as_h2o_lfu@r=0.1 at 400.0 ms" in text
    assert "Of the 3 runs that keep only part of the prefix KV, 0 are within 5 points" in text
    assert "the fastest is" not in text  # as_h2o_lfu@r=0.1, already named as the fastest of all
    table = tradeoff.table(results)
    lines = table.splitlines()
    assert lines[2].startswith("| as_h2o_lfu@r=0.1 | 0.1 | 35.0 ± 7.5 | 40 | -62.5 ± 7.8 | 400.0 | 4.50x | "
                               "waiting on KV I/O 70% | yes |")
    assert lines[-1] == "| recompute | - | 97.5 ± 5.0 | 40 | - | 1800.0 | - | compute 70% | yes |"


def test_a_full_kv_run_fastest_in_the_band_is_compared_with_the_fastest_pruning_run():
    results = _results(
        ("recompute", None, 0.90, 3376.0),
        ("as_full", None, 0.90, 560.0, "kv_io_stall"),
        ("spec", 0.25, 0.35, 715.0, "compute"),
        ("spec", 0.75, 0.55, 905.0, "compute"),
    )
    text = " ".join(tradeoff.summary(results))
    assert "Fastest within 5 points of recompute's accuracy: as_full (" in text and "Fastest of all" not in text
    assert ("the most accurate is spec@r=0.75, 55.0% ± 5.0 (-35.0 pp vs recompute) at 905.0 ms; the fastest is "
            "spec@r=0.25 at 715.0 ms, 1.28x slower than as_full, its TTFT mostly compute (500 ms, 70%), then "
            "identification (214 ms, 30%).") in text


def test_ties_and_the_band_edge():
    results = _results(
        ("recompute", None, 0.90, 900.0),
        ("as_full", None, 0.90, 250.04, "kv_io_stall"),
        ("spec", 0.5, 0.85, 249.96, "probe_io"),  # exactly 5 points below: inside the band
        ("spec", 0.25, 0.849, 120.0, "probe_io"),  # just outside
    )
    lines = tradeoff.summary(results)
    text = " ".join(lines)
    assert "Tied fastest within 5 points of recompute's accuracy (2 runs at 250.0 ms): spec@r=0.5 (" in text
    assert "Tied with it: as_full (" in text
    assert "Fastest of all: spec@r=0.25 at 120.0 ms" in text
    assert [p.key for p in tradeoff.fastest_within(tradeoff.points(results), tradeoff.reference(
        tradeoff.points(results)))] == ["spec@r=0.5", "as_full"]
    # a run as fast as recompute (to the printed 0.1 ms) is not "faster"; without recompute the most accurate
    # run is the reference
    same = _results(("recompute", None, 0.9, 500.0), ("as_full", None, 0.9, 500.01, "kv_io_stall"))
    assert "No run is faster than recompute within 5 points" in " ".join(tradeoff.summary(same))
    no_ref = _results(("as_full", None, 0.9, 300.0, "kv_io_stall"), ("spec", 0.25, 0.6, 100.0, "probe_io"))
    text = " ".join(tradeoff.summary(no_ref))
    assert "No recompute run: the reference is the most accurate run, as_full, 90.0% ± 5.0" in text
    assert "the most accurate faster run is spec@r=0.25, 60.0% ± 5.0 (-30.0 pp vs as_full)" in text


def test_plot_has_one_marker_per_run_and_a_line_per_pruning_system(tmp_path):
    import matplotlib.pyplot as plt

    fig = tradeoff.figure(SWEEP)
    data = {line.get_label(): len(line.get_xdata()) for line in fig.axes[0].lines
            if not line.get_label().startswith("_")}
    plt.close(fig)
    assert data == {"recompute": 1, "as_full": 1, "spec": 3, "as_h2o_lfu": 1}
    assert sum(data.values()) == len(SWEEP["systems"])
    path = tmp_path / "tradeoff.png"
    tradeoff.plot(SWEEP, path)
    assert path.stat().st_size > 1000


@pytest.mark.parametrize("n", [1, 2])
def test_tradeoff_plot_only_with_something_to_compare(n):
    rows = [("recompute", None, 0.9, 500.0), ("as_full", None, 0.9, 200.0, "kv_io_stall")][:n]
    assert tradeoff.worth_plotting(_results(*rows)) == (n == 2)
    assert tradeoff.summary(_results(*rows))[1].startswith("recompute: 90.0% ± 5.0 at 500.0 ms")


def _scope_names(sentence):
    """The systems the run-count sentence names, and the counts it gives."""
    import re

    m = re.match(r"(\d+) runs? of (\d+) systems? \((.*)\)", sentence)
    groups = [re.sub(r" (once( each)?|at retention .*)$", "", g) for g in m.group(3).split("; ")]
    names = [n for g in groups for n in re.split(r", | and ", g)]
    return int(m.group(1)), int(m.group(2)), names


@pytest.mark.parametrize("rows", [
    SWEEP,
    _results(("recompute", None, 0.9, 500.0), ("as_full", None, 0.9, 200.0, "kv_io_stall"),
             ("as_h2o_lru", 0.25, 0.3, 190.0), ("as_h2o_lru", 0.75, 0.7, 195.0),
             ("as_h2o_lfu", 0.25, 0.3, 191.0), ("as_h2o_lfu", 0.75, 0.7, 196.0),
             ("spec", 0.25, 0.3, 300.0, "probe_io"), ("spec", 0.75, 0.6, 400.0, "probe_io")),
    _results(("recompute", None, 0.9, 500.0)),
])
def test_the_run_count_sentence_names_every_system_it_counts(rows):
    """"8 runs of 5 systems" must go on to name 5 systems, not only the 3 that prune."""
    sentence = tradeoff.summary(rows)[0].split(", each on the same")[0]
    runs, count, names = _scope_names(sentence)
    assert runs == len(rows["systems"]) and count == len(names) == len(set(names))
    assert set(names) == {s["system"] for s in rows["systems"].values()}
    if len(rows["systems"]) == 8:
        assert sentence == ("8 runs of 5 systems (as_full and recompute once each; as_h2o_lfu, as_h2o_lru and spec "
                            "at retention 0.25 and 0.75)")
    if len(rows["systems"]) == 1:
        assert sentence == "1 run of 1 system (recompute once)"


def test_labels_are_placed_apart_even_for_coinciding_points():
    """Two systems with the same TTFT and accuracy at the same retention printed "r=0.75r=0.75": every label's box
    must now be clear of every other label and of every marker, inside the axes."""
    import matplotlib.pyplot as plt

    results = _results(
        ("recompute", None, 0.875, 3069.0),
        ("as_full", None, 0.875, 513.0, "kv_io_stall"),
        ("as_h2o_lru", 0.25, 0.3125, 512.9), ("as_h2o_lru", 0.75, 0.6875, 543.9),
        ("as_h2o_lfu", 0.25, 0.3125, 512.9), ("as_h2o_lfu", 0.75, 0.6875, 543.9),  # on top of as_h2o_lru
        ("spec", 0.25, 0.3125, 938.5, "probe_io"), ("spec", 0.75, 0.5625, 1384.2, "probe_io"),
    )
    fig = tradeoff.figure(results)
    try:
        for dpi in (fig.dpi, 120):  # as drawn, and as `plot` saves it
            fig.set_dpi(dpi)
            fig.canvas.draw()
            renderer = fig.canvas.get_renderer()
            ax = fig.axes[0]
            boxes = [t.get_window_extent(renderer) for t in ax.texts]
            assert sorted(t.get_text() for t in ax.texts) == ["r=0.25"] * 3 + ["r=0.75"] * 3
            frame = ax.get_window_extent(renderer)
            for i, a in enumerate(boxes):
                assert frame.x0 <= a.x0 and a.x1 <= frame.x1 and frame.y0 <= a.y0 and a.y1 <= frame.y1
                for b in boxes[i + 1:]:
                    assert not a.overlaps(b), (a, b)
            for line in ax.lines:
                for px, py in ax.transData.transform(list(zip(line.get_xdata(), line.get_ydata()))):
                    for a in boxes:
                        assert not (a.x0 < px < a.x1 and a.y0 < py < a.y1)  # no label over a marker's centre
            legend = ax.get_legend().get_window_extent(renderer)
            assert legend.x0 >= frame.x1  # the legend sits beside the data, never on it
    finally:
        plt.close(fig)


def test_place_labels_gives_identical_anchors_different_places():
    anchors = [(100.0, 100.0)] * 3
    offsets = tradeoff.place_labels(anchors, [(30.0, 10.0)] * 3, (0, 0, 400, 400))
    assert len(set(offsets)) == 3


@pytest.mark.parametrize("lo, hi", [(300.0, 1800.0), (470.0, 3300.0), (360.0, 1950.0), (20.0, 5000.0)])
def test_log_axis_ticks_cover_both_ends(lo, hi):
    """A log TTFT axis from 300 ms had its first tick at 500 ms: ticks now reach near both ends."""
    import math

    ticks = tradeoff.log_ticks(lo, hi)
    assert len(ticks) >= 4 and all(lo <= t <= hi for t in ticks)
    assert math.log10(ticks[0] / lo) <= 0.4 * math.log10(hi / lo)
    assert math.log10(hi / ticks[-1]) <= 0.4 * math.log10(hi / lo)


def test_tradeoff_log_axis_has_a_tick_below_500_ms():
    import matplotlib.pyplot as plt

    results = _results(("recompute", None, 0.9, 1800.0), ("as_full", None, 0.9, 300.0, "kv_io_stall"),
                       ("spec", 0.25, 0.5, 320.0, "probe_io"), ("spec", 0.75, 0.8, 400.0, "probe_io"))
    fig = tradeoff.figure(results)
    try:
        ax = fig.axes[0]
        assert ax.get_xscale() == "log"
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert min(ticks) < 500 and len(ticks) >= 4
    finally:
        plt.close(fig)
