"""Shared start-up of specjax's command-line tools: absl flags, quiet library logging, one-line errors."""

from __future__ import annotations

import functools
import logging

from absl import app, flags
from absl import logging as absl_logging

from specjax.errors import exit_on_error


def run(main) -> None:
    """app.run(main) with library INFO chatter (orbax, XLA) hidden unless -v/--verbosity asks for it."""

    @functools.wraps(main)
    def quiet_main(argv):
        if not flags.FLAGS["verbosity"].present:
            absl_logging.set_verbosity(absl_logging.WARNING)
            # JAX logs its search for TPU/GPU plugins at INFO through its own logger.
            logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
        return main(argv)

    app.run(exit_on_error(quiet_main))
