"""Every system a run can compare, by name: the engine's (`specjax.eval.engine_systems`) and any a plugin or test
adds (`PLUGINS`); `resolve` checks a --systems list, `make_system` builds one."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import pathlib
import sys
from collections.abc import Callable
from typing import Any

from specjax.engine.systems import SYSTEMS as KNOWN_SYSTEMS  # every system, registered once, with its description
from specjax.engine.policies import Planner
from specjax.engine.systems import make_system as engine_make_system
from specjax.eval.engine_systems import factories
from specjax.eval.errors import EvalError
from specjax.eval.systems import System, SystemSettings

# the SPEC paper's line-up, what `--systems default` runs
DEFAULT_SYSTEMS = ("recompute", "as_full", "as_h2o_lru", "as_h2o_lfu", "spec")


Factory = Callable[[Any, SystemSettings], System]
# Systems from outside the engine, by name (a plugin's or a test's); they win over the engine's of the same name.
PLUGINS: dict[str, Factory] = {}


def load_plugins(spec: str | None) -> list[str]:
    """Import each of `spec`'s comma-separated Python files or module names (`--plugins`), once per process: each may
    register identification policies and systems (`specjax.engine.identify.register`,
    `specjax.engine.systems.register`; docs/development.md, "Adding a system"). Returns the modules' names."""
    names = []
    for item in [s.strip() for s in (spec or "").split(",") if s.strip()]:
        if item.endswith(".py"):
            path = pathlib.Path(item).expanduser().resolve()
            if not path.is_file():
                raise EvalError(f"--plugins: no file {item}")
            name = f"specjax_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
            if name not in sys.modules:
                spec_ = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(spec_)
                sys.modules[name] = module
                try:
                    spec_.loader.exec_module(module)
                except BaseException:
                    del sys.modules[name]
                    raise
        else:
            name = item
            try:
                importlib.import_module(item)
            except ModuleNotFoundError as e:
                raise EvalError(f"--plugins: cannot import {item} ({e})") from None
        names.append(name)
    return names


def available() -> dict[str, Factory]:
    """name -> factory: every system the prefill engine builds (recompute included, so all are timed alike), then
    the plugins'."""
    return {**factories(), **PLUGINS}


def resolve(spec: str) -> list[str]:
    """Parse --systems: names are checked before any work starts."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise EvalError("--systems is empty; give a comma-separated list, e.g. recompute,spec")
    built = available()
    if names == ["default"]:
        return [n for n in DEFAULT_SYSTEMS if n in built]
    if names == ["all"]:
        return [n for n in KNOWN_SYSTEMS if n in built]
    for n in names:
        if n not in built and precision_variant(n) is None:
            raise EvalError(f"unknown system '{n}'; known systems: {', '.join(KNOWN_SYSTEMS)} (and any that reuses "
                            f"KV at 8, 4 or 2 bits: NAME-kv8, NAME-kv4, NAME-kv2; spec_mixed's rest: spec_mixed-rest2)")
    if len(set(names)) != len(names):
        raise EvalError(f"--systems lists a system twice: {spec}")
    return names


def precision_variant(name: str) -> tuple[str, dict] | None:
    """(system, options) of a name `SYSTEM-kvB` (a system that reuses prefix KV, loading its K and V at B bits: 8, 4
    or 2), `SYSTEM-restB` (a system that loads what its selection leaves out at B bits: spec_mixed) or
    `SYSTEM-kvB-restC`, each perhaps with `-restkD` (the rest's keys at D bits), or `planner-planB` (the planner free
    to load at B bits and up), so that one run compares precisions of one system (`SystemOptions.kv_bits`,
    `rest_bits`, `rest_key_bits`, `plan_bits`); None for any other name."""
    options, base = {}, name
    # the reverse of the order `SystemOptions.apply` names them in
    for option, tag in (("plan_bits", "-plan"), ("rest_key_bits", "-restk"), ("rest_bits", "-rest"),
                        ("kv_bits", "-kv")):
        head, sep, bits = base.rpartition(tag)
        if sep and bits in ("8", "4", "2"):
            base, options[option] = head, int(bits)
    system = KNOWN_SYSTEMS.get(base)
    if not options or base not in available() or (system is not None and not system.reuse) or (
            ("rest_bits" in options or "rest_key_bits" in options) and system is not None
            and system.rest_bits is None) or (
            "plan_bits" in options and system is not None and not isinstance(system.schedule, Planner)):
        return None
    return base, options


def check_distinct(names: list[str], options) -> None:
    """Refuse a --systems list two of whose systems would be built as one (`as_full,as_full-kv4` with --kv_bits 4):
    their results would be filed under one name."""
    built: dict[str, str] = {}
    for name in names:
        base, changes = precision_variant(name) or (name, {})
        if base not in KNOWN_SYSTEMS:  # a plugin's: named by itself
            continue
        as_built = engine_make_system(base, dataclasses.replace(options, **changes)).name
        if as_built in built:
            raise EvalError(f"--systems: {built[as_built]} and {name} are both built as {as_built} with these options")
        built[as_built] = name


def uses_retention(name: str) -> bool:
    """Whether the system keeps a share of the prefix (`--retention`); a plugin's is assumed to."""
    variant = precision_variant(name)
    system = KNOWN_SYSTEMS.get(variant[0] if variant else name)
    return True if system is None else system.prunes


def make_system(name: str, model, settings: SystemSettings) -> System:
    """The system registered as `name`, built with `settings`. Its own `name` labels its results: the registered
    name, extended by the options it was built with ("spec-no_prefetch"); any other is refused, so that no run is
    filed under another system."""
    built, variant = available(), precision_variant(name)
    if variant is not None:
        settings = dataclasses.replace(settings, options=dataclasses.replace(settings.options, **variant[1]))
    elif name not in built:
        resolve(name)  # raises the right one-line error
    system = built[variant[0] if variant else name](model, settings)
    if system.name != name and not system.name.startswith(name + "-"):
        raise EvalError(f"system {name!r} was built as {system.name!r}: a system's name must be the name it is "
                        f"registered under, with any options after a '-' ({name}-...)")
    return system
