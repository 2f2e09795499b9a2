"""Errors a user can cause; the CLI prints them as one line, without a traceback."""

from specjax.errors import SpecjaxError


class EvalError(SpecjaxError):
    """A problem with the user's request (unknown name, missing data, bad value)."""
