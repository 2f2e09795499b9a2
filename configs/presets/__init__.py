"""Experiment presets reproducing the papers' setups: `python -m specjax.eval --preset NAME`."""
