"""(torch) Builds and loads conveyor's C++ CPU kernels once, cached on disk.

One extension module: paged attention (`paged_attention.cpp`), the fused element-wise ops of
the decoder families' fused forward (`fused_ops.cpp`, `decoder.cpp`), the sampler's greedy argmax and temperature sampling
(`sampling.cpp`), and the linears: float multiply-adds over weight panels (`panel_gemm.cpp`), bf16
pair products (`pair_gemm.cpp`, compiled in where the compiler targets AVX512-BF16) and bf16 on AMX
tiles (`amx_gemm.cpp`, where it targets AMX). The build needs a C++
compiler and ninja; where either is missing, `cpu_kernels()` returns None and the engine takes the torch
backend (`core/backends/sdpa.py`: correct, slower, not batch-invariant).

Two routes (`cpu_route`): "native", built for this CPU (`-march=native`), where it has AVX-512; and "avx2",
built for AVX2 + FMA (`-march=x86-64-v3`), where it has those but no AVX-512, or where CONVEYOR_CPU_ISA=avx2
(`--cpu-isa avx2`) asks for it on an AVX-512 CPU. Both are exact (one order per output, whatever the batch);
their bits differ from each other (`cpu_isa` names the one that ran). CPUs with neither take the torch backend.
A build is cached per CPU, route, torch version and source (`kernels/py311-<build tag>`): a cache directory
shared between machines (a home directory on a cluster) never hands one CPU a build with another's
instructions, which would die of SIGILL. It is built once under a lock that a killed builder cannot leave
behind (`cache_build.py`), and later runs import the cached library directly.
Set CONVEYOR_NO_KERNELS=1 to force the torch backend, CONVEYOR_KERNEL_ARCH to build the native route for a named
-march instead of this CPU, CONVEYOR_NO_AMX=1 to run the routes of CPUs without AMX tiles on one that has them. The
kernel sources include only the ATen headers they use, not torch/extension.h, and compile as two translation units
side by side (`_UNITS`): the first build takes 20-60 s on 2 cores (by CPU), on a thread beside the model's conversion and
load (`build_in_background`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

from conveyor.core.cache_build import cache_dir, cached_build

_NAME = "conveyor_cpu_kernels"
_CSRC = Path(__file__).parent / "csrc"
# The build's two translation units, compiled side by side: each the `csrc/` files listed, included into one unit,
# so that the ATen and pybind11 headers (2-4 and 6-9 s a unit on 2 cores, most of a small file's time) are parsed once
# a unit instead of once a file; the two take about the same time. Only the second (pybind11, the decoder's torch ops)
# includes more of ATen than `ATen/core/Tensor.h`: outputs are made with `new_empty`, not `at::empty`, whose header
# alone cost 2 s more. Each file keeps its internals in a namespace named after it, so that the files of a unit cannot
# take each other's helpers.
_UNITS = (("paged_attention.cpp", "fused_ops.cpp", "sampling.cpp", "panel_gemm.cpp", "pair_gemm.cpp"),
          ("bindings.cpp", "decoder.cpp", "amx_gemm.cpp", "encoder_attention.cpp", "encoder_ops.cpp", "peak.cpp",
           "quant_gemm.cpp"))
_module = None
_tried = False
_why_not: str | None = None  # why cpu_kernels() is None, once it is
_loading = threading.Lock()  # held while the module builds or imports (build_in_background's thread, or a caller)
_build_notes = True  # the build's two lines on stderr (`quiet_build_notes` turns them off)


def cpu_kernels():
    """The compiled module of this process's route (paged_attention, kv_pairs, rms_norm, rope_store, store_kv,
    silu_mul, argmax_rows, sample_rows, panel_gemm, pair_gemm, pair_gemm_available, amx_gemm, amx_gemm_available,
    build_isa, ...), or None. Waits for a build that `build_in_background` started."""
    with _loading:
        return _load()


def build_in_background() -> None:
    """Start building (or importing) the kernels on a thread of their own, so that a first run's build overlaps
    the model's conversion and load; `cpu_kernels()` waits for it. Nothing where they loaded already, or where
    no route runs here.

    Python's imports are not safe against two threads importing the same module at once (a run once lost its
    kernels to "No module named 'platformdirs._paths'" while the main thread imported platformdirs too): the
    modules the thread imports are imported here first (torch's cpp_extension only where the library is to be
    built), and an ImportError on the thread is not taken as the kernels' failure: `cpu_kernels()` then loads them
    again on its caller's thread."""
    route = cpu_route()[0]
    if _tried or os.environ.get("CONVEYOR_NO_KERNELS") == "1" or route is None:
        return
    import torch  # noqa: F401 - the library links against torch's

    folder = _build_folder()
    if not (folder / f"{module_name(route)}.so").exists():
        import torch.utils.cpp_extension  # noqa: F401 - the build's
    threading.Thread(target=_load_in_background, args=(folder,), name="conveyor-kernels", daemon=True).start()


def _load_in_background(folder: Path) -> None:
    with _loading:
        _load(folder)


def kernels_expected() -> bool:
    """Whether the kernels run here, without waiting for a build: the answer where they loaded, else whether this
    CPU has a route and their build is cached or a C++ compiler and ninja are there to make it. (A build can still
    fail; the run then says so and takes the torch backend.)"""
    if _settled():
        return _module is not None
    if os.environ.get("CONVEYOR_NO_KERNELS") == "1" or cpu_route()[0] is None:
        return False
    from torch.utils.cpp_extension import is_ninja_available

    return bool(shutil.which(os.environ.get("CXX") or "c++")) and is_ninja_available()


def quiet_build_notes() -> None:
    """No notes on stderr while the kernels build (`conveyor run --quiet`: a cron job's log gets warnings, errors and
    the closing line only)."""
    global _build_notes
    _build_notes = False


def _settled() -> bool:
    """Whether the kernels have loaded, or failed to, for good (no build running)."""
    return _tried and not _loading.locked()


def _load(background_folder: Path | None = None):
    """The module, loaded (or built) once; `background_folder`: the build folder `build_in_background` found, on its
    thread."""
    global _module, _tried, _why_not
    if _tried:
        return _module
    _tried = True
    if os.environ.get("CONVEYOR_NO_KERNELS") == "1":
        _why_not = "CONVEYOR_NO_KERNELS=1 is set"
        return None
    route, _why_not = cpu_route()
    if route is None:
        return None
    try:
        import torch  # noqa: F401 - the module links against torch's libraries

        name = module_name(route)
        folder = background_folder or _build_folder()
        built: list = []

        def build(scratch: Path) -> Path:
            from torch.utils.cpp_extension import load

            if _build_notes:
                sys.stderr.write(f"conveyor: compiling the C++ CPU kernels once, beside the model's load (20-60 s "
                                 f"on 2 cores; cached in {folder})\n")
            start = time.monotonic()
            built.append(load(name=name, sources=unit_sources(scratch), build_directory=str(scratch),
                              extra_cflags=_cflags(), extra_ldflags=["-fopenmp"], verbose=False))
            if _build_notes:
                sys.stderr.write(f"conveyor: compiled the C++ CPU kernels in {time.monotonic() - start:.0f} s\n")
            return scratch / f"{name}.so"

        library = cached_build(folder, f"{name}.so", build)
        _module = built[0] if built else _import_extension(name, library)
        if _module.build_isa() == "generic":  # a named -march with neither AVX-512 nor AVX2: torch is faster there
            _module = None
            _why_not = f"CONVEYOR_KERNEL_ARCH={kernel_arch()} has neither AVX-512 nor AVX2 + FMA"
    except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
        if background_folder is not None and isinstance(e, ImportError):  # perhaps a race with the main thread's imports: retried there
            _tried = False
            return None
        _why_not = f"their build failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        warnings.warn(f"conveyor: C++ CPU kernels unavailable ({_why_not}); using the slower torch fallback",
                      stacklevel=2)
        _module = None
    return _module


def unit_sources(folder: Path) -> list[str]:
    """Write the build's translation units (`_UNITS`) into `folder`: their paths, to compile."""
    paths = []
    for i, files in enumerate(_UNITS):
        path = folder / f"unit_{i}.cpp"
        path.write_text("".join(f'#include "{_CSRC / name}"\n' for name in files))
        paths.append(str(path))
    return paths


def module_name(route: str | None = None) -> str:
    """The extension module's name (and its library's, `.so` added) on `route` (this process's by default): each
    route's build is a module of its own."""
    route = route or cpu_route()[0]
    return _NAME if route in (None, "native") else f"{_NAME}_{route}"


def kernels_missing_reason() -> str | None:
    """Why `cpu_kernels()` is None here (None while it is not)."""
    return None if cpu_kernels() is not None else _why_not


def native_bf16(wait: bool = True) -> bool:
    """Whether bfloat16 runs on bf16 instructions here: conveyor's kernels are built and use AMX tiles or
    AVX512-BF16 pair products (elsewhere bf16 is widened to float at every step: no faster than float32).
    `wait=False`: while a build runs, the answer the CPU's flags give (the native route, with AVX512-BF16 or AMX)."""
    if not wait and not _settled() and not os.environ.get("CONVEYOR_KERNEL_ARCH"):
        flags = cpu_identity()[1]
        amx = {"amx_tile", "amx_bf16"} <= set(flags) and os.environ.get("CONVEYOR_NO_AMX") != "1"
        return kernels_expected() and cpu_route()[0] == "native" and ("avx512_bf16" in flags or amx)
    ops = cpu_kernels()
    return ops is not None and bool(ops.amx_gemm_available() or ops.pair_gemm_available())


CPU_ISA_CHOICES = ("auto", "avx2")  # CONVEYOR_CPU_ISA / --cpu-isa


def requested_isa() -> str:
    """CONVEYOR_CPU_ISA as given ("auto" where unset); the CLI refuses a value outside CPU_ISA_CHOICES before
    anything loads (`check_cpu_isa`)."""
    return os.environ.get("CONVEYOR_CPU_ISA", "").strip().lower() or "auto"


def check_cpu_isa() -> str | None:
    """What is wrong with CONVEYOR_CPU_ISA here (None where nothing is): a value outside CPU_ISA_CHOICES, avx2 on a
    CPU without AVX2 + FMA, or avx2 beside CONVEYOR_KERNEL_ARCH (both would name the kernels' instructions)."""
    isa = requested_isa()
    if isa not in CPU_ISA_CHOICES:
        return f"CONVEYOR_CPU_ISA={isa} is not one of {', '.join(CPU_ISA_CHOICES)}"
    if isa == "avx2":
        if not route_for(cpu_identity()[1]):
            return "--cpu-isa avx2 (CONVEYOR_CPU_ISA=avx2) needs AVX2 and FMA, which this CPU lacks"
        if os.environ.get("CONVEYOR_KERNEL_ARCH"):
            return ("--cpu-isa avx2 (CONVEYOR_CPU_ISA=avx2) and CONVEYOR_KERNEL_ARCH both name the kernels' "
                    "instructions; unset one")
    return None


def select_isa(isa: str) -> None:
    """Make `isa` ("auto" or "avx2", an engine config's cpu_isa) this process's route, before the kernels load;
    ConfigError naming cpu_isa where it cannot run here, or where the kernels already loaded on another route
    (one process runs one). "auto" keeps CONVEYOR_CPU_ISA's choice, checked."""
    from conveyor.core.errors import ConfigError

    if isa != "auto":
        if _tried and cpu_route()[0] != isa:  # (an AVX2-only CPU's auto is the avx2 route)
            raise ConfigError("cpu_isa", f"cpu_isa {isa}: this process already runs the kernels' {cpu_route()[0]} "
                              f"route; run --cpu-isa {isa} in a process of its own", isa)
        os.environ["CONVEYOR_CPU_ISA"] = isa
    problem = check_cpu_isa()
    if problem is not None:
        raise ConfigError("cpu_isa", problem, None if isa == "auto" else isa)


def route_for(flags: list[str]) -> str | None:
    """The kernels' route on a CPU with these /proc/cpuinfo flags: "native" with AVX-512F, "avx2" with AVX2 and
    FMA (each 16-float vector of `vec16.h` as two 8-float registers), None elsewhere (Arm, older x86: the torch
    backend is the faster there)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if "avx512f" in flags:
        return "native"
    return "avx2" if "avx2" in flags and "fma" in flags else None


def cpu_route() -> tuple[str | None, str | None]:
    """(the route this process builds and runs: "native" or "avx2", why none where None). A named -march
    (CONVEYOR_KERNEL_ARCH) takes the native route whatever this CPU has."""
    problem = check_cpu_isa()
    if problem is not None:
        return None, problem
    if requested_isa() == "avx2":
        return "avx2", None
    if os.environ.get("CONVEYOR_KERNEL_ARCH"):
        return "native", None
    route = route_for(cpu_identity()[1])
    why = "this CPU has neither AVX-512 nor AVX2 + FMA, where they would be slower than torch"
    return route, None if route else why


def cpu_isa() -> str | None:
    """The instructions the kernels of this process run: "amx" (AMX tiles), "avx512bf16", "avx512", "avx2";
    None where the kernels do not run."""
    ops = cpu_kernels()
    if ops is None:
        return None
    return "amx" if ops.amx_gemm_available() else ops.build_isa()


def _build_folder() -> Path:
    """Where this process's build is cached (its CPU, route, torch and sources: `build_tag`)."""
    return cache_dir() / "kernels" / f"py{sys.version_info.major}{sys.version_info.minor}-{build_tag()}"


def _import_extension(name: str, library: Path):
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_tag() -> str:
    """What a build depends on, hashed: the CPU (`cpu_tag`), torch's version (its ABI), the compiler
    flags, the translation units (`_UNITS`: what a unit may inline) and every file of `csrc/` (headers included). A
    change to any of them builds afresh."""
    import torch

    h = hashlib.sha256(f"{cpu_tag()}|{torch.__version__}|{' '.join(_cflags())}|{_UNITS}".encode())
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
    """The -march the kernels are built for: "x86-64-v3" (AVX2 + FMA) on the avx2 route, else "native" (this
    CPU) or CONVEYOR_KERNEL_ARCH's (a CPU family shared by a cluster's nodes)."""
    if cpu_route()[0] == "avx2" and not os.environ.get("CONVEYOR_KERNEL_ARCH"):
        return "x86-64-v3"
    return os.environ.get("CONVEYOR_KERNEL_ARCH") or "native"


def _cflags() -> list[str]:
    arch = kernel_arch()
    flags = ["-O3", f"-march={arch}", "-fopenmp"]
    if arch == "x86-64-v3":
        flags.append("-mtune=native")  # AVX2's instructions, scheduled for this CPU
    elif platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-mprefer-vector-width=512")  # full-width AVX-512 where the CPU has it
    return flags

