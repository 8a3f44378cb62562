"""Input readers: stream RawRecords from JSONL (plain, compressed, stdin), JSON arrays, Parquet, CSV and
Hugging Face datasets. open_reader picks the reader; fatal problems raise InputError before any work.
"""

from __future__ import annotations

import os
from pathlib import Path

from conveyor.io.errors import InputError
from conveyor.io.records.readers.compression import sniff, without_suffix
from conveyor.io.records.readers.fingerprint import fingerprint, fingerprints_content
from conveyor.io.records.readers.hf_datasets import DatasetsFolderReader, HubDatasetReader, is_datasets_folder
from conveyor.io.records.readers.json_array import JsonArrayReader
from conveyor.io.records.readers.jsonl import JsonlReader
from conveyor.io.records.readers.record import (
    DEFAULT_MAX_RECORD_BYTES,
    FORMATS,
    RawRecord,
    Reader,
    is_stream,
    open_binary,
)
from conveyor.io.records.readers.tabular import CsvReader, ParquetReader
from conveyor.io.storage import check_scheme, info, is_remote

__all__ = ["DEFAULT_MAX_RECORD_BYTES", "FORMATS", "InputError", "RawRecord", "Reader", "fingerprint", "fingerprints_content",
           "open_reader"]

_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet",
               ".csv": "csv", ".tsv": "tsv", ".tab": "tsv"}
_STDIN_FORMATS = ("jsonl", "json")


def open_reader(source: str, input_format: str | None = None, split: str | None = None,
                max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Reader:
    """The reader for `source`: a path, "-" for stdin (JSONL), a datasets folder or a hub dataset name.

    input_format (jsonl, json, parquet, csv, datasets) overrides the extension; `split` selects a
    datasets split, and with a name that is not a local path means a hub dataset. A record bigger than
    `max_record_bytes` becomes an error row (JSONL and JSON arrays: before it is parsed).
    """
    cap = max_record_bytes
    fmt = input_format.lower() if input_format else None
    if fmt is not None and fmt not in FORMATS:
        raise InputError(source, None, f"unknown input format {input_format!r}; use --input-format with "
                                       f"one of {', '.join(FORMATS)}")
    if source == "-":
        fmt = fmt or "jsonl"
        if fmt not in _STDIN_FORMATS:
            raise InputError(source, None, f"{fmt} cannot be read from stdin; pass a file path, or pipe JSONL")
        return JsonlReader(source, max_record_bytes=cap) if fmt == "jsonl" else \
            JsonArrayReader(source, cap)
    check_scheme(source, "the input")
    if is_remote(source):
        return _remote_reader(source, fmt, split, cap)
    path = Path(source)
    if not path.exists():
        if fmt == "datasets" or split is not None:
            return HubDatasetReader(source, split, cap)
        raise InputError(source, None, "no such file; check the path")
    if path.is_dir():
        if fmt == "datasets" or (fmt is None and is_datasets_folder(path)):
            return DatasetsFolderReader(source, split, cap)
        raise InputError(source, None, "is a folder but not one written by datasets' save_to_disk "
                                       "(no dataset_info.json or state.json); pass a file")
    fmt = fmt or _format_from_name(source)
    if split is not None and fmt != "datasets":
        raise InputError(source, None, f"--split applies to Hugging Face datasets, not to a {fmt} file; drop it")
    if not os.access(path, os.R_OK):
        raise InputError(source, None, "cannot be read (permission denied); check its permissions")
    return _file_reader(source, fmt, cap, split)


def _remote_reader(source: str, fmt: str | None, split: str | None, cap: int) -> Reader:
    """The reader of one object in object storage (a URL), streamed."""
    if fmt == "datasets" or split is not None:
        raise InputError(source, None, "a datasets folder is read from a local path; name one Parquet, JSONL, JSON "
                                       "or CSV object in the store, or copy the folder to a local disk")
    found = info(source)
    if found is None:
        raise InputError(source, None, "no such object; check the URL and the store's credentials")
    if found.get("type") == "directory":
        raise InputError(source, None, "is a folder in the store; name one file in it")
    return _file_reader(source, fmt or _format_from_name(source), cap)


def _file_reader(source: str, fmt: str, cap: int, split: str | None = None) -> Reader:
    """The reader of a file (or an object) of format `fmt`."""
    if fmt == "jsonl":
        return JsonlReader(source, max_record_bytes=cap)
    if fmt == "json":
        return JsonArrayReader(source, cap)
    if fmt == "parquet":
        if not is_stream(source):
            with open_binary(source) as f:
                compressed = sniff(f)
            if compressed is not None:
                raise InputError(source, None, f"a {compressed}-compressed Parquet file; decompress it first "
                                               "(Parquet compresses its own columns)")
        return ParquetReader(source, cap)
    if fmt in ("csv", "tsv"):
        return CsvReader(source, cap, tabs=fmt == "tsv")
    return DatasetsFolderReader(source, split, cap)


def _format_from_name(source: str) -> str:
    """The format a name says, a compression suffix aside (`data.csv.gz` is CSV; `data.gz` JSONL, as it always was)."""
    name = without_suffix(source.lower())
    if name != source.lower() and not os.path.splitext(name)[1]:
        return "jsonl"
    fmt = _EXTENSIONS.get(os.path.splitext(name)[1])
    if fmt is None:
        raise InputError(source, None, "unknown input extension; use .jsonl, .json, .parquet, .csv or .tsv (the text "
                                       "formats may be compressed: .gz, .bz2, .xz, .zst), a datasets folder, or - for "
                                       "stdin, or pass --input-format")
    return fmt
