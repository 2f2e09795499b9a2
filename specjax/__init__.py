"""specjax: prefix-KV caching on SSD with importance-informed selection and speculative prefetch.

    import specjax
    model = specjax.load_model("smollm2-135m")
    model.generate("The capital of France is", max_new_tokens=8)

    store = specjax.open_store(model, "/tmp/kv")                # prefix KV reuse (specjax.reuse)
    engine = specjax.prefill_engine(model, "spec", store, retention=0.25)
"""

from specjax import host_memory

host_memory.reuse_freed_blocks()  # before XLA's threads first allocate (see specjax.host_memory)

from specjax.api import Model, load_model  # noqa: E402
from specjax.config import ModelConfig  # noqa: E402
from specjax.connector import Connector, CorruptPrefixError  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402
from specjax.reuse import Request, open_store, prefill_engine, warm_up  # noqa: E402

__all__ = ["Connector", "CorruptPrefixError", "Model", "ModelConfig", "Request", "SpecjaxError", "load_model", "open_store", "prefill_engine", "warm_up"]
