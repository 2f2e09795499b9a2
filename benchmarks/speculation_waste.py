"""Diagnostic: how many disk chunks does spec's speculative prefetch waste, and would a stricter guess help?

Runs `python -m specjax.eval` unchanged (every flag of it applies; give it `--systems spec`) and, for each layer
after the first of every `spec` request the run makes (warm-up passes included), compares the chunks speculation
reads for that layer with the chunks the layer's real important set needs. Only chunks in neither cache count:
a cached chunk costs no disk read whether it was guessed or not. Per layer and kind (K, V) it reports

- speculated: uncached chunks the guess reads (as built: `specjax.engine.speculation`),
- used: those the layer's set then needs; wasted = speculated - used,
- demand: uncached chunks the set needs that the guess missed (read on demand, as impress reads all of them),

and the same for stricter guesses that keep only chunks holding at least a share `t` of their slots from the
previous layer's set (`--thresholds`). With the same caches, impress would read `used + demand` of the as-built row.

    python benchmarks/speculation_waste.py --task piqa --data_dir DATA --limit 24 \\
        --prefix_tokens 1024 --systems spec --retention 0.25 --output_dir /tmp/waste

It subscribes to the engine's `selection` event (`specjax.engine.events`) to look, never to change what is read; a
measurement aid, not a system. Prints the table and writes OUTPUT_DIR/speculation_waste.json.
"""

from __future__ import annotations

import collections
import json
import pathlib
import weakref

from absl import app, flags

from specjax.engine import events, speculation
from specjax.eval import __main__ as eval_main
from specjax.stores import K, V

flags.DEFINE_string("thresholds", "0.125,0.25,0.5", "Comma-separated shares of a chunk's slots the previous "
                    "layer's set must fill for a stricter guess to read it.")
FLAGS = flags.FLAGS

_counts: collections.Counter = collections.Counter()


def _looking(thresholds):
    """The `selection` event's subscriber: counts each spec layer that had a guess against its real set."""
    previous_of = weakref.WeakKeyDictionary()  # a request's LayerIO -> its previous layer's set

    def looking(io, layer, chosen):
        previous = previous_of.get(io)
        if io.path.system.prefetch.speculative and previous is not None and layer in io.prefetched:
            _count(io, layer, previous, chosen, thresholds)
        previous_of[io] = chosen

    return looking


def _count(io, layer, previous, chosen, thresholds):
    store, cache, c = io.path.store, io.path.cache, io.path.store.layout.chunk_tokens
    guessed = set(store.locate(io.match, io.prefetched[layer], layer).unique_chunks().tolist())
    needed = set(store.locate(io.match, chosen, layer).unique_chunks().tolist())
    # the stricter guesses: _speculate's chunks minus those the previous set fills thinly
    chunks, hits = speculation.ranking(io.locate, layer, previous)
    guesses = {"as built": guessed}
    guesses.update({f"t={t:g}": {int(x) for x, h in zip(chunks, hits) if h >= t * c} for t in thresholds})
    _counts["layers"] += 1
    for kind in (K, V):
        cached = {x for x in guessed | needed if cache is not None and cache.where((layer, kind, x)) is not None}
        for name, guess in guesses.items():
            speculated, need = guess - cached, needed - cached
            _counts[(name, "speculated")] += len(speculated)
            _counts[(name, "used")] += len(speculated & need)
            _counts[(name, "demand")] += len(need - speculated)


def _report(output_dir, thresholds):
    per = 2 * max(_counts["layers"], 1)  # per layer and kind
    rows = []
    for name in ["as built"] + [f"t={t:g}" for t in thresholds]:
        s, u, d = (_counts[(name, x)] / per for x in ("speculated", "used", "demand"))
        rows.append({"guess": name, "speculated": s, "used": u, "wasted": s - u, "demand": d, "read": s + d,
                     "impress_read": (_counts[("as built", "used")] + _counts[("as built", "demand")]) / per})
    print(f"uncached chunks per layer and kind over {_counts['layers']} layers:")
    print("| guess | speculated | used | wasted | demand | read | impress reads |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['guess']} | {r['speculated']:.2f} | {r['used']:.2f} | {r['wasted']:.2f} | {r['demand']:.2f} "
              f"| {r['read']:.2f} | {r['impress_read']:.2f} |")
    if output_dir:
        path = pathlib.Path(output_dir) / "speculation_waste.json"
        path.write_text(json.dumps({"layers": _counts["layers"], "rows": rows}, indent=1))
        print(f"wrote {path}")


def main(argv):
    thresholds = [float(t) for t in FLAGS.thresholds.split(",") if t]
    try:
        with events.subscribed("selection", _looking(thresholds)):
            eval_main.main(argv)
    finally:
        _report(FLAGS.output_dir, thresholds)


if __name__ == "__main__":
    app.run(main)
