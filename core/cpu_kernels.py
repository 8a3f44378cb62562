"""(torch) Builds and loads conveyor's C++ CPU kernels once, cached on disk.

One extension module: paged attention (`paged_attention.cpp`), the fused element-wise ops of
the Llama-family forward (`fused_ops.cpp`), the sampler's greedy argmax and temperature sampling
(`sampling.cpp`), the panel matmul of decode steps (`small_gemm.cpp`) and the bf16 matmul on AMX
tiles (`amx_gemm.cpp`, compiled in only where the compiler targets AMX). The build needs a C++
compiler and ninja; where either is missing, `cpu_kernels()` returns None: attention falls back to
gathering K/V for torch's SDPA, the model runs its eager transformers forward and the sampler its
torch ops (correct, slower).
The build is tuned for the CPU it runs on (`-march=native`), so it is cached per CPU
(`kernels/py311-<cpu tag>`): a cache directory shared between machines (a home directory on a
cluster) never hands one CPU a build with another's instructions, which would die of SIGILL.
Set CONVEYOR_NO_KERNELS=1 to force that fallback. The kernel sources include only the ATen headers
they use, not torch/extension.h: the first build takes ~35 s on 2 cores instead of ~80.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

_SOURCES = ("paged_attention.cpp", "fused_ops.cpp", "sampling.cpp", "small_gemm.cpp", "amx_gemm.cpp", "bindings.cpp")
_module = None
_tried = False


def cpu_kernels():
    """The compiled module (paged_attention, rms_norm, rope_store, silu_mul, argmax_rows, sample_rows,
    small_gemm, amx_gemm, amx_gemm_available), or None."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("CONVEYOR_NO_KERNELS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        from conveyor.core.model_loader import cache_dir

        build_dir = cache_dir() / "kernels" / f"py{sys.version_info.major}{sys.version_info.minor}-{cpu_tag()}"
        build_dir.mkdir(parents=True, exist_ok=True)
        csrc = Path(__file__).parent / "csrc"
        if not (build_dir / "conveyor_cpu_kernels.so").exists():
            sys.stderr.write(f"conveyor: compiling the C++ CPU kernels once (about 30 s on 2 cores; cached in {build_dir})\n")
        _module = load(name="conveyor_cpu_kernels", sources=[str(csrc / s) for s in _SOURCES],
                       build_directory=str(build_dir), extra_cflags=_cflags(),
                       extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
        warnings.warn(f"conveyor: C++ CPU kernels unavailable ({str(e).splitlines()[0] if str(e) else e}); "
                      "using the slower torch fallback", stacklevel=2)
        _module = None
    return _module


def cpu_identity(cpuinfo: str | None = None) -> tuple[str, list[str]]:
    """(model name, sorted instruction-set flags) of the first processor in /proc/cpuinfo (or the
    text given); platform.processor() and no flags where there is none."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # first processor's values
    model = fields.get("model name") or platform.processor() or platform.machine()
    return model, sorted((fields.get("flags") or fields.get("Features") or "").split())  # x86 / arm64


def cpu_tag(cpuinfo: str | None = None) -> str:
    """A short hash of what `-march=native` compiles for: the architecture, the CPU's model name and
    its instruction-set flags."""
    model, flags = cpu_identity(cpuinfo)
    return hashlib.sha256(f"{platform.machine()}|{model}|{' '.join(flags)}".encode()).hexdigest()[:12]


def _cflags() -> list[str]:
    flags = ["-O3", "-march=native", "-fopenmp"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-mprefer-vector-width=512")  # full-width AVX-512 where the CPU has it
    return flags

