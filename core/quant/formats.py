"""What a quantized checkpoint's `quantization_config` asks for, read from the config alone (pure Python): the
`Scheme` conveyor computes it by, or the reason it refuses it (`Refused`), before any weight is read.

Kept quantized on the CPU's fused forward (`weights.QuantWeight`):
- compressed-tensors `pack-quantized` and `int-quantized` weights of 4 or 8 bits (per channel, per group or per
  tensor; symmetric or with zero points; group act-order), without activation quantization (W4A16, W8A16);
- compressed-tensors `int-quantized` 8-bit weights per channel or tensor with int8 symmetric activations per token
  (dynamic) or per tensor (static): W8A8;
- GPTQ (4 or 8 bits, groups or per channel, symmetric or not, `desc_act`), AWQ GEMM (4 bits, zero points).
De-quantized as they load (float32, then the model's dtype; the dense routes compute them): compressed-tensors
`float-quantized` FP8 weights without FP8 activations. Everything else is refused, naming what.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


class Refused(Exception):
    """The config asks for something conveyor does not compute (the message says what)."""


@dataclass(frozen=True)
class ModuleScheme:
    kind: str  # "wq", "w8a8" or "fp8" (de-quantized as it loads)
    bits: int
    group: int | None  # k per group; None: one group per row (per channel or per tensor)
    symmetric: bool = True
    act_order: bool = False
    static_input: bool = False  # w8a8: the activations' scale is the checkpoint's (per tensor), not per row

    def describe(self) -> str:
        if self.kind == "w8a8":
            return f"W8A8 int8 ({'static' if self.static_input else 'per-token'} activation scales)"
        if self.kind == "fp8":
            return "FP8 weights"
        groups = f"groups of {self.group}" if self.group else "per channel"
        return f"W{self.bits}A16 int{self.bits}, {groups}{'' if self.symmetric else ', zero points'}" + \
            (", act-order" if self.act_order else "")


@dataclass(frozen=True)
class Scheme:
    method: str  # "compressed-tensors", "gptq", "awq"
    packing: str  # compressed-tensors' format, "gptq", "gptq_v2" or "awq_gemm"
    groups: tuple[tuple[tuple[str, ...], ModuleScheme], ...]  # (targets, scheme), in the config's order
    ignore: tuple[str, ...] = field(default_factory=tuple)

    def module(self, name: str) -> ModuleScheme | None:
        """The scheme of the linear module `name` (None: it is not quantized)."""
        if any(_matches(pattern, name) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(t, name) for t in targets):
                return scheme
        return None

    def describe(self) -> str:
        forms = sorted({s.describe() for _, s in self.groups})
        return f"{self.method} ({'; '.join(forms)})"

    @property
    def dequantized(self) -> bool:
        return all(s.kind == "fp8" for _, s in self.groups)


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def scheme_of(qc: dict) -> Scheme:
    """The Scheme of a `quantization_config`, or Refused naming what is not computed."""
    method = str(qc.get("quant_method", "unknown"))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    raise Refused(f"quantization method {method} is not supported")


def _compressed_tensors(qc: dict) -> Scheme:
    fmt = str(qc.get("format") or "dense")
    if qc.get("sparsity_config"):
        raise Refused("compressed-tensors sparsity (sparsity_config) is not supported")
    if qc.get("kv_cache_scheme"):
        raise Refused("a quantized KV cache (kv_cache_scheme) is not supported")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise Refused(f"compressed-tensors quantization_status {status!r} (only \"compressed\" checkpoints load)")
    groups = []
    for name, group in (qc.get("config_groups") or {}).items():
        group_fmt = str(group.get("format") or fmt)
        if group.get("output_activations"):
            raise Refused(f"config group {name}: quantized output activations are not supported")
        groups.append((tuple(group.get("targets") or ()), _ct_group(name, group_fmt, group.get("weights") or {},
                                                                     group.get("input_activations"))))
    if not groups:
        raise Refused("a compressed-tensors config without config_groups")
    return Scheme("compressed-tensors", fmt, tuple(groups), tuple(qc.get("ignore") or ()))


def _ct_group(name: str, fmt: str, w: dict, act: dict | None) -> ModuleScheme:
    where = f"config group {name}"
    bits, wtype, strategy = int(w.get("num_bits", 0)), w.get("type", "int"), w.get("strategy", "tensor")
    if w.get("dynamic"):
        raise Refused(f"{where}: dynamic weight quantization is not supported")
    if strategy not in ("channel", "group", "tensor"):
        raise Refused(f"{where}: weight strategy {strategy!r} is not supported (channel, group and tensor are)")
    group = int(w["group_size"]) if strategy == "group" and w.get("group_size") else None
    if strategy == "group" and not group:
        raise Refused(f"{where}: group strategy without a group_size")
    act_order = w.get("actorder") not in (None, False)
    if wtype == "float":
        if fmt != "float-quantized" or bits != 8:
            raise Refused(f"{where}: float weights of {bits} bits in format {fmt!r} (FP8 float-quantized is read)")
        if act is not None:
            raise Refused(f"{where}: FP8 activations ({act.get('type', 'float')} {act.get('num_bits')} bits) are "
                          "not computed; an FP8 weight-only checkpoint is")
        return ModuleScheme("fp8", 8, group)
    if wtype != "int":
        raise Refused(f"{where}: weights of type {wtype!r} are not supported")
    if fmt not in ("pack-quantized", "int-quantized"):
        raise Refused(f"{where}: compressed-tensors format {fmt!r} is not supported (pack-quantized, int-quantized "
                      "and float-quantized are)")
    if bits not in (4, 8) or (fmt == "int-quantized" and bits != 8):
        raise Refused(f"{where}: {bits}-bit integer weights in format {fmt!r} are not supported (4 and 8 bits are)")
    symmetric = bool(w.get("symmetric", True))
    if act is None:
        return ModuleScheme("wq", bits, group, symmetric, act_order)
    if act.get("type", "int") != "int" or int(act.get("num_bits", 0)) != 8:
        raise Refused(f"{where}: {act.get('type')} {act.get('num_bits')}-bit activations are not computed (int8 "
                      "ones are)")
    if not act.get("symmetric", True):
        raise Refused(f"{where}: asymmetric activation quantization is not supported")
    if fmt != "int-quantized" or bits != 8 or not symmetric or group or act_order:
        raise Refused(f"{where}: int8 activations with {bits}-bit weights "
                      f"{'in groups' if group else 'with zero points' if not symmetric else 'in ' + fmt} are not "
                      "computed (W8A8 takes symmetric int8 weights per channel or tensor)")
    act_strategy = act.get("strategy", "token")
    dynamic = bool(act.get("dynamic", False))
    if (act_strategy, dynamic) not in (("token", True), ("tensor", False)):
        raise Refused(f"{where}: activation strategy {act_strategy!r}{' (dynamic)' if dynamic else ' (static)'} is "
                      "not supported (per token dynamic, or per tensor static, is)")
    return ModuleScheme("w8a8", 8, None, True, False, static_input=not dynamic)


def _gptq(qc: dict) -> Scheme:
    bits = int(qc.get("bits", 0))
    if bits not in (4, 8):
        raise Refused(f"GPTQ with {bits} bits is not supported (4 and 8 are)")
    packing = str(qc.get("checkpoint_format") or qc.get("format") or "gptq")
    if packing not in ("gptq", "gptq_v2"):
        raise Refused(f"GPTQ checkpoint format {packing!r} is not supported (gptq and gptq_v2 are)")
    if qc.get("lm_head"):
        raise Refused("a GPTQ-quantized lm_head is not supported")
    if qc.get("dynamic"):
        raise Refused("GPTQ per-module overrides (dynamic) are not supported")
    group = int(qc.get("group_size", -1) or -1)
    scheme = ModuleScheme("wq", bits, group if group > 0 else None, bool(qc.get("sym", True)),
                          bool(qc.get("desc_act", False)))
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + ("lm_head",)
    return Scheme("gptq", packing, ((("Linear",), scheme),), ignore)


def _awq(qc: dict) -> Scheme:
    bits = int(qc.get("bits", qc.get("w_bit", 0)) or 0)
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise Refused(f"AWQ version {version!r} is not supported (gemm is)")
    if bits != 4:
        raise Refused(f"AWQ with {bits} bits is not supported (4 is)")
    if not qc.get("zero_point", True):
        raise Refused("AWQ without zero points is not supported")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)) or 128)
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + ("lm_head",)
    return Scheme("awq", "awq_gemm", ((("Linear",), ModuleScheme("wq", 4, group if group > 0 else None, False)),),
                  ignore)
