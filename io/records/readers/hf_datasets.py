"""Hugging Face `datasets` readers: a folder written by save_to_disk, or a hub dataset streamed by name.

`datasets` is imported only when one of these is opened (it is slow to import).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from conveyor.io.errors import InputError
from conveyor.io.records.readers.record import DEFAULT_MAX_RECORD_BYTES, RawRecord, Reader, first_line, table_row

MARKER_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")


def is_datasets_folder(path: Path) -> bool:
    return any((path / name).is_file() for name in MARKER_FILES)


class DatasetsFolderReader(Reader):
    """A Dataset (or one split of a DatasetDict, named by --split where it has several) saved with save_to_disk;
    resume seeks by row."""

    format = "datasets"

    def __init__(self, source: str, split: str | None, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        import datasets

        self.source = source
        self.max_record_bytes = max_record_bytes
        try:
            loaded = datasets.load_from_disk(source)
        except Exception as e:  # datasets raises many types for a bad folder
            raise InputError(source, None, f"not a readable datasets folder ({first_line(e)}); "
                                           "write it with Dataset.save_to_disk or pass a file") from e
        if isinstance(loaded, datasets.DatasetDict):
            names = sorted(loaded)
            if split is None and len(names) == 1:
                split = names[0]
            if split is None:  # which one is the user's to say, not ours to guess
                raise InputError(source, None, f"is a DatasetDict of the splits {', '.join(names)}; choose one with "
                                               "--split")
            if split not in loaded:
                raise InputError(source, None, f"has no split {split!r}; choose one of {', '.join(names)} "
                                               "with --split")
            loaded = loaded[split]
            self.split = split
        elif split is not None and loaded.split is not None and str(loaded.split) != split:
            raise InputError(source, None, f"holds the split {str(loaded.split)!r}, not {split!r}; "
                                           "drop --split or change it")
        if self.split is None and loaded.split is not None:
            self.split = str(loaded.split)
        self.dataset = loaded.with_format(None)  # plain Python rows, even if saved with a torch format

    def iter_from(self, start_index: int) -> Iterator[RawRecord]:
        num_rows = len(self.dataset)
        if start_index >= num_rows:  # (datasets' select of an empty range past the end raises)
            return
        rows = self.dataset.select(range(start_index, num_rows)) if start_index else self.dataset
        for index, row in enumerate(rows, start_index):
            yield table_row(self, row, index, None)

    def count(self) -> int | None:
        return len(self.dataset)


class HubDatasetReader(Reader):
    """A dataset on the Hugging Face hub, streamed; resume skips records one by one."""

    format = "datasets"

    def __init__(self, name: str, split: str | None, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        import datasets

        self.source = name
        self.max_record_bytes = max_record_bytes
        self.split = split or "train"
        try:
            self.dataset = datasets.load_dataset(name, split=self.split, streaming=True)
        except Exception as e:  # network, auth, missing dataset or split: all end the run the same way
            raise InputError(name, None, f"no such file or folder, and loading it as a Hugging Face hub "
                                         f"dataset (split {self.split!r}) failed ({first_line(e)}); check "
                                         "the path, or the dataset name, --split and network access") from e

    def iter_from(self, start_index: int) -> Iterator[RawRecord]:
        rows = self.dataset.skip(start_index) if start_index else self.dataset
        index = start_index
        try:
            for row in rows:
                yield table_row(self, row, index, None)
                index += 1
        except (OSError, ConnectionError, ValueError) as e:
            raise InputError(self.source, None, f"streaming stopped at record {index} ({first_line(e)}); "
                                                "check network access and run again to resume") from e

    def count(self) -> int | None:
        try:
            return int(self.dataset.info.splits[self.split].num_examples)
        except (AttributeError, KeyError, TypeError, ValueError):
            return None

