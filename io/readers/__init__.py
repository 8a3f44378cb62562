"""Input readers: stream RawRecords from JSONL (plain, gzip, stdin), JSON arrays, Parquet, CSV and
Hugging Face datasets. open_reader picks the reader; fatal problems raise InputError before any work.
"""

from __future__ import annotations

import os
from pathlib import Path

from conveyor.io.errors import InputError
from conveyor.io.readers.fingerprint import fingerprint
from conveyor.io.readers.hf_datasets import DatasetsFolderReader, HubDatasetReader, is_datasets_folder
from conveyor.io.readers.json_array import JsonArrayReader
from conveyor.io.readers.jsonl import JsonlReader
from conveyor.io.readers.record import FORMATS, RawRecord, Reader, is_stream
from conveyor.io.readers.tabular import CsvReader, ParquetReader

__all__ = ["FORMATS", "InputError", "RawRecord", "Reader", "fingerprint", "open_reader"]

_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".gz": "jsonl", ".json": "json",
               ".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}
_STDIN_FORMATS = ("jsonl", "json")
_GZIP_MAGIC = b"\x1f\x8b"


def open_reader(source: str, input_format: str | None = None, split: str | None = None) -> Reader:
    """The reader for `source`: a path, "-" for stdin (JSONL), a datasets folder or a hub dataset name.

    input_format (jsonl, json, parquet, csv, datasets) overrides the extension; `split` selects a
    datasets split, and with a name that is not a local path means a hub dataset.
    """
    fmt = input_format.lower() if input_format else None
    if fmt is not None and fmt not in FORMATS:
        raise InputError(source, None, f"unknown input format {input_format!r}; use --input-format with "
                                       f"one of {', '.join(FORMATS)}")
    if source == "-":
        fmt = fmt or "jsonl"
        if fmt not in _STDIN_FORMATS:
            raise InputError(source, None, f"{fmt} cannot be read from stdin; pass a file path, or pipe JSONL")
        return JsonlReader(source, is_gzip=False) if fmt == "jsonl" else JsonArrayReader(source)
    path = Path(source)
    if not path.exists():
        if fmt == "datasets" or split is not None:
            return HubDatasetReader(source, split)
        raise InputError(source, None, "no such file; check the path")
    if path.is_dir():
        if fmt == "datasets" or (fmt is None and is_datasets_folder(path)):
            return DatasetsFolderReader(source, split)
        raise InputError(source, None, "is a folder but not one written by datasets' save_to_disk "
                                       "(no dataset_info.json or state.json); pass a file")
    fmt = fmt or _format_from_name(source)
    if split is not None and fmt != "datasets":
        raise InputError(source, None, f"--split applies to Hugging Face datasets, not to a {fmt} file; drop it")
    if not os.access(path, os.R_OK):
        raise InputError(source, None, "cannot be read (permission denied); check its permissions")
    if fmt == "jsonl":
        if is_stream(source):  # a pipe: sniffing would eat its first bytes
            return JsonlReader(source, is_gzip=source.lower().endswith(".gz"))
        with open(path, "rb") as f:
            is_gzip = f.read(2) == _GZIP_MAGIC
        return JsonlReader(source, is_gzip=is_gzip)
    if fmt == "json":
        return JsonArrayReader(source)
    if fmt == "parquet":
        return ParquetReader(source)
    if fmt == "csv":
        return CsvReader(source)
    return DatasetsFolderReader(source, split)


def _format_from_name(source: str) -> str:
    name = source.lower()
    if name.endswith(".jsonl.gz"):
        return "jsonl"
    fmt = _EXTENSIONS.get(os.path.splitext(name)[1])
    if fmt is None:
        raise InputError(source, None, "unknown input extension; use .jsonl, .jsonl.gz, .json, .parquet or "
                                       ".csv, a datasets folder, or - for stdin, or pass --input-format")
    return fmt
