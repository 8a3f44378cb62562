"""(torch) The exact linears of the CPU kernels: a weight packed once in the layout of the kernel that multiplies by
it (32-column panels, bf16 pairs or AMX tiles), chosen from the dtype and the CPU (`Linear`)."""

from __future__ import annotations

import torch


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [ceil(N / 32), K, 32]: 32-column panels of W.T, each contiguous (zero-padded)."""
    n, k = weight.shape
    panels = -(-n // 32)
    wt = torch.zeros(k, panels * 32, dtype=weight.dtype)
    wt[:, :n] = weight.t()
    return wt.view(k, panels, 32).permute(1, 0, 2).contiguous()


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (K even) -> [ceil(N / 32), K / 2, 32, 2]: for each panel of 32 output columns, for each pair
    (k, k + 1), the columns' two weights side by side: the operand layout of AVX512-BF16's VDPBF16PS."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"pack_pairs: K={k} is odd")
    return pack_panels(weight).view(-1, k // 2, 2, 32).transpose(2, 3).contiguous()


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (K a multiple of 32) -> [ceil(N / 32), K / 32, 2, 16, 16, 2]: for each panel of 32 output
    columns, for each 32-wide slice of K, two 16 x 16 tiles of (k, k + 1) pairs: the layout of the B
    operand of AMX's TDPBF16PS, one contiguous run per panel (zero-padded columns)."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"pack_amx: K={k} is not a multiple of 32")
    padded = -(-n // 32) * 32
    w = weight if padded == n else torch.cat([weight, weight.new_zeros(padded - n, k)])
    return w.reshape(padded // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


class Linear:
    """y = x @ W.T (+ b) by one kernel for every row count, chosen once from the dtype and the CPU.

    One kernel per layer, whatever M is, is the exactness contract for linears (see
    `conveyor.core.exactness`): each kernel computes an output as one fixed chain over k, so a row's
    result does not depend on the rows around it.
    - float32 (and bf16/fp16 where neither below exists): `panel_gemm`, float multiply-adds over W in
      32-column panels; a read of the weights at decode sizes, at or above oneDNN's rate on prompt steps.
    - bfloat16 on CPUs with AMX tiles: `amx_gemm` (`amx_gemm.cpp`).
    - bfloat16 on CPUs with AVX512-BF16 but no tiles: `pair_gemm`, bf16 pair products.
    """

    PANELS, PAIRS, TILES = 0, 1, 2  # the routes, as decoder.h numbers them

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features = weight.shape[0]
        k = weight.shape[1]
        if weight.dtype == torch.bfloat16 and k % 32 == 0 and ops.amx_gemm_available():
            self.packed, self.gemm, self.route = pack_amx(weight), ops.amx_gemm, self.TILES
        elif weight.dtype == torch.bfloat16 and k % 2 == 0 and ops.pair_gemm_available():
            self.packed, self.gemm, self.route = pack_pairs(weight), ops.pair_gemm, self.PAIRS
        else:
            self.packed, self.gemm, self.route = pack_panels(weight), ops.panel_gemm, self.PANELS

    GELU = 1  # `act`: the output's GELU (erf form), applied as each block is stored (the bits of gelu after it)

    def __call__(self, x: torch.Tensor, act: int = 0) -> torch.Tensor:
        return self.gemm(x, self.packed, self.out_features, self.bias, act)

    def native(self, ops):
        """The same linear as the C++ decoder holds it (`ops.Linear`)."""
        return ops.Linear(self.packed, self.out_features, self.bias, self.route)
