"""Helpers for the CLI tests: run `conveyor` in this process or as a child process, read outputs.

In-process runs call `conveyor.cli.app.main`, the console script's own entry point, so they take
the same path as `conveyor ...` minus the 5-10 s of importing torch and transformers again; the
tests that need a real process (exit status, stderr, signals, kill -9, locks) start one with
`python -m conveyor.cli`, forked from a warm Python (`warm_python.py`) unless they ask for a fresh
interpreter (`fresh=True`: a claim about the interpreter's start itself).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from warm_python import WarmProcess, run_warm

CONVEYOR = [sys.executable, "-m", "conveyor.cli"]
# The columns of an output row that must not depend on timing, batching or interruptions.
STABLE = ("id", "index", "status", "output", "finish_reason", "prompt_tokens", "completion_tokens", "seed")
DESIGN_COLUMNS = ("id", "index", "status", "output", "finish_reason", "prompt_tokens", "completion_tokens",
                  "error", "seed", "queue_s", "ttft_s", "latency_s")


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


def tiny_args(model: Path) -> list[str]:
    """Options for a fast run on the tiny model: a small KV pool instead of the 2 GiB default."""
    return ["--model", str(model), "--kv-cache-memory", "8MiB"]


def run_in_process(*args, stdin: bytes | None = None) -> Result:
    """`conveyor ARGS` through `main()`, capturing stdout and stderr (neither is a TTY)."""
    from conveyor.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    saved_stdin = sys.stdin
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([str(a) for a in args])
            except SystemExit as e:
                code = e.code
            else:  # pragma: no cover - main() always exits
                raise AssertionError("main() returned instead of exiting")
    finally:
        sys.stdin = saved_stdin
    return Result(int(code or 0), out.getvalue(), err.getvalue())


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # One torch thread: on a shared 2-core runner more threads spin against each other (steps get
    # 10-20x slower); outputs do not depend on it.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("CONVEYOR_DEBUG", None)
    return env


def tiny_run_argv(model: Path, tmp_path: Path, count: int, max_tokens: int) -> tuple[list[str], Path, list[str]]:
    """`count` records r0, r1, ... of `max_tokens` each written to an input file: their ids, the output's path and
    `conveyor run --quiet` over them on the tiny model."""
    records = [{"id": f"r{i}", "prompt": f"record {i}", "max_tokens": max_tokens} for i in range(count)]
    src, out = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    return [r["id"] for r in records], out, ["conveyor", "run", str(src), "-o", str(out), *map(str, tiny_args(model)),
                                             "--quiet"]


def entry_in_child(argv: list[str], setup: str = "", after: str = "", fresh: bool = False
                   ) -> subprocess.CompletedProcess:
    """`argv` through the console script's entry (`cli/entry.py`) in a child process: the Python lines of `setup`
    first, those of `after` once the command has exited (its SystemExit as `e`), then the process exits as it would.
    `fresh`: in a fresh interpreter (a claim about what happens while it imports the libraries)."""
    script = ("import sys\nfrom conveyor.cli import entry\n" + setup + f"sys.argv = {argv!r}\n"
              "try:\n    entry.main()\nexcept SystemExit as e:\n" + textwrap.indent(after + "raise\n", "    "))
    if fresh:
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                              env=child_env())
    done = run_warm(["-c"], child_env(), code=script, timeout=300)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(errors="replace"),
                                       done.stderr.decode(errors="replace"))


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def run_child(*args, stdin: bytes | None = None, timeout: float = 600, cwd: Path | None = None,
              fresh: bool = False) -> Result:
    """`conveyor ARGS` in a child process (`fresh`: a fresh interpreter)."""
    if fresh:
        proc = subprocess.run([*CONVEYOR, *map(str, args)], input=stdin, capture_output=True, timeout=timeout,
                              env=child_env(), cwd=cwd)
    else:
        proc = run_warm(["conveyor", *map(str, args)], child_env(), stdin=stdin, timeout=timeout,
                        module="conveyor.cli", cwd=cwd)
    return Result(proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace"))


# Child(setup=...): the child stops itself (SIGSTOP) once it has written part N of a part-file output, so that a test
# sees it mid-run whatever the machine's speed (format with part=N).
STOP_AFTER_PART = """import os, signal
from conveyor.io.rows.parts import PartWriter
_write = PartWriter._write
def _write_then_stop(self, part, first, stop):
    _write(self, part, first, stop)
    if part == {part}:
        os.kill(os.getpid(), signal.SIGSTOP)
PartWriter._write = _write_then_stop
"""


class Child:
    """A `conveyor` child process whose stdout/stderr go to files (a full pipe would stall it)."""

    live: list["Child"] = []  # killed after each test (conftest): a failed test leaves none running or frozen

    def __init__(self, args, log_dir: Path, name: str, setup: str = "") -> None:
        """`conveyor ARGS`; with `setup`, through the console script's entry after those Python lines (to patch the
        child: `STOP_AFTER_PART` stops it at a chosen point, for the test to look at it there)."""
        self.out_path = log_dir / f"{name}.stdout"
        self.err_path = log_dir / f"{name}.stderr"
        code = f"import sys\n{setup}sys.argv = {['conveyor', *map(str, args)]!r}\nfrom conveyor.cli import entry\n" \
               "entry.main()\n" if setup else None
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err, open(os.devnull, "rb") as null:
            self.proc = WarmProcess(["conveyor", *map(str, args)], child_env(), null.fileno(), out.fileno(),
                                    err.fileno(), module=None if setup else "conveyor.cli", code=code)
        self.started = time.monotonic()
        Child.live.append(self)

    @classmethod
    def kill_all(cls) -> None:
        for child in cls.live:
            if child.is_alive():
                child.proc.kill()  # SIGKILL ends a SIGSTOPped process too
                child.proc.wait(30)
        cls.live.clear()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def freeze(self) -> None:
        """SIGSTOP, and return once the child has stopped (kill() returns before a child running on
        another core stops: a read right after it could still race the child's next write)."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while self.is_alive() and time.monotonic() < deadline:
            try:
                with open(f"/proc/{self.pid}/stat", encoding="ascii", errors="replace") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                return  # no /proc here: the signal alone
            if state in ("T", "t"):
                return
            time.sleep(0.001)

    def is_stopped(self) -> bool:
        """Whether the child is stopped (SIGSTOP), by the test or by itself."""
        try:
            with open(f"/proc/{self.pid}/stat", encoding="ascii", errors="replace") as f:
                return f.read().rpartition(")")[2].split()[0] in ("T", "t")
        except (OSError, IndexError):
            return False

    def wait(self, timeout: float = 600) -> Result:
        code = self.proc.wait(timeout)
        return Result(code, self.out_path.read_text(errors="replace"), self.err_path.read_text(errors="replace"))

    def kill9(self) -> Result:
        self.proc.send_signal(signal.SIGKILL)
        return self.wait()

    def wait_until(self, condition, timeout: float = 300, what: str = "a condition") -> None:
        """Poll `condition()` until true; fail if the child exits first or time runs out."""
        deadline = time.monotonic() + timeout
        while not condition():
            if not self.is_alive():
                result = self.wait()
                raise AssertionError(f"conveyor exited ({result.code}) before {what}:\n{result.err[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.05)


def journal_state(run_dir: Path, strict: bool = True) -> tuple[int, int]:
    """(committed rows, contiguous prefix) of a run directory's journal, read-only beside a live
    writer; (0, 0) if there is no journal. strict=False, for polling a run that is starting: a
    journal whose tables do not exist yet reads as (0, 0)."""
    from conveyor.io.state.journal import Journal

    path = Path(run_dir) / "journal.sqlite"
    if not path.exists():
        return 0, 0
    try:
        with Journal(path, read_only=True, verify=False) as journal:
            return journal.num_committed(), journal.contiguous_prefix()
    except Exception:  # noqa: BLE001
        if strict:
            raise
        return 0, 0


def num_committed(run_dir: Path, strict: bool = True) -> int:
    return journal_state(run_dir, strict)[0]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def write_input(path: Path, records: list[dict], fmt: str) -> Path:
    """`records` as an input of format jsonl, jsonl.gz, json, parquet, csv or datasets (a folder)."""
    if fmt == "jsonl":
        return write_jsonl(path, records)
    if fmt == "jsonl.gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        return path
    if fmt == "json":
        path.write_text(json.dumps(records, indent=1), encoding="utf-8")
        return path
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
        return path
    if fmt == "csv":
        import csv

        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
        return path
    if fmt == "datasets":
        import datasets

        datasets.Dataset.from_list(records).save_to_disk(str(path))
        return path
    raise ValueError(fmt)


def window_of(summary: dict, parts: float) -> str:
    """A --max-runtime that stops a run like the one `summary` describes about `parts` times, whatever this machine's
    speed: that run's setup and model load, then a `parts`-th of its generation (at least 0.3 s)."""
    setup = summary["wall_s"] - summary["elapsed_s"]
    return f"{setup + max(summary['elapsed_s'] / parts, 0.3):.2f}s"


def read_rows(path: Path) -> list[dict]:
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def stable(rows: list[dict]) -> list[tuple]:
    return [tuple(row[k] for k in STABLE) for row in rows]


def assert_same_rows(rows: list[dict], expected: list[dict]) -> None:
    """Row for row on the stable columns, naming the first difference."""
    assert [r["index"] for r in rows] == list(range(len(rows))), "rows missing, repeated or out of order"
    assert len({r["id"] for r in rows}) == len(rows), "duplicate ids in the output"
    assert len(rows) == len(expected), f"{len(rows)} rows, expected {len(expected)}"
    for got, want in zip(rows, expected):
        diff = {k: (got[k], want[k]) for k in STABLE if got[k] != want[k]}
        assert not diff, f"row {got['index']} ({got['id']}) differs (got, expected): {diff}"
