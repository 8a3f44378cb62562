"""`conveyor run ... --executor ray`: one dataset over N conveyor engines on a Ray cluster, exactly once,
resumable.

Each worker is a Ray actor that runs one shard of the run (`--shard I/N`, io/state/shards.py: the same code as
`conveyor run --shard`, with its own journal in the shared run directory); the driver waits for them and merges
their rows into the output. One worker per GPU where the cluster has GPUs (`--num-workers` to use fewer),
else `--num-workers` engines with the cluster's CPUs split between them (torch threads = CPUs per worker).

Fault tolerance is Ray's own: an actor whose process dies is restarted (max_restarts) and the call it was
running is retried on it (max_task_retries), which resumes the shard from its journal, so a worker killed
mid-run loses at most one checkpoint interval. SIGTERM, SIGHUP or Ctrl-C to the driver stops the workers
cleanly (a stop file in the run directory: they commit and return) and exits 75, as a local run does. A driver
killed (kill -9, its node lost) takes its actors with it; the same command again resumes every shard from its
journal.

Cluster: RAY_ADDRESS (for example after `ray start --head`: RAY_ADDRESS=auto, or ray://host:10001) joins that
cluster; without it a local Ray instance starts on this machine. Every node must see the run directory and the
input at the same paths (shared storage: NFS, a parallel file system): each worker checks, before any model
work, that it can read a token the driver wrote into the run directory and open the input.

Why actors over shards rather than Ray Data's `map_batches`: each worker streams the input with conveyor's own
readers (a bad line is an error row, not a failed block; every input format, record digests), and exactly-once
comes from each shard's journal (a row is committed once, by input index), which Ray Data's outputs do not give.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
import uuid
from pathlib import Path

from conveyor.cli.command_line import command_line
from conveyor.cli.config import Invocation
from conveyor.cli.exit_codes import UsageError
from conveyor.cli.notes import quiet_libraries, say
from conveyor.cli.stop_signals import StopController
from conveyor.cli.summary import Ending, check_summary_path, report
from conveyor.io.counts import counted
from conveyor.io.run_spec import RunSpec

MAX_RESTARTS = 4  # a worker that dies more often than this is a real failure, not bad luck


class ShardWorker:
    """The Ray actor: one engine, one shard at a time."""

    def __init__(self, spec: RunSpec, max_runtime: float | None, threads: int | None,
                 command: str | None = None) -> None:
        self.spec = spec
        self.max_runtime = max_runtime  # each worker's own deadline
        self.threads = threads
        self.command = command  # the driver's: the command that resumes this shard

    def check(self, token_path: str, token: str) -> tuple[str, str | None]:
        """(this node, None) where the run directory and input are shared with the driver, else what is wrong."""
        node = socket.gethostname()
        try:
            if Path(token_path).read_text(encoding="utf-8") != token:
                return node, f"{token_path} holds another run's token"
        except OSError as e:
            return node, f"cannot read {token_path} ({e.strerror or e}): the run directory is not shared storage"
        if not Path(self.spec.input.path).exists():
            return node, f"cannot see the input {self.spec.input.path}"
        return node, None

    def run(self, shard: str, stop_path: str | None = None) -> dict:
        """Run shard `shard` ("I/N") to its end, or until it stops (--max-runtime, or `stop_path` exists: the
        driver got a signal): its summary (io's RunSummary: its outcome, and the latency sketches the driver's
        figures are made of) and why it stopped, where it did."""
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        from conveyor.io.run import Run

        quiet_libraries()
        spec = dataclasses.replace(self.spec, state=dataclasses.replace(self.spec.state, shard=shard))
        run = Run(spec, command=self.command, merge_when_done=False)
        stopper = StopController(self.max_runtime)
        if stop_path is not None:
            stopper.stop_when_exists(stop_path, "the driver was asked to stop")
        try:
            run.open()
            run.load_engine()
            result = run.execute(stopper.should_stop)
        finally:
            run.close()
        return {"shard": shard, "summary": result.summary(),
                "message": stopper.reason or result.message,  # (a stopped worker's: why)
                "node": socket.gethostname()}


def run_on_ray(invocation: Invocation) -> int:
    """The run's shards on the Ray cluster, one worker each, until every one is done or a signal stops them; the
    driver (io's SplitRun) then merges their summaries and rows. Its report and exit code."""
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray needs Ray: pip install 'conveyor[ray]'") from None
    from conveyor.io.split_run import SplitRun

    spec, cli = invocation.spec, invocation.cli
    driver = SplitRun(spec)
    run_dir = driver.open()
    check_summary_path(cli.summary_json)
    address = os.environ.get("RAY_ADDRESS") or None
    stopper = StopController()  # the deadline of --max-runtime is each worker's own
    stop_path = None
    owned = not ray.is_initialized()  # a caller (a notebook, a test) may have joined a cluster already
    if owned:
        ray.init(address=address, include_dashboard=False, log_to_driver=not cli.quiet,
                 logging_level="error" if cli.quiet else "warning")
    try:
        token = uuid.uuid4().hex[:12]
        workers, each = _start_workers(ray, spec, cli, run_dir, token)
        if not cli.quiet:
            where = f"cluster {address}" if address else "a local Ray instance" if owned else "the Ray cluster joined"
            say(f"{counted(len(workers), 'worker')} on {where} ({each} each)")
        stop_path = run_dir.resolve() / f"ray-stop-{token}"
        stopper.install()  # a signal: the workers stop at their next step, commit and return
        results = _wait(ray, [w.run.remote(f"{i}/{len(workers)}", str(stop_path)) for i, w in enumerate(workers)],
                        cli, stopper, stop_path)
    finally:
        stopper.uninstall()
        if stop_path is not None:
            stop_path.unlink(missing_ok=True)
        if owned:
            ray.shutdown()
    return _report(driver, results, stopper, cli, len(workers))


def _start_workers(ray, spec: RunSpec, cli, run_dir: Path, token: str) -> tuple[list, str]:
    """The workers (Ray actor handles), and what each has ("1 GPU", "2 CPUs"): one per GPU where the cluster has GPUs
    and the run may use them (`--num-workers` to use fewer), else `--num-workers` (default 1) with the cluster's CPUs
    split between them; each checked to see the run directory and the input."""
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    device = spec.engine.device
    use_gpus = (gpus > 0 and device in ("auto", "cuda")) or device.startswith("cuda:")
    workers_n = cli.num_workers or (gpus if use_gpus else 1)
    if use_gpus and workers_n > gpus:
        raise UsageError(f"--num-workers {workers_n}: the cluster has {counted(gpus, 'GPU')}, one per worker")
    per_worker = max(1, int(resources.get("CPU", 1)) // workers_n)
    options = dict(num_cpus=0 if use_gpus else per_worker, num_gpus=1 if use_gpus else 0,
                   max_restarts=MAX_RESTARTS, max_task_retries=MAX_RESTARTS)
    worker_spec = dataclasses.replace(
        spec, input=dataclasses.replace(spec.input, path=_absolute(spec.input.path)),
        output=dataclasses.replace(spec.output, path=_absolute_output(spec.output.path)),
        state=dataclasses.replace(spec.state, run_dir=str(run_dir.resolve())))
    actor = ray.remote(ShardWorker)
    workers = [actor.options(name=worker_name(token, i, workers_n), **options).remote(
        worker_spec, cli.max_runtime, None if use_gpus else per_worker, command_line()) for i in range(workers_n)]
    _check_storage(ray, workers, run_dir)
    return workers, "1 GPU" if use_gpus else counted(per_worker, "CPU")


def _report(driver, results: list[dict], stopper: StopController, cli, workers_n: int) -> int:
    """The run's summary from the driver (its workers' added; where none stopped, the rows merged), reported."""
    from conveyor.io.run_report import Outcome

    summary, merged = driver.finish([r["summary"] for r in results])
    if merged is None:  # a worker stopped: nothing merged, and no --summary-json
        reason = stopper.reason or next(r["message"] for r in results if r["summary"].outcome is Outcome.STOPPED)
        message = f"stopped ({reason}); run the same command again to resume"
        return report(summary, Ending(message, message, None), cli.quiet, None)
    parts = driver.output_folder is not None
    # (the workers wrote the parts, some in earlier processes of the run: the folder's rows are said, not "wrote")
    wrote = f"{driver.output_folder}/ holds the run's {counted(merged.rows, 'row', thousands=True)} as part files" \
        if parts else \
        f"wrote {driver.spec.output.path}"
    shards = counted(merged.shards, "shard")
    message = f"{counted(workers_n, 'worker')}; " + (f"{shards} wrote their parts" if parts else f"merged {shards}")
    return report(summary, Ending(message, wrote, summary.records, wrote), cli.quiet, cli.summary_json)


def worker_name(token: str, shard: int, count: int) -> str:
    """The Ray actor name of a run's worker for shard `shard` of `count` (`token`: the run's, random)."""
    return f"conveyor-{token}-shard-{shard}-of-{count}"


def _absolute_output(path: str) -> str:
    """-o made absolute (a folder's trailing "/" kept: it says the output is part files); a store's URL as it is."""
    if "://" in path:
        return path
    return str(Path(path).resolve()) + ("/" if path.endswith("/") else "")


def _absolute(path: str) -> str:
    """A local path made absolute (workers may start elsewhere); a hub dataset name stays as it is."""
    p = Path(path)
    return str(p.resolve()) if p.exists() else path


def _check_storage(ray, workers, run_dir: Path) -> None:
    token = uuid.uuid4().hex
    token_path = run_dir / f"ray-check-{token[:12]}"
    token_path.write_text(token, encoding="utf-8")
    try:
        found = ray.get([w.check.remote(str(token_path.resolve()), token) for w in workers])
    finally:
        token_path.unlink(missing_ok=True)
    bad = [(node, problem) for node, problem in found if problem]
    if bad:
        node, problem = bad[0]
        raise UsageError(f"--executor ray: a worker on {node}: {problem}; the run directory ({run_dir}) and the input "
                         "must be on storage every node mounts at the same path (or choose --run-dir there)")


def _wait(ray, pending: list, cli, stopper: StopController, stop_path: Path) -> list[dict]:
    """The workers' results; a worker's error re-raised as itself (its exit code stands). After a signal, the
    stop file tells the workers to stop; they commit and return."""
    results = []
    last = time.monotonic()
    while pending:
        if stopper.should_stop() and not stop_path.exists():
            stop_path.write_text(stopper.reason or "stop", encoding="utf-8")
        done, pending = ray.wait(pending, timeout=0.2)
        for ref in done:
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None)
                raise (cause if isinstance(cause, BaseException) else e) from None
        if not cli.quiet and time.monotonic() - last >= cli.log_every and pending:
            sys.stderr.write(f"conveyor: {len(results)} of {counted(len(results) + len(pending), 'shard')} done\n")
            last = time.monotonic()
    return results
