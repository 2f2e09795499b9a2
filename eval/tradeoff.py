"""The accuracy-TTFT trade-off that leads results.md: one point per (system, retention), a table, a plot, and
sentences computed from the results dict alone, so the text says what this run measured and nothing else."""

from __future__ import annotations

import dataclasses
import pathlib

from specjax.eval.systems import BREAKDOWN_KEYS, KNOWN_SYSTEMS

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


def summary(results: dict, band_pp: float = BAND_PP) -> list[str]:
    """The trade-off in a few sentences, every figure taken from `results`."""
    pts = points(results)
    ns = sorted({p.n for p in pts})
    n_text = f"{ns[0]} requests" if len(ns) == 1 else f"{ns[0]}-{ns[-1]} requests (n per run in the table)"
    retentions = sorted({p.retention for p in pts if p.retention is not None})
    pruning = sorted({p.system for p in pts if p.retention is not None})
    scope = f"{len(pts)} runs of {len({p.system for p in pts})} systems"
    if pruning:
        scope += f" ({', '.join(pruning)} at retention {', '.join(f'{r:g}' for r in retentions)})"
    out = [f"{scope}, each on the same {n_text}; accuracy ± one standard error, TTFT the mean per request."]
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


def figure(results: dict):
    """Accuracy against mean TTFT: a line through each pruning system's retentions, a lone marker for each system
    that does not prune. Every plotted data line carries its system's name as label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (the log axis' plain labels)

    pts = points(results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_system: dict[str, list[Point]] = {}
    for p in pts:
        by_system.setdefault(p.system, []).append(p)
    markers = "osD^vP*Xh<>"
    for i, (name, group) in enumerate(sorted(by_system.items())):
        group.sort(key=lambda p: (p.retention is None, p.retention or 0.0))
        x = [p.ttft_ms for p in group]
        y = [100 * p.acc for p in group]
        line, = ax.plot(x, y, marker=markers[i % len(markers)], markersize=7, label=name,
                        linestyle="-" if len(group) > 1 else "none")
        ax.errorbar(x, y, yerr=[100 * p.stderr for p in group], fmt="none", ecolor=line.get_color(), capsize=3,
                    alpha=0.6)
        for p in group:
            if p.retention is not None:
                ax.annotate(f"r={p.retention:g}", (p.ttft_ms, 100 * p.acc), textcoords="offset points",
                            xytext=(5, 4), fontsize=7)
    ref = reference(pts)
    ax.axhspan(100 * ref.acc - BAND_PP, 100 * ref.acc, color="gray", alpha=0.12,
               label=f"within {BAND_PP:g} pp of {ref.key}")
    spread = max(p.ttft_ms for p in pts) / max(min(p.ttft_ms for p in pts), 1e-9)
    if spread > 4:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("mean TTFT (ms)")
    ax.set_ylabel("accuracy (%), ± one standard error")
    ns = sorted({p.n for p in pts})
    n_text = f"n={ns[0]}" if len(ns) == 1 else f"n={ns[0]}-{ns[-1]}"
    ax.set_title(f"{results['model']} / {results['task']}: accuracy vs TTFT ({n_text} requests per point)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def worth_plotting(results: dict) -> bool:
    return len(results["systems"]) > 1
