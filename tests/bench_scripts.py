"""Loading a script of `benchmarks/` (not an installed package) as a module, for the tests of benchmarks."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load(script: str, module_name: str):
    """benchmarks/`script` as module `module_name`, registered in sys.modules (its dataclasses look their module up,
    and worker processes it spawns import it by that name)."""
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
