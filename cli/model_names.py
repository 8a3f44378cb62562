"""A mistyped --model refused before any work, naming what it may have meant: a path that is not there, or a bare
name that is neither an embedded model nor a local folder, where an embedded model's name, a model folder (one with
a config.json) or a .gguf file is close to it. A name with nothing close goes on as before (the model's loader says
what it is not; a hub id, owner/name, is the hub's to answer)."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from conveyor.cli.exit_codes import UsageError
from conveyor.core import EMBEDDED_MODELS


def check_model_name(model: str) -> None:
    """UsageError where `model` names nothing here and an embedded model, model folder or .gguf file is close to it."""
    path = Path(model).expanduser()
    if model in EMBEDDED_MODELS or path.exists():
        return
    bare = "/" not in model and not model.startswith("~") and not model.endswith(".gguf")
    as_path = model.startswith((".", "/", "~")) or model.count("/") > 1 or model.endswith(".gguf")
    if not (bare or as_path):  # owner/name: a hub id
        return
    folder = path.parent if as_path else Path(".")
    near = _nearest(path.name, folder)
    if not near:
        return
    named = " or ".join(os.path.join(os.path.dirname(model), name) if as_path and name not in EMBEDDED_MODELS
                        else name for name in near)
    if as_path:
        raise UsageError(f"--model {model}: no such file or folder (did you mean {named}?); give a Hugging Face "
                         f"model folder, a .gguf file, a hub id, or an embedded model ({', '.join(EMBEDDED_MODELS)})")
    if _in_hub_cache(model):  # (an old hub id without an owner, downloaded: it loads)
        return
    raise UsageError(f"--model {model}: not an embedded model, a local model folder or a .gguf file (did you mean "
                     f"{named}?); a model of the Hugging Face hub is named owner/name")


def _nearest(name: str, folder: Path, count: int = 2) -> list[str]:
    """Up to `count` names close to `name`, nearest first: the embedded models' and those of the model folders and
    .gguf files in `folder`."""
    local = []
    if folder.is_dir():
        try:
            entries = list(folder.iterdir())
        except OSError:  # (unreadable: nothing to offer from it)
            entries = []
        local = [p.name for p in entries if (p.is_dir() and (p / "config.json").is_file()) or
                 (p.suffix == ".gguf" and p.is_file())]
    return difflib.get_close_matches(name, [*EMBEDDED_MODELS, *local], n=count, cutoff=0.75)


def _in_hub_cache(model: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(model, "config.json"), str)
    except ValueError:  # (not a name the hub would take)
        return False
