"""Shared setup for every test: where no CUDA device exists, Triton runs its kernels in its interpreter on
the CPU (TRITON_INTERPRET=1, read when a kernel is defined), so the cuda backend's kernels are tested here
too. Set before any test module imports Triton."""

from __future__ import annotations

import os
import shutil


def _has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidiactl")


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
