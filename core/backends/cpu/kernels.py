"""(torch) Builds and loads conveyor's C++ CPU kernels once, cached on disk.

One extension module: paged attention (`paged_attention.cpp`), the fused element-wise ops of
the decoder families' fused forward (`fused_ops.cpp`, `decoder.cpp`), the sampler's greedy argmax and temperature sampling
(`sampling.cpp`), and the linears: float multiply-adds over weight panels (`panel_gemm.cpp`), bf16
pair products (`pair_gemm.cpp`, compiled in where the compiler targets AVX512-BF16) and bf16 on AMX
tiles (`amx_gemm.cpp`, where it targets AMX). The build needs a C++
compiler and ninja; where either is missing, `cpu_kernels()` returns None and the engine takes the torch
backend (`core/backends/sdpa.py`: correct, slower, not batch-invariant). CPUs without AVX-512 take it too
(`kernels_pay_off`).
The build is tuned for the CPU it runs on (`-march=native`), so it is cached per CPU, torch version
and source (`kernels/py311-<build tag>`): a cache directory shared between machines (a home
directory on a cluster) never hands one CPU a build with another's instructions, which would die of
SIGILL. It is built once under a lock that a killed builder cannot leave behind (`cache_build.py`),
and later runs import the cached library directly.
Set CONVEYOR_NO_KERNELS=1 to force the torch backend, CONVEYOR_KERNEL_ARCH to build for a named -march
instead of this CPU, CONVEYOR_NO_AMX=1 to run the routes of CPUs without AMX tiles on one that has them. The kernel sources include only the ATen headers
they use, not torch/extension.h: the first build takes ~35 s on 2 cores instead of ~80.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import sys
import warnings
from pathlib import Path

from conveyor.core.cache_build import cache_dir, cached_build

_NAME = "conveyor_cpu_kernels"
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("paged_attention.cpp", "encoder_attention.cpp", "encoder_ops.cpp", "fused_ops.cpp", "sampling.cpp", "panel_gemm.cpp", "pair_gemm.cpp", "amx_gemm.cpp", "peak.cpp",
            "decoder.cpp", "bindings.cpp")
_module = None
_tried = False
_why_not: str | None = None  # why cpu_kernels() is None, once it is


def cpu_kernels():
    """The compiled module (paged_attention, kv_pairs, rms_norm, rope_store, store_kv, silu_mul, argmax_rows,
    sample_rows, panel_gemm, pair_gemm, pair_gemm_available, amx_gemm, amx_gemm_available), or None."""
    global _module, _tried, _why_not
    if _tried:
        return _module
    _tried = True
    if os.environ.get("CONVEYOR_NO_KERNELS") == "1":
        _why_not = "CONVEYOR_NO_KERNELS=1 is set"
        return None
    if kernel_arch() == "native" and not kernels_pay_off(cpu_identity()[1]):
        _why_not = "this CPU has no AVX-512, where they would be slower than torch"
        return None
    try:
        import torch  # noqa: F401 - the module links against torch's libraries

        folder = cache_dir() / "kernels" / f"py{sys.version_info.major}{sys.version_info.minor}-{build_tag()}"
        built: list = []

        def build(scratch: Path) -> Path:
            from torch.utils.cpp_extension import load

            sys.stderr.write(f"conveyor: compiling the C++ CPU kernels once (about 30 s on 2 cores; cached in {folder})\n")
            built.append(load(name=_NAME, sources=[str(_CSRC / s) for s in _SOURCES], build_directory=str(scratch),
                              extra_cflags=_cflags(), extra_ldflags=["-fopenmp"], verbose=False))
            return scratch / f"{_NAME}.so"

        library = cached_build(folder, f"{_NAME}.so", build)
        _module = built[0] if built else _import_extension(library)
        if not _module.wide_vectors():  # a named -march without AVX-512: torch is faster there
            _module = None
            _why_not = f"CONVEYOR_KERNEL_ARCH={kernel_arch()} has no AVX-512"
    except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
        _why_not = f"their build failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        warnings.warn(f"conveyor: C++ CPU kernels unavailable ({_why_not}); using the slower torch fallback",
                      stacklevel=2)
        _module = None
    return _module


def kernels_missing_reason() -> str | None:
    """Why `cpu_kernels()` is None here (None while it is not)."""
    return None if cpu_kernels() is not None else _why_not


def native_bf16() -> bool:
    """Whether bfloat16 runs on bf16 instructions here: conveyor's kernels are built and use AMX tiles or
    AVX512-BF16 pair products (elsewhere bf16 is widened to float at every step: no faster than float32)."""
    ops = cpu_kernels()
    return ops is not None and bool(ops.amx_gemm_available() or ops.pair_gemm_available())


def kernels_pay_off(flags: list[str]) -> bool:
    """Whether the kernels beat torch on a CPU with these /proc/cpuinfo flags: only with AVX-512F.
    They are written for 16-float vectors (`vec16.h`); where registers are narrower (AVX2, Arm's
    NEON) the compiler moves every vector through the stack, and an AVX2 build measured 4-40x
    slower than torch per op (its panel matmul 11x at 1 row) and 4.1x slower on a whole run than
    the torch fallback. Such CPUs run the fallback, and skip the build."""
    return platform.machine().lower() in ("x86_64", "amd64") and "avx512f" in flags


def _import_extension(library: Path):
    spec = importlib.util.spec_from_file_location(_NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_tag() -> str:
    """What a build depends on, hashed: the CPU (`cpu_tag`), torch's version (its ABI), the compiler
    flags and every file of `csrc/` (headers included). A change to any of them builds afresh."""
    import torch

    h = hashlib.sha256(f"{cpu_tag()}|{torch.__version__}|{' '.join(_cflags())}".encode())
    for path in sorted(_CSRC.iterdir()):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _proc_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def cpu_identity(cpuinfo: str | None = None) -> tuple[str, list[str]]:
    """(model name, sorted instruction-set flags) of the first processor in /proc/cpuinfo (or the
    text given); platform.processor() and no flags where there is none."""
    if cpuinfo is None:
        cpuinfo = _proc_cpuinfo()
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


def kernel_arch() -> str:
    """The -march the kernels are built for: "native" (this CPU), or CONVEYOR_KERNEL_ARCH's (a CPU
    family shared by a cluster's nodes, or an older one's instructions on a newer CPU to check its
    code paths)."""
    return os.environ.get("CONVEYOR_KERNEL_ARCH") or "native"


def _cflags() -> list[str]:
    flags = ["-O3", f"-march={kernel_arch()}", "-fopenmp"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-mprefer-vector-width=512")  # full-width AVX-512 where the CPU has it
    return flags

