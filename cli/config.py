"""Options -> RunSpec: a YAML config file merged with command-line flags, checked, and built into io's RunSpec and
the settings only the CLI reads (`CliSettings`).

An option is a field of one of the options dataclasses (core's SamplingParams, EngineConfig and PoolingOptions, io's BuildOptions,
InputOptions, OutputOptions, StateOptions and the RunSpec's own, CliSettings) declared with `core.fields.option`: its
type annotation, choices and limits are read from there, to type a config file's values (`_checked`), to list the
choices and the default in `--help` (`choices_text`, `default_text`) and to find which field an option fills
(`OPTIONS`). Adding an option is its alias (cli/options.py), its command parameter (cli/run.py) and its field.

Precedence: a flag given on the command line > the value in the `--config` file > the field's default. Config keys
are option names (`max_tokens` or `max-tokens`); unknown keys are one error naming each, with the nearest option
name. A value a dataclass refuses is a usage error naming its option (`ConfigError.named`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.cli.exit_codes import UsageError
from conveyor.cli.model_names import check_model_name
from conveyor.cli.option_names import option_name
from conveyor.cli.prompt_options import check_prompt_options
from conveyor.core import (
    ConfigError,
    EngineConfig,
    OptionMeta,
    SamplingParams,
    check_fields,
    check_value,
    field_kinds,
    option,
    option_fields,
    option_meta,
    parse_memory,
)
from conveyor.io.run_spec import (
    BuildOptions,
    InputOptions,
    OutputOptions,
    PoolingOptions,
    RunSpec,
    StateOptions,
    run_grammar,
)

EXECUTORS = ("local", "ray")  # this process, or one engine per worker on a Ray cluster (cli/ray_executor.py)


@dataclass(frozen=True)
class CliSettings:
    """What only the command line reads: how the run is shown, stopped and spread."""

    quiet: bool = option(False)  # warnings and errors only: no progress display, no summary
    summary_json: str | None = option(None)  # write the run summary as JSON here
    max_runtime: float | None = option(None, positive=True)  # seconds; then stop cleanly (exit 75)
    executor: str = option(EXECUTORS[0], choices=EXECUTORS)
    num_workers: int | None = option(None, positive=True)  # --executor ray: engines (None: the cluster's GPUs, else 1)
    log_every: float = option(10.0, positive=True, flag=False)  # seconds between plain progress lines without a TTY

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class Invocation:
    spec: RunSpec
    cli: CliSettings


GRAMMAR_KEYS = ("json_schema", "choice", "regex")  # the run's grammar: each becomes SamplingParams.grammar
# The dataclasses whose option fields are the options (core.fields.option), and so the config file's keys.
_OWNERS = (RunSpec, SamplingParams, BuildOptions, EngineConfig, InputOptions, OutputOptions, StateOptions,
           PoolingOptions, CliSettings)


def _option_table() -> dict[str, tuple[type, str]]:
    table: dict[str, tuple[type, str]] = {}
    for owner in _OWNERS:
        for f in option_fields(owner):
            key = option_meta(f).name or f.name
            if key in table:
                raise AssertionError(f"option {key} is the field of both {table[key][0].__name__} and {owner.__name__}")
            table[key] = (owner, f.name)
    return {**table, **{key: (SamplingParams, "grammar") for key in GRAMMAR_KEYS}}


# option key -> (the dataclass it fills, its field there), read from the fields' metadata
OPTIONS: dict[str, tuple[type, str]] = _option_table()


def _field(key: str) -> dataclasses.Field:
    owner, name = OPTIONS[key]
    return next(f for f in dataclasses.fields(owner) if f.name == name)


def _meta(key: str) -> OptionMeta:
    return option_meta(_field(key)) or OptionMeta()


_FILE_KEYS = {key for key in OPTIONS if _meta(key).config_file}  # (input, output and --restart are not)


def default_of(key: str) -> Any:
    """The default of option `key`: its field's default in the dataclass it fills."""
    f = _field(key)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def default_text(key: str, shown: str | None = None) -> str:
    """"[default: X]" for --help, X read from the option's source (escaped: rich would take it for markup)."""
    value = default_of(key) if shown is None else shown
    if isinstance(value, bool):
        value = str(value).lower()
    return f"\\[default: {value}]"


def choices_text(key: str) -> str:
    """Option `key`'s choices as --help lists them: "a, b or c", read from its field."""
    choices = [str(c) for c in _meta(key).choices if c is not None]
    return ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else "".join(choices)


def size_text(size: int) -> str:
    """A byte count as --help shows it: 4194304 -> "4MiB" (the largest binary unit that divides it)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


class _RepeatedKey(Exception):
    def __init__(self, key: str, lines: tuple[int, int]) -> None:
        super().__init__(key)
        self.key, self.lines = key, lines


def _loader(yaml: Any) -> type:
    """yaml's SafeLoader, but a key given twice in one mapping raises _RepeatedKey (PyYAML keeps the last)."""

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise _RepeatedKey(str(key), (seen[key], line))
                if isinstance(key, (str, int, float, bool)):
                    seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return Loader


def load_config_file(path: str) -> tuple[dict[str, Any], dict[str, int]]:
    """(option key -> value, option key -> the line it is on) of the config file `path`; a usage error naming the
    file, and the line where there is one, where it cannot be read as a mapping of option: value."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--config {path}: no such file")
    try:
        loader = _loader(yaml)(p.read_text(encoding="utf-8"))
        try:
            root = loader.get_single_node()
            data = loader.construct_document(root) if root is not None else None
        finally:
            loader.dispose()
    except UnicodeDecodeError as e:
        raise UsageError(f"--config {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        raise UsageError(f"--config {path}: {_yaml_problem(e)}") from None
    except _RepeatedKey as e:
        raise UsageError(f"--config {path}: the key {e.key} is given twice (line {e.lines[0]} and line {e.lines[1]}) "
                         "and only one would be used; keep one") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}")
    out, unknown, spelled = {}, [], {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in spelled:
            raise UsageError(f"--config {path}: {spelled[name]} and {key} are one option, given twice; keep one")
        spelled[name] = key
        if name in _FILE_KEYS:
            if value is not None:  # (`key:` with no value: the option's default, as if not given)
                out[name] = value
        else:
            unknown.append(_unknown_key(key, name))
    if unknown:
        raise UsageError(f"--config {path}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; keys "
                         "are option names such as max_tokens")
    lines = {str(key.value).replace("-", "_"): key.start_mark.line + 1 for key, _ in root.value}
    return out, {name: line for name, line in lines.items() if name in out}


def _yaml_problem(e) -> str:
    """"line 3: not valid YAML (what is wrong, and what it was reading from which line)" of a YAMLError."""
    mark, context = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
    if mark is None:
        return f"not valid YAML ({str(e).splitlines()[0]})"
    what = e.problem or str(e).splitlines()[0]
    if e.context and context is not None and context.line != mark.line:
        what += f", {e.context} that starts on line {context.line + 1}"
    return f"line {mark.line + 1}: not valid YAML ({what})"


def _unknown_key(key: Any, name: str) -> str:
    """'max_token' (did you mean max_tokens?), or the key alone where no option name is close."""
    import difflib

    close = difflib.get_close_matches(name, sorted(_FILE_KEYS), n=1, cutoff=0.75)
    if name == "restart":
        return f"{key!r} (give --restart on the command line: a config file does not discard a run's state)"
    return f"{key!r} (did you mean {close[0]}?)" if close else repr(key)


def parse_duration(text: str | float | int, option: str = "--max-runtime") -> float:
    """'50m' -> 3000.0; '2h' -> 7200.0; '90s' or '90' -> 90.0; '1h30m' works too."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        s = str(text).strip().lower()
        parts = re.findall(r"(\d+(?:\.\d+)?)\s*([hms]?)", s)
        if not s or "".join(n + u for n, u in parts) != s.replace(" ", ""):
            raise UsageError(f"{option}: cannot read {text!r}; write it like 50m, 2h, 1h30m or 90s")
        scale = {"h": 3600, "m": 60, "s": 1, "": 1}
        seconds = sum(float(n) * scale[u] for n, u in parts)
    if seconds <= 0:
        raise UsageError(f"{option}: must be positive, got {text!r}")
    return seconds


def holds_list(key: str) -> bool:
    """Whether the option `key` holds a list of strings (--stop, --keep-fields, --served-model-name, --choice)."""
    return key == "choice" or (key in OPTIONS and tuple in field_kinds(*OPTIONS[key]))


def build_config(flags: dict[str, Any], config_path: str | None) -> Invocation:
    """Merge file and flags (flags that are None were not given) into a checked RunSpec and CliSettings. A value the
    config file gives that is refused is named with the file and its line."""
    values, lines = load_config_file(config_path) if config_path else ({}, {})
    given = {k: v for k, v in flags.items() if v is not None and not (isinstance(v, (list, tuple)) and not v)}
    from_file = {key: line for key, line in lines.items() if key not in given}
    values.update(given)
    try:
        return _checked_invocation(values)
    except UsageError as e:
        found = re.match(r"--[a-z0-9-]+", str(e))  # (each message starts with the option at fault)
        key = found.group().removeprefix("--").replace("-", "_") if found else None
        if key not in from_file:
            raise
        raise UsageError(f"--config {config_path}: line {from_file[key]}: {e}") from None


def _checked_invocation(values: dict[str, Any]) -> Invocation:
    """`values` (option key -> value, file and flags merged) checked and built."""
    for key in [k for k in values if holds_list(k)]:
        values[key] = _as_str_tuple(key, values[key])
    if values.get("max_runtime") is not None:
        values["max_runtime"] = parse_duration(values["max_runtime"])
    for key in [k for k in values if k in OPTIONS and k not in GRAMMAR_KEYS]:
        values[key] = _checked(key, values[key])
    for key in ("json_schema", "regex"):  # (a path and a pattern: text; --choice's items are checked above)
        if key in values and not isinstance(values[key], str):
            raise UsageError(f"{option_name(key)}: expected a string, got {values[key]!r}")
    check_prompt_options(values)
    try:
        invocation = _invocation(values)
    except ConfigError as e:
        raise UsageError(e.named(option_name(e.field))) from None
    check_model_name(invocation.spec.model)
    return invocation


def _checked(key: str, value: Any) -> Any:
    """Option `key`'s value checked as its field declares (type, choices, limits; a size read), as the field holds
    it; a usage error naming the option. (What the dataclass checks beyond that, it checks when it is built.)"""
    owner, name = OPTIONS[key]
    meta = _meta(key)
    if meta.switch:
        if not isinstance(value, bool):
            raise UsageError(f"{option_name(key)}: expected true or false, got {value!r}")
        return value
    if meta.size:
        value = _checked_size(key, value, keep_text=str in field_kinds(owner, name))
    try:
        return check_value(owner, name, value)
    except ConfigError as e:
        raise UsageError(e.named(option_name(key))) from None


def _invocation(values: dict[str, Any]) -> Invocation:
    """The dataclasses filled from `values` (option key -> value); ConfigError where one refuses a value."""
    fields: dict[type, dict[str, Any]] = {}
    for key, value in values.items():
        owner, name = OPTIONS.get(key, (None, None))
        if owner is not None and name != "grammar":
            if _meta(key).switch:  # the option is true or false; the field 0 or None (a number of alternatives)
                value = 0 if value else None
            fields.setdefault(owner, {})[name] = value
    fields.setdefault(SamplingParams, {})["grammar"] = _grammar(values)
    built = {owner: _built(owner, fields.get(owner, {}))
             for owner in (SamplingParams, BuildOptions, EngineConfig, StateOptions, PoolingOptions, CliSettings)}
    spec = _built(RunSpec, {
        "input": _built(InputOptions, {"path": values["input"], **fields.get(InputOptions, {})}),
        "output": _built(OutputOptions, {"path": values["output"], **fields.get(OutputOptions, {})}),
        "sampling": built[SamplingParams], "build": built[BuildOptions], "engine": built[EngineConfig],
        "state": built[StateOptions], "pooling": built[PoolingOptions], **fields.get(RunSpec, {})})
    return Invocation(spec, built[CliSettings])


def _built(owner: type, values: dict[str, Any]) -> Any:
    """owner(**values); a ConfigError names the option that fills the field at fault."""
    try:
        return owner(**values)
    except ConfigError as e:
        key = next((k for k, (o, name) in OPTIONS.items() if o is owner and name == e.field), e.field)
        raise UsageError(e.named(option_name(key))) from None


def _grammar(values: dict[str, Any]):
    """The run's grammar from --json-schema (the file's content), --choice or --regex, or None."""
    path = values.get("json_schema")
    text = None
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--json-schema {path}: cannot be read ({getattr(e, 'strerror', None) or e}); give a "
                             "file holding a JSON schema") from None
    try:
        return run_grammar(text, values.get("choice", ()), values.get("regex"))
    except ValueError as e:
        raise UsageError(str(e) if str(e).startswith("--") else f"--json-schema {path}: {e}") from None


def _as_str_tuple(key: str, value: Any) -> tuple[str, ...]:
    """--stop: each string whole; --choice: split on commas, every space kept (" yes, no" offers " yes" and " no"), a
    config file's list taken item by item (a choice may hold a comma); --keep-fields, --served-model-name: names,
    split and stripped."""
    if isinstance(value, str):
        if key == "stop":
            items = [value]
        elif key == "choice":
            items = [v for v in value.split(",") if v]
        else:
            items = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, (list, tuple)):
        items = []
        for v in value:
            if not isinstance(v, str):
                raise UsageError(f"{option_name(key)}: expected strings, got {v!r}")
            items.extend([v] if key in ("stop", "choice") else [s.strip() for s in v.split(",") if s.strip()])
    else:
        raise UsageError(f"{option_name(key)}: expected a string or a list of strings, got {value!r}")
    return tuple(items)


def _checked_size(key: str, value: Any, keep_text: bool) -> Any:
    """A size option (--kv-cache-memory, --max-record-bytes, ...): a size like 2GiB, 512MiB or a number of bytes;
    as written where the field takes text (the engine reads the KV budget), else the number of bytes."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise UsageError(f"{option_name(key)}: expected a size such as 2GiB or 512MiB, got {value!r}")
    try:
        size = parse_memory(value, key)
    except ConfigError:
        size = 0
    if size <= 0:
        raise UsageError(f"{option_name(key)}: cannot read {value!r}; write a positive size like 2GiB, 512MiB or a "
                         "number of bytes")
    return value if keep_text else size
