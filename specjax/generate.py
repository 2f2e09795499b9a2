"""Greedy generation from the command line (a quick check that a model loads and speaks).

    python -m specjax.generate --prompt "The capital of France is"
"""

from __future__ import annotations

from absl import flags

from specjax.api import load_model
from specjax.cli import run

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Flags of this command; defined only when it runs, so importing the module defines none."""
    flags.DEFINE_string("model", "smollm2-135m", "Registered model name or converted model directory.")
    flags.DEFINE_string("prompt", "The capital of France is", "Text to continue.")
    flags.DEFINE_integer("max_new_tokens", 16, "Tokens to generate (greedy).")
    flags.DEFINE_string("dtype", None, "Compute dtype (float32, bfloat16); default: the stored dtype.")


def main(argv):
    del argv
    model = load_model(FLAGS.model, dtype=FLAGS.dtype)
    print(f"{model!r}")
    print(FLAGS.prompt + model.generate(FLAGS.prompt, FLAGS.max_new_tokens))


if __name__ == "__main__":
    define_flags()
    run(main)
