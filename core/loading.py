"""Starting the engine, for callers outside core: an engine config made concrete for this machine, the engine, a
model's tokenizer alone, the embedded models. Imports no torch until a function that needs it is called, so
`conveyor.core` can re-export these and stay torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conveyor.core.config import EngineConfig

if TYPE_CHECKING:
    from conveyor.core.engine import Engine


def resolve_engine_config(config: EngineConfig) -> tuple[EngineConfig, tuple[str, ...]]:
    """(`config` as it will run on this machine, the fields given that change nothing here); ConfigError naming
    the field (device, backend) that cannot work here. See `core.backends.resolve_engine_config`."""
    from conveyor.core.backends import resolve_engine_config as resolve

    return resolve(config)


def load_engine(model: str, config: EngineConfig) -> Engine:
    """The engine for `model` (an embedded name, a folder, a .gguf file or a hub id) with `config`."""
    from conveyor.core.engine import Engine

    return Engine.from_pretrained(model, config)


def load_tokenizer(model: str) -> tuple[Any, int]:
    """(tokenizer, context length in tokens) of `model`, without loading its weights."""
    from conveyor.core.model_loader import load_tokenizer as load

    return load(model)
