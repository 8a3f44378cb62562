"""`--executor ray` on a local Ray instance (2 CPUs, the tiny model): 2 workers give a single run's rows row for
row, and a summary over both workers' rows; a worker killed with `ray.kill` mid-run is restarted by Ray and resumes
its shard, writing each of its part files once; a driver given SIGTERM
stops its workers and exits 75, and one killed with kill -9 is resumed by the same command; nothing is lost or
written twice."""

from __future__ import annotations

import json
import signal
import threading
import time

import numpy as np
import pytest
from cli_helpers import Child, assert_same_rows, num_committed, read_rows, run_in_process, tiny_args, write_jsonl

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'conveyor[ray]')")

RECORDS = [{"id": f"r{i:02d}", "prompt": f"w{i} w{i + 3} " * (1 + i % 6), "max_tokens": 8 + i % 13}
           for i in range(48)]
RECORDS[7] = {"id": "bad", "prompt": ""}
OPTS = ("--temperature", "0.7", "--seed", "3", "--max-num-seqs", "4", "--checkpoint-every", "2", "--quiet")


def _args(tiny_model, src, out, *extra):
    return ("run", src, "-o", out, *tiny_args(tiny_model), *OPTS, *extra)


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("single")
    src = write_jsonl(tmp / "in.jsonl", RECORDS)
    assert run_in_process(*_args(tiny_model, src, tmp / "out.jsonl")).code == 3
    return read_rows(tmp / "out.jsonl")


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance for the module (2 CPUs), its address yielded: the drivers in this process join it, and so
    do those in child processes given it as RAY_ADDRESS (a cluster's start is seconds of two cores)."""
    # address="local": a fresh cluster, never one `ray start` left running on the host
    context = ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield context.address_info["address"]
    ray.shutdown()


def test_two_workers_equal_a_single_run_and_the_summary_is_over_every_workers_rows(tmp_path, tiny_model, single,
                                                                                  local_ray):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    out = tmp_path / "out.parquet"
    result = run_in_process(*_args(tiny_model, src, out, "--executor", "ray", "--num-workers", "2",
                                   "--summary-json", tmp_path / "summary.json"))
    assert result.code == 3, result.err
    # --quiet: one closing line for a cron job's log, as a local run gives
    assert result.err_lines[-1] == f"conveyor: {len(RECORDS)}/{len(RECORDS)} records have a row (1 error); wrote {out}"
    rows = read_rows(out)
    assert_same_rows(rows, single)
    assert sorted(p.name for p in (tmp_path / "out.parquet.conveyor").iterdir() if p.is_dir()) == \
        ["shard-0-of-2", "shard-1-of-2"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    ok = [row for row in rows if row["status"] == "ok"]
    for key in ("ttft_s", "latency_s", "queue_s"):  # (an exact max: the driver merged both workers' rows)
        assert summary[key]["max"] == max(row[key] for row in ok)
        assert summary[key]["p50"] == pytest.approx(float(np.percentile([row[key] for row in ok], 50)), abs=2e-6)
    assert summary["model"] == str(tiny_model) and summary["records"] == len(RECORDS)
    assert summary["steps"] > 0 and 0 < summary["occupancy"] <= 1
    assert summary["wall_s"] >= summary["elapsed_s"] > 0


def test_a_worker_killed_mid_run_is_restarted_and_resumes_writing_its_parts_once(tmp_path, tiny_model, single,
                                                                                 local_ray):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    out = tmp_path / "out"
    shard_dir = tmp_path / "out.conveyor" / "shard-1-of-2"
    result = {}
    driver = threading.Thread(target=lambda: result.update(r=run_in_process(
        *_args(tiny_model, src, f"{out}/", "--executor", "ray", "--num-workers", "2", "--rows-per-file", "8",
               "--output-format", "jsonl"))))
    driver.start()
    deadline = time.monotonic() + 300
    while num_committed(shard_dir, strict=False) < 4:
        assert driver.is_alive(), f"the run ended before shard 1 committed 4 rows: {result}"
        assert time.monotonic() < deadline, "timed out waiting for shard 1's 4th commit"
        time.sleep(0.05)
    [name] = [a for a in ray.util.list_named_actors() if a.endswith("shard-1-of-2")]
    killed_at = num_committed(shard_dir, strict=False)
    ray.kill(ray.get_actor(name), no_restart=False)  # the process dies; Ray restarts it and retries the call
    driver.join(timeout=300)
    assert not driver.is_alive() and result["r"].code == 3, result
    assert 0 < killed_at < len(RECORDS) // 2  # it died mid-shard
    parts = sorted(out.glob("part-*"))  # each shard's own parts, every one there (beside the folder's owner)
    assert [p.name for p in parts] == [f"part-0000{k}-shard-{s}-of-2.jsonl" for k in range(6) for s in range(2)]
    assert (out / "_conveyor_run.json").is_file()
    assert_same_rows(sorted((row for part in parts for row in read_rows(part)), key=lambda row: row["index"]),
                     single)


def test_a_driver_stopped_by_sigterm_or_killed_with_kill_9_resumes_to_the_same_output(tmp_path, tiny_model, local_ray,
                                                                                      monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", local_ray)  # the first drivers join the cluster (a driver's death ends its
    # workers); the last starts a local Ray instance of its own, as a driver without RAY_ADDRESS does
    # longer answers than RECORDS': each shard runs for seconds, so both interruptions land mid-shard
    records = [{"id": f"r{i:02d}", "prompt": f"w{i} w{i + 3} " * (1 + i % 6), "max_tokens": 60 + i % 13}
               for i in range(32)]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    opts = ("--ignore-eos", "--max-num-seqs", "2")
    assert run_in_process(*_args(tiny_model, src, tmp_path / "single.jsonl", *opts)).code == 0
    single = read_rows(tmp_path / "single.jsonl")
    out = tmp_path / "out.jsonl"
    run_dir = tmp_path / "out.jsonl.conveyor"
    args = _args(tiny_model, src, out, *opts, "--executor", "ray", "--num-workers", "2")

    def committed() -> int:
        return sum(num_committed(run_dir / f"shard-{i}-of-2", strict=False) for i in range(2))

    child = Child(args, tmp_path, "driver")
    child.wait_until(lambda: committed() >= 2, timeout=300, what="the shards' first commits")
    child.send(signal.SIGTERM)  # the workers stop at their next step and commit; the driver exits 75
    stopped = child.wait(timeout=120)
    assert stopped.code == 75 and "SIGTERM" in stopped.err, stopped.err
    last = stopped.err.strip().splitlines()[-1]
    assert last.startswith("conveyor: ") and "records have a row (0 errors); stopped (" in last, stopped.err
    assert 2 <= committed() < len(records) and not out.exists()
    assert not list(run_dir.glob("ray-stop-*"))
    status = run_in_process("status", out)  # each shard resumes with the driver's command
    assert "(2 shards)" in status.out and "0 of 2 shards finished" in status.out, status.out
    assert status.out.count("resume with: conveyor run") == 2 and "--executor ray" in status.out, status.out
    child = Child(args, tmp_path, "resumed")
    child.wait_until(lambda: committed() >= 6, timeout=300, what="more commits")
    child.kill9()
    done_before = committed()
    monkeypatch.delenv("RAY_ADDRESS")
    again = Child(args, tmp_path, "again").wait(timeout=300)
    assert again.code == 0, again.err
    assert again.err.strip().splitlines()[-1] == \
        f"conveyor: {len(records)}/{len(records)} records have a row (0 errors); wrote {out}", again.err
    assert 0 < done_before < len(records)
    assert_same_rows(read_rows(out), single)
