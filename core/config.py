"""EngineConfig: the engine's numbers (block size, batch caps, KV pool size), frozen, and the defaults that depend
on the device. Every engine default is written here once. Pure Python.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from conveyor.core.errors import ConfigError
from conveyor.core.fields import check_fields, option

DEFAULT_MODEL = "smollm2-135m-instruct"  # the embedded model (core/model_loader.py), fetched on first use
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULES = ("fcfs", "priority", "sjf", "lpm")  # the policies of core/schedule_policy.py; the first is the default
SPECULATIVE_METHODS = ("ngram",)  # the drafters of core/speculative.py
DEFAULT_SPECULATIVE_TOKENS = 6  # draft tokens per request and step (benchmarks/NOTES.md: chosen by measurement)
BACKENDS = ("auto", "cpu", "cuda", "torch")  # core/backends
CPU_ISAS = ("auto", "avx2")  # the cpu backend's kernels: auto (this CPU's widest route) or avx2 (core/backends/cpu)
DEFAULT_KV_CACHE_MEMORY = "2GiB"  # the KV pool's budget on the CPU (a GPU's comes from gpu_memory_utilization)
# Sizes whose default depends on the device: a GPU step has room for far more rows.
DEVICE_DEFAULTS = {"cpu": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
                   "cuda": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.9}}
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # tokens per KV block the kernels take
MAX_SPECULATIVE_TOKENS = 32  # draft tokens per request and step, at most
MIN_WAITING = 64  # backpressure: at least this many requests may wait (max(2 x max_num_seqs, MIN_WAITING))

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_memory(text: str | int, field: str = "kv_cache_memory") -> int:
    """'2GiB' -> 2147483648; '500MB' -> 500000000; plain integers are bytes. ConfigError naming `field`."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ConfigError(field, f"{field}: cannot read {text!r}; write it like 2GiB, 512MiB or 1000000000") from None
    if value <= 0:
        raise ConfigError(field, f"{field} must be positive, got {text!r}")
    return int(value)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduling and memory settings. None means "the device's default" (DEVICE_DEFAULTS), filled in by
    `for_device`. A value learned at run time (blocks that fit) is returned, not stored."""

    block_size: int = option(16)  # tokens per KV block
    max_num_seqs: int | None = option(None)  # requests running in one step
    max_num_batched_tokens: int | None = option(None)  # tokens fed to one forward pass
    num_kv_blocks: int | None = option(None)  # pool size; None = derive from kv_cache_memory
    # budget for the KV pool when num_kv_blocks is None; None = the backend's default: DEFAULT_KV_CACHE_MEMORY on
    # the CPU, on a GPU what gpu_memory_utilization of its memory leaves after the weights and activations
    kv_cache_memory: str | int | None = option(None, size=True)
    gpu_memory_utilization: float | None = option(None)  # on a GPU, the fraction of its memory the engine may take
    enable_prefix_caching: bool = True
    max_waiting: int | None = None  # backpressure: requests held in WAITING; None = lookahead, else its default
    # The order waiting requests run in (core/schedule_policy.py): fcfs, priority, sjf or lpm. The outputs are the
    # same under each; only speed and latency move.
    schedule: str = option(SCHEDULES[0], choices=SCHEDULES)
    # The waiting requests a schedule other than fcfs chooses among (the reader's look-ahead): None = max(2 x
    # max_num_seqs, 64).
    lookahead: int | None = option(None)
    # Speculative decoding (core/speculative.py): "ngram" drafts a request's next tokens from its own prompt and
    # output, up to num_speculative_tokens per step (None: DEFAULT_SPECULATIVE_TOKENS). The outputs are the same with
    # it and without; only speed moves.
    speculative: str | None = option(None, choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int | None = option(None)
    device: str = option("auto")  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = option(DTYPES[0], choices=DTYPES)
    backend: str = option(BACKENDS[0], choices=BACKENDS)  # core/backends
    fused_forward: bool = True  # the cpu backend, the decoder families: the fused forward instead of transformers'
    # The cpu backend's kernels: auto (AVX-512 where the CPU has it, else AVX2 + FMA) or avx2 (the AVX2 route on any
    # CPU with it). Both are exact; their bits differ from each other.
    cpu_isa: str = option(CPU_ISAS[0], choices=CPU_ISAS)
    # A request's grammar: compiled off the step loop within this many seconds, and refused above this many bytes
    # of schema, regex or choices (a record past either is an error row; the run goes on).
    max_grammar_compile_s: float = option(20.0)
    max_grammar_bytes: int = option(256 << 10, size=True)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting", "num_kv_blocks",
                     "lookahead", "num_speculative_tokens"):
            value = getattr(self, name)
            if value is None and name != "block_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"{name} must be a positive integer, got {value!r}")
        s = self.max_grammar_compile_s
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0:
            raise ConfigError("max_grammar_compile_s", f"max_grammar_compile_s must be a positive number of seconds, "
                              f"got {s!r}")
        if isinstance(self.max_grammar_bytes, bool) or not isinstance(self.max_grammar_bytes, int) \
                or self.max_grammar_bytes < 1:
            raise ConfigError("max_grammar_bytes", f"max_grammar_bytes must be a positive integer, got "
                              f"{self.max_grammar_bytes!r}")
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError("block_size", f"block_size must be a power of two up to 128, got {self.block_size!r}")
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1):
            raise ConfigError("gpu_memory_utilization",
                              f"gpu_memory_utilization: a fraction of the GPU's memory in (0, 1], e.g. 0.9; got {u!r}")
        if self.backend not in BACKENDS:
            raise ConfigError("backend", f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if self.cpu_isa not in CPU_ISAS:
            raise ConfigError("cpu_isa", f"cpu_isa must be one of {', '.join(CPU_ISAS)}; got {self.cpu_isa!r}")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError("device", f"device: {self.device!r} is not one of auto, cpu, cuda or cuda:N", self.device)
        self._check_schedule()
        self._check_speculative()
        check_fields(self)

    def _check_speculative(self) -> None:
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ConfigError("speculative", f"speculative must be {' or '.join(SPECULATIVE_METHODS)} (drafts from "
                              f"the request's own tokens); got {self.speculative!r}", self.speculative)
        if self.num_speculative_tokens is not None and self.speculative is None:
            raise ConfigError("num_speculative_tokens", "num_speculative_tokens: drafts are made only with "
                              "speculative ngram; give both, or drop it", self.num_speculative_tokens)
        if self.num_speculative_tokens is not None and self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ConfigError("num_speculative_tokens", f"num_speculative_tokens: at most {MAX_SPECULATIVE_TOKENS} "
                              f"draft tokens per step; got {self.num_speculative_tokens}", self.num_speculative_tokens)

    @property
    def speculative_tokens(self) -> int:
        """Draft tokens per request and step, where speculation is on."""
        n = self.num_speculative_tokens
        return DEFAULT_SPECULATIVE_TOKENS if n is None else n

    def _check_schedule(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError("schedule", f"schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}")
        if self.lookahead is not None and self.schedule == SCHEDULES[0]:
            raise ConfigError("lookahead", "lookahead: fcfs runs requests in input order whatever it sees ahead; "
                              "give it with schedule priority, sjf or lpm, or drop it", self.lookahead)
        if self.lookahead is not None and self.max_waiting is not None and self.lookahead != self.max_waiting:
            raise ConfigError("lookahead", f"lookahead {self.lookahead} and max_waiting {self.max_waiting} both "
                              "bound the waiting requests; give one", self.lookahead)
        if self.schedule == "lpm" and not self.enable_prefix_caching:
            raise ConfigError("schedule", "schedule lpm orders requests by their prefix-cache hits, but prefix "
                              "caching is off; turn it on or choose another schedule", self.schedule)

    def for_device(self, device_type: str) -> EngineConfig:
        """This config with the defaults of a `device_type` ("cpu" or "cuda") device filled in where not given."""
        defaults = DEVICE_DEFAULTS.get(device_type, DEVICE_DEFAULTS["cpu"])
        changes = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        seqs = changes.get("max_num_seqs", self.max_num_seqs)
        if self.max_waiting is None:
            changes["max_waiting"] = self.lookahead if self.lookahead is not None else max(2 * seqs, MIN_WAITING)
        return dataclasses.replace(self, **changes) if changes else self
