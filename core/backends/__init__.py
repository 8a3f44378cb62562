"""(torch) The engine's backends and how one is chosen (see `base.py` for what a backend owns).

    cpu    conveyor's C++ kernels and fused forward; exact in float32 and bfloat16     backends/cpu/
    cuda   Triton paged attention, a lean forward, CUDA graphs for small steps        backends/cuda/
    torch  plain torch (SDPA over gathered K/V), any device; the reference            backends/sdpa.py

`--backend auto` takes cpu on a CPU where the kernels build (AVX-512, a compiler), cuda on a CUDA device where
Triton imports, torch elsewhere.
"""

from __future__ import annotations

import os

import torch

from conveyor.core.backends.base import Backend

BACKENDS = ("auto", "cpu", "cuda", "torch")


def available_backends(device: torch.device) -> list[str]:
    """The backends that run on `device` here (the cuda backend runs on a CPU only under TRITON_INTERPRET=1,
    Triton's interpreter: for tests)."""
    out = []
    if device.type == "cpu":
        from conveyor.core.backends.cpu.kernels import cpu_kernels

        if cpu_kernels() is not None:
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


def select_backend(model: torch.nn.Module, name: str = "auto", fused_forward: bool = True,
                   max_num_seqs: int = 64, max_num_batched_tokens: int = 2048) -> Backend:
    """The backend `name` for `model` (on its device); ValueError naming the option where it cannot run."""
    if name not in BACKENDS:
        raise ValueError(f"--backend: {name!r} is not one of {', '.join(BACKENDS)}")
    device = next(model.parameters()).device
    runs = available_backends(device)
    if name == "auto":
        name = {"cpu": "cpu" if "cpu" in runs else "torch", "cuda": "cuda" if "cuda" in runs else "torch"}.get(
            device.type, "torch")
    elif name not in runs:
        raise ValueError(f"--backend {name}: does not run on {device} here ({_why_not(name, device)}); "
                         f"backends that do: {', '.join(runs)}")
    if name == "cpu":
        from conveyor.core.backends.cpu.backend import CpuBackend

        return CpuBackend(model, fused_forward=fused_forward)
    if name == "cuda":
        from conveyor.core.backends.cuda.backend import CudaBackend

        return CudaBackend(model, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    from conveyor.core.backends.sdpa import TorchBackend

    return TorchBackend(model)


def _why_not(name: str, device: torch.device) -> str:
    if name == "cpu":
        if device.type != "cpu":
            return "it runs on the CPU only"
        from conveyor.core.backends.cpu.kernels import kernels_missing_reason

        return f"conveyor's C++ kernels are unavailable: {kernels_missing_reason()}"
    if name == "cuda":
        return "it needs a CUDA device and Triton" if device.type == "cpu" else "Triton does not import"
    return "?"
