"""ModelShape: what the engine, its backends and the checks before a model loads read of a model's config, with its
fallbacks in one place. Pure Python (it reads a transformers config object, never imports transformers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.core.errors import ConfigError
from conveyor.core.model_support import rotary_context_limit
from conveyor.core.outputs import ModelLimits

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int  # decoder layers
    num_heads: int  # query heads per layer
    num_kv_heads: int  # key / value heads per layer (fewer than num_heads under grouped-query attention)
    head_dim: int  # elements per head
    hidden_size: int  # elements per row of the residual stream
    intermediate_size: int  # elements per row inside the MLP
    vocab_size: int  # token ids: logits per row
    max_model_len: int  # tokens a request may hold, prompt + output: positions the model was trained for

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        """The shape of a loaded model (a transformers PreTrainedModel)."""
        return cls.of_config(model.config)

    @classmethod
    def of_config(cls, cfg: Any) -> ModelShape:
        """The shape a transformers config describes."""
        heads = cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads_of(cfg),  # none given: one per query head
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            hidden_size=cfg.hidden_size,
            intermediate_size=getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
            vocab_size=cfg.vocab_size,
            max_model_len=context_of(cfg),
        )

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(self.max_model_len, self.vocab_size)

    def kv_bytes_per_block(self, block_size: int, dtype: str) -> int:
        """Bytes of one KV block (keys and values of every layer) in `dtype` ("float32", "bfloat16", ...)."""
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def num_kv_blocks(self, budget: int, block_size: int, dtype: str) -> int:
        """KV blocks that fit `budget` bytes; ConfigError (kv_cache_memory) where not one does."""
        per_block = self.kv_bytes_per_block(block_size, dtype)
        if budget < per_block:
            raise ConfigError("kv_cache_memory", f"the KV cache budget ({budget} bytes) holds no block of this model; "
                              f"one block needs {per_block} bytes")
        return budget // per_block


def kv_heads_of(cfg: Any) -> int:
    """Key / value heads per layer, by whichever name the config gives them (Falcon: num_kv_heads, or one where
    multi_query); one per query head where it names none. (The loaded model's own K/V shapes, `attention_probe`,
    decide the pool.)"""
    for name in ("num_key_value_heads", "num_kv_heads", "n_head_kv"):
        value = getattr(cfg, name, None)
        if value:
            return int(value)
    if getattr(cfg, "multi_query", False):
        return 1
    return cfg.num_attention_heads


def context_of(cfg: Any) -> int:
    """Tokens a request may hold: the positions the model was trained for (no limit of its own where the config
    gives none), and no more than a rotary that changes with the sequence's length stays fixed for
    (`model_support.rotary_context_limit`)."""
    limit = int(getattr(cfg, "max_position_embeddings", 0) or 0) or 1 << 30
    rotary = rotary_context_limit(cfg)
    return min(limit, rotary[0]) if rotary else limit
