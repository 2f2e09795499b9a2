"""The evaluation's settings as one typed tree: a frozen dataclass per layer of the stack (the model, the workload,
the store and its links, the engine, the run), beside the systems' own `SystemOptions`.

A field is a setting once: its name is the flag's, its type the flag's type, its default and help the flag's, and its
check (`__post_init__`, through `setting(check=...)`) refuses a bad value from the command line and from a preset
alike. `python -m specjax.eval` defines its flags from `EVAL_GROUPS`, builds their values once into an
`EvalSettings` (the groups as one tree), hands that down to be read by attribute (`settings.store.cpu_cache`) and
records the values as results.json's `config`; `python -m specjax.eval.observe` defines the ones it shares from the
same fields (with defaults of its own).
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Callable, Mapping, Sequence

from absl import flags

from specjax.engine.systems import SystemOptions
from specjax.engine.types import EngineConfig
from specjax.errors import SpecjaxError
from specjax.eval import presets as presets_lib
from specjax.eval import registry, synthetic
from specjax.eval import tasks as tasks_lib
from specjax.eval.errors import EvalError
from specjax.eval.units import parse_bandwidth, parse_bytes, parse_fewshot, parse_retentions, parse_size
from specjax.stores import Layout
from specjax.stores.scheduler import INFLIGHT_S, MIN_INFLIGHT_BYTES


def setting(default, help: str, *, choices: tuple[str, ...] | None = None, check: Callable | None = None):
    """A field of a settings group: its default, the help of the flag of its name, the values it may take
    (`choices`: an enum flag) and `check(value)`, which raises ValueError (or SpecjaxError) saying what is wrong."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "check": check})


def _must(ok: Callable[[object], bool], message: str) -> Callable:
    def check(value):
        if not ok(value):
            raise ValueError(message)
    return check


def _parsed(parse: Callable, message: str) -> Callable:
    def check(value):
        try:
            parse(value)
        except (ValueError, TypeError):
            raise ValueError(message) from None
    return check


def _unless_none(parse: Callable) -> Callable:
    return lambda value: None if value is None else parse(value)


def check_fields(group) -> None:
    """Each field's `setting` check, failing with the setting's name and value."""
    for field in dataclasses.fields(group):
        value, check, choices = getattr(group, field.name), field.metadata.get("check"), field.metadata.get("choices")
        if choices is not None and value is not None and value not in choices:
            raise SpecjaxError(f"{field.name} {value!r}: choose one of {', '.join(choices)}")
        if check is None:
            continue
        try:
            check(value)
        except (ValueError, TypeError) as e:
            raise SpecjaxError(f"{field.name} {value!r}: {e}") from None


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:g}MiB"


# `--limit`'s default for a synthetic task (needle, rag): the default run stays short
NEEDLE_DEFAULT_LIMIT = 16
DEFAULT_RETENTION = "0.25,0.75"


def _default_runs() -> str:
    """How many runs the default --systems and --retention make, in words (for --limit's help)."""
    pruning = [name for name in registry.DEFAULT_SYSTEMS if registry.uses_retention(name)]
    retentions = len(parse_retentions(DEFAULT_RETENTION))
    runs = len(registry.DEFAULT_SYSTEMS) - len(pruning) + len(pruning) * retentions
    return (f"{runs} runs: {len(registry.DEFAULT_SYSTEMS)} systems, the {len(pruning)} that prune at "
            f"{retentions} retentions")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """Which model, with which weights, on how many devices."""

    model: str = setting("smollm2-135m", "Model: a registered name (smollm2-135m, opt-6.7b, tiny-llama, ...), a "
                         "Hugging Face hub id ORG/NAME, a Hugging Face checkpoint folder, or a directory written by "
                         "`python -m specjax.convert`. Hub checkpoints and folders are converted once into "
                         "$SPECJAX_HOME/models.")
    revision: str | None = setting(None, "Branch, tag or commit of a Hugging Face hub --model (default: main).")
    init: str = setting("pretrained", "Weights: `pretrained` (converted checkpoint) or `random` (real shapes, for "
                        "timing only: accuracy is then meaningless and results say so).",
                        choices=("pretrained", "random"))
    dtype: str | None = setting(None, "Model dtype (float32, bfloat16, float16); default: the model's own.")
    tensor_parallel: int = setting(1, "Devices to split the model over by attention head and MLP unit (jax.sharding "
                                   "mesh over the first N; specjax.sharding); each device holds, loads and attends "
                                   "over its own KV heads. 1: one device, no mesh. On CPU, "
                                   "XLA_FLAGS=--xla_force_host_platform_device_count=N gives N devices.",
                                   check=_must(lambda v: v >= 1, "must be at least 1 (1: one device)"))

    __post_init__ = check_fields


@dataclasses.dataclass(frozen=True)
class WorkloadSettings:
    """The requests: which task, how its prefixes are built and shared."""

    task: str = setting("needle", "Task: " + "; ".join(f"{k} ({v.description})" for k, v in tasks_lib.TASKS.items())
                        + ".")
    data_dir: str | None = setting(None, "Folder with the tasks' data files, laid out as docs/data.md describes "
                                   "(e.g. DIR/piqa/valid.jsonl). Searched first, then $SPECJAX_DATA, then the "
                                   "Hugging Face hub (after `pip install datasets`).")
    data_path: str | None = setting(None, "JSONL file for --task mc_jsonl: one {\"query\",\"choices\",\"gold\"} per "
                                    "line.")
    limit: int | None = setting(None, "Number of requests (the first N task items, as lm-eval's --limit). Unset: "
                                f"all items; for needle {NEEDLE_DEFAULT_LIMIT}, to keep specjax.eval's default run "
                                f"({_default_runs()}) short on a 2-core CPU; README.md gives its measured time.",
                                check=_must(lambda v: v is None or v > 0, "must be a positive number of requests"))
    num_fewshot: str = setting("2-10", "Few-shot examples per shared prefix: N, or A-B for a uniform draw per prefix "
                               "(the papers' 2-10). 0 gives lm-eval's zero-shot prompts.",
                               check=_parsed(parse_fewshot, "must be N or A-B with 0 <= A <= B"))
    prefix_tokens: int | None = setting(None, "Extend every prefix with more examples (needle: more facts) to at "
                                        "least this many tokens (SPEC: 4.8k-5.7k average, up to 10k); 0 or unset: "
                                        "do not.", check=_must(lambda v: v is None or v >= 0,
                                                               "must be a token count (0: do not extend)"))
    reuse_mean: float = setting(8.0, "Mean number of queries sharing one prefix (normal distribution).",
                                check=_must(lambda v: v >= 1, "must be at least 1"))
    reuse_std: float = setting(3.0, "Standard deviation of the number of queries sharing one prefix.",
                               check=_must(lambda v: v >= 0, "must be non-negative"))
    needle_facts: int = setting(synthetic.NeedleSpec.num_facts, "needle: key-value facts per prefix (ignored when "
                                "--prefix_tokens is set).", check=_must(lambda v: v >= 4, "must be at least 4"))
    add_bos: bool = setting(False, "Start every prefix with the tokenizer's BOS token (lm-eval adds none).")
    seed: int = setting(0, "Seed for the workload (items, few-shot draws, reuse counts, needle facts) and random "
                        "weights.")

    __post_init__ = check_fields


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    """The KV store, its cache tiers and the links bytes cross."""

    chunk_tokens: int = setting(Layout.chunk_tokens, "Tokens per stored KV chunk (SPEC: 64), for every system "
                                "but those with a chunk of their own (" + ", ".join(
                                    f"{name}: {s.chunk_tokens}" for name, s in registry.KNOWN_SYSTEMS.items()
                                    if s.chunk_tokens) + ").",
                                check=_must(lambda v: v > 0, "must be positive"))
    gpu_cache: str = setting("15%", "GPU prefix-KV cache budget: bytes (10GB, 512MiB) or a percentage of the "
                             "workload's stored prefix KV (SPEC: 10GB of ~60GB).", check=parse_size)
    cpu_cache: str = setting("50%", "CPU prefix-KV cache budget: bytes or a percentage of the stored prefix KV "
                             "(SPEC: 32GB of ~60GB). Keep GPU+CPU under 100% so part of the KV lives only on disk.",
                             check=parse_size)
    disk_bandwidth: str | None = setting(None, "Emulated disk read bandwidth (e.g. 5GB/s); unset = the real disk.",
                                         check=_unless_none(parse_bandwidth))
    pcie_bandwidth: str | None = setting(None, "Emulated CPU->GPU bandwidth (e.g. 25GB/s); unset = the real link.",
                                         check=_unless_none(parse_bandwidth))
    direct_io: bool = setting(False, "Read the store with O_DIRECT so the page cache does not hide the disk.")
    inflight_bytes: str | None = setting(None, "Most bytes of KV reads the disk's read scheduler keeps in flight "
                                         f"(e.g. {_mib(2 * MIN_INFLIGHT_BYTES)}); unset: on a real disk the larger "
                                         f"of {_mib(MIN_INFLIGHT_BYTES)} and {INFLIGHT_S * 1000:g} ms of the disk's "
                                         "read rate as measured during the run, on an emulated one (--disk_bandwidth) "
                                         "one read at a time. Reads beyond it wait in its queue, demand before "
                                         "speculative, where a superseded speculative read is dropped unread.",
                                         check=_unless_none(parse_bytes))
    store: str | None = setting(None, "Folder for the prefix-KV stores, kept for later runs (a path or file:///path; "
                                "the evaluation hard-links each run's copy, so kvstore URLs such as gs:// are for "
                                "the Python API, specjax.stores.KVStore); default: a temporary folder removed at "
                                "the end.")

    __post_init__ = check_fields


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """How the engine computes what it does not load (`EngineConfig` fields of the same names)."""

    cake_chunk_tokens: int = setting(EngineConfig.cake_chunk_tokens, "cake: tokens per chunk computed from the front "
                                     "or loaded from the back (Cake: 512); a multiple of --chunk_tokens.",
                                     check=_must(lambda v: v > 0, "must be positive"))
    prefill_chunk_tokens: int = setting(EngineConfig.prefill_chunk_tokens, "Chunked prefill when nothing is reused "
                                        "(recompute, a cold request): more new tokens than this are computed in "
                                        "chunks of this many, each attending to the earlier chunks' KV (exact); 0: "
                                        "one block, as the plain forward.",
                                        check=_must(lambda v: v >= 0, "must be >= 0 (0: one block)"))

    __post_init__ = check_fields


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """Which runs to make and where their results go."""

    systems: str = setting("default", "Comma-separated systems: " + ", ".join(registry.KNOWN_SYSTEMS) + ". "
                           "`default` = the SPEC paper's line-up (" + ", ".join(registry.DEFAULT_SYSTEMS) + ") "
                           "restricted to those built; `all` = every built system.")
    plugins: str | None = setting(None, "Comma-separated Python files or modules imported first: each may register "
                                  "identification policies and systems (docs/development.md, \"Adding a system\"), "
                                  "e.g. examples/recent_window.py, whose systems --systems may then name.")
    retention: str = setting(DEFAULT_RETENTION, "Fraction of prefix tokens kept, or a comma-separated list to sweep "
                             "(e.g. 0.05,0.1,0.25,0.5); each system that prunes runs once per value, the others "
                             "(recompute, as_full, cake, ...) once in all. results.md opens with the accuracy-TTFT "
                             "trade-off over them.",
                             check=_parsed(parse_retentions, "must be fractions in (0, 1], comma-separated, e.g. 0.25 "
                                           "or 0.05,0.1,0.25,0.5"))
    record_selections: str | None = setting(None, "Folder to record, for each system that identifies, the attention "
                                            "scores its identification decided from (one file per system and "
                                            "retention), to replay in a timing run of another shape "
                                            "(--replay_selections; specjax.engine.replay).")
    replay_selections: str | None = setting(None, "Folder of selection traces (--record_selections): each system "
                                            "that identifies decides from the recorded scores of its own system and "
                                            "retention instead of its own, mapped by request, relative layer depth "
                                            "and relative prefix offset. Same task only; onto random weights or the "
                                            "recording model. Accuracy of a replayed run is meaningless; its TTFT, "
                                            "bytes, reads and hits are what it is for.")
    interleave: bool = setting(False, "Time the runs request by request in turns (each request's runs in a rotating "
                               "order) instead of one run after another: every run is warmed and compiled first and "
                               "all stay open, so a slow phase of a shared machine falls on each alike. Holds every "
                               "run's engine, caches and private store at once.")
    output_dir: str | None = setting(None, "Where results.json, results.md and plots go; default "
                                     "results/<model>-<task>.")
    preset: str | None = setting(None, "Experiment preset from specjax.configs.presets (" +
                                 ", ".join(presets_lib.names()) + "); flags given on the command line override it.")

    __post_init__ = check_fields


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """`python -m specjax.eval`'s settings as one tree, one group per field (`settings.store.cpu_cache`,
    `settings.run.systems`): built once from the flags' values (`from_values`, each group checking its own), then
    handed down and read by attribute."""

    model: ModelSettings = ModelSettings()
    workload: WorkloadSettings = WorkloadSettings()
    store: StoreSettings = StoreSettings()
    engine: EngineSettings = EngineSettings()
    run: RunSettings = RunSettings()
    options: SystemOptions = SystemOptions()

    @classmethod
    def from_values(cls, values: Mapping) -> EvalSettings:
        """The tree from flat values (setting name -> value: the flags', a preset's); a setting left out keeps its
        default, a name no group has is refused."""
        refuse_unknown(values, names(), "specjax.eval")
        return cls(**{field.name: group_from(type(field.default), values) for field in dataclasses.fields(cls)})

    def values(self) -> dict:
        """Flat: every setting's name -> value, in the flags' order (results.json's `config`)."""
        return {name: getattr(group, name) for group in self.groups() for name in names([type(group)])}

    def groups(self) -> tuple:
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))

    def replace(self, **values) -> EvalSettings:
        """These settings with some changed, by setting name (`replace(disk_bandwidth="5GB/s")`), checked anew."""
        return EvalSettings.from_values({**self.values(), **values})


# `python -m specjax.eval`'s settings, one flag per field; results.json records their values as `config`
EVAL_GROUPS = tuple(type(field.default) for field in dataclasses.fields(EvalSettings))


def names(groups=EVAL_GROUPS) -> tuple[str, ...]:
    return tuple(field.name for group in groups for field in dataclasses.fields(group))


HELP_WIDTH = 100


def shown_default(value) -> str:
    """A default as the help shows it: as written on the command line; None as `unset`."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if str(value) else '""'


def heading(group) -> str:
    """A group's heading in the help: the first sentence of its docstring."""
    text = " ".join((group.__doc__ or group.__name__).split("\n\n")[0].split())
    return text.split(". ")[0].rstrip(".") + "."


def flag_help(name: str, kind: str, default, help: str, choices: Sequence[str] | None = None,
              width: int = HELP_WIDTH) -> str:
    """One flag's entry: `--name (type; default: ...)`, its help wrapped below it."""
    what = " | ".join(choices) if choices else {"bool": "bool", "int": "int", "float": "float"}.get(kind)
    head = f"  --{name} ({what + '; ' if what else ''}default: {shown_default(default)})"
    body = textwrap.fill(" ".join(help.split()), width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                         break_long_words=False, break_on_hyphens=False)
    return head + "\n" + body + "\n"


def field_help(field: dataclasses.Field, width: int = HELP_WIDTH) -> str:
    return flag_help(field.name, field.type.split(" | ")[0], field.default, field.metadata["help"],
                     field.metadata.get("choices"), width)


def render_help(doc: str, groups=EVAL_GROUPS, sections: Sequence[tuple[str, Sequence[str]]] = (),
                footer: str = "", width: int = HELP_WIDTH) -> str:
    """A command's --help: `doc`, then every field of `groups` as a flag (its name, type, default and help) under
    its group's heading, then `sections` (a heading and entries rendered by `flag_help`), then `footer`; each line
    at most `width` columns but for a word longer than that."""
    parts = [doc.strip("\n") + "\n"]
    for group in groups:
        parts.append(heading(group) + "\n" + "".join(field_help(f, width) for f in dataclasses.fields(group)))
    parts += [title + "\n" + "".join(entries) for title, entries in sections if entries]
    if footer:
        parts.append(textwrap.fill(" ".join(footer.split()), width) + "\n")
    return "\n".join(parts)


def define_flags(group, only: tuple[str, ...] | None = None, defaults: dict | None = None) -> tuple[str, ...]:
    """One absl flag per field of `group` (or of its fields `only`): its name, default (or `defaults`' value) and
    help, typed by the field's type (an enum where it lists choices), checked by building the group from it (the
    group's own message on a bad value). Returns the flags' names."""
    defined = []
    for field in dataclasses.fields(group):
        if only is not None and field.name not in only:
            continue
        default = (defaults or {}).get(field.name, field.default)
        help_text, choices = field.metadata["help"], field.metadata["choices"]
        if choices is not None:
            flags.DEFINE_enum(field.name, default, choices, help_text)
        else:
            define = {"bool": flags.DEFINE_bool, "int": flags.DEFINE_integer, "float": flags.DEFINE_float,
                      "str": flags.DEFINE_string}[field.type.split(" | ")[0]]
            define(field.name, default, help_text)
        flags.register_validator(field.name, lambda v, name=field.name: _parses(lambda x: group(**{name: x}), v),
                                 f"is not a value of {group.__name__}.{field.name}")
        defined.append(field.name)
    return tuple(defined)


def _parses(build, value) -> bool:
    """True if `build(value)` succeeds; a refusal carries its own message (it says what to write instead)."""
    try:
        build(value)
        return True
    except (ValueError, TypeError, SpecjaxError) as e:
        raise flags.ValidationError(f"{e}") from None


def group_from(group, values: Mapping, defaults: Mapping | None = None):
    """`group` built from the `values` of its fields (flat: setting name -> value, from flags and a preset), a field
    absent there from `defaults`, then from its own default; a value no flag would take (a preset's) is refused
    with the setting's message."""
    given = {**(defaults or {}), **values}
    try:
        return group(**{field.name: given[field.name] for field in dataclasses.fields(group) if field.name in given})
    except SpecjaxError as e:
        raise EvalError(f"setting {e}") from None


def refuse_unknown(values: Mapping, known: Sequence[str], what: str) -> None:
    """Refuse a name in `values` that is none of the `known` settings of `what` (a command)."""
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise EvalError(f"{what} has no setting {', '.join(unknown)}")


def as_settings(settings: EvalSettings | Mapping) -> EvalSettings:
    """`settings` as the tree; flat values (setting name -> value) are built into it once."""
    return settings if isinstance(settings, EvalSettings) else EvalSettings.from_values(settings)


__all__ = ["EVAL_GROUPS", "EngineSettings", "EvalSettings", "ModelSettings", "RunSettings", "StoreSettings",
           "WorkloadSettings", "as_settings", "check_fields", "define_flags", "flag_help", "group_from", "names",
           "render_help", "setting", "shown_default"]
