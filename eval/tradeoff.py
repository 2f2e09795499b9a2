"""The accuracy-TTFT trade-off that leads results.md: one point per (system, retention), a table, a plot, and
sentences computed from the results dict alone, so the text says what this run measured and nothing else."""

from __future__ import annotations

import dataclasses
import pathlib

from specjax.engine.systems import SYSTEMS as KNOWN_SYSTEMS
from specjax.eval.systems import BREAKDOWN_KEYS

BAND_PP = 5.0  # "near the reference": at most this many accuracy points (pp) below it
PHASE_NAMES = {"probe_io": "probe-key I/O", "identify": "identification", "kv_io_stall": "waiting on KV I/O",
               "compute": "compute"}


@dataclasses.dataclass(frozen=True)
class Point:
    key: str  # the results key: system, or system@r=R in a sweep
    system: str
    retention: float | None  # None: the system does not prune, so one run stands for every retention
    acc: float  # fraction of requests right
    stderr: float
    n: int
    ttft_ms: float  # mean
    breakdown_ms: dict[str, float]
    paired_pp: tuple[float, float] | None  # accuracy minus recompute's on the same requests (pp) and its stderr


def points(results: dict) -> list[Point]:
    """Every run of the results, fastest mean TTFT first (ties: by key)."""
    out = []
    for key, s in results["systems"].items():
        a, paired = s["accuracy"], s.get("paired_vs_recompute")
        out.append(Point(key, s.get("system", key), s.get("retention"), a["acc"], a["stderr"], a["n"],
                         s["ttft_ms"]["mean"], dict(s["breakdown_ms"]),
                         (100 * paired["acc_diff"], 100 * paired["stderr"]) if paired else None))
    return sorted(out, key=lambda p: (p.ttft_ms, p.key))


def frontier(pts: list[Point]) -> set[str]:
    """Keys of the points no other point beats on both: at most as slow and at least as accurate, better in one."""
    def beats(q, p):
        return q.ttft_ms <= p.ttft_ms and q.acc >= p.acc and (q.ttft_ms < p.ttft_ms or q.acc > p.acc)

    return {p.key for p in pts if not any(beats(q, p) for q in pts)}


def reference(pts: list[Point]) -> Point:
    """recompute (exact) when it ran, else the most accurate point (ties: the fastest)."""
    for p in pts:
        if p.system == "recompute":
            return p
    return max(pts, key=lambda p: (p.acc, -p.ttft_ms))


def _same_ms(a: float, b: float) -> bool:
    return round(a, 1) == round(b, 1)  # equal as printed: the report cannot tell them apart


def within(p: Point, ref: Point, band_pp: float = BAND_PP) -> bool:
    """At most `band_pp` accuracy points below `ref` (the edge included)."""
    return 100 * (ref.acc - p.acc) <= band_pp + 1e-9


def fastest_within(pts: list[Point], ref: Point, band_pp: float = BAND_PP) -> list[Point]:
    """The fastest points within the band below `ref` (several when their mean TTFTs tie)."""
    near = [p for p in pts if within(p, ref, band_pp)]
    best = min(p.ttft_ms for p in near)
    return [p for p in near if _same_ms(p.ttft_ms, best)]


# ---------------------------------------------------------------- text


def _name(p: Point) -> str:
    return p.key if p.retention is None or "@" in p.key else f"{p.key} (r={p.retention:g})"


def _acc(p: Point) -> str:
    return f"{100 * p.acc:.1f}% ± {100 * p.stderr:.1f}"


def _speed(p: Point, ref: Point) -> str:
    if _same_ms(p.ttft_ms, ref.ttft_ms) or not p.ttft_ms or not ref.ttft_ms:
        return f"as fast as {ref.key}"
    if p.ttft_ms < ref.ttft_ms:
        return f"{ref.ttft_ms / p.ttft_ms:.2f}x faster than {ref.key}"
    return f"{p.ttft_ms / ref.ttft_ms:.2f}x slower than {ref.key}"


def _vs_ref(p: Point, ref: Point) -> str:
    if p.paired_pp is not None:
        return f"{p.paired_pp[0]:+.1f} ± {p.paired_pp[1]:.1f} pp vs {ref.key} on the same requests"
    return f"{100 * (p.acc - ref.acc):+.1f} pp vs {ref.key}"


def phases(p: Point) -> str:
    """Where the point's mean TTFT goes: its largest phase ("mostly" when over half), and the next one when it is a
    tenth or more."""
    total = p.ttft_ms or sum(p.breakdown_ms.values())
    parts = sorted(((p.breakdown_ms.get(k, 0.0), k) for k in BREAKDOWN_KEYS), reverse=True)
    if not total or parts[0][0] <= 0:
        return "without a breakdown"
    shown = [parts[0]] + [(ms, k) for ms, k in parts[1:2] if ms >= 0.1 * total]
    text = ", then ".join(f"{PHASE_NAMES[k]} ({ms:.0f} ms, {100 * ms / total:.0f}%)" for ms, k in shown)
    share = parts[0][0] / total
    return ("all " if share >= 0.99 else "mostly " if share > 0.5 else "led by ") + text


def _describe(system: str) -> str:
    """The system's description; a system run with options of its own ("spec-no_prefetch") has its base's."""
    info = KNOWN_SYSTEMS.get(system) or KNOWN_SYSTEMS.get(system.split("-")[0])
    return f" ({info.description})" if info else ""


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def scope(pts: list[Point]) -> str:
    """How many runs of how many systems, naming every system: those that ran once (they keep the whole prefix, or
    none of it), then those that prune, grouped by the retentions they ran at."""
    systems = sorted({p.system for p in pts})
    once = [s for s in systems if all(p.retention is None for p in pts if p.system == s)]
    by_retentions: dict[tuple[float, ...], list[str]] = {}
    for s in systems:
        if s not in once:
            rs = tuple(sorted({p.retention for p in pts if p.system == s and p.retention is not None}))
            by_retentions.setdefault(rs, []).append(s)
    parts = []
    if once:
        parts.append(_and(once) + (" once" if len(once) == 1 else " once each"))
    parts += [f"{_and(names)} at retention {_and([f'{r:g}' for r in rs])}" for rs, names in by_retentions.items()]
    runs = f"{len(pts)} run{'s' if len(pts) != 1 else ''}"
    return f"{runs} of {len(systems)} system{'s' if len(systems) != 1 else ''} ({'; '.join(parts)})"


def summary(results: dict, band_pp: float = BAND_PP) -> list[str]:
    """The trade-off in a few sentences, every figure taken from `results`."""
    pts = points(results)
    ns = sorted({p.n for p in pts})
    n_text = f"{ns[0]} requests" if len(ns) == 1 else f"{ns[0]}-{ns[-1]} requests (n per run in the table)"
    out = [f"{scope(pts)}, each on the same {n_text}; accuracy ± one standard error, TTFT the mean per request."]
    ref = reference(pts)
    if ref.system == "recompute":
        out.append(f"{ref.key}: {_acc(ref)} at {ref.ttft_ms:.1f} ms, {phases(ref)}.")
    else:
        out.append(f"No recompute run: the reference is the most accurate run, {_name(ref)}, {_acc(ref)} at "
                   f"{ref.ttft_ms:.1f} ms, {phases(ref)}.")
    if len(pts) == 1:
        return out
    band = f"within {band_pp:g} points of {ref.key}'s accuracy"
    # all at one mean TTFT, which is at most the reference's since the reference is within its own band
    best = [p for p in fastest_within(pts, ref, band_pp) if not _same_ms(p.ttft_ms, ref.ttft_ms)]
    named = set()  # runs whose breakdown a sentence already gave
    if not best:
        faster = [p for p in pts if p.ttft_ms < ref.ttft_ms and not _same_ms(p.ttft_ms, ref.ttft_ms)]
        text = f"No run is faster than {ref.key} {band}"
        if faster:
            top = max(faster, key=lambda p: (p.acc, -p.ttft_ms))
            text += (f"; the most accurate faster run is {_name(top)}, {_acc(top)} ({_vs_ref(top, ref)}) at "
                     f"{top.ttft_ms:.1f} ms, {_speed(top, ref)}; its TTFT is {phases(top)}")
            named.add(top.key)
        out.append(text + ".")
    for i, p in enumerate(best):
        if i:
            head = "Tied with it: "
        elif len(best) == 1:
            head = f"Fastest {band}: "
        else:
            head = f"Tied fastest {band} ({len(best)} runs at {p.ttft_ms:.1f} ms): "
        out.append(f"{head}{_name(p)}{_describe(p.system)}, {_acc(p)} ({_vs_ref(p, ref)}) at {p.ttft_ms:.1f} ms, "
                   f"{_speed(p, ref)}; its TTFT is {phases(p)}.")
        named.add(p.key)
    overall = pts[0]
    if overall.key != ref.key and overall.key not in named:
        named.add(overall.key)
        out.append(f"Fastest of all: {_name(overall)} at {overall.ttft_ms:.1f} ms, {_speed(overall, ref)}, but "
                   f"{_acc(overall)} ({_vs_ref(overall, ref)}); its TTFT is {phases(overall)}.")
    pruned = [p for p in pts if p.retention is not None]
    if pruned:
        top = max(pruned, key=lambda p: (p.acc, -p.ttft_ms))
        near = [p for p in pruned if within(p, ref, band_pp)]
        if top.key != ref.key:
            runs = f"{len(pruned)} runs that keep" if len(pruned) > 1 else "1 run that keeps"
            text = (f"Of the {runs} only part of the prefix KV, {len(near)} {'is' if len(near) == 1 else 'are'} "
                    f"{band}; the most accurate is {_name(top)}, {_acc(top)} ({_vs_ref(top, ref)}) at "
                    f"{top.ttft_ms:.1f} ms")
            quick = pruned[0]  # the fastest of them
            if quick.key not in named:
                versus = best[0] if best else ref
                text += (f"; the fastest is {_name(quick)} at {quick.ttft_ms:.1f} ms, {_speed(quick, versus)}, its "
                         f"TTFT {phases(quick)}")
            out.append(text + ".")
    return out


def table(results: dict) -> str:
    """One row per point, fastest first; `frontier`: no other run is both at least as fast and as accurate."""
    pts = points(results)
    ref, edge = reference(pts), frontier(pts)
    header = ["run", "retention", "acc % ± se", "n", f"Δacc vs {ref.key} (pp)", "TTFT mean ms",
              f"vs {ref.key}", "largest phase", "frontier"]
    rows = []
    for p in pts:
        diff = f"{p.paired_pp[0]:+.1f} ± {p.paired_pp[1]:.1f}" if p.paired_pp else \
            ("-" if p.key == ref.key else f"{100 * (p.acc - ref.acc):+.1f}")
        total = p.ttft_ms or 1.0
        ms, k = max((p.breakdown_ms.get(k, 0.0), k) for k in BREAKDOWN_KEYS)
        rows.append([p.key, "-" if p.retention is None else f"{p.retention:g}", _acc(p).replace("%", ""), str(p.n),
                     diff, f"{p.ttft_ms:.1f}",
                     f"{ref.ttft_ms / p.ttft_ms:.2f}x" if p.ttft_ms and p.key != ref.key else "-",
                     f"{PHASE_NAMES[k]} {100 * ms / total:.0f}%", "yes" if p.key in edge else ""])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


# ---------------------------------------------------------------- plot

# where a point's label may go, in points from the point, nearest first: right, left, above, below, then further out
LABEL_OFFSETS = [(6, 5), (6, -6), (-6, 5), (-6, -6), (0, 10), (0, -11)] + [
    (r * dx, r * dy) for r in (1.8, 2.6, 3.4, 4.4) for dx, dy in
    ((6, 5), (6, -6), (-6, 5), (-6, -6), (0, 10), (0, -11), (8, 0), (-8, 0))]


LINE_WEIGHT = 0.5  # a label over a line costs this much per unit of area it covers; over a marker or label, 1
DISTANCE_WEIGHT = 0.1  # and this per point it is further from its own point than the nearest place


def log_ticks(lo: float, hi: float, min_ticks: int = 4, max_gap: float = 0.4) -> list[float]:
    """Ticks for a log axis from `lo` to `hi`: the plainest series of 1-2-5 style values that puts at least
    `min_ticks` ticks on it and leaves no stretch without one (between ticks or at either end) over `max_gap` of
    the axis' log span, so a span of under a decade has ticks at both ends, not only 500 and 1000."""
    import math

    if not (lo > 0 and hi > lo):
        return []
    span = math.log10(hi / lo)
    ticks: list[float] = []
    for subs in ((1,), (1, 2, 5), (1, 2, 3, 5), (1, 2, 3, 4, 5, 7), (1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9),
                 (1, 1.2, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 6, 7, 8, 9)):
        ticks = sorted({round(m * 10.0 ** k, 10) for k in range(math.floor(math.log10(lo)) - 1,
                                                                 math.ceil(math.log10(hi)) + 1)
                        for m in subs if lo <= m * 10.0 ** k <= hi})
        edges = [lo, *ticks, hi]
        if len(ticks) >= min_ticks and all(math.log10(b / a) <= max_gap * span for a, b in zip(edges, edges[1:])):
            break
    return ticks


def _overlap(a, b) -> float:
    """The area two boxes (x0, y0, x1, y1) share."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h if w > 0 and h > 0 else 0.0


def place_labels(anchors: list[tuple[float, float]], sizes: list[tuple[float, float]], frame, obstacles=(),
                 offsets=None, pad: float = 1.0, soft=(), soft_weight: float = 0.1,
                 far: float = float("inf"), distance_weight: float = 0.5,
                 clearance: float = 0.0) -> list[tuple[float, float]]:
    """Greedy label placement in display units: for each anchor (a point, x y), the one of `offsets` (dx, dy from
    the anchor to the label's near edge, centred on dy) whose box, of `sizes[i]` (w h), costs least: it should lie
    in `frame` (x0 y0 x1 y1), overlap neither an obstacle box (markers; another point's kept `clearance` away, so a
    label is not read as its neighbour's) nor a label placed before it, preferably no `soft` box (bits of lines,
    weighed `soft_weight`), and be near its point (`distance_weight` per unit beyond the nearest offset). A label
    further than `far` (|dx| + |dy|) gets a line back to its point: that
    line should cross no label placed before it and no other marker, and is a soft obstacle for the labels after
    it. Returns each label's offset."""
    offsets = offsets or LABEL_OFFSETS
    nearest = min(abs(dx) + abs(dy) for dx, dy in offsets)
    placed: list[tuple[float, float, float, float]] = []
    leaders: list[tuple[float, float, float, float]] = []  # the lines from labels pushed away back to their points
    soft = list(soft)
    chosen = []
    for (x, y), (w, h) in zip(anchors, sizes):
        own = [o for o in obstacles if o[0] <= x <= o[2] and o[1] <= y <= o[3]]
        others = [o for o in obstacles if o not in own]
        kept_off = [(o[0] - clearance, o[1] - clearance, o[2] + clearance, o[3] + clearance) for o in others]
        best, best_cost = None, None
        for dx, dy in offsets:
            x0 = x + dx if dx > 0 else x + dx - w if dx < 0 else x - w / 2
            box = (x0 - pad, y + dy - h / 2 - pad, x0 + w + pad, y + dy + h / 2 + pad)
            outside = (max(0.0, frame[0] - box[0]) + max(0.0, box[2] - frame[2]) +
                       max(0.0, frame[1] - box[1]) + max(0.0, box[3] - frame[3])) * (w + h)
            cost = (outside + sum(_overlap(box, o) for o in (*placed, *own, *kept_off)) +
                    soft_weight * sum(_overlap(box, o) for o in (*soft, *leaders)) +
                    distance_weight * (abs(dx) + abs(dy) - nearest))
            if abs(dx) + abs(dy) > far:  # its own line back to the point
                near = (x0 if dx > 0 else x0 + w if dx < 0 else x0 + w / 2, y + dy)
                cost += sum(_overlap(b, o) for b in _segment_boxes([(x, y), near], 1.0) for o in (*placed, *others))
            if best_cost is None or cost < best_cost - 1e-9:
                best, best_cost = (dx, dy, box), cost
        dx, dy, box = best
        placed.append(box)
        if abs(dx) + abs(dy) > far:
            near = (box[0] + pad if dx > 0 else box[2] - pad if dx < 0 else (box[0] + box[2]) / 2, y + dy)
            leaders += _segment_boxes([(x, y), near], 1.5)
        chosen.append((dx, dy))
    return chosen


def _segment_boxes(xy, half: float, step: float = 4.0) -> list[tuple[float, float, float, float]]:
    """Small boxes every `step` display units along the polyline `xy`."""
    import numpy as np

    out = []
    for (x0, y0), (x1, y1) in zip(xy[:-1], xy[1:]):
        n = max(1, int(np.hypot(x1 - x0, y1 - y0) / step))
        for t in np.linspace(0.0, 1.0, n + 1):
            x, y = x0 + t * (x1 - x0), y0 + t * (y1 - y0)
            out.append((x - half, y - half, x + half, y + half))
    return out


def _annotate_points(fig, ax, labelled: list[tuple[float, float, str, str]], fontsize: float = 7) -> None:
    """Label each (x, y, text, colour) beside its point without covering another label or marker; a label pushed
    away from its point gets a thin line back to it."""
    fig.canvas.draw()  # fixes the layout, so display positions are final
    renderer = fig.canvas.get_renderer()
    scale = fig.dpi / 72.0
    anchors = [tuple(ax.transData.transform((x, y))) for x, y, _, _ in labelled]
    sizes = []
    for _, _, text, _ in labelled:
        t = ax.text(0, 0, text, fontsize=fontsize)
        ext = t.get_window_extent(renderer)
        sizes.append((ext.width, ext.height))
        t.remove()
    bbox = ax.get_window_extent(renderer)
    markers, lines = [], []
    for line in ax.lines:  # every marker of every data line is an obstacle, the lines between them soft ones
        xy = ax.transData.transform(list(zip(line.get_xdata(), line.get_ydata())))
        if line.get_marker() not in (None, "None", "", " "):
            r = (line.get_markersize() / 2 + 1.5) * scale
            markers += [(px - r, py - r, px + r, py + r) for px, py in xy]
        if line.get_linestyle() not in ("None", "none", "", " "):
            lines += _segment_boxes(xy, 1.5 * scale)
    for coll in ax.collections:  # the error bars
        for seg in getattr(coll, "get_segments", lambda: [])():
            lines += _segment_boxes(ax.transData.transform(seg), 1.5 * scale)
    offsets = [(dx * scale, dy * scale) for dx, dy in LABEL_OFFSETS]
    far = 14 * scale
    chosen = place_labels(anchors, sizes, (bbox.x0, bbox.y0, bbox.x1, bbox.y1), markers, offsets, soft=lines,
                          far=far, clearance=4 * scale, soft_weight=LINE_WEIGHT,
                          distance_weight=DISTANCE_WEIGHT / scale)
    for (x, y, text, colour), (dx, dy) in zip(labelled, chosen):
        pushed = abs(dx) + abs(dy) > far
        # in points, so that saving at another dpi scales the offsets with the text and markers
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx / scale, dy / scale), fontsize=fontsize,
                    color=colour,
                    ha="left" if dx > 0 else "right" if dx < 0 else "center", va="center",
                    bbox=dict(boxstyle="square,pad=0.05", fc="white", ec="none", alpha=0.75),
                    arrowprops=dict(arrowstyle="-", lw=0.5, color=colour, shrinkA=0, shrinkB=3) if pushed else None)


def figure(results: dict):
    """Accuracy against mean TTFT: a line through each pruning system's retentions, a lone marker for each system
    that does not prune. Every plotted data line carries its system's name as label; each pruning point is labelled
    with its retention, placed clear of the other labels and markers; the legend sits outside the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (the log axis' plain labels)

    pts = points(results)
    fig, ax = plt.subplots(figsize=(10, 5.4))
    by_system: dict[str, list[Point]] = {}
    for p in pts:
        by_system.setdefault(p.system, []).append(p)
    markers = "osD^vP*Xh<>"
    labelled = []
    for i, (name, group) in enumerate(sorted(by_system.items())):
        group.sort(key=lambda p: (p.retention is None, p.retention or 0.0))
        x = [p.ttft_ms for p in group]
        y = [100 * p.acc for p in group]
        line, = ax.plot(x, y, marker=markers[i % len(markers)], markersize=7, label=name,
                        linestyle="-" if len(group) > 1 else "none")
        ax.errorbar(x, y, yerr=[100 * p.stderr for p in group], fmt="none", ecolor=line.get_color(), capsize=3,
                    alpha=0.6)
        labelled += [(p.ttft_ms, 100 * p.acc, f"r={p.retention:g}", line.get_color())
                     for p in group if p.retention is not None]
    ref = reference(pts)
    ax.axhspan(100 * ref.acc - BAND_PP, 100 * ref.acc, color="gray", alpha=0.12,
               label=f"within {BAND_PP:g} pp of {ref.key}")
    spread = max(p.ttft_ms for p in pts) / max(min(p.ttft_ms for p in pts), 1e-9)
    if spread > 4:
        ax.set_xscale("log")
        lo, hi = ax.get_xlim()
        ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(log_ticks(lo, hi)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlim(lo, hi)
    ax.set_xlim(ax.get_xlim())  # labels are placed for these limits: keep them
    ax.set_ylim(ax.get_ylim())
    ax.set_xlabel("mean TTFT (ms)")
    ax.set_ylabel("accuracy (%), ± one standard error")
    ns = sorted({p.n for p in pts})
    n_text = f"n={ns[0]}" if len(ns) == 1 else f"n={ns[0]}-{ns[-1]}"
    ax.set_title(f"{results['model']} / {results['task']}: accuracy vs TTFT ({n_text} requests per point)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    if labelled:
        _annotate_points(fig, ax, labelled)
    return fig


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def worth_plotting(results: dict) -> bool:
    return len(results["systems"]) > 1
