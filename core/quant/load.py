"""(torch) A quantized checkpoint folder (compressed-tensors, GPTQ, AWQ) loaded without its quantization library:
the model built from its config with no weights, each quantized linear replaced by a `QuantLinear` read from the
format's own tensors (`tensors.read_linear`), every other weight loaded as it is, in the model's dtype.

The quantized linears stay quantized on every device: the CPU's fused forward multiplies by them with its C++
kernels, the CUDA backend's lean forward with Triton ones (`backends/cuda/triton_quant.py`). FP8 weights are
de-quantized as they load, into plain linears of the model's dtype.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from conveyor.core.errors import ConfigError, UnsupportedModel
from conveyor.core.quant.formats import Scheme
from conveyor.core.quant.tensors import MissingTensor, read_linear
from conveyor.core.quant.weights import QuantLinear, QuantWeight

# Tensor names that only a quantization format writes: one left unread would have changed what the model computes.
QUANT_SUFFIXES = ("weight_scale", "weight_zero_point", "weight_packed", "weight_shape", "weight_g_idx", "input_scale",
                  "input_zero_point", "output_scale", "k_scale", "v_scale", "qweight", "qzeros", "scales", "g_idx")


class _Tensors:
    """The checkpoint's tensors by name, read lazily from its safetensors files."""

    def __init__(self, folder: Path, named: str) -> None:
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted({folder / f for f in json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()})
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ConfigError("model", f"{named}: a quantized checkpoint is read from safetensors files, and {folder} "
                              "has none")
        self.handles = [safe_open(str(f), framework="pt") for f in files]
        self.where = {key: h for h in self.handles for key in h.keys()}
        self.read: set[str] = set()

    def get(self, name: str) -> torch.Tensor | None:
        handle = self.where.get(name)
        if handle is None:
            return None
        self.read.add(name)
        return handle.get_tensor(name)


def load_quantized(folder: Path, cfg, scheme: Scheme, dtype: torch.dtype, device: torch.device, named: str,
                   auto_class=None):
    """The model of `folder` with its quantized linears (QuantLinear on the CPU, de-quantized elsewhere)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    tensors = _Tensors(folder, named)
    plain = copy.deepcopy(cfg)
    if hasattr(plain, "quantization_config"):
        del plain.quantization_config
    with init_empty_weights(include_buffers=False):
        model = (auto_class or AutoModelForCausalLM).from_config(plain, dtype=dtype)
    replaced: set[str] = set()
    tied = bool(getattr(plain, "tie_word_embeddings", False))
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        ms = scheme.module(name)
        if ms is None or (tied and module is model.get_output_embeddings()):
            continue  # (a tied lm_head is the embeddings: stored once, unquantized)
        try:
            weight = read_linear(scheme, ms, name, tensors.get, (module.out_features, module.in_features))
        except MissingTensor as e:
            raise ConfigError("model", f"{named}: the checkpoint has no tensor {e.args[0]}, which its "
                              f"quantization_config ({scheme.describe()}) needs; check that the folder holds every "
                              "weight file") from None
        except ValueError as e:
            raise UnsupportedModel(f"model {named}: {name} is not stored as {scheme.describe()} says ({e})") from None
        bias = tensors.get(f"{name}.bias")
        if module.bias is None and bias is not None:  # (GPTQ writes a bias of zeros for every linear)
            if bool(bias.any()):
                raise UnsupportedModel(f"model {named}: {name} has a bias in the checkpoint that the model's "
                                       "architecture has no place for")
            bias = None
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        if isinstance(weight, QuantWeight):
            new = QuantLinear(weight.to(device), None if bias is None else bias.to(device), dtype)
        else:
            new = torch.nn.Linear(module.in_features, module.out_features, bias=bias is not None, dtype=dtype,
                                  device="meta")
            new.weight = torch.nn.Parameter(weight.to(dtype), requires_grad=False)
            if bias is not None:
                new.bias = torch.nn.Parameter(bias.to(dtype), requires_grad=False)
        setattr(parent, name.rpartition(".")[2], new)
        replaced.add(name)
    if not replaced:
        raise UnsupportedModel(f"model {named}: its quantization_config ({scheme.describe()}) names no linear layer "
                               "of the model")
    state = {}
    for key, param in model.state_dict().items():
        if not param.is_meta:
            continue
        t = tensors.get(key)
        if t is not None:
            state[key] = t.to(dtype) if t.is_floating_point() else t
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = sorted(k for k, p in model.state_dict().items() if p.is_meta)
    if missing:
        raise ConfigError("model", f"model {named}: its weight files do not hold {len(missing)} of the model's "
                          f"weights ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); check that the "
                          "folder holds every weight file of the checkpoint")
    unread = sorted(k for k in tensors.where if k not in tensors.read and k.rpartition(".")[2] in QUANT_SUFFIXES)
    if unread:
        raise UnsupportedModel(f"model {named}: the checkpoint holds quantization tensors that its config does not "
                               f"account for ({', '.join(unread[:4])}{', ...' if len(unread) > 4 else ''}), so "
                               "conveyor would not compute what it defines")
    return model.eval()
