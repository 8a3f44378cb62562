"""Options -> RunSpec: a YAML config file merged with command-line flags, checked, and built into io's RunSpec and
the settings only the CLI reads (`CliSettings`).

Precedence: a flag given on the command line > the value in the `--config` file > the default. The default is the
field default of the dataclass the option fills (`OPTIONS`: core's SamplingParams and EngineConfig, io's
BuildOptions and the RunSpec's own options, CliSettings), so it is written once: `--help` shows it from there too
(`default_text`). Config keys are option names (`max_tokens` or `max-tokens`); an unknown key is an error that
names the key and the file. A value core refuses is a usage error naming its option (`ConfigError.named`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.cli.exit_codes import UsageError
from conveyor.cli.prompt_options import check_prompt_options
from conveyor.core import (
    BACKENDS,
    DTYPES,
    REASONING_PARSERS,
    SCHEDULES,
    SPECULATIVE_METHODS,
    ConfigError,
    EngineConfig,
    SamplingParams,
    parse_memory,
)
from conveyor.io.run_spec import (
    INPUT_FORMATS,
    ON_ERROR,
    OUTPUT_FORMATS,
    TEMPLATE_AS,
    BuildOptions,
    InputOptions,
    OutputOptions,
    RunSpec,
    StateOptions,
    run_grammar,
)

EXECUTORS = ("local", "ray")  # this process, or one engine per worker on a Ray cluster (cli/ray_executor.py)


@dataclass(frozen=True)
class CliSettings:
    """What only the command line reads: how the run is shown, stopped and spread."""

    quiet: bool = False  # warnings and errors only: no progress display, no summary
    summary_json: str | None = None  # write the run summary as JSON here
    max_runtime: float | None = None  # seconds; then stop cleanly (exit 75)
    executor: str = EXECUTORS[0]
    num_workers: int | None = None  # --executor ray: engines (None: the cluster's GPUs, else 1)
    log_every: float = 10.0  # seconds between plain progress lines without a TTY


@dataclass(frozen=True)
class Invocation:
    spec: RunSpec
    cli: CliSettings


# option key -> (the dataclass it fills, its field there). "spec" fields are RunSpec's own.
OPTIONS: dict[str, tuple[type, str]] = {
    "model": (RunSpec, "model"), "profile": (RunSpec, "profile"), "reasoning_parser": (RunSpec, "reasoning_parser"),
    **{k: (SamplingParams, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "ignore_eos",
                                         "min_tokens", "logprobs", "prompt_logprobs")},
    **{k: (BuildOptions, k) for k in ("seed", "system_prompt", "prompt_field", "messages_field", "id_field",
                                       "keep_fields", "chat_field", "prompt_template", "prompt_template_as",
                                       "truncate_prompt_tokens", "n", "chat_template")},
    "served_model_name": (BuildOptions, "served_model_names"),  # vLLM's option name
    **{k: (EngineConfig, k) for k in ("dtype", "device", "backend", "max_num_seqs", "max_num_batched_tokens",
                                       "num_kv_blocks", "kv_cache_memory", "gpu_memory_utilization", "block_size",
                                       "max_grammar_compile_s", "max_grammar_bytes", "schedule", "lookahead",
                                       "speculative", "num_speculative_tokens")},
    "input_format": (InputOptions, "format"), "split": (InputOptions, "split"), "limit": (InputOptions, "limit"),
    "max_record_bytes": (InputOptions, "max_record_bytes"),
    "output_format": (OutputOptions, "format"), "on_error": (OutputOptions, "on_error"),
    **{k: (StateOptions, k) for k in ("run_dir", "restart", "shard", "checkpoint_every", "checkpoint_seconds")},
    **{k: (CliSettings, k) for k in ("quiet", "summary_json", "max_runtime", "executor", "num_workers",
                                      "log_every")},
    # The run's grammar: each becomes SamplingParams.grammar (run_grammar).
    "json_schema": (SamplingParams, "grammar"), "choice": (SamplingParams, "grammar"),
    "regex": (SamplingParams, "grammar"),
}
_FILE_KEYS = set(OPTIONS)  # (input, output and --restart are not config-file keys)
_FILE_KEYS.discard("restart")
_CHOICES = {
    "dtype": DTYPES,
    "backend": BACKENDS,
    "executor": EXECUTORS,
    "on_error": ON_ERROR,
    "prompt_template_as": TEMPLATE_AS,
    "reasoning_parser": (None, *REASONING_PARSERS),
    "input_format": (None, *INPUT_FORMATS),
    "output_format": (None, *OUTPUT_FORMATS),
    "schedule": SCHEDULES,
    "speculative": (None, *SPECULATIVE_METHODS),
}


def option_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def default_of(key: str) -> Any:
    """The default of option `key`: its field's default in the dataclass it fills."""
    owner, name = OPTIONS[key]
    f = next(f for f in dataclasses.fields(owner) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def default_text(key: str, shown: str | None = None) -> str:
    """"[default: X]" for --help, X read from the option's source (escaped: rich would take it for markup)."""
    value = default_of(key) if shown is None else shown
    if isinstance(value, bool):
        value = str(value).lower()
    return f"\\[default: {value}]"


def size_text(size: int) -> str:
    """A byte count as --help shows it: 4194304 -> "4MiB" (the largest binary unit that divides it)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def load_config_file(path: str) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UsageError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in _FILE_KEYS:
            raise UsageError(f"--config {path}: unknown key {key!r}; keys are option names such as max_tokens")
        out[name] = value
    return out


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


def build_config(flags: dict[str, Any], config_path: str | None) -> Invocation:
    """Merge file and flags (flags that are None were not given) into a checked RunSpec and CliSettings."""
    values: dict[str, Any] = load_config_file(config_path) if config_path else {}
    values.update({k: v for k, v in flags.items() if v is not None and not (isinstance(v, (list, tuple)) and not v)})
    for key in ("stop", "keep_fields", "choice"):
        if key in values:
            values[key] = _as_str_tuple(key, values[key])
    if values.get("max_runtime") is not None:
        values["max_runtime"] = parse_duration(values["max_runtime"])
    _check_strings(values)
    for key in ("kv_cache_memory", "max_record_bytes", "max_grammar_bytes"):
        if key in values:
            values[key] = _checked_size(key, values[key])
    if "device" in values:
        _check_device(values["device"])
    for key, choices in _CHOICES.items():
        if key in values and values[key] not in choices:
            allowed = ", ".join(c for c in choices if c)
            raise UsageError(f"{option_name(key)}: {values[key]!r} is not one of {allowed}")
    _check_types(values)
    check_prompt_options(values)
    try:
        return _invocation(values)
    except ConfigError as e:
        raise UsageError(e.named(option_name(e.field))) from None


def _invocation(values: dict[str, Any]) -> Invocation:
    """The dataclasses filled from `values` (option key -> value); ConfigError where core refuses one."""
    fields: dict[type, dict[str, Any]] = {}
    for key, value in values.items():
        owner, name = OPTIONS.get(key, (None, None))
        if owner is not None and name != "grammar":
            fields.setdefault(owner, {})[name] = value
    sampling = fields.get(SamplingParams, {})
    if sampling.get("prompt_logprobs") is not None:  # the option is a switch; the field a number of alternatives
        sampling["prompt_logprobs"] = 0 if sampling["prompt_logprobs"] else None
    sampling["grammar"] = _grammar(values)
    spec = RunSpec(
        input=InputOptions(path=values["input"], **fields.get(InputOptions, {})),
        output=OutputOptions(path=values["output"], **fields.get(OutputOptions, {})),
        sampling=SamplingParams(**sampling),
        build=BuildOptions(**fields.get(BuildOptions, {})),
        engine=EngineConfig(**fields.get(EngineConfig, {})),
        state=StateOptions(**fields.get(StateOptions, {})),
        **fields.get(RunSpec, {}))
    return Invocation(spec, CliSettings(**fields.get(CliSettings, {})))


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
    config file's list taken item by item (a choice may hold a comma); --keep-fields: names, split and stripped."""
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


_STR_KEYS = {"input", "output", "model", "dtype", "device", "backend", "system_prompt", "prompt_field",
             "messages_field", "id_field", "input_format", "output_format", "split", "on_error", "summary_json",
             "run_dir", "json_schema", "regex", "shard", "executor", "chat_field", "prompt_template",
             "prompt_template_as", "reasoning_parser", "schedule", "speculative", "chat_template"}


def _check_strings(values: dict[str, Any]) -> None:
    for key in _STR_KEYS:
        value = values.get(key)
        if value is not None and not isinstance(value, str):
            raise UsageError(f"{option_name(key)}: expected a string, got {value!r}")


def _checked_size(key: str, value: Any) -> Any:
    """--kv-cache-memory / --max-record-bytes / --max-grammar-bytes: a size like 2GiB, 512MiB or a number of
    bytes (the KV budget stays as written: the engine reads it)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise UsageError(f"{option_name(key)}: expected a size such as 2GiB or 512MiB, got {value!r}")
    try:
        size = parse_memory(value, key)
    except ConfigError:
        size = 0
    if size <= 0:
        raise UsageError(f"{option_name(key)}: cannot read {value!r}; write a positive size like 2GiB, 512MiB or a "
                         "number of bytes")
    return value if key == "kv_cache_memory" else size


def _check_device(device: str) -> None:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise UsageError(f"--device: {device!r} is not one of auto, cpu, cuda or cuda:N")


# Types a config file may get wrong (flags arrive typed); the values themselves are checked by the dataclasses.
_INT_KEYS = {"max_tokens", "top_k", "seed", "n", "min_tokens", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
             "block_size", "limit", "checkpoint_every", "logprobs", "num_workers", "lookahead",
             "num_speculative_tokens"}
_FLOAT_KEYS = {"temperature", "top_p", "min_p", "checkpoint_seconds", "log_every", "gpu_memory_utilization",
               "max_grammar_compile_s"}
_BOOL_KEYS = {"ignore_eos", "quiet", "restart", "profile", "prompt_logprobs"}
_POSITIVE = {"num_workers", "checkpoint_every", "checkpoint_seconds", "log_every"}  # not checked downstream


def _check_types(values: dict[str, Any]) -> None:
    for key, value in values.items():
        if value is None:
            continue
        opt = option_name(key)
        if key in _INT_KEYS and (isinstance(value, bool) or not isinstance(value, int)):
            raise UsageError(f"{opt}: expected an integer, got {value!r}")
        if key in _FLOAT_KEYS:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(f"{opt}: expected a number, got {value!r}")
            values[key] = float(value)
        if key in _BOOL_KEYS and not isinstance(value, bool):
            raise UsageError(f"{opt}: expected true or false, got {value!r}")
        if key in _POSITIVE and values[key] <= 0:
            raise UsageError(f"{opt}: must be positive, got {value!r}")
        if key == "limit" and value < 0:
            raise UsageError(f"{opt}: must be >= 0, got {value!r}")
