"""Experiment presets (specjax.configs.presets.<name>.PRESET): flag values for a paper's setup.

A preset is a dict: "description", "tasks" (run one after another, each into OUTPUT_DIR/<task>),
"flags" (flag name -> value) and optional "per_task" (task -> flag overrides). Flags given on
the command line win over the preset.
"""

from __future__ import annotations

import importlib
import pkgutil

from specjax.eval.errors import EvalError

PACKAGE = "specjax.configs.presets"


def names() -> list[str]:
    try:
        package = importlib.import_module(PACKAGE)
    except ModuleNotFoundError:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))


def load(name: str) -> dict:
    if name not in names():
        raise EvalError(f"unknown preset '{name}'; known presets: {', '.join(names()) or 'none'}")
    preset = importlib.import_module(f"{PACKAGE}.{name}").PRESET
    return {"name": name, **preset}


def apply(preset: dict, values: dict, present: set[str]) -> dict:
    """Preset flags under the command line's."""
    unknown = set(preset.get("flags", {})) - set(values)
    if unknown:
        raise EvalError(f"preset {preset['name']} sets unknown flags {sorted(unknown)}")
    out = dict(values)
    for key, value in preset.get("flags", {}).items():
        if key not in present:
            out[key] = value
    return out


def for_task(preset: dict | None, values: dict, task: str, present: set[str]) -> dict:
    out = dict(values, task=task)
    if preset:
        for key, value in preset.get("per_task", {}).get(task, {}).items():
            if key not in present:
                out[key] = value
    return out
