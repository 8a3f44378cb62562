"""A fingerprint of a model's files, so that a run can tell that the weights behind the same `--model` changed.

A run's rows are reused only under the model they were computed with; the name alone does not say that (a folder
a fine-tune was saved over, a hub id whose cache took a newer revision). The fingerprint hashes the content of
every file that decides a row (weights, config, tokenizer, pooling modules), never a README. Each file's content
hash is cached under the conveyor cache, keyed by its path, size, modification time and inode, so a file is read
once per version: a rerun costs a `stat` per file. Pure Python (hashlib).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from conveyor.core.cache_build import cache_dir

# Folders and files that do not decide a row: other runtimes' exports and documentation.
_SKIPPED_DIRS = frozenset({".git", ".cache", "onnx", "openvino"})
_SKIPPED_SUFFIXES = (".md", ".onnx", ".msgpack", ".h5", ".ot", ".lock", ".gitattributes")


def model_fingerprint(model: str, embedded: dict[str, str]) -> str | None:
    """"sha256:<hex>" over the files of `model` (a folder, a .gguf file, a hub id in the Hugging Face cache);
    `embedded` maps the embedded models' names to the pinned package they come from (their fingerprint is that
    pin: the conversion is part of the tool's version). None where the files are not here to be read (a hub id not
    downloaded yet)."""
    if model in embedded:
        return f"embedded:{embedded[model]}"
    path = Path(model).expanduser()
    if path.is_file():
        return _digest([(path.name, path)])
    if not path.is_dir():
        path = hub_snapshot(model)
        if path is None:
            return None
    files = []
    for root, dirs, names in os.walk(path, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(names):
            if name.startswith(".") or name.endswith(_SKIPPED_SUFFIXES):
                continue
            file = Path(root) / name
            files.append((file.relative_to(path).as_posix(), file))
    return _digest(files)


def hub_snapshot(model: str) -> Path | None:
    """The Hugging Face cache's snapshot folder of hub id `model`, where it is there."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(model, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def _digest(files: list[tuple[str, Path]]) -> str:
    h = hashlib.sha256()
    for name, file in sorted(files):
        h.update(f"{name}\0{file_digest(file)}\0".encode())
    return "sha256:" + h.hexdigest()


def file_digest(file: Path) -> str:
    """The sha256 of a file's content, read once per version of the file (path, size, mtime, inode) and cached."""
    real = file.resolve()
    st = real.stat()
    key = hashlib.sha256(f"{real}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_dev}".encode()).hexdigest()
    entry = cache_dir() / "file-digests" / key[:2] / key
    try:
        cached = entry.read_text().strip()
        if len(cached) == 64:
            return cached
    except OSError:
        pass
    h = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    try:  # a cache that cannot be written costs a read next time, nothing more
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".digest-")
        with os.fdopen(fd, "w") as f:
            f.write(digest)
        os.replace(tmp, entry)
    except OSError:
        pass
    return digest
