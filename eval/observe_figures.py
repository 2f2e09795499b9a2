"""The PNG figures of `python -m specjax.eval.observe`, one per paper figure it reproduces, from the results of
`observe_analysis.analyse` (plus the engine runs of `observe_measure.engine_measurements`)."""

from __future__ import annotations

import pathlib

import numpy as np

from specjax.eval.observe_measure import PROBE_LABELS


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_figures(results: dict, out: pathlib.Path, label: str) -> list[pathlib.Path]:
    """Write the figures into `out` (each titled with `label`); returns their paths."""
    plt = _plt()
    written = []
    for make in (_head_heatmaps, _head_similarity, _layer_similarity, _static_preidentification, _chunk_density,
                 _itf_threshold, _engine_reorder_and_cache):
        made = make(plt, results)
        if made is None:
            continue
        fig, name = made
        fig.suptitle(label, fontsize=8, y=0.995)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _head_heatmaps(plt, results: dict):
    """SPEC Fig. 7b: head x head Jaccard at the middle layer, per retention."""
    heads, rets = results["heads"], results["retentions"]
    mid = results["middle_layer"]
    fig, axes = plt.subplots(1, len(rets), figsize=(4 * len(rets), 3.6))
    for ax, ret in zip(np.atleast_1d(axes), rets):
        im = ax.imshow(heads[ret]["matrix"][mid], vmin=0, vmax=1, cmap="viridis")
        ax.set_title(f"layer {mid}, retention {ret:.0%}", fontsize=9)
        ax.set_xlabel("query head")
        ax.set_ylabel("query head")
        fig.colorbar(im, ax=ax, fraction=0.046)
    return fig, "fig7b_head_jaccard_heatmap.png"


def _head_similarity(plt, results: dict):
    """SPEC Fig. 8: mean Jaccard between heads per layer, all pairs and within / across KV heads."""
    heads, rets = results["heads"], results["retentions"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, ret in enumerate(rets):
        color = f"C{i}"
        h = heads[ret]
        ax.plot(h["per_layer"], color=color, label=f"{ret:.0%} all pairs")
        if h["within_per_layer"] is not None:
            ax.plot(h["within_per_layer"], color=color, ls="--", label=f"{ret:.0%} same KV head")
        if h["across_per_layer"] is not None:
            ax.plot(h["across_per_layer"], color=color, ls=":", label=f"{ret:.0%} different KV heads")
        ax.axhline(h["random"], color=color, lw=0.6, alpha=0.6)
    ax.set_xlabel("layer")
    ax.set_ylabel("mean Jaccard between heads")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=6, ncol=3)
    ax.set_title("head similarity per layer (thin lines: random expectation)", fontsize=9)
    return fig, "fig8_head_jaccard_per_layer.png"


def _layer_similarity(plt, results: dict):
    """SPEC Obs. III: layer x layer Jaccard of the shared set, and adjacent layers."""
    lay = results["layers"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    im = axes[0].imshow(lay["matrix"], vmin=0, vmax=1, cmap="viridis")
    axes[0].set_title(f"layer x layer Jaccard of the shared set ({lay['retention']:.0%})", fontsize=9)
    axes[0].set_xlabel("layer")
    axes[0].set_ylabel("layer")
    fig.colorbar(im, ax=axes[0], fraction=0.046)
    axes[1].plot(np.arange(1, len(lay["adjacent_shared"]) + 1), lay["adjacent_shared"], label="shared set")
    axes[1].plot(np.arange(1, len(lay["adjacent_per_head"]) + 1), lay["adjacent_per_head"], label="same head")
    axes[1].axhline(lay["random_jaccard"], color="gray", lw=0.8, label="random")
    axes[1].set_xlabel("layer l (vs l-1)")
    axes[1].set_ylabel("Jaccard")
    axes[1].set_ylim(0, 1)
    axes[1].legend(fontsize=7)
    axes[1].set_title("adjacent layers (SPEC Obs. III)", fontsize=9)
    return fig, "obs3_layer_similarity.png"


def _static_preidentification(plt, results: dict):
    """SPEC Fig. 4: recall and accuracy of another query's sets."""
    rets = results["retentions"]
    spi, acc = results["spi"], results["accuracy"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    axes[0].bar([f"{r:.0%}" for r in rets], [spi[r]["recall"] for r in rets])
    axes[0].set_ylim(0, 1)
    axes[0].set_ylabel("recall of own important set")
    axes[0].set_xlabel("retention")
    axes[0].set_title("static pre-identification (another query's sets)", fontsize=9)
    if acc:
        x = np.arange(len(rets))
        own = [acc.get(f"own@{r}", {}).get("acc", np.nan) for r in rets]
        stat = [acc.get(f"spi@{r}", {}).get("acc", np.nan) for r in rets]
        axes[1].bar(x - 0.2, own, 0.4, label="own sets (ORI)")
        axes[1].bar(x + 0.2, stat, 0.4, label="other query's sets (SPI)")
        axes[1].axhline(acc["full"]["acc"], color="k", lw=0.8, label="full prefix")
        axes[1].set_xticks(x, [f"{r:.0%}" for r in rets])
        axes[1].set_ylim(0, 1)
        axes[1].set_ylabel("accuracy")
        axes[1].legend(fontsize=7)
    axes[1].set_title("accuracy cost (SPEC Fig. 4)", fontsize=9)
    return fig, "fig4_static_preidentification.png"


def _chunk_density(plt, results: dict):
    """SPEC Fig. 5a / ContiguousKV Fig. 4: important fraction of touched chunks, read amplification."""
    den = results["density"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ret in den:
        axes[0].hist(den[ret]["shared"]["fractions"], bins=np.linspace(0, 1, 21), histtype="step",
                     density=True, label=f"{ret:.0%} kept")
    axes[0].set_xlabel(f"important fraction of a touched {results['chunk_tokens']}-token chunk (shared set)")
    axes[0].set_ylabel("density")
    axes[0].legend(fontsize=7)
    axes[0].set_title("chunk density (SPEC Fig. 5a)", fontsize=9)
    xs = sorted(den)
    axes[1].plot([f"{r:.0%}" for r in xs], [den[r]["shared"]["read_amplification"] for r in xs], "o-",
                 label="shared set")
    axes[1].plot([f"{r:.0%}" for r in xs], [den[r]["per_kv_head"]["read_amplification"] for r in xs], "s-",
                 label="per KV head")
    axes[1].set_xlabel("retention")
    axes[1].set_ylabel("read amplification")
    axes[1].legend(fontsize=7)
    axes[1].set_title("read amplification (ContiguousKV Fig. 4)", fontsize=9)
    return fig, "fig5a_chunk_density.png"


def _itf_threshold(plt, results: dict):
    """SPEC Fig. 11, 19, 22: keys read, accuracy and per-layer fallback against alpha (and the engine's runs)."""
    acc = results["accuracy"]
    sweep, alphas = results["itf"], results["alphas"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for probes_name, marker in (("spread", "o"), ("engine", "s")):
        axes[0].plot(alphas, [sweep[(probes_name, a)]["keys_loaded"] for a in alphas], marker + "-",
                     label=f"{PROBE_LABELS[probes_name]} {sweep[(probes_name, alphas[0])]['probes']}")
    axes[0].set_xlabel("alpha")
    axes[0].set_ylabel("prefix keys read / all keys")
    axes[0].legend(fontsize=7)
    axes[0].set_title("keys loaded vs alpha (SPEC Fig. 11)", fontsize=9)
    if acc:
        axes[1].plot(alphas, [acc.get(f"itf-spread@{a}", {}).get("acc", np.nan) for a in alphas], "o-",
                     label="ITF, spread probes")
        axes[1].axhline(acc["full"]["acc"], color="k", lw=0.8, label="full prefix")
        axes[1].set_ylim(0, 1)
        axes[1].legend(fontsize=7)
    axes[1].set_xlabel("alpha")
    axes[1].set_ylabel("accuracy")
    axes[1].set_title("accuracy vs alpha (SPEC Fig. 22)", fontsize=9)
    for a in alphas:
        axes[2].plot(sweep[("spread", a)]["fallback_per_layer"], label=f"alpha {a}")
    axes[2].set_xlabel("layer")
    axes[2].set_ylabel("fallback rate")
    axes[2].set_ylim(-0.02, 1.02)
    axes[2].legend(fontsize=6)
    axes[2].set_title("per-layer ITF fallback, spread probes (SPEC Fig. 19)", fontsize=9)
    eng_runs = (results.get("engine") or {}).get("runs") or {}
    eng_alphas = [a for a in alphas if f"spec alpha={a}" in eng_runs]
    if eng_alphas:
        axes[0].plot(eng_alphas, [eng_runs[f"spec alpha={a}"]["keys_loaded"] for a in eng_alphas], "^--",
                     label="engine run (spec)")
        axes[0].legend(fontsize=7)
        axes[1].plot(eng_alphas, [eng_runs[f"spec alpha={a}"]["accuracy"] for a in eng_alphas], "^--",
                     label="engine run (spec)")
        axes[1].legend(fontsize=7)
    return fig, "fig11_19_22_itf_threshold.png"


def _engine_reorder_and_cache(plt, results: dict):
    """SPEC Fig. 20, 21: the engine's reordering and cache policy; None without those engine runs."""
    eng_runs = (results.get("engine") or {}).get("runs") or {}
    base, noro, lfu = (eng_runs.get(k) for k in ("spec alpha=0.6", "spec no reorder", "spec LFU cache"))
    if not (base and noro and lfu):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    axes[0].bar(["no reorder", "reorder"], [noro["chunks_read_per_request"], base["chunks_read_per_request"]])
    axes[0].set_ylabel("chunks read per request")
    axes[0].set_title("reordering (SPEC Fig. 20), engine", fontsize=9)
    axes[1].bar(["LFU", "score"], [lfu["device_hit_ratio"], base["device_hit_ratio"]])
    axes[1].set_ylim(0, 1)
    axes[1].set_ylabel("device-cache hit ratio")
    axes[1].set_title("cache policy (SPEC Fig. 21), engine", fontsize=9)
    return fig, "fig20_21_engine.png"
