"""(torch) A .gguf file loaded with its linears kept in their quantized blocks (`gguf_blocks.KEPT`) on the CPU:
transformers' own GGUF load, tensor by tensor (its name map and its per-architecture tensor processing), except that
a linear weight of a kept type becomes a `QuantLinear` instead of being de-quantized. The row permutation
transformers applies to such a tensor (Llama's q/k) is read off its processor by passing it the row numbers; where
a processor does anything else to a linear, that tensor is de-quantized as transformers does. Everything else
(embeddings, norms, other block types, F16/BF16/F32 tensors) loads de-quantized, as before.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch

from conveyor.core.errors import ConfigError
from conveyor.core.quant.gguf_blocks import KEPT, quant_weight
from conveyor.core.quant.weights import QuantLinear


def linear_types(path: Path) -> tuple[Counter, Counter]:
    """(block types of the file's 2-D weights other than the embeddings: kept, de-quantized) as counts, read from
    the file's header (the tensors are memory-mapped, not read)."""
    from gguf import GGUFReader

    kept, dense = Counter(), Counter()
    for t in GGUFReader(str(path)).tensors:
        if len(t.shape) != 2 or t.name.startswith("token_embd") or not t.name.endswith(".weight"):
            continue
        kind = t.tensor_type.name
        (kept if kind in KEPT else dense)[kind] += 1
    return kept, dense


def describe_gguf(path: Path) -> list[tuple[str, str]]:
    """What `conveyor models --check` says of a .gguf file's weights: which linears stay in their blocks on the cpu
    backend, which are de-quantized as they load."""
    kept, dense = linear_types(path)

    def counts(c: Counter) -> str:
        return ", ".join(f"{n} {kind}" for kind, n in sorted(c.items()))

    lines = [("weights", f"GGUF: {counts(kept) or 'no'} linears of block types kept in their blocks ("
                         f"{', '.join(KEPT)}){f'; {counts(dense)} de-quantized as they load' if dense else ''}; the "
                         "embeddings and norms de-quantized as they load")]
    lines.append(("routes", "cpu: the kept linears stay quantized (de-quantized in the kernel's registers, the same "
                            "sums as the dense route over the de-quantized weights, which equal transformers' GGUF "
                            "load); cuda: every tensor de-quantized as it loads"))
    return lines


def _row_order(processor, name: str, n: int, mapping: dict, config: dict):
    """The order transformers' processor puts a linear's n rows in (None: their own), or False where it does more
    than reorder rows."""
    probe = np.arange(n, dtype=np.float64).reshape(n, 1)
    try:
        result = processor.process(weights=probe, name=name, tensor_key_mapping=mapping,
                                   parsed_parameters={"tensors": {}, "config": config})
    except Exception:  # noqa: BLE001 - a processor that cannot take the probe: the tensor is de-quantized instead
        return False
    if result is None or result.name != name or result.weights.shape != (n, 1):
        return False
    rows = result.weights[:, 0]
    if not np.array_equal(np.sort(rows), probe[:, 0]):
        return False
    rows = rows.astype(np.int64)
    return None if np.array_equal(rows, probe[:, 0]) else rows


def load_gguf_quantized(path: Path, cfg, dtype: torch.dtype, named: str):
    """The model of the .gguf file `path`, on the CPU, its linears of kept block types as QuantLinear."""
    from accelerate import init_empty_weights
    from gguf import GGUFReader, dequantize
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    parsed = load_gguf_checkpoint(str(path))
    reader = GGUFReader(str(path))
    architecture = read_field(reader, "general.architecture")[0]
    config = parsed.get("config", {})
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    mapping = get_gguf_hf_weights_map(model, processor)
    modules = dict(model.named_modules())
    params = {"tensors": {}, "config": config}
    for t in reader.tensors:
        kind = t.tensor_type.name
        hf = mapping.get(t.name)
        target = modules.get(hf.rpartition(".")[0]) if hf is not None and hf.endswith(".weight") else None
        if kind in KEPT and isinstance(target, torch.nn.Linear):
            rows = _row_order(processor, t.name, target.out_features, mapping, config)
            if rows is not False:
                weight = quant_weight(t.data, kind, (target.out_features, target.in_features), rows)
                bias = torch.zeros(target.out_features, device="meta") if target.bias is not None else None
                parent, _, leaf = hf.rpartition(".")[0].rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, leaf, QuantLinear(weight, bias, dtype))
                continue
        result = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name, tensor_key_mapping=mapping,
                                   parsed_parameters=params)
        if result.name in mapping:
            params["tensors"][mapping[result.name]] = torch.from_numpy(np.copy(result.weights)).to(dtype)
    model.load_state_dict(params["tensors"], strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = sorted(k for k, p in model.state_dict().items() if p.is_meta)
    if missing:
        raise ConfigError("model", f"model {named}: the file does not hold {len(missing)} of the model's weights "
                          f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})")
    return model.eval()
