"""How each decoder layer of a model attends, as the model defines it: what every backend's attention must do
beyond softmax(scale * q.k) v over the keys up to the query. Pure Python.

Read off the model's own transformers forward (`backends/attention_probe.py`), never guessed from a config's
field names: the window its attention mask has, the scaling, softcap and sinks its attention function is handed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LayerAttention:
    scale: float  # the scores' factor
    window: int | None = None  # a query at position p sees keys (p - window, p] only (transformers' sliding window)
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the softmax
    sinks: bool = False  # a per-head logit joins the softmax's denominator (gpt-oss's `sinks`)


@dataclass(frozen=True, slots=True)
class ModelAttention:
    """Every layer's attention, and the K/V each layer stores (the pool's shape)."""

    layers: tuple[LayerAttention, ...]
    num_kv_heads: int
    head_dim: int

    @property
    def all_slide(self) -> int | None:
        """The widest window where every layer has one (the keys a request needs at most: blocks before them
        can be given back), else None."""
        windows = [layer.window for layer in self.layers]
        if not windows or any(w is None for w in windows):
            return None
        return max(windows)
