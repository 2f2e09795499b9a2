"""`python -m specjax.eval --help`: every flag of the command, grouped as the settings tree, with its default and
help; exit status 0; the help texts that state numbers say what the code does."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from specjax.eval import __main__ as cli
from specjax.eval import settings as settings_lib
from specjax.eval.units import parse_bytes
from specjax.stores import scheduler

ENTRY = re.compile(r"^  --(\w+) \((?:[^;()]*; )?default: (.*)\)$")


def _help(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specjax.eval", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.fixture(scope="module")
def shown() -> str:
    done = _help("--help")
    assert done.returncode == 0, done.stderr
    return done.stdout


def _expected_default(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def test_help_lists_every_flag_once_with_its_default_in_the_settings_groups(shown):
    entries = [ENTRY.match(line) for line in shown.splitlines()]
    names = [m.group(1) for m in entries if m]
    expected = list(settings_lib.names()) + ["progress", "resume", "num_processes", "process_id", "coordinator"]
    assert names == expected  # each exactly once, in the settings tree's order, then the command's own
    for name in expected:
        assert len(re.findall(rf"^  --{name} \(", shown, re.M)) == 1
    defaults = {m.group(1): m.group(2) for m in entries if m}
    fields = {f.name: f for group in settings_lib.EVAL_GROUPS for f in dataclasses.fields(group)}
    for name, field in fields.items():
        assert defaults[name] == _expected_default(field.default), name
    assert defaults["progress"] == _expected_default(cli.FLAGS["progress"].default) == "true"
    assert defaults["resume"] == "false"
    assert (defaults["num_processes"], defaults["process_id"], defaults["coordinator"]) == ("1", "0", '""')

    flat = " ".join(shown.split())
    for name, field in fields.items():
        assert " ".join(field.metadata["help"].split()) in flat, name
    # grouped: each group's heading, then its own fields
    at = [shown.index("\n" + settings_lib.heading(g) + "\n") for g in settings_lib.EVAL_GROUPS]
    assert at == sorted(at)
    for group, start, end in zip(settings_lib.EVAL_GROUPS, at, at[1:] + [len(shown)]):
        assert [m.group(1) for m in map(ENTRY.match, shown[start:end].splitlines()) if m][:len(
            dataclasses.fields(group))] == [f.name for f in dataclasses.fields(group)]
    assert settings_lib.heading(settings_lib.ModelSettings) == settings_lib.ModelSettings.__doc__.splitlines()[0]
    # absl's and other libraries' flags stay out, pointed to
    assert "--helpfull" in shown and "--logtostderr" not in [m.group(1) for m in entries if m]
    assert "chex" not in shown and "absl.app" not in shown
    assert max(len(line) for line in shown.splitlines()) <= settings_lib.HELP_WIDTH
    assert "../shared" not in shown and "shared/data" not in shown


def test_short_help_flags_print_the_same_and_exit_0(shown):
    done = _help("-h")
    assert done.returncode == 0 and done.stdout == shown
    assert cli.help_text() == shown
    for argv in (["--helpshort"], ["--task", "piqa", "--help"], ["-?"], ["--help=true"]):
        assert cli.wants_help(argv), argv
    for argv in ([], ["--task", "piqa"], ["--", "--help"], ["--helpfull"]):
        assert not cli.wants_help(argv), argv


def test_inflight_bytes_help_says_what_the_scheduler_keeps_in_flight():
    (field,) = [f for f in dataclasses.fields(settings_lib.StoreSettings) if f.name == "inflight_bytes"]
    text = " ".join(field.metadata["help"].split())
    amount = re.search(r"the larger of (\S+) and (\S+) ms", text)
    assert amount, text
    assert parse_bytes(amount.group(1)) == scheduler.MIN_INFLIGHT_BYTES
    assert float(amount.group(2)) / 1000 == scheduler.INFLIGHT_S
    assert not re.search(r"\b4MiB", text)  # the stale figure
    # an emulated disk: one read at a time
    assert "one read at a time" in text and scheduler.ReadScheduler(bytes_per_s=1e9).max_inflight_bytes == 0
    assert scheduler.ReadScheduler().max_inflight_bytes == scheduler.MIN_INFLIGHT_BYTES


def test_numbers_in_help_texts_follow_the_code():
    from specjax.eval import registry

    helps = {f.name: " ".join(f.metadata["help"].split())
             for g in settings_lib.EVAL_GROUPS for f in dataclasses.fields(g)}
    own = {name: s.chunk_tokens for name, s in registry.KNOWN_SYSTEMS.items() if s.chunk_tokens}
    assert own and all(f"{name}: {n}" in helps["chunk_tokens"] for name, n in own.items())
    assert f"for needle {cli.NEEDLE_DEFAULT_LIMIT}," in helps["limit"]
    runs = cli.runner.plan(registry.resolve("default"),
                           settings_lib.parse_retentions(settings_lib.RunSettings.retention))
    assert f"({len(runs)} runs: {len(registry.DEFAULT_SYSTEMS)} systems" in helps["limit"]
    assert ", ".join(registry.DEFAULT_SYSTEMS) in helps["systems"]
    assert "docs/data.md" in helps["data_dir"] and "shared" not in helps["data_dir"]
