"""Which implementation a call uses, one rule for the kernels and the model's attention: the call's `impl` argument
> the innermost `ImplChoice.using` block > the choice's environment variable > a default by platform. The choice is
made when a caller is traced: a jitted step traced before entering a block keeps its old choice."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Callable

import jax


@dataclasses.dataclass(frozen=True)
class ImplChoice:
    """`impls`: the names a call may ask for, "auto" first; `default(backend)`: the choice of "auto" everywhere
    else (jax.default_backend())."""

    name: str  # what is chosen (error messages)
    impls: tuple[str, ...]
    env_var: str
    default: Callable[[str], str]
    _override: contextvars.ContextVar = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_override", contextvars.ContextVar(f"specjax_{self.env_var.lower()}", default=None))

    @contextlib.contextmanager
    def using(self, impl: str):
        """Within the block, calls with impl="auto" use `impl`."""
        self.check(impl)
        token = self._override.set(impl)
        try:
            yield
        finally:
            self._override.reset(token)

    def resolve(self, impl: str = "auto") -> str:
        self.check(impl)
        chosen = impl
        if chosen == "auto":
            chosen = self._override.get() or os.environ.get(self.env_var, "auto").strip().lower() or "auto"
            if chosen not in self.impls:
                raise ValueError(f"${self.env_var}={chosen!r} is not one of {self.impls}; unset it or pick one.")
        return self.default(jax.default_backend()) if chosen == "auto" else chosen

    def check(self, impl: str) -> None:
        if impl not in self.impls:
            raise ValueError(f"{self.name} impl={impl!r} is not one of {self.impls}.")
