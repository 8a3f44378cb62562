"""Inputs and outputs in object storage, against a real S3-compatible server started here (moto's server mode, over
HTTP, reached by s3fs as any S3 endpoint would be): a remote input to a remote file and to remote parts, a kill -9
and resume writing each remote part once, an input that changed in the store, and the options a remote output
needs."""

from __future__ import annotations

import gzip
import io
import json

import pytest
from cli_helpers import STOP_AFTER_PART, Child, run_in_process, stable, tiny_args, write_jsonl

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

RECORDS = [{"id": f"r{i}", "prompt": f"Name a colour and the number {i}."} for i in range(30)]
GREEDY = ["--max-tokens", "16", "--temperature", "0", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def s3():
    """An S3 endpoint on localhost; the environment points the AWS clients (this process's and children's) at it."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    patch = pytest.MonkeyPatch()
    for key, value in env.items():
        patch.setenv(key, value)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir("data")
    yield fs
    patch.undo()
    server.stop()


def _put(fs, url: str, records: list[dict], gz: bool = False) -> None:
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    fs.pipe(url, gzip.compress(data) if gz else data)
    fs.invalidate_cache()


def _rows(fs, url: str) -> list[dict]:
    import pyarrow.parquet as pq

    fs.invalidate_cache()
    return pq.read_table(io.BytesIO(fs.cat(url))).to_pylist()


def _reference(tmp_path, tiny_model) -> list[dict]:
    src = write_jsonl(tmp_path / "local.jsonl", RECORDS)
    out = tmp_path / "local.jsonl.out.jsonl"
    assert run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *GREEDY, "-q").code == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_a_remote_input_to_a_remote_file_and_a_changed_input_reuses_rows(s3, tmp_path, tiny_model):
    _put(s3, "s3://data/in.jsonl.gz", RECORDS[:20], gz=True)
    args = ["run", "s3://data/in.jsonl.gz", "-o", "s3://data/out.parquet", "--run-dir", tmp_path / "rd",
            *tiny_args(tiny_model), *GREEDY]
    result = run_in_process(*args, "-q")
    assert result.code == 0, result.err
    assert "wrote s3://data/out.parquet" in result.err
    expected = stable(_reference(tmp_path, tiny_model))
    assert stable(_rows(s3, "s3://data/out.parquet")) == expected[:20]
    assert not [p for p in (tmp_path / "rd").iterdir() if p.name.startswith(".upload-")]

    _put(s3, "s3://data/in.jsonl.gz", RECORDS, gz=True)  # a new version of the object: 10 more records
    grown = run_in_process(*args)
    assert grown.code == 0, grown.err
    assert "reused 20, new 10" in grown.out + grown.err
    assert stable(_rows(s3, "s3://data/out.parquet")) == expected
    status = run_in_process("status", "s3://data/out.parquet", "--run-dir", tmp_path / "rd")
    assert status.code == 0 and "finished: s3://data/out.parquet is written" in status.out, status.out


def test_remote_parts_survive_kill_9_and_read_as_one_table(s3, tmp_path, tiny_model):
    import pyarrow.dataset as ds

    _put(s3, "s3://data/parts-in.jsonl", RECORDS)
    command = ["run", "s3://data/parts-in.jsonl", "-o", "s3://data/answers/", "--rows-per-file", "6",
               "--run-dir", tmp_path / "rd", *tiny_args(tiny_model), *GREEDY, "--checkpoint-every", "2",
               "--max-num-seqs", "2"]
    child = Child(command, tmp_path, "killed", setup=STOP_AFTER_PART.format(part=1))  # stops itself mid-run

    def parts() -> dict[str, tuple]:
        """Each part object's (ETag, LastModified): an object put again is modified again."""
        try:
            found = s3.ls("data/answers", detail=True, refresh=True)
        except FileNotFoundError:
            return {}
        return {i["name"].rsplit("/", 1)[1]: (i.get("ETag"), str(i.get("LastModified"))) for i in found
                if i["type"] == "file"}

    child.wait_until(child.is_stopped, what="two parts in the store")
    assert child.kill9().code == -9
    before = parts()
    assert sorted(before) == ["_conveyor_run.json", "part-00000.parquet", "part-00001.parquet"]
    result = run_in_process(*command, "-q")
    assert result.code == 0, result.err
    after = parts()
    assert sorted(after) == ["_conveyor_run.json", *(f"part-0000{k}.parquet" for k in range(5))]
    assert all(after[name] == before[name] for name in before), "a part in the store was written again"
    table = ds.dataset("data/answers/", filesystem=s3, format="parquet").to_table().to_pylist()
    assert stable(table) == stable(_reference(tmp_path, tiny_model))


def test_remote_options_are_checked_before_any_work(s3, tmp_path, tiny_model):
    _put(s3, "s3://data/small.jsonl", RECORDS[:2])
    no_run_dir = run_in_process("run", "s3://data/small.jsonl", "-o", "s3://data/o.parquet", *tiny_args(tiny_model))
    assert no_run_dir.code == 2 and "give --run-dir too" in no_run_dir.err
    missing = run_in_process("run", "s3://data/nothing.jsonl", "-o", tmp_path / "o.parquet", *tiny_args(tiny_model))
    assert missing.code == 2 and "s3://data/nothing.jsonl" in missing.err and "no such object" in missing.err
    unknown = run_in_process("run", "ftp://host/in.jsonl", "-o", tmp_path / "o.parquet", *tiny_args(tiny_model))
    assert unknown.code == 2 and "ftp:// is not a store" in unknown.err
