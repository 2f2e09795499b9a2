"""Errors a user can cause, and the one-line reporting that command-line entry points use for them."""

from __future__ import annotations

import functools
import sys


class SpecjaxError(Exception):
    """An error with a message that tells the user what to do; printed without a traceback."""


class ModelNotFoundError(SpecjaxError):
    pass


class CheckpointError(SpecjaxError):
    pass


def exit_on_error(main):
    """Wrap a CLI main so a SpecjaxError (or StoreError) ends in one clear line and exit status 2 (or the error's
    `exit_code`), and Ctrl-C in one line and status 130."""

    from specjax.stores.errors import StoreError  # stores cannot know SpecjaxError; catch its errors too

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (SpecjaxError, StoreError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(getattr(e, "exit_code", 2))
        except KeyboardInterrupt:
            print("error: interrupted (Ctrl-C)", file=sys.stderr)
            sys.exit(130)

    return wrapper
