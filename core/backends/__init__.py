"""(torch) The engine's backends and how one is chosen (see `base.py` for what a backend owns), and what an engine
config means on this machine (`resolve_engine_config`: `--device auto`, `--dtype auto`, the device's sizes).

    cpu    conveyor's C++ kernels and fused forward; exact in float32 and bfloat16     backends/cpu/
    cuda   Triton paged attention, a lean forward, CUDA graphs for small steps        backends/cuda/
    torch  plain torch (SDPA over gathered K/V), any device; the reference            backends/sdpa.py

`--backend auto` takes cpu on a CPU where the kernels build (AVX-512 or AVX2 + FMA, a compiler), cuda on a CUDA
device where Triton imports, torch elsewhere.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from conveyor.core.backends.attention_probe import model_attention
from conveyor.core.backends.base import Backend
from conveyor.core.config import BACKENDS, EngineConfig
from conveyor.core.errors import ConfigError


def resolve_device(device: str) -> torch.device:
    """The `device` field as a torch.device ("auto": CUDA where there is a device, else the CPU); ConfigError
    where it names no device, or a CUDA one where none is."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ConfigError("device", str(e), device) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "no CUDA device is available here; use --device cpu", device)
    return dev


def resolve_engine_config(config: EngineConfig) -> tuple[EngineConfig, tuple[str, ...]]:
    """(`config` as it will run here, the fields given that change nothing here). As it runs: the device resolved
    ("auto": a GPU where there is one), that device's default sizes filled in, `dtype="auto"` made concrete (a
    run's manifest records what ran), the backend checked to run on the device, the cpu kernels' route chosen
    (`cpu_isa`, before they load, whose build then starts beside the model's load); ConfigError naming the field
    (device, backend, cpu_isa) where it cannot. Changing nothing: gpu_memory_utilization off a GPU, or beside
    kv_cache_memory."""
    device = resolve_device(config.device)
    if device.type == "cpu" and config.backend in ("auto", "cpu"):
        from conveyor.core.backends.cpu.kernels import build_in_background, select_isa

        select_isa(config.cpu_isa)  # before anything builds or loads the kernels
        build_in_background()  # a first run's build overlaps the model's conversion and load
    elif config.cpu_isa != "auto":
        raise ConfigError("cpu_isa", f"cpu_isa chooses the instructions of the cpu backend's kernels; this run is on "
                          f"{device} with the {config.backend} backend, where it would change nothing: drop it",
                          config.cpu_isa)
    runs = available_backends(device, wait=False)
    if config.backend != "auto" and config.backend not in runs:
        raise ConfigError("backend", f"does not run on {device} here; backends that do: {', '.join(runs)} (or auto)",
                          config.backend)
    dtype = auto_dtype(device, wait=False) if config.dtype == "auto" else config.dtype
    resolved = dataclasses.replace(config.for_device(device.type), device=str(device), dtype=dtype)
    unused = ()
    if config.gpu_memory_utilization is not None and (device.type != "cuda" or config.kv_cache_memory is not None):
        unused = ("gpu_memory_utilization",)
    return resolved, unused


def quiet_build_notes() -> None:
    """No notes on stderr from a backend's one-time build (the cpu kernels' compile): `conveyor run --quiet`, whose
    log is warnings, errors and its closing line. Called before `resolve_engine_config`, which starts that build."""
    from conveyor.core.backends.cpu.kernels import quiet_build_notes as quiet_cpu_build

    quiet_cpu_build()


def auto_dtype(device: torch.device, wait: bool = True) -> str:
    """What `--dtype auto` means on `device`: bfloat16 on a GPU and on CPUs where conveyor's kernels run bf16 on
    bf16 instructions (AMX tiles or AVX512-BF16: about 2.5-3x float32's speed, and as right as float32 on
    benchmarks/dtype_check.py's factual questions); float32 on other CPUs, where bf16 would be widened to float
    at every step, no faster and less precise."""
    if device.type == "cuda":
        return "bfloat16"
    from conveyor.core.backends.cpu.kernels import native_bf16

    return "bfloat16" if native_bf16(wait) else "float32"


def available_backends(device: torch.device, wait: bool = True) -> list[str]:
    """The backends that run on `device` here (the cuda backend runs on a CPU only under TRITON_INTERPRET=1,
    Triton's interpreter: for tests). `wait=False`: the cpu backend as expected while its kernels build."""
    out = []
    if device.type == "cpu":
        from conveyor.core.backends.cpu.kernels import cpu_kernels, kernels_expected

        if (cpu_kernels() is not None) if wait else kernels_expected():
            out.append("cpu")
    if _triton_runs(device):
        out.append("cuda")
    out.append("torch")
    return out


def _triton_runs(device: torch.device) -> bool:
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if device.type not in ("cpu", "cuda"):
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no Triton here
        return False
    return True


def packed_pooling(model: torch.nn.Module, encoder: bool, classifier: bool, name: str, pooling: str, pool):
    """(the packed exact route of a pooling model where its device has one, "") or (None, why not): on the CPU,
    conveyor's kernels (`cpu/packed_pooling.py`); `pool(hidden, first, n, method)` pools one sequence's rows."""
    if next(model.parameters()).device.type != "cpu":
        return None, "not on the CPU"
    from conveyor.core.backends.cpu.packed_pooling import PackedPooling

    return PackedPooling.build(model, encoder, classifier, name, pooling, pool)


def select_backend(model: torch.nn.Module, name: str = "auto", fused_forward: bool = True,
                   max_num_seqs: int = 64, max_num_batched_tokens: int = 2048) -> Backend:
    """The backend `name` for `model` (on its device), handed the model's attention as its forward defines it (the
    probe: `attention_probe.model_attention`, which switches the model to conveyor's attention); ConfigError naming
    the field where it cannot run, UnsupportedModel where conveyor would not compute its attention as it does."""
    if name not in BACKENDS:
        raise ConfigError("backend", f"{name!r} is not one of {', '.join(BACKENDS)}")
    device = next(model.parameters()).device
    runs = available_backends(device)
    if name == "auto":
        name = {"cpu": "cpu" if "cpu" in runs else "torch", "cuda": "cuda" if "cuda" in runs else "torch"}.get(
            device.type, "torch")
    elif name not in runs:
        raise ConfigError("backend", f"does not run on {device} here ({_why_not(name, device)}); backends that do: "
                          f"{', '.join(runs)}", name)
    attention = model_attention(model)
    if name == "cpu":
        from conveyor.core.backends.cpu.backend import CpuBackend

        return CpuBackend(model, attention, fused_forward=fused_forward)
    if name == "cuda":
        from conveyor.core.backends.cuda.backend import CudaBackend

        return CudaBackend(model, attention, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    from conveyor.core.backends.sdpa import TorchBackend

    return TorchBackend(model, attention)


def _why_not(name: str, device: torch.device) -> str:
    if name == "cpu":
        if device.type != "cpu":
            return "it runs on the CPU only"
        from conveyor.core.backends.cpu.kernels import kernels_missing_reason

        return f"conveyor's C++ kernels are unavailable: {kernels_missing_reason()}"
    if name == "cuda":
        return "it needs a CUDA device and Triton" if device.type == "cpu" else "Triton does not import"
    return "?"
