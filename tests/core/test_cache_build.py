"""The cache's build-once protocol (kernels, model conversion): concurrent builders build once, a
builder killed mid-build leaves nothing that blocks the next one, and a reader never sees a
half-written result (no torch, but for the last test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conveyor.core.cache_build import cached_build, exclusive_lock

# A child builder: announces its scratch directory in `started`, then writes the file once `release` exists.
CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from conveyor.core.cache_build import cached_build
    folder, started, release = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    def build(scratch):
        (scratch / "part.o").write_text("half")
        started.write_text(str(scratch))
        while not release.exists():
            time.sleep(0.02)
        out = scratch / "lib.so"
        out.write_text("built by the child")
        return out
    print(cached_build(folder, "lib.so", build))
""")


def _start_child(folder: Path, started: Path, release: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(folder), str(started), str(release)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not started.exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the child builder never started"
        time.sleep(0.02)
    return proc


def _builder(calls: list, text: str = "built here"):
    def build(scratch: Path) -> Path:
        calls.append(scratch)
        out = scratch / "lib.so"
        out.write_text(text)
        return out
    return build


def test_builds_once_then_returns_the_cached_file(tmp_path):
    calls: list = []
    folder = tmp_path / "kernels" / "py311-abc"
    first = cached_build(folder, "lib.so", _builder(calls))
    second = cached_build(folder, "lib.so", _builder(calls))
    assert first == second == folder / "lib.so"
    assert first.read_text() == "built here"
    assert len(calls) == 1
    assert not calls[0].exists(), "the scratch directory was left behind"


def test_a_builder_killed_mid_build_blocks_no_one_and_its_leftovers_are_cleared(tmp_path):
    folder = tmp_path / "kernels" / "py311-abc"
    child = _start_child(folder, tmp_path / "started", release=tmp_path / "never")
    dead_scratch = Path((tmp_path / "started").read_text())
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    assert not (folder / "lib.so").exists()

    calls: list = []
    start = time.monotonic()
    path = cached_build(folder, "lib.so", _builder(calls), wait_s=30)
    assert time.monotonic() - start < 10
    assert path.read_text() == "built here" and len(calls) == 1
    assert not dead_scratch.exists(), "the killed builder's scratch directory was not cleared"


class _Said:
    """A stderr that keeps what is written to it, read from another thread without losing a write (reading a
    captured stream while it is written can drop what lands between the read and its reset)."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def text(self) -> str:
        return "".join(self.parts)


def test_a_second_caller_waits_for_the_running_builder_and_uses_its_result(tmp_path, monkeypatch):
    folder = tmp_path / "kernels" / "py311-abc"
    release = tmp_path / "release"
    child = _start_child(folder, tmp_path / "started", release)
    said = _Said()
    monkeypatch.setattr(sys, "stderr", said)

    def release_once_the_caller_waits() -> None:
        deadline = time.monotonic() + 120
        while "waiting for another process to finish building" not in said.text() and time.monotonic() < deadline:
            time.sleep(0.05)
        release.write_text("")

    releaser = threading.Thread(target=release_once_the_caller_waits)
    releaser.start()
    calls: list = []
    path = cached_build(folder, "lib.so", _builder(calls), wait_s=300)
    releaser.join()
    assert calls == [], "the waiting caller built it a second time"
    assert path.read_text() == "built by the child"
    assert child.wait(30) == 0
    assert "waiting for another process to finish building" in said.text()


def test_a_lock_file_left_on_disk_does_not_block(tmp_path):
    folder = tmp_path / "kernels" / "py311-abc"
    folder.parent.mkdir(parents=True)
    (folder.parent / "py311-abc.lock").write_text("")  # a file alone is not a lock
    (folder.parent / "py311-abc").mkdir()
    (folder / "lock").write_text("")  # what a killed torch `load()` left in older caches
    calls: list = []
    assert cached_build(folder, "lib.so", _builder(calls), wait_s=5).read_text() == "built here"


def test_a_failed_build_leaves_no_file_and_the_next_caller_retries(tmp_path):
    folder = tmp_path / "kernels" / "py311-abc"

    def broken(scratch: Path) -> Path:
        (scratch / "lib.so").write_text("half")
        raise RuntimeError("compiler error")

    with pytest.raises(RuntimeError, match="compiler error"):
        cached_build(folder, "lib.so", broken)
    assert not (folder / "lib.so").exists()
    assert list(folder.parent.glob(".py311-abc.build-*")) == []
    calls: list = []
    assert cached_build(folder, "lib.so", _builder(calls)).read_text() == "built here"


def test_waiting_gives_up_with_a_timeout_instead_of_hanging(tmp_path):
    lock = tmp_path / "x.lock"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from conveyor.core.cache_build import exclusive_lock
        with exclusive_lock(Path({str(lock)!r}), 5):
            print("held", flush=True)
            time.sleep(600)
    """)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"held"
        with pytest.raises(TimeoutError, match="stayed locked"):
            with exclusive_lock(lock, 0.5):
                pass
    finally:
        holder.kill()
        holder.wait(30)
    with exclusive_lock(lock, 5):  # the holder's death released it
        pass


def test_a_fresh_process_loads_the_cached_kernels_past_a_stale_torch_lock_file():
    """The kernels cache as built by this machine's earlier tests (or built here): a later process
    imports the library directly, whatever lock file a killed process left in its folder."""
    pytest.importorskip("torch")
    from conveyor.core.backends.cpu.kernels import build_tag, cpu_kernels, module_name
    from conveyor.core.cache_build import cache_dir

    if cpu_kernels() is None:
        pytest.skip("no C++ kernels here (no compiler, or a CPU without AVX-512 or AVX2 + FMA)")
    folder = cache_dir() / "kernels" / f"py{sys.version_info.major}{sys.version_info.minor}-{build_tag()}"
    assert (folder / f"{module_name()}.so").exists()
    (folder / "lock").write_text("")  # torch's load() waited on this forever
    try:
        child = subprocess.run([sys.executable, "-c", "from conveyor.core.backends.cpu.kernels import cpu_kernels; "
                                "m = cpu_kernels(); print(m.__name__, callable(m.paged_attention))"],
                               capture_output=True, text=True, timeout=120)
    finally:
        (folder / "lock").unlink()
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == [module_name(), "True"]
    assert "compiling" not in child.stderr


def _writer(text: str):
    def build(scratch: Path) -> Path:
        out = scratch / "lib.so"
        out.write_text(text)
        return out
    return build


def test_a_cached_file_others_may_write_is_not_loaded_but_built_privately(tmp_path, capfd):
    folder = tmp_path / "kernels" / "tag"
    assert cached_build(folder, "lib.so", _writer("ours")).read_text() == "ours"
    assert (folder.stat().st_mode & 0o777) == 0o700 and (folder.parent.stat().st_mode & 0o777) == 0o700
    planted = folder / "lib.so"
    planted.write_text("planted")
    planted.chmod(0o777)
    got = cached_build(folder, "lib.so", _writer("rebuilt"))
    assert got != planted and got.read_text() == "rebuilt"
    assert "is writable by other users" in capfd.readouterr().err
    assert (got.parent.parent.stat().st_mode & 0o077) == 0  # the private copy's folder is 0700


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="only root can give a file away")
def test_a_cached_file_of_another_user_is_not_loaded(tmp_path, capfd):
    folder = tmp_path / "kernels" / "tag"
    planted = cached_build(folder, "lib.so", _writer("ours"))
    os.chown(planted, 65534, 65534)
    got = cached_build(folder, "lib.so", _writer("rebuilt"))
    assert got != planted and got.read_text() == "rebuilt"
    assert "belongs to another user" in capfd.readouterr().err


def test_a_loose_folder_of_our_own_is_tightened_and_its_files_still_used(tmp_path):
    folder = tmp_path / "models" / "m"
    built = cached_build(folder, "lib.so", _writer("ours"))
    folder.chmod(0o775)  # a umask of 002
    assert cached_build(folder, "lib.so", _writer("rebuilt")) == built and built.read_text() == "ours"
    assert (folder.stat().st_mode & 0o022) == 0
