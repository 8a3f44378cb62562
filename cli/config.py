"""Run configuration: a YAML config file merged with command-line flags into a frozen RunConfig.

Precedence: a flag given on the command line > the value in the `--config` file > the default
below. Config keys are option names (`max_tokens` or `max-tokens`); an unknown key is an error
that names the key and the file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.cli.exit_codes import UsageError


@dataclass(frozen=True)
class RunConfig:
    input: str
    output: str
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    device: str = "auto"
    backend: str = "auto"  # core/backends: auto, cpu, cuda or torch
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    json_schema: str | None = None  # a file holding the JSON schema every output must match
    choice: tuple[str, ...] = ()  # every output is one of these
    regex: str | None = None  # every output matches this
    logprobs: int | None = None  # per output token: its logprob and this many alternatives
    prompt_logprobs: bool = False  # the logprob of every prompt token
    system_prompt: str | None = None
    prompt_field: str = "prompt"
    messages_field: str = "messages"
    id_field: str = "id"
    keep_fields: tuple[str, ...] = ()
    input_format: str | None = None
    output_format: str | None = None
    split: str | None = None
    max_num_seqs: int | None = None  # None: 64 on the CPU, 256 on a GPU (DEVICE_DEFAULTS)
    max_num_batched_tokens: int | None = None  # None: 2048 on the CPU, 8192 on a GPU
    num_kv_blocks: int | None = None
    kv_cache_memory: str | None = None  # None: 2GiB on the CPU; on a GPU from gpu_memory_utilization
    gpu_memory_utilization: float | None = None  # on a GPU: the fraction of its memory weights, activations and KV
    # may take (None: 0.9, DEVICE_DEFAULTS); on the CPU, --kv-cache-memory sizes the KV cache instead
    max_record_bytes: int = 4 << 20  # a bigger record is an error row, never parsed
    block_size: int = 16
    limit: int | None = None
    on_error: str = "record"
    quiet: bool = False
    summary_json: str | None = None
    run_dir: str | None = None
    checkpoint_every: int | None = None
    checkpoint_seconds: float = 30.0
    max_runtime: float | None = None  # seconds
    restart: bool = False
    shard: str | None = None  # "I/N": answer the records whose index is I mod N (io/shards.py)
    executor: str = "local"  # "local" (this process) or "ray" (cli/ray_executor.py)
    num_workers: int | None = None  # --executor ray: engines, one per GPU where there are GPUs
    profile: bool = False
    log_every: float = 10.0  # seconds between plain progress lines without a TTY

    def generation_config(self) -> dict[str, Any]:
        """What decides the output rows: a change of any of these under a run directory is drift."""
        keys = ("dtype", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos",
                "min_tokens", "system_prompt", "prompt_field", "messages_field", "id_field", "keep_fields",
                "regex", "logprobs", "prompt_logprobs")
        out = {k: getattr(self, k) for k in keys}
        out["stop"] = list(self.stop)
        out["keep_fields"] = list(self.keep_fields)
        out["choice"] = list(self.choice)
        out["json_schema"] = self.json_schema_text()  # the schema itself: an edited file is drift
        # The options added later are left out while unset: a run started before they existed is no drift.
        return {k: v for k, v in out.items() if k in keys[:15] or not (v is None or v is False or v == [])}

    def json_schema_text(self) -> str | None:
        """--json-schema's file content, or None; UsageError naming the option where it cannot be read."""
        if self.json_schema is None:
            return None
        try:
            return Path(self.json_schema).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--json-schema {self.json_schema}: cannot be read ({getattr(e, 'strerror', None) or e}); "
                             "give a file holding a JSON schema") from None


# Engine sizes whose default depends on the device: a GPU step has room for far more rows.
DEVICE_DEFAULTS = {"cpu": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
                   "cuda": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.9}}

FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}
_FILE_KEYS = set(FIELDS) - {"input", "output", "restart"}
_CHOICES = {
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "backend": ("auto", "cpu", "cuda", "torch"),
    "executor": ("local", "ray"),
    "on_error": ("record", "skip", "fail"),
    "input_format": (None, "jsonl", "json", "parquet", "csv", "datasets"),
    "output_format": (None, "parquet", "jsonl", "openai-batch"),
}


def option_name(key: str) -> str:
    return "--" + key.replace("_", "-")


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
        import re

        s = str(text).strip().lower()
        parts = re.findall(r"(\d+(?:\.\d+)?)\s*([hms]?)", s)
        if not s or "".join(n + u for n, u in parts) != s.replace(" ", ""):
            raise UsageError(f"{option}: cannot read {text!r}; write it like 50m, 2h, 1h30m or 90s")
        scale = {"h": 3600, "m": 60, "s": 1, "": 1}
        seconds = sum(float(n) * scale[u] for n, u in parts)
    if seconds <= 0:
        raise UsageError(f"{option}: must be positive, got {text!r}")
    return seconds


def build_config(flags: dict[str, Any], config_path: str | None) -> RunConfig:
    """Merge file and flags (flags that are None were not given) into a validated RunConfig."""
    values: dict[str, Any] = load_config_file(config_path) if config_path else {}
    values.update({k: v for k, v in flags.items() if v is not None and not (isinstance(v, (list, tuple)) and not v)})
    for key in ("stop", "keep_fields", "choice"):
        if key in values:
            values[key] = _as_str_tuple(key, values[key])
    if "max_runtime" in values and values["max_runtime"] is not None:
        values["max_runtime"] = parse_duration(values["max_runtime"])
    _check_strings(values)
    for key in ("kv_cache_memory", "max_record_bytes"):
        if key in values:
            values[key] = _checked_size(key, values[key])
    if "device" in values:
        _check_device(values["device"])
    for key, choices in _CHOICES.items():
        if key in values and values[key] not in choices:
            allowed = ", ".join(c for c in choices if c)
            raise UsageError(f"{option_name(key)}: {values[key]!r} is not one of {allowed}")
    _check_types(values)
    return RunConfig(**values)


def _as_str_tuple(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        items = [value] if key == "stop" else [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, (list, tuple)):
        items = []
        for v in value:
            if not isinstance(v, str):
                raise UsageError(f"{option_name(key)}: expected strings, got {v!r}")
            items.extend([v] if key == "stop" else [s.strip() for s in v.split(",") if s.strip()])
    else:
        raise UsageError(f"{option_name(key)}: expected a string or a list of strings, got {value!r}")
    return tuple(items)


_STR_KEYS = {"input", "output", "model", "dtype", "device", "backend", "system_prompt", "prompt_field",
             "messages_field", "id_field", "input_format", "output_format", "split", "on_error", "summary_json", "run_dir",
             "json_schema", "regex", "shard", "executor"}


def _check_strings(values: dict[str, Any]) -> None:
    for key in _STR_KEYS:
        value = values.get(key)
        if value is not None and not isinstance(value, str):
            raise UsageError(f"{option_name(key)}: expected a string, got {value!r}")


def _checked_size(key: str, value: Any) -> Any:
    """--kv-cache-memory / --max-record-bytes: a size like 2GiB, 512MiB or a number of bytes."""
    from conveyor.core.config import parse_memory

    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise UsageError(f"{option_name(key)}: expected a size such as 2GiB or 512MiB, got {value!r}")
    try:
        size = parse_memory(value)
    except ValueError:
        size = 0
    if size <= 0:
        raise UsageError(f"{option_name(key)}: cannot read {value!r}; write a positive size like 2GiB, 512MiB or a "
                         "number of bytes")
    return size if key == "max_record_bytes" else value


def _check_device(device: str) -> None:
    import re

    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise UsageError(f"--device: {device!r} is not one of auto, cpu, cuda or cuda:N")


_INT_KEYS = {"max_tokens", "top_k", "seed", "min_tokens", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
             "block_size", "limit", "checkpoint_every", "logprobs", "num_workers"}
_FLOAT_KEYS = {"temperature", "top_p", "min_p", "checkpoint_seconds", "log_every", "gpu_memory_utilization"}
_BOOL_KEYS = {"ignore_eos", "quiet", "restart", "profile", "prompt_logprobs"}
_POSITIVE = {"max_tokens", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size", "num_workers",
             "checkpoint_every", "checkpoint_seconds", "log_every"}


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
        if key == "gpu_memory_utilization" and not 0 < value <= 1:
            raise UsageError(f"{opt}: a fraction of the GPU's memory in (0, 1], e.g. 0.9; got {value!r}")
        if key == "logprobs" and not 0 <= value <= 20:
            raise UsageError(f"{opt}: the number of alternatives must be from 0 to 20, got {value!r}")
    if "block_size" in values and values["block_size"] not in (1, 2, 4, 8, 16, 32, 64, 128):
        raise UsageError(f"--block-size: must be a power of two up to 128, got {values['block_size']!r}")
