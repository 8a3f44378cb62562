"""EngineConfig: the engine's numbers (block size, batch caps, KV pool size), frozen. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_memory(text: str | int) -> int:
    """'2GiB' -> 2147483648; '500MB' -> 500000000; plain integers are bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"kv_cache_memory: cannot read {text!r}; write it like 2GiB, 512MiB or 1000000000")
    value = float(num) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {text!r}")
    return int(value)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduling and memory settings. A value learned at run time (blocks that fit) is returned, not stored."""

    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # requests running in one step
    max_num_batched_tokens: int = 2048  # tokens fed to one forward pass
    num_kv_blocks: int | None = None  # pool size; None = derive from kv_cache_memory
    # budget for the KV pool when num_kv_blocks is None; None = the backend's default: 2 GiB on the CPU, on a
    # GPU what gpu_memory_utilization of its memory leaves after the weights and activations
    kv_cache_memory: str | int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_waiting: int = 256  # backpressure: requests held in WAITING by generate()
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    backend: str = "auto"  # "auto" | "cpu" | "cuda" | "torch" (core/backends)
    fused_forward: bool = True  # the cpu backend, Llama-family models: the fused forward instead of transformers'

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")
        if self.backend not in ("auto", "cpu", "cuda", "torch"):
            raise ValueError(f"backend must be one of auto, cpu, cuda, torch; got {self.backend!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
