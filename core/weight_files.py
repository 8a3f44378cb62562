"""Whether a local model folder's weight files are all there and whole, from their names, the index of shards and
the safetensors headers alone (never the weights): a folder without weights, a shard missing, a file cut short are
refused at once, naming the files, instead of a model with weights made up at random. Pure Python.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from conveyor.core.errors import ConfigError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")


def check_weight_files(model: str, path: str) -> None:
    """ConfigError (model) naming the files, where a local model folder has no weights, a shard its index lists is
    missing, or a safetensors file is shorter than its header says (a download cut short). Reads headers only."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return  # a hub id: the download checks its own files
    named = f"model {model}"
    present = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    if not present and not files:
        raise ConfigError("model", f"{named}: the folder {folder} has no weights (no {', '.join(WEIGHT_FILES[:2])} "
                          "or index of shards); copy the checkpoint's weight files into it")
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if not index.is_file():
            continue
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ConfigError("model", f"{named}: {index} is not a readable index of weight shards ({e})") from None
        gone = [name for name in shards if not (folder / name).is_file()]
        if gone:
            raise ConfigError("model", f"{named}: {len(gone)} of the {len(shards)} weight shards that {index_name} "
                              f"lists are not in {folder} ({', '.join(gone[:4])}{', ...' if len(gone) > 4 else ''}); "
                              "download the missing files")
        files = [folder / name for name in shards]
    for file in files:
        if file.suffix == ".safetensors":
            _check_safetensors(named, file)


def _check_safetensors(named: str, file: Path) -> None:
    """ConfigError where `file` is not whole: its header unreadable, or its tensors' data past its end."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"its header of {length} bytes is longer than the file")
            header = json.loads(f.read(length))
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise ConfigError("model", f"{named}: the weight file {file} is not a whole safetensors file ({e}); "
                          "download it again") from None
    if 8 + length + end > size:
        raise ConfigError("model", f"{named}: the weight file {file} is cut short ({size} bytes of "
                          f"{8 + length + end}); download it again")
