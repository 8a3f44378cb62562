"""(torch) The CPU's packed forward of the BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa, CamemBERT), exact.

Many sequences run in one pass as one [tokens, hidden] block, with no padding: the linears are conveyor's exact
kernels (`linears.Linear`: one fixed chain over k per output, whatever the row count), the embeddings, layer norms
and activation are row-wise, and the attention (`csrc/encoder_attention.cpp`) runs one task per sequence and head:
every row sees all of its own sequence's keys, in a fixed order, and none of another's. A sequence's hidden states
are the same bits alone or packed with any others (the exactness contract, `conveyor.core.exactness`).

`PackedEncoder.build(model, ops)` returns (None, why) for what it does not cover; the pooling engine then runs the
model's own forward one sequence at a time.
"""

from __future__ import annotations

import torch

from conveyor.core.backends.cpu.linears import Linear
from conveyor.core.backends.decoder_plan import concat_linears
from conveyor.core.pooling_params import TokenSequence

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "camembert")


class PackedEncoder:
    """Callable: sequences -> their last hidden states, [total tokens, hidden] in the sequences' order."""

    def __init__(self, model: torch.nn.Module, ops) -> None:
        from transformers.activations import ACT2FN

        self.ops = ops
        self.config = cfg = model.config
        base = model.base_model
        self.embeddings = base.embeddings
        # RoBERTa's positions start after its padding index (no padding here: a sequence's are consecutive)
        self.position_offset = int(cfg.pad_token_id) + 1 if cfg.model_type != "bert" else 0
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.act = ACT2FN[cfg.hidden_act]
        self.erf_gelu = cfg.hidden_act == "gelu"  # BERT's own GELU: in the up projection's kernel, as it stores
        self.dtype = next(model.parameters()).dtype
        self.layers = []
        for layer in base.encoder.layer:
            attn = layer.attention  # (q, k, v as one linear: each column is the same chain over k)
            qkv = Linear(*concat_linears([attn.self.query, attn.self.key, attn.self.value]), ops)
            self.layers.append((qkv, self._linear(attn.output.dense), attn.output.LayerNorm,
                                self._linear(layer.intermediate.dense), self._linear(layer.output.dense),
                                layer.output.LayerNorm))

    def _linear(self, m: torch.nn.Linear) -> Linear:
        return Linear(m.weight.detach(), None if m.bias is None else m.bias.detach(), self.ops)

    @classmethod
    def build(cls, model: torch.nn.Module, ops) -> tuple[PackedEncoder | None, str | None]:
        cfg = model.config
        if ops is None:
            return None, "conveyor's C++ kernels are not built here"
        if next(model.parameters()).device.type != "cpu":
            return None, "the model is not on the CPU"
        if cfg.model_type not in ENCODER_TYPES:
            return None, f"model type {cfg.model_type!r} has no packed encoder forward"
        if getattr(cfg, "position_embedding_type", "absolute") not in (None, "absolute"):
            return None, f"position_embedding_type {cfg.position_embedding_type!r}"
        if getattr(cfg, "is_decoder", False) or getattr(cfg, "add_cross_attention", False):
            return None, "a BERT used as a decoder"
        from transformers.activations import ACT2FN

        if cfg.hidden_act not in ACT2FN or cfg.hidden_size % cfg.num_attention_heads:
            return None, f"activation {cfg.hidden_act!r} or heads that do not divide the hidden size"
        return cls(model, ops), None

    @torch.inference_mode()
    def __call__(self, sequences: list[TokenSequence]) -> torch.Tensor:
        ids: list[int] = []
        types: list[int] = []
        positions: list[int] = []
        starts = [0]
        for s in sequences:
            n = len(s.token_ids)
            ids.extend(s.token_ids)
            types.extend(s.token_type_ids if s.token_type_ids is not None else [0] * n)
            positions.extend(range(self.position_offset, self.position_offset + n))
            starts.append(starts[-1] + n)
        long = torch.long
        emb = self.embeddings
        h = emb.word_embeddings(torch.tensor(ids, dtype=long)) + emb.token_type_embeddings(torch.tensor(types,
                                                                                                   dtype=long))
        h = emb.LayerNorm(h + emb.position_embeddings(torch.tensor(positions, dtype=long)))
        bounds = torch.tensor(starts, dtype=long)
        ops = self.ops
        for qkv, out, norm1, up, down, norm2 in self.layers:
            attended = ops.packed_attention(qkv(h), bounds, self.heads, self.scale).to(h.dtype)
            h = ops.add_layer_norm(h, out(attended), norm1.weight, norm1.bias, norm1.eps)
            inner = up(h, Linear.GELU) if self.erf_gelu else self.act(up(h))
            h = ops.add_layer_norm(h, down(inner), norm2.weight, norm2.bias, norm2.eps)
        return h
