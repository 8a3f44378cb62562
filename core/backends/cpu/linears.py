"""(torch) The exact linears of the CPU kernels: a weight packed once in the layout of the kernel that multiplies by
it (32-column panels, bf16 pairs or AMX tiles; quantized values with their groups' scales, or int8 in fours of k),
chosen from the weight's form, the dtype and the CPU (`Linear`)."""

from __future__ import annotations

import functools

import torch

from conveyor.core.quant.weights import QuantWeight


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


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[N, G] -> [ceil(N / 32), G, 32] float32, each panel's columns side by side (zero-padded)."""
    n, g = t.shape
    padded = torch.zeros(-(-n // 32) * 32, g, dtype=torch.float32)
    padded[:n] = t
    return padded.view(-1, 32, g).transpose(1, 2).contiguous()


def pack_wq(q: QuantWeight) -> dict:
    """A weight-only QuantWeight in `wq_gemm`'s layout: values [ceil(N / 32), K, 32] bytes (8 bits) or
    [ceil(N / 32), K, 16] (4 bits: column j in the low nibble, j + 16 in the high one), scales, zeros and offsets
    [ceil(N / 32), groups, 32] (padded columns: value 0, scale 0, zero 0: weight 0)."""
    values = pack_panels(q.values)  # [P, K, 32] uint8
    if q.bits == 4:
        values = (values[..., :16] | (values[..., 16:] << 4)).contiguous()
    return {"q": values, "scales": _panels(q.scales), "zeros": _panels(q.zeros),
            "offsets": None if q.offsets is None else _panels(q.offsets)}


def pack_i8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 W [N, K] -> ([ceil(N / 32), ceil(K / 4), 32, 4] int8: for each panel of 32 columns, for each four of k,
    each column's four weights side by side (zero-padded), [ceil(N / 32) * 32] int32 sums of each column's weights)."""
    n, k = values.shape
    k4 = -(-k // 4)
    padded = torch.zeros(-(-n // 32) * 32, k4 * 4, dtype=torch.int8)
    padded[:n, :k] = values
    packed = padded.view(-1, 32, k4, 4).permute(0, 2, 1, 3).contiguous()
    return packed, padded.to(torch.int32).sum(dim=1, dtype=torch.int32)


@functools.lru_cache(maxsize=None)
def vnni_agrees(ops) -> bool:
    """Whether i8_gemm's AVX512-VNNI route is built in and gives the int16 route's bits on a test problem here (the
    integer sums are exact, so the two must agree; where they do not, the int16 route runs)."""
    if not ops.i8_vnni_built():
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-128, 128, (70, 100), generator=g, dtype=torch.int8)
    packed, wsum = pack_i8(w)
    scale = torch.rand(96, generator=g) + 0.5
    x = torch.randn(23, 100, generator=g)
    return all(torch.equal(ops.i8_gemm(x, packed, wsum, scale, 70, None, s, True),
                           ops.i8_gemm(x, packed, wsum, scale, 70, None, s, False)) for s in (0.0, 0.03))


class Linear:
    """y = x @ W.T (+ b) by one kernel for every row count, chosen once from the dtype and the CPU.

    One kernel per layer, whatever M is, is the exactness contract for linears (see
    `conveyor.core.exactness`): each kernel computes an output as one fixed chain over k, so a row's
    result does not depend on the rows around it.
    - float32 (and bf16/fp16 where neither below exists): `panel_gemm`, float multiply-adds over W in
      32-column panels; a read of the weights at decode sizes, at or above oneDNN's rate on prompt steps.
    - bfloat16 on CPUs with AMX tiles: `amx_gemm` (`amx_gemm.cpp`).
    - bfloat16 on CPUs with AVX512-BF16 but no tiles: `pair_gemm`, bf16 pair products.
    - quantized weights (a `QuantWeight`): `wq_gemm` for weight-only formats (de-quantized in the panel, then the
      float multiply-adds of `panel_gemm`), `i8_gemm` for W8A8 (int8 products, int32 sums), in every dtype.
    """

    PANELS, PAIRS, TILES, QUANT, INT8 = 0, 1, 2, 3, 4  # the routes, as decoder.h numbers them

    def __init__(self, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None, ops) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features = weight.shape[0]
        self.quant: dict = {}
        if isinstance(weight, QuantWeight):
            self._pack_quant(weight, ops)
            self._native = self.native(ops)
            return
        k = weight.shape[1]
        if weight.dtype == torch.bfloat16 and k % 32 == 0 and ops.amx_gemm_available():
            self.packed, self.gemm, self.route = pack_amx(weight), ops.amx_gemm, self.TILES
        elif weight.dtype == torch.bfloat16 and k % 2 == 0 and ops.pair_gemm_available():
            self.packed, self.gemm, self.route = pack_pairs(weight), ops.pair_gemm, self.PAIRS
        else:
            self.packed, self.gemm, self.route = pack_panels(weight), ops.panel_gemm, self.PANELS

    def _pack_quant(self, q: QuantWeight, ops) -> None:
        self.perm = q.perm
        if q.kind == "w8a8":
            self.packed, wsum = pack_i8(q.values)
            scales = torch.zeros(wsum.numel(), dtype=torch.float32)
            scales[:q.shape[0]] = q.scales
            self.route = self.INT8
            self.quant = {"wsum": wsum, "scales": scales, "x_scale": q.x_scale, "vnni": vnni_agrees(ops)}
        else:
            packed = pack_wq(q)
            self.packed, self.route = packed.pop("q"), self.QUANT
            self.quant = {**packed, "group": q.group, "bits": q.bits}

    GELU = 1  # `act`: the output's GELU (erf form), applied as each block is stored (the bits of gelu after it)

    def __call__(self, x: torch.Tensor, act: int = 0) -> torch.Tensor:
        if self.route < self.QUANT:
            return self.gemm(x, self.packed, self.out_features, self.bias, act)
        if act:
            raise ValueError("a quantized linear has no fused activation")
        return self._native(x)

    def native(self, ops):
        """The same linear as the C++ decoder holds it (`ops.Linear`)."""
        linear = ops.Linear(self.packed, self.out_features, self.bias, self.route)
        q = self.quant
        if self.route == self.QUANT:
            linear.scales, linear.zeros, linear.offsets = q["scales"], q["zeros"], q["offsets"]
            linear.group, linear.bits = q["group"], q["bits"]
        elif self.route == self.INT8:
            linear.scales, linear.wsum, linear.x_scale, linear.vnni = q["scales"], q["wsum"], q["x_scale"], q["vnni"]
        if self.route >= self.QUANT and self.perm is not None:
            linear.perm = self.perm
        return linear
