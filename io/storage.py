"""Object storage: which paths are URLs (s3://, gs://, az://, hf://, ...), and the few things a run does with one,
through fsspec: read it as a stream, tell whether its content changed (its ETag or version, and size), put a
finished local file there, list and remove a folder's files.

An object appears whole or not at all: a file is put in one upload (S3's multipart upload completes at its end),
so `put` is what `atomic.py`'s rename is for a local path. Credentials and endpoints come from each store's usual
environment (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`, `GOOGLE_APPLICATION_CREDENTIALS`, `HF_TOKEN`, ...) or fsspec's
own configuration (`FSSPEC_S3_ENDPOINT_URL`, ...). The backend packages (s3fs, gcsfs, adlfs) are the `remote` extra.
"""

from __future__ import annotations

import posixpath
import re
from typing import IO

from conveyor.io.errors import InputError

# The stores a URL may name; a scheme outside these is no URL here (a local path may contain "://" nowhere else).
REMOTE_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "hf")
_URL = re.compile(r"^([a-z][a-z0-9+.-]*)://", re.IGNORECASE)
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
             "abfss": "adlfs", "adl": "adlfs", "hf": "huggingface_hub"}
# What names an object's content, in the order taken: a version (S3 with versioning, GCS generation), an ETag
# (S3, GCS, Azure), a content hash (GCS md5, the hub's blob id).
_CONTENT_TAGS = ("VersionId", "generation", "ETag", "etag", "md5Hash", "content_md5", "blob_id")
READ_BLOCK = 8 << 20  # bytes fetched per ranged read of a streamed object


def scheme(path: str) -> str | None:
    """The URL's scheme in lower case (`s3`), or None for a local path or stdin."""
    match = _URL.match(path)
    return match.group(1).lower() if match else None


def is_remote(path: str) -> bool:
    """Whether `path` names object storage (one of REMOTE_SCHEMES)."""
    return scheme(path) in REMOTE_SCHEMES


def check_scheme(path: str, what: str) -> None:
    """InputError where `path` is a URL of a scheme conveyor does not read or write (`what`: "-o", the input)."""
    name = scheme(path)
    if name is not None and name not in REMOTE_SCHEMES:
        raise InputError(path, None, f"{what}: {name}:// is not a store conveyor reads or writes; use one of "
                                     f"{', '.join(s + '://' for s in REMOTE_SCHEMES)}, or a local path")


def filesystem(url: str):
    """(fsspec filesystem, path within it) for `url`; InputError naming the package a scheme needs where it is
    missing."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except ImportError:
        package = _PACKAGES.get(scheme(url) or "", "its fsspec backend")
        raise InputError(url, None, f"{scheme(url)}:// needs the {package} package: pip install "
                                    f"'conveyor[remote]' (or pip install {package})") from None


def info(url: str) -> dict | None:
    """The object's metadata (size, ETag, version, type), or None where nothing is there."""
    fs, path = filesystem(url)
    try:
        return fs.info(path)
    except FileNotFoundError:
        return None


def open_read(url: str) -> IO[bytes]:
    """The object as a binary stream, read in ranged blocks: memory stays flat whatever its size."""
    fs, path = filesystem(url)
    try:
        return fs.open(path, "rb", block_size=READ_BLOCK)
    except FileNotFoundError:
        raise InputError(url, None, "no such object; check the URL") from None


def remote_fingerprint(url: str) -> str:
    """"remote:<etag or version>:<size>", what tells a changed object from the same one (a content fingerprint:
    an object's ETag changes with its bytes)."""
    found = info(url)
    if found is None:
        raise InputError(url, None, "no such object; check the URL")
    tag = next((found[key] for key in _CONTENT_TAGS if found.get(key)), None)
    if tag is None:
        raise InputError(url, None, "the store gives no ETag, version or content hash for it, so a resumed run could "
                                    "not tell whether it changed; copy it to a local file")
    return f"remote:{str(tag).strip(chr(34))}:{found.get('size')}"


def put(local: str, url: str) -> None:
    """The local file at `url`, in one upload: the object appears whole when it completes, or not at all."""
    fs, path = filesystem(url)
    fs.put_file(local, path)


def list_names(folder: str) -> list[str]:
    """The names of the files directly in `folder` (a URL), none where it does not exist."""
    fs, path = filesystem(folder)
    try:
        return sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))
    except FileNotFoundError:
        return []


def remove(url: str) -> None:
    """Remove the object at `url`, where there is one."""
    fs, path = filesystem(url)
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass


def join(folder: str, name: str) -> str:
    """`name` inside `folder`, a URL or a local path."""
    return folder.rstrip("/") + "/" + name
