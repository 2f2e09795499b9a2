"""Shared start-up of specjax's command-line tools: absl flags, quiet library logging, one-line errors."""

from __future__ import annotations

from absl import app, flags, logging

from specjax.errors import exit_on_error


def run(main) -> None:
    """app.run(main) with library INFO chatter (orbax, XLA) hidden unless -v/--verbosity asks for it."""
    flags.FLAGS.set_default("verbosity", logging.WARNING)
    app.run(exit_on_error(main))
