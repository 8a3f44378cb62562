"""The pooling tasks' packed exact route on conveyor's CPU kernels: many sequences in one pass through the BERT-family
encoder (`encoder.py`) or a fused decoder (`packed_decoder.py`), a classifier's head on the kernels' linears, and the
mean pooled by the kernel in each sequence's own order; what `core/pooling_model.py` runs where it can."""

from __future__ import annotations

from collections.abc import Callable

import torch

from conveyor.core.backends.cpu.backend import kernels_arithmetic
from conveyor.core.backends.cpu.kernels import cpu_isa, cpu_kernels, kernels_missing_reason
from conveyor.core.backends.cpu.linears import Linear
from conveyor.core.errors import UnsupportedModel


class PackedPooling:
    """`run(sequences)`: per sequence, its pooled hidden state (an embedder) or its head's logits (a classifier), in
    float32; `pool(hidden, first, n, method)` pools one sequence's rows for cls and last."""

    def __init__(self, forward, head, ops, encoder: bool, classifier: bool, pooling: str, pool: Callable) -> None:
        self.forward, self.head, self.ops = forward, head, ops
        self.encoder, self.classifier, self.pooling, self.pool = encoder, classifier, pooling, pool

    @classmethod
    def build(cls, model: torch.nn.Module, encoder: bool, classifier: bool, name: str, pooling: str,
              pool: Callable) -> tuple[PackedPooling | None, str]:
        """(the route for `model`, "") or (None, why it cannot run packed). A decoder's probe may switch its attention
        implementation; it is switched back where the route is not taken."""
        ops = cpu_kernels()
        if ops is None:
            return None, f"conveyor's C++ kernels are unavailable: {kernels_missing_reason()}"
        before = model.config._attn_implementation
        if encoder:
            from conveyor.core.backends.cpu.encoder import PackedEncoder

            forward, why = PackedEncoder.build(model, ops)
        else:
            from conveyor.core.backends.cpu.packed_decoder import PackedDecoder

            try:
                forward, why = PackedDecoder.build(model, name, ops)
            except UnsupportedModel as e:  # its own forward computes it as it defines it
                forward, why = None, str(e)
        head = None
        if forward is not None and classifier:
            head, why = _exact_head(model, ops)
            if head is None:
                forward = None
        if forward is None:
            if model.config._attn_implementation != before:
                model.set_attn_implementation(before)
            return None, why
        return cls(forward, head, ops, encoder, classifier, pooling, pool), ""

    def arithmetic(self, dtype: torch.dtype) -> str:
        return kernels_arithmetic(self.ops, dtype)

    @staticmethod
    def cpu_isa() -> str | None:
        return cpu_isa()

    def run(self, sequences) -> list[torch.Tensor]:
        starts, at = [], 0
        for s in sequences:
            starts.append(at)
            at += len(s.token_ids)
        if not self.encoder and (self.classifier or self.pooling == "last"):  # one row per sequence
            hidden = self.forward(sequences, [start + len(s.token_ids) - 1 for start, s in zip(starts, sequences)])
            if self.classifier:
                return list(self.head(hidden).float().unbind(0))
            return [row.float().clone() for row in hidden.unbind(0)]
        hidden = self.forward(sequences) if self.encoder else self.forward(sequences, list(range(at)))
        if self.classifier:  # an encoder's head, on the first token
            return list(self.head(hidden.index_select(0, torch.tensor(starts))).float().unbind(0))
        if self.pooling == "mean":  # each sequence's rows summed in order by the kernel
            return list(self.ops.mean_pool(hidden, torch.tensor([*starts, at])).unbind(0))
        return [self.pool(hidden, start, len(s.token_ids), self.pooling) for start, s in zip(starts, sequences)]


def _exact_head(model: torch.nn.Module, ops):
    """(the classification head of `model` with the kernels' linears, None), or (None, why not)."""

    def linear(m):
        return Linear(m.weight.detach(), None if m.bias is None else m.bias.detach(), ops)

    kids = {n for n, _ in model.named_children()}
    classifier = getattr(model, "classifier", None)
    if "score" in kids and isinstance(model.score, torch.nn.Linear):  # a decoder's: on the last token
        score = linear(model.score)
        return score, None
    if "bert" in kids and isinstance(classifier, torch.nn.Linear) and model.bert.pooler is not None:
        dense, out = linear(model.bert.pooler.dense), linear(classifier)
        return (lambda x: out(torch.tanh(dense(x)))), None
    if classifier is not None and {n for n, _ in classifier.named_children()} >= {"dense", "out_proj"}:
        dense, out = linear(classifier.dense), linear(classifier.out_proj)  # RoBERTa's, on <s>
        return (lambda x: out(torch.tanh(dense(x)))), None
    return None, f"a classification head of modules {sorted(kids)}"
