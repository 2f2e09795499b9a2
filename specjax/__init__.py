"""specjax: prefix-KV caching on SSD with importance-informed selection and speculative prefetch.

    import specjax
    model = specjax.load_model("smollm2-135m")
    model.generate("The capital of France is", max_new_tokens=8)
"""

from specjax.api import Model, load_model
from specjax.config import ModelConfig
from specjax.errors import SpecjaxError

__all__ = ["Model", "ModelConfig", "SpecjaxError", "load_model"]
