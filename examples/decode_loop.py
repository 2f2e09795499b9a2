"""A decode loop of one's own over the store: prefix KV loaded and saved layer by layer through `specjax.Connector`.

A shared prefix (a few-shot prompt) is computed once and its KV saved to the store as the loop runs. Each later
request loads the prefix's K and V layer by layer from the store into its KV cache, computes only its own tokens,
then decodes greedily from that cache. Every answer is checked against the same loop with nothing stored.

    python examples/decode_loop.py                          # smollm2-135m
    python examples/decode_loop.py --store /tmp/my-kv --new_tokens 12
"""

from __future__ import annotations

import argparse
import tempfile

import jax.numpy as jnp
import numpy as np

import specjax
from specjax.models import inference
from specjax.models import transformer as T
from specjax.shapes import bucket

PREFIX = ("Answer each question with one word.\n"
          "Q: What colour is the sky on a clear day? A: blue\n"
          "Q: What do bees make? A: honey\n"
          "Q: What is frozen water called? A: ice\n")
QUESTIONS = ["Q: What colour is grass? A:", "Q: What animal barks? A:", "Q: What falls from clouds? A:"]


def prefill(model, connector, prompt: list[int], capacity: int, save: bool):
    """The prompt's last logits and a KV cache of `capacity` positions holding its KV: the stored prefix's K and V
    from `connector`, layer by layer, the rest computed here (and saved to the store if `save`)."""
    cfg, params = model.config, model.params
    reused = connector.begin(prompt)
    try:
        connector.start_load()
        own = np.asarray(prompt[reused:], np.int32)
        width = min(bucket(len(own), minimum=16), capacity - reused)
        ids = np.zeros(width, np.int32)
        ids[:len(own)] = own
        positions = jnp.arange(reused, reused + width, dtype=jnp.int32)
        h = T.embed_step(cfg, params, jnp.asarray(ids), positions)
        rotary = T.rotary_step(cfg, positions)
        cache = inference.empty_cache(cfg, capacity, params["embed"].dtype)
        end = reused + len(own)
        for layer, lp in enumerate(params["layers"]):
            k, v = connector.wait_for_layer(layer)  # [kv_heads, reused, head_dim]: this layer's stored prefix
            cache.k[layer] = cache.k[layer].at[:, :reused].set(k.astype(cache.k[layer].dtype))
            cache.v[layer] = cache.v[layer].at[:, :reused].set(v.astype(cache.v[layer].dtype))
            h, cache.k[layer], cache.v[layer] = T.cached_layer(cfg, lp, h, positions, cache.k[layer], cache.v[layer],
                                                               reused, end, rotary)
            if save:
                connector.save_layer(layer, cache.k[layer][:, reused:end], cache.v[layer][:, reused:end])
    except BaseException:
        connector.finish()  # lets go of the stored prefix; a partial save is discarded
        raise
    connector.finish()  # publishes what was saved (every layer), lets go of the stored prefix
    cache.length = end
    logits = np.asarray(T.head_step(cfg, params, h[len(own) - 1:len(own)]))[0]
    return logits, cache, reused


def decode(model, logits, cache, new_tokens: int) -> list[int]:
    """Greedy tokens from a prefilled cache."""
    out = []
    for _ in range(new_tokens):
        out.append(int(np.argmax(logits)))
        if cache.length >= cache.capacity:
            break
        logits = inference.extend(model.config, model.params, cache, out[-1:])[-1]
    return out


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--store", help="the store's folder (default: a new temporary one, removed at the end)")
    parser.add_argument("--new_tokens", type=int, default=4, help="tokens decoded per question")
    args = parser.parse_args(argv)

    model = specjax.load_model(args.model)
    prefix = model.tokenizer.encode(PREFIX)
    served = []
    with tempfile.TemporaryDirectory(prefix="specjax-kv-") as scratch:
        store = specjax.open_store(model, args.store or scratch)
        try:
            connector = specjax.Connector(store)
            capacity = bucket(len(prefix) + 64)
            prefill(model, connector, prefix, capacity, save=True)  # the prefix's KV, computed once and stored
            for question in QUESTIONS:
                prompt = prefix + model.tokenizer.encode(question)
                read_before = store.metrics.snapshot()["disk_bytes"]
                logits, cache, reused = prefill(model, connector, prompt, capacity, save=False)
                read = store.metrics.snapshot()["disk_bytes"] - read_before
                tokens = decode(model, logits, cache, args.new_tokens)
                plain = inference.greedy_generate(model.config, model.params, prompt, args.new_tokens)
                served.append({"question": question, "answer": model.tokenizer.decode(tokens), "reused": reused,
                               "computed": len(prompt) - reused, "disk_bytes": read,
                               "same_as_without_the_store": tokens == plain[:len(tokens)]})
        finally:
            store.close()
    for s in served:
        print(f"{s['question']}{s['answer']!r:12s} reused {s['reused']} tokens from the store "
              f"({s['disk_bytes']} bytes read), computed {s['computed']}; "
              f"{'same' if s['same_as_without_the_store'] else 'NOT the same'} as without the store")
    return served


if __name__ == "__main__":
    main()
