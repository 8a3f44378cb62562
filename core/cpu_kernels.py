"""(torch) Builds and loads conveyor's C++ CPU kernels (paged attention) once, cached on disk.

The build needs a C++ compiler and ninja; where either is missing, `paged_attention_op()` returns
None and the attention falls back to gathering K/V for torch's SDPA (correct, slower).
Set CONVEYOR_NO_KERNELS=1 to force that fallback.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

_op = None
_tried = False


def paged_attention_op():
    """The compiled `paged_attention(q, cache, tables, token_req, token_ctx, block_size, scale)`, or None."""
    global _op, _tried
    if _tried:
        return _op
    _tried = True
    if os.environ.get("CONVEYOR_NO_KERNELS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        from conveyor.core.model_loader import cache_dir

        build_dir = cache_dir() / "kernels" / f"py{sys.version_info.major}{sys.version_info.minor}"
        build_dir.mkdir(parents=True, exist_ok=True)
        source = Path(__file__).parent / "csrc" / "paged_attention.cpp"
        module = load(name="conveyor_paged_attention", sources=[str(source)], build_directory=str(build_dir),
                      extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                      verbose=False)
        _op = module.paged_attention
    except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
        warnings.warn(f"conveyor: C++ paged attention unavailable ({str(e).splitlines()[0] if str(e) else e}); "
                      "using the slower torch fallback", stacklevel=2)
        _op = None
    return _op
