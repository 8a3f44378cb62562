"""(torch) One form for every quantized linear conveyor computes, and the module that holds it.

`QuantWeight` is either weight-only ("wq": unsigned 4- or 8-bit values u with a float32 scale s, zero z and offset o
per group of k; the weight is ((u - z) * s) + o in float32, the multiply and the add rounded apart) or W8A8 ("w8a8":
int8 values with a float32 scale per output column, activations quantized to int8 per row). Every format's reader
(compressed-tensors, GPTQ, AWQ, GGUF blocks) writes its tensors into this form exactly: the de-quantized weight is
the format's own definition, computed in float32.

`QuantLinear.forward` is the plain torch definition of the format (de-quantize; for W8A8, quantize each row of x as
the kernels do, multiply in integers, scale): the forward of a model that runs its transformers forward, and the
reference the tests hold the CPU kernels to.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

W8A8_QMAX = 127.5  # a row's scale: its largest magnitude / this (compressed-tensors' symmetric int8 range)


@dataclass(frozen=True)
class QuantWeight:
    kind: str  # "wq" (weight-only) or "w8a8"
    values: torch.Tensor  # wq: uint8 [N, K] (each < 2 ** bits); w8a8: int8 [N, K]
    scales: torch.Tensor  # wq: float32 [N, groups]; w8a8: float32 [N]
    bits: int = 8
    group: int = 0  # wq: k per group (the last group may be short)
    zeros: torch.Tensor | None = None  # wq: float32 [N, groups]
    offsets: torch.Tensor | None = None  # wq: float32 [N, groups], or None: no offset
    perm: torch.Tensor | None = None  # x's columns in this order first (GPTQ act-order), long [K]
    x_scale: float = 0.0  # w8a8: the checkpoint's static activation scale, or 0: per row (dynamic)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> torch.Tensor:
        """The weights [N, K] in float32 as the format defines them (columns in `perm` order where it is set)."""
        if self.kind == "w8a8":
            return self.values.float() * self.scales[:, None]
        k = self.values.shape[1]
        idx = torch.arange(k) // self.group
        w = (self.values.float() - self.zeros[:, idx]) * self.scales[:, idx]
        return w + self.offsets[:, idx] if self.offsets is not None else w

    def dense(self) -> torch.Tensor:
        """The de-quantized weights over x's own column order (the act-order permutation undone)."""
        w = self.dequantize()
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def to(self, device: torch.device) -> QuantWeight:
        """The same weight with its tensors on `device`."""
        def move(t):
            return None if t is None else t.to(device)
        return replace(self, values=move(self.values), scales=move(self.scales), zeros=move(self.zeros),
                       offsets=move(self.offsets), perm=move(self.perm))

    def rows(self, start: int, end: int) -> QuantWeight:
        """Rows [start, end) of the weight (views)."""
        def cut(t):
            return None if t is None else t[start:end]
        return replace(self, values=cut(self.values), scales=cut(self.scales), zeros=cut(self.zeros),
                       offsets=cut(self.offsets))

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """The weights stacked along N (q/k/v, gate/up): they must share kind, bits, group, act-order and
        activation scale; ValueError naming the difference otherwise."""
        first = parts[0]
        for p in parts[1:]:
            for name in ("kind", "bits", "group", "x_scale"):
                if getattr(p, name) != getattr(first, name):
                    raise ValueError(f"linears fused into one matmul differ in {name} ({getattr(first, name)} and "
                                     f"{getattr(p, name)})")
            if (p.perm is None) != (first.perm is None) or (p.perm is not None and not torch.equal(p.perm, first.perm)):
                raise ValueError("linears fused into one matmul differ in their act-order")
            if (p.offsets is None) != (first.offsets is None):
                raise ValueError("linears fused into one matmul differ in having offsets")

        def stack(name):
            ts = [getattr(p, name) for p in parts]
            return None if ts[0] is None else torch.cat(ts)
        return replace(first, values=stack("values"), scales=stack("scales"), zeros=stack("zeros"),
                       offsets=stack("offsets"))


def quantize_rows(x: torch.Tensor, x_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(int values as float32 [M, K], scales [M, 1]) of x's rows, as the W8A8 kernel quantizes them: s = the row's
    largest magnitude / 127.5 (1 for a row of zeros), or the static scale; q = clamp(round half even(x / s),
    -128, 127), in float32."""
    xf = x.float()
    if x_scale > 0:
        s = torch.full((xf.shape[0], 1), x_scale, dtype=torch.float32)
    else:
        s = xf.abs().amax(dim=1, keepdim=True) / W8A8_QMAX
        s = torch.where(s == 0, torch.ones_like(s), s)
    return torch.clamp(torch.round(xf / s), -128, 127), s


class QuantLinear(torch.nn.Module):
    """A linear layer over a QuantWeight, computed as the format defines it (plain torch)."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.quant = weight
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else torch.nn.Parameter(bias.to(dtype), requires_grad=False)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quant
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if q.perm is not None:
            x2 = x2[:, q.perm]
        if q.kind == "w8a8":
            xq, s = quantize_rows(x2, q.x_scale)
            acc = (xq.double() @ q.values.double().t()).float()  # the int32 sums, exact
            y = (acc * s) * q.scales[None, :]
        else:
            y = x2.float() @ q.dequantize().t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        q = self.quant
        what = "W8A8 int8" if q.kind == "w8a8" else f"{q.bits}-bit weights, groups of {q.group}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {what}"
