"""Test helper (torch): quantized checkpoint folders of a float model, written from each format's own definition
(compressed-tensors pack-quantized and int-quantized, GPTQ, AWQ GEMM), with the weights each one defines, computed
here apart from conveyor's readers: `write(model, folder, fmt)` -> {linear name: de-quantized float32 weight}."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

FORMATS = ("ct-w8a8", "ct-w8a8-static", "ct-w4a16", "ct-w4a16-asym", "ct-w8a16", "ct-w4a16-actorder", "gptq-4",
           "gptq-8-channel", "gptq-4-asym-desc", "awq")
GROUP = 32


def _pack_along(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Unsigned values packed into int32 words along `dim`, slot i of a word at bits [bits i, bits i + bits) holding
    the word's value order[i] (in order where None)."""
    per = 32 // bits
    v = values.to(torch.int64)
    if dim == 0:
        v = v.t()
    rows, cols = v.shape
    words = -(-cols // per)
    v = torch.nn.functional.pad(v, (0, words * per - cols)).reshape(rows, words, per)
    out = torch.zeros(rows, words, dtype=torch.int64)
    for slot in range(per):
        out |= v[:, :, order[slot] if order else slot] << (bits * slot)
    out = torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)
    return out.t().contiguous() if dim == 0 else out


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    return w.reshape(n, k // group, group)


def _sym(w: torch.Tensor, bits: int, group: int | None):
    """(signed q [N, K], scales [N, groups]) of symmetric quantization."""
    qmax = 2 ** (bits - 1) - 1
    g = _groups(w, group or w.shape[1])
    s = g.abs().amax(-1) / qmax
    q = torch.clamp(torch.round(g / s[..., None]), -qmax - 1, qmax).reshape(w.shape)
    return q.to(torch.int32), s


def _asym(w: torch.Tensor, bits: int, group: int | None):
    """(unsigned q [N, K], unsigned zero [N, groups], scales [N, groups]) of asymmetric quantization."""
    top = 2 ** bits - 1
    g = _groups(w, group or w.shape[1])
    lo, hi = g.amin(-1), g.amax(-1)
    s = (hi - lo) / top
    z = torch.clamp(torch.round(-lo / s), 0, top)
    q = torch.clamp(torch.round(g / s[..., None]) + z[..., None], 0, top).reshape(w.shape)
    return q.to(torch.int32), z.to(torch.int32), s


def _expand(t: torch.Tensor, k: int) -> torch.Tensor:
    return t.repeat_interleave(k // t.shape[1], dim=1)


def write(model: torch.nn.Module, folder, fmt: str) -> dict[str, torch.Tensor]:
    """Save `model` (float32) in `folder` as `fmt` (FORMATS): every linear of its layers quantized, the rest as it
    is; returns the de-quantized weight of each quantized linear, as the format defines it."""
    model.save_pretrained(folder)
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    want = {}
    for name in linears:
        w = state.pop(f"{name}.weight").float()
        want[name] = _quantize_into(state, name, w, fmt)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = _config(fmt)
    (folder / "config.json").write_text(json.dumps(cfg))
    return want


def _quantize_into(state: dict, name: str, w: torch.Tensor, fmt: str) -> torch.Tensor:
    n, k = w.shape
    if fmt.startswith("ct-w8a8"):
        q, s = _sym(w, 8, None)
        state[f"{name}.weight"] = q.to(torch.int8)
        state[f"{name}.weight_scale"] = s.reshape(n, 1)
        state[f"{name}.weight_zero_point"] = torch.zeros(n, 1, dtype=torch.int8)  # (written for symmetric ones too)
        if fmt == "ct-w8a8-static":
            state[f"{name}.input_scale"] = torch.tensor([0.02])
            state[f"{name}.input_zero_point"] = torch.zeros(1, dtype=torch.int8)
        return q.float() * s
    if fmt in ("ct-w4a16", "ct-w8a16", "ct-w4a16-actorder"):
        bits = 8 if fmt == "ct-w8a16" else 4
        group = None if bits == 8 else GROUP
        if fmt == "ct-w4a16-actorder":  # groups over a shuffled order of k, g_idx saying each k's group
            order = torch.randperm(k, generator=torch.Generator().manual_seed(k))  # (one order per input, as
            # the linears that share an input share it in a real checkpoint: their statistics are the input's)
            q_perm, s = _sym(w[:, order], bits, group)
            q = torch.empty_like(q_perm)
            q[:, order] = q_perm
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[order] = (torch.arange(k) // group).to(torch.int32)
            state[f"{name}.weight_g_idx"] = g_idx
            want = q.float() * s[:, g_idx.long()]
        else:
            q, s = _sym(w, bits, group)
            want = q.float() * (_expand(s, k) if group else s)
        state[f"{name}.weight_packed"] = _pack_along(q + 2 ** (bits - 1), bits, 1)
        state[f"{name}.weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
        state[f"{name}.weight_scale"] = s if group else s.reshape(n, 1)
        return want
    if fmt == "ct-w4a16-asym":
        q, z, s = _asym(w, 4, GROUP)
        state[f"{name}.weight_packed"] = _pack_along(q, 4, 1)  # (q - 8) + 8: the signed value's offset undone
        state[f"{name}.weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
        state[f"{name}.weight_scale"] = s
        state[f"{name}.weight_zero_point"] = _pack_along(z, 4, 0)
        return (q.float() - _expand(z.float(), k)) * _expand(s, k)
    if fmt.startswith("gptq"):
        bits = 8 if fmt == "gptq-8-channel" else 4
        group = None if fmt == "gptq-8-channel" else GROUP
        if fmt == "gptq-4-asym-desc":  # act-order: groups over k in an order of the input's, g_idx saying each k's group
            order = torch.randperm(k, generator=torch.Generator().manual_seed(k + 1))
            q_perm, z, s = _asym(w[:, order], bits, group)
            q = torch.empty_like(q_perm)
            q[:, order] = q_perm
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[order] = (torch.arange(k) // group).to(torch.int32)
            stored_z = z  # gptq_v2: zeros as they are
        else:
            q, s = _sym(w, bits, group)
            q = q + 2 ** (bits - 1)
            z = torch.full_like(s, 2 ** (bits - 1), dtype=torch.int32)
            g_idx = (torch.arange(k) // (group or k)).to(torch.int32)
            stored_z = z - 1  # the gptq format stores zero - 1
        s = s.half().float()  # GPTQ keeps its scales in fp16
        state[f"{name}.qweight"] = _pack_along(q.t(), bits, 0)  # [K / per, N]
        state[f"{name}.qzeros"] = _pack_along(stored_z.t(), bits, 1)  # [groups, N / per]
        state[f"{name}.scales"] = s.t().contiguous().half()
        state[f"{name}.g_idx"] = g_idx
        state[f"{name}.bias"] = torch.zeros(n, dtype=torch.float16)  # AutoGPTQ writes one for every linear
        which = g_idx.long() if s.shape[1] > 1 else torch.zeros(k, dtype=torch.long)
        return (q.float() - z.float()[:, which]) * s[:, which]
    if fmt == "awq":
        q, z, s = _asym(w, 4, GROUP)
        order = (0, 2, 4, 6, 1, 3, 5, 7)
        state[f"{name}.qweight"] = _pack_along(q.t(), 4, 1, order)  # [K, N / 8]
        state[f"{name}.qzeros"] = _pack_along(z.t(), 4, 1, order)  # [groups, N / 8]
        state[f"{name}.scales"] = s.t().contiguous()
        return (q.float() - _expand(z.float(), k)) * _expand(s, k)
    raise ValueError(fmt)


def _config(fmt: str) -> dict:
    if fmt.startswith("ct-"):
        int_w = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
        acts = None
        form = "pack-quantized"
        if fmt.startswith("ct-w8a8"):
            form = "int-quantized"
            static = fmt.endswith("static")
            acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor" if static else "token",
                    "dynamic": not static}
        elif fmt != "ct-w8a16":
            int_w.update(num_bits=4, strategy="group", group_size=GROUP, symmetric=fmt != "ct-w4a16-asym",
                         actorder="group" if fmt.endswith("actorder") else None)
        return {"quant_method": "compressed-tensors", "format": form, "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": int_w, "input_activations": acts}},
                "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}
    if fmt.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 8 if fmt == "gptq-8-channel" else 4,
                "group_size": -1 if fmt == "gptq-8-channel" else GROUP, "desc_act": fmt.endswith("desc"),
                "sym": "asym" not in fmt, "checkpoint_format": "gptq_v2" if "asym" in fmt else "gptq",
                "lm_head": False}
    return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
