"""A serving loop that reuses one shared prefix's stored KV for every request.

A few-shot prompt (the shared prefix) is stored once; each request appends its own text and scores the answers it
may have. Every request reuses the prefix's KV from the store, so only its own tokens are computed. as_full loads all
of it (the answers recompute would give); a selective system (`--system spec`) loads only the share each layer
attends to, which pays on long prefixes, not on this short one.

    python examples/serve_prefix.py                              # smollm2-135m, as_full
    python examples/serve_prefix.py --system spec --retention 0.5 --store /tmp/my-kv
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np

import specjax
from specjax.compiles import CompileCounter

PREFIX = ("Decide whether each review is positive or negative.\n"
          "Review: A warm, funny film with a great cast. Sentiment: positive\n"
          "Review: Dull, slow and far too long. Sentiment: negative\n"
          "Review: I would happily watch it again tomorrow. Sentiment: positive\n"
          "Review: The plot made no sense and the acting was wooden. Sentiment: negative\n")
REVIEWS = ["An absolute delight from start to finish.", "I walked out halfway through.",
           "Beautifully shot and deeply moving.", "A tedious mess with nothing to say."]
ANSWERS = [" positive", " negative"]


def serve(model, engine, prefix: list[int]) -> list[dict]:
    """One request per review: its first token's logits and each answer's log-probability, over the stored prefix."""
    answers = [model.tokenizer.encode(a) for a in ANSWERS]
    served = []
    for review in REVIEWS:
        query = model.tokenizer.encode(f"Review: {review} Sentiment:")
        result = engine.run(specjax.Request(prefix, query, answers))
        scores = [logprob for logprob, _ in result.continuation_logprobs]
        served.append({"review": review, "answer": ANSWERS[int(np.argmax(scores))].strip(),
                       "ttft_ms": result.ttft_ms, "reused_tokens": result.reused_tokens,
                       "computed_tokens": result.computed_tokens, "disk_bytes": int(result.io.get("disk_bytes", 0))})
    return served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--system", default="as_full", help="any of specjax.engine.SYSTEMS")
    parser.add_argument("--retention", type=float, default=0.25,
                        help="the share of the prefix a selective system keeps")
    parser.add_argument("--store", help="the store's folder (default: a new temporary one, removed at the end)")
    args = parser.parse_args()

    model = specjax.load_model(args.model)
    with tempfile.TemporaryDirectory(prefix="specjax-kv-") as scratch:
        store = specjax.open_store(model, args.store or scratch, system=args.system)
        try:
            engine = specjax.prefill_engine(model, args.system, store, retention=args.retention)
            prefix = model.tokenizer.encode(PREFIX)
            stored = engine.warm(prefix)  # the shared prefix's KV, computed and stored once
            print(f"prefix of {len(prefix)} tokens {'stored' if stored else 'already in the store'}")
            warm = specjax.Request(prefix, model.tokenizer.encode("Review: Fine. Sentiment:"),
                                   [model.tokenizer.encode(a) for a in ANSWERS])
            print(f"warm-up compiled {specjax.warm_up(engine, [warm])} programs")
            with CompileCounter() as compiles:
                served = serve(model, engine, prefix)
            for s in served:
                print(f"{s['answer']:8s} TTFT {s['ttft_ms']:7.1f} ms  reused {s['reused_tokens']} tokens, computed "
                      f"{s['computed_tokens']}, read {s['disk_bytes']} bytes from disk   {s['review']}")
            print(f"compiled while serving: {compiles.count}")
        finally:
            store.close()


if __name__ == "__main__":
    main()
