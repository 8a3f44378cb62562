"""Parquet and CSV (or TSV) readers: rows become dicts keyed by column name.

Parquet skips whole row groups on resume using their row counts; CSV cells stay strings.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from typing import Iterator

from conveyor.io.errors import InputError
from conveyor.io.records.readers.compression import READ_ERRORS, decompressing, sniff
from conveyor.io.records.readers.record import (
    DEFAULT_MAX_RECORD_BYTES,
    RawRecord,
    Reader,
    digest_of,
    first_line,
    is_stream,
    location,
    open_binary,
    table_row,
)
from conveyor.io.storage import is_remote

BATCH_ROWS = 1024


class ParquetReader(Reader):
    format = "parquet"

    def __init__(self, source: str, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        self.source = source
        self.max_record_bytes = max_record_bytes
        pf = self._open()
        self.num_rows = pf.metadata.num_rows
        self.group_rows = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
        repeated = _repeated_field(pf.schema_arrow)
        if repeated is not None:  # a row as a dict keeps one of them and drops the other without a word
            raise InputError(self.source, None, f"column {repeated!r} appears twice in the schema; rename one")

    def _open(self):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(open_binary(self.source) if is_remote(self.source) else self.source)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise InputError(self.source, None, f"not a readable Parquet file ({first_line(e)}); "
                                                "check the file, or pass --input-format") from e

    def iter_from(self, start_index: int) -> Iterator[RawRecord]:
        import pyarrow as pa

        # Row groups that end at or before start_index are never read.
        index, groups = 0, []
        for group, num_rows in enumerate(self.group_rows):
            if groups or index + num_rows > start_index:
                groups.append(group)
            else:
                index += num_rows
        if not groups:
            return
        num_skip = max(start_index - index, 0)  # rows to drop from the first group read
        pf = self._open()
        try:
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=groups):
                if num_skip:
                    dropped = min(num_skip, batch.num_rows)
                    batch = batch.slice(dropped)
                    num_skip -= dropped
                    index += dropped
                for row in batch.to_pylist():
                    yield table_row(self, row, index, None)
                    index += 1
        except (pa.ArrowException, OSError) as e:
            raise InputError(self.source, None, f"could not read row {index} ({first_line(e)}); "
                                                "the file may be corrupt") from e
        finally:
            pf.close()

    def count(self) -> int | None:
        return self.num_rows


def _repeated_field(schema, prefix: str = "") -> str | None:
    """The first field name a schema (or a struct within it, a list's items included) gives twice, as a path."""
    import pyarrow as pa

    names = [field.name for field in schema]
    for name in names:
        if names.count(name) > 1:
            return prefix + name
    for field in schema:
        kind = field.type
        while pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
            kind = kind.value_type
        if pa.types.is_struct(kind):
            found = _repeated_field([kind.field(i) for i in range(kind.num_fields)], f"{prefix}{field.name}.")
            if found is not None:
                return found
    return None


class CsvReader(Reader):
    """A header row, then one record per row. Line numbers are physical lines where each row starts
    (a quoted cell may span lines). Blank lines are not records. Cells are strings, never converted. `tabs`: cells
    separated by tabs (TSV), not commas."""

    def __init__(self, source: str, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, tabs: bool = False) -> None:
        self.format = "tsv" if tabs else "csv"
        self.delimiter, self.separator = ("\t", "tabs") if tabs else (",", "commas")
        self.source = source
        self.is_stream = is_stream(source)
        self.max_record_bytes = max_record_bytes
        # Prompts can be long; the default 128 KiB cell limit would turn them into parse failures.
        csv.field_size_limit(min(sys.maxsize, 2**31 - 1))

    def _rows(self) -> Iterator[tuple[int, list[str]]]:
        """(start line, cells) per non-blank row, header included. Undecodable bytes stay as surrogates."""
        try:
            raw = open_binary(self.source)
            f = io.TextIOWrapper(decompressing(raw, sniff(raw)), encoding="utf-8-sig", errors="surrogateescape",
                                 newline="")
        except OSError as e:
            raise InputError(self.source, None, f"cannot be read ({e.strerror or e}); check the path "
                                                "and its permissions") from e
        with f:
            reader = csv.reader(f, delimiter=self.delimiter)
            last_line = 0
            try:
                for cells in reader:
                    start, last_line = last_line + 1, reader.line_num
                    if not cells or (len(cells) == 1 and not cells[0].strip()):
                        continue
                    yield start, cells
            except csv.Error as e:
                raise InputError(self.source, last_line + 1, f"invalid {self.format.upper()} ({e}); check the "
                                                             "quoting") from e
            except READ_ERRORS as e:
                raise InputError(self.source, last_line + 1, f"could not read the file ({e}); check that it is "
                                                             "complete and not corrupt") from e

    def iter_from(self, start_index: int) -> Iterator[RawRecord]:
        header: list[str] | None = None
        index = 0
        for line, cells in self._rows():
            if header is None:
                header = self._check_header(line, cells)
                continue
            if index >= start_index:
                yield self._record(index, line, header, cells)
            index += 1

    def _record(self, index: int, line: int, header: list[str], cells: list[str]) -> RawRecord:
        problem = "not valid UTF-8; save the file as UTF-8" if not _is_utf8(cells) else \
            f"the row has {len(cells)} fields but the header has {len(header)}; quote cells that contain " \
            f"{self.separator}" if len(cells) > len(header) else None
        if problem is not None:  # (its digest is its header's and cells': the same bad row with the same message)
            digest = digest_of(json.dumps([header, cells], ensure_ascii=False).encode("utf-8", "surrogatepass")) \
                if self.with_digests else None
            return RawRecord(index, line, None, f"{location(index, line)}: {problem}", digest)
        record = dict(zip(header, cells))
        for name in header[len(cells):]:
            record[name] = None  # a short row: the missing trailing cells are null
        return table_row(self, record, index, line)

    def _check_header(self, line: int, cells: list[str]) -> list[str]:
        if not _is_utf8(cells):
            raise InputError(self.source, line, "the header is not valid UTF-8; save the file as UTF-8")
        seen = set()
        for name in cells:
            if name in seen:
                raise InputError(self.source, line, f"column {name!r} appears twice in the header; rename one")
            seen.add(name)
        return cells

    def count(self) -> int | None:
        """Rows after the header, found by parsing (quoted cells may hold newlines)."""
        if self.is_stream:
            return None
        return max(sum(1 for _ in self._rows()) - 1, 0)


def _is_utf8(cells: list[str]) -> bool:
    try:
        for cell in cells:
            cell.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True

