"""Offline throughput of conveyor against its peers, on one seeded workload, same weights, same machine.

    python benchmarks/throughput.py --dtype bfloat16                 # all engines, n=256, 3 repetitions
    python benchmarks/throughput.py --engines conveyor,vllm --reps 5
    python benchmarks/throughput.py --n 4 --max-tokens-cap 8 --reps 1 # smoke test: every path end to end

What is measured. Output tokens per second: the sum over requests of the tokens each was asked for
(`max_tokens`, generated greedily with EOS ignored, so every engine does exactly the same useful work),
divided by the wall seconds of the one call that generates the whole workload. Each engine runs in its own
fresh process (benchmarks/bench_worker.py), so peak RSS is per engine and nothing is shared; engines alternate
(A B C A B C ...) so that slow drift of a shared machine hits all of them alike, and the table reports the median
and the min-max spread per engine. Ratios against conveyor are the result: absolute seconds on a shared machine
mean little. Each worker also checks that every request really
got its max_tokens tokens (`count_ok`).

Common to all engines: the weights are conveyor's cached SmolLM2-135M-Instruct folder
(`ensure_embedded("smollm2-135m-instruct")`), loaded by every engine from that folder; prompts are the
workload's chat messages through the tokenizer's chat template (`apply_chat_template(...,
add_generation_prompt=True)`), tokenized once here and handed to every engine as token ids; greedy
decoding; `--threads` torch threads (vLLM: the same cores through VLLM_CPU_OMP_THREADS_BIND); the same KV
budget (`--kv-gib`), sequence cap (`--max-num-seqs`) and token budget per step (`--max-num-batched-tokens`)
for the three continuous-batching engines. Timing rule, identical for all: load (not timed into tok/s),
then a short untimed warm-up on other prompts through the same engine instance, then the timed call.

Engines:
  conveyor    conveyor.core.engine.Engine, SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True).
  conveyor-avx2, torch, torch-avx2
              the same engine on the AVX2 kernels (CONVEYOR_CPU_ISA=avx2), on the torch backend (the fallback,
              CONVEYOR_NO_KERNELS=1), and on the torch backend with torch's own kernels, oneDNN and MKL held to
              AVX2 (the fallback as a CPU without AVX-512 runs it): `--engines conveyor-avx2,torch-avx2` prints
              the AVX2 route's ratio to that fallback.
  vllm        vllm.LLM (CPU build, in the venv made by benchmarks/setup_vllm.sh, with its LD_PRELOAD of
              tcmalloc + Intel OpenMP), token-id prompts, SamplingParams(temperature=0, max_tokens=mt,
              ignore_eos=True), vLLM's default CPU compilation (torch.compile, no CUDA graphs) unless
              --vllm-eager. Skipped with a message when the venv is missing.
  hf-cb       transformers' own continuous batching: the manager behind `model.generate_batch`, driven
              through `model.continuous_batching_context_manager` so that each request gets its own
              max_new_tokens (generate_batch takes one max_new_tokens for all) and eos_token_id=-1 (EOS
              ignored); do_sample=False. Settings, and why:
                attn_implementation="sdpa"  CB on CPU accepts sdpa, paged|eager or flash; flash kernels are
                                            GPU-only and paged|eager is the slow fallback, so sdpa;
                                            auto_switch_to_flash=False (nothing to switch to on a CPU).
                num_blocks                  from --kv-gib (page_size 256, transformers' default): by default
                                            it would take 60% of free RAM on a CPU, unlike the others.
                max_batch_tokens / max_requests_per_batch = --max-num-batched-tokens / --max-num-seqs.
                use_cuda_graph=False, use_async_batching=False (the double buffering exists to overlap host
                                            work with a GPU; on a CPU both run on the same cores).
                default_compile_level=0     no torch.compile, like conveyor and the HF baselines.
                allow_block_sharing=True    its prefix cache, as conveyor's and vLLM's are on.
  hf-static   transformers `model.generate` in static padded batches of --static-batch (16) requests,
              taken in workload order (no sorting), left padding. Rule for exact lengths: each batch runs
              with max_new_tokens = min_new_tokens = the largest max_tokens in that batch (EOS can then
              never end it), and each request counts only its own max_tokens tokens as useful output; the
              rest is padding waste, which is exactly what continuous batching removes. The total generated
              including that waste is reported as extra.generated_incl_padding_waste.
  conveyor@REF  with --baseline REF: conveyor as of the git revision REF (a worktree of it in a temporary
              folder, imported in place of this checkout), run exactly like `conveyor`: "before and after"
              of a change in one run, alternated with the other engines.
  sequential  transformers `model.generate`, one request at a time, min_new_tokens = max_new_tokens =
              max_tokens, on the first --sequential-n (16) requests only: its tok/s is on that subset and is
              labelled so.

Output: a table (median tok/s, spread, wall s, peak RSS MiB, each engine's tok/s / conveyor's and
conveyor's / each engine's, fraction of the workload's steady-state roofline ceiling, from the rates in
benchmarks/roofline.json if present: see roofline.py) and
a JSON file (--out, default benchmarks/results/throughput-<dtype>.json) with every run.

Steady state, measured (conveyor only: it reports each step, `Engine.last_step`): a whole run's tok/s
includes its ramp-down, where the last long requests decode a few at a time, so it sits below a ceiling
that assumes a full batch throughout. The steps that ran a full batch (--max-num-seqs requests) are
therefore also timed on their own: their output tokens/s, and that against the roofline ceiling of the
same work (their own prompt tokens per output token and decode context). Run roofline.py just before
this script: the machine's speed drifts, and a ceiling measured in another hour is not this run's. With
--probe, the matmul rates at the decode batch and at the prompt step (and the read bandwidth) are also
timed right before and after each conveyor run, and its steady state is set against their mean as well.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "bench_worker.py"
RESULT_PREFIX = "BENCH_RESULT "
# conveyor's engine on another route of this CPU, in its own process: the environment it runs under.
VARIANTS = {
    "conveyor-avx2": {"CONVEYOR_CPU_ISA": "avx2"},  # the AVX2 kernels (--cpu-isa avx2)
    "torch": {"CONVEYOR_NO_KERNELS": "1"},  # the torch backend: the fallback where the kernels do not run
    # the fallback as a CPU without AVX-512 runs it: torch's own kernels, oneDNN and MKL held to AVX2
    "torch-avx2": {"CONVEYOR_NO_KERNELS": "1", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                   "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
ALL_ENGINES = ("conveyor", "vllm", "hf-cb", "hf-static", "sequential", *VARIANTS)

sys.path.insert(0, str(HERE))
from roofline import cpu_signature  # noqa: E402
from workload import make_workload  # noqa: E402


def chat_token_ids(tokenizer, messages) -> list[int]:
    """apply_chat_template(tokenize=True) gives a list in transformers 4.x, a BatchEncoding in 5.x."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(t) for t in out]


def build_requests(tokenizer, n: int, seed: int, cap: int | None, **shape) -> list[dict]:
    """The workload as token ids; `shape`: make_workload's min_words / max_words / min_tokens / max_tokens."""
    out = []
    for r in make_workload(n, seed, **shape):
        mt = min(r.max_tokens, cap) if cap else r.max_tokens
        out.append({"id": r.id, "prompt_token_ids": chat_token_ids(tokenizer, r.messages), "max_tokens": mt})
    return out


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return list(range(os.cpu_count() or 1))


def load_roofline(path: Path) -> dict | None:
    """roofline.py's record at `path`, if it exists and was measured on a CPU like this one (same model name
    and matmul instruction sets); otherwise None, saying why: another CPU's rates are no ceiling here."""
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    measured_on, here = (record.get("machine") or {}).get("cpu"), cpu_signature()
    if measured_on != here:
        print(f"roofline: {path} was measured on {measured_on!r}, this machine is {here!r}; its rates do not apply "
              f"here, so no roofline fraction from it. Run `python benchmarks/roofline.py` (about 4 minutes) "
              f"to measure this machine, or pass --probe.", file=sys.stderr)
        return None
    return record


def vllm_command(venv: Path, spec_path: Path) -> list[str] | None:
    py = venv / "bin" / "python"
    envfile = venv / "vllm-env.sh"
    if not py.exists() or not envfile.exists():
        return None
    script = (f"source {shlex.quote(str(envfile))} && exec {shlex.quote(str(py))} {shlex.quote(str(WORKER))} "
              f"--engine vllm --spec {shlex.quote(str(spec_path))}")
    return ["bash", "-c", script]


class RssSampler:
    """Peak memory of a worker process and all its descendants (vLLM runs its engine core and worker in child
    processes), sampled from this parent process: the summed RSS every `interval` s, and the summed PSS (shared
    pages divided among the processes that map them, so libraries and weights mapped by several processes count
    once) every `pss_every` samples because reading smaps costs more. Sampling from outside keeps the sampler's
    Python thread off the measured interpreter's GIL (conveyor and the transformers engines run their step loop
    in the worker's main thread; vLLM's runs in a child process either way)."""

    def __init__(self, pid: int, interval: float = 0.1, pss_every: int = 10) -> None:
        import psutil

        self.interval = interval
        self.pss_every = pss_every
        self.peak = 0
        self.peak_pss = 0
        self.peak_detail: list = []
        self._n = 0
        self._stop = threading.Event()
        self._proc = psutil.Process(pid)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self, with_pss: bool) -> None:
        try:
            procs = [self._proc] + self._proc.children(recursive=True)
        except Exception:
            procs = [self._proc]
        detail, pss = [], 0
        for p in procs:
            try:
                if with_pss:
                    full = p.memory_full_info()
                    rss, pss = full.rss, pss + full.pss
                else:
                    rss = p.memory_info().rss
                detail.append((p.pid, p.name(), rss))
            except Exception:
                pass
        total = sum(d[2] for d in detail)
        if total > self.peak:
            self.peak, self.peak_detail = total, detail
        self.peak_pss = max(self.peak_pss, pss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample(with_pss=self._n % self.pss_every == 0)
            self._n += 1
            self._stop.wait(self.interval)

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak


def run_one(engine: str, spec_path: Path, args, log_path: Path) -> dict:
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["OMP_NUM_THREADS"] = str(args.threads)
    if engine == "vllm":
        cmd = vllm_command(args.vllm_venv, spec_path)
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in allowed_cpus()[:args.threads])
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(args.kv_gib)))
        env.pop("PYTHONPATH", None)
    elif engine.startswith("conveyor@"):  # conveyor as of another revision, imported from its worktree
        cmd = [sys.executable, str(WORKER), "--engine", "conveyor", "--spec", str(spec_path)]
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(args.baseline_path), env.get("PYTHONPATH")) if p)
    elif engine in VARIANTS:
        cmd = [sys.executable, str(WORKER), "--engine", "conveyor", "--spec", str(spec_path)]
        env.update(VARIANTS[engine])
    else:
        cmd = [sys.executable, str(WORKER), "--engine", engine, "--spec", str(spec_path)]
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=str(REPO))
        sampler = RssSampler(proc.pid).start()
        try:
            stdout, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            sampler.stop()
            return {"engine": engine, "error": f"timed out after {args.timeout}s (log: {log_path})"}
        sampler.stop()
    elapsed = time.perf_counter() - t0
    with open(log_path, "a", encoding="utf-8") as log:  # vLLM logs to stdout: keep it next to stderr
        log.write("\n--- stdout ---\n" + "".join(l + "\n" for l in stdout.splitlines()
                                                  if not l.startswith(RESULT_PREFIX)))
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            res = json.loads(line[len(RESULT_PREFIX):])
            res["engine"] = engine  # conveyor@REF runs the worker's conveyor engine
            mib = 1024 * 1024
            res["peak_rss_mib"] = max(sampler.peak / mib, res.get("maxrss_self_mib", 0.0))  # summed over the tree
            res["peak_pss_mib"] = sampler.peak_pss / mib
            res["peak_rss_processes"] = [[pid, name, round(rss / mib, 1)] for pid, name, rss in sampler.peak_detail]
            res["process_s"] = elapsed
            res["log"] = str(log_path)
            return res
    tail = Path(log_path).read_text(encoding="utf-8", errors="replace").strip().splitlines()[-15:]
    return {"engine": engine, "error": f"exit {proc.returncode}, no result (log: {log_path})", "log_tail": tail}


def baseline_package(ref: str, tmp: Path) -> Path:
    """A folder to put first on PYTHONPATH so that `import conveyor` is conveyor as of git revision `ref`:
    a worktree of it (detached, in `tmp`) and a `conveyor` package whose subpackages are its folders."""
    tree = tmp / "baseline-tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(tree), ref], check=True,
                   capture_output=True, text=True)
    package = tmp / "baseline" / "conveyor"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for sub in ("core", "io", "cli"):
        (package / sub).symlink_to(tree / sub, target_is_directory=True)
    return package.parent


def remove_baseline(tmp: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tmp / "baseline-tree")],
                   capture_output=True, text=True)


def workload_stats(requests: list[dict]) -> dict:
    """Prompt tokens per output token, and the mean context of a decode token and of a prompt token."""
    out = sum(r["max_tokens"] for r in requests)
    prompt = sum(len(r["prompt_token_ids"]) for r in requests)
    decode_ctx = sum(len(r["prompt_token_ids"]) * r["max_tokens"] + r["max_tokens"] * (r["max_tokens"] - 1) / 2
                     for r in requests) / max(out, 1)
    prompt_ctx = sum(len(r["prompt_token_ids"]) * (len(r["prompt_token_ids"]) + 1) / 2 for r in requests) / max(prompt, 1)
    return {"prompt_per_output": prompt / max(out, 1), "decode_context": decode_ctx, "prompt_context": prompt_ctx}


def steady_state_ceiling(roofline: dict | None, folder: str, dtype: str, requests: list[dict], batch: int,
                         prefill_m: int) -> dict | None:
    """roofline.workload_ceiling for this workload, from benchmarks/roofline.json's measured rates."""
    if not roofline or dtype not in roofline.get("matmul", {}):
        return None
    from roofline import workload_ceiling

    cfg = json.loads((Path(folder) / "config.json").read_text())
    return workload_ceiling(cfg, dtype, roofline["matmul"][dtype], roofline["bandwidth"]["read_gbs"], batch,
                            prefill_m, **workload_stats(requests))


def full_batch_fraction(run: dict, roofline: dict | None, folder: str, dtype: str, requests: list[dict], batch: int,
                        prefill_m: int) -> dict | None:
    """A conveyor run's steady state as measured: the steps that ran a full batch (`batch` requests), their
    output tokens/s, and that against the roofline ceiling of the same work (those steps' own prompt tokens
    per output token and decode context, the workload's prompt context): with roofline.json's rates, and
    with the rates probed next to the run (`--probe`) where there are some."""
    window = (run.get("extra") or {}).get("full_batch_steps")
    if not window or not window.get("tok_s") or not window.get("decode_context"):
        return None
    out = {"steps": window["steps"], "seconds": window["seconds"], "tok_s": window["tok_s"],
           "share_of_wall": window["seconds"] / run["wall_s"] if run.get("wall_s") else None}
    from roofline import workload_ceiling

    cfg = json.loads((Path(folder) / "config.json").read_text())
    mix = {"prompt_per_output": window["prompt_tokens"] / window["output_tokens"],
           "decode_context": window["decode_context"],
           "prompt_context": workload_stats(requests)["prompt_context"]}
    out.update(mix)
    if roofline and dtype in roofline.get("matmul", {}):
        bw = roofline["bandwidth"]["read_gbs"]
        ceiling = workload_ceiling(cfg, dtype, roofline["matmul"][dtype], bw, batch, prefill_m, **mix)
        out.update(ceiling_tok_s=ceiling["tok_s"], fraction_of_roofline=window["tok_s"] / ceiling["tok_s"])
    probe = run.get("probe")
    if probe:
        ceiling = workload_ceiling(cfg, dtype, probe["rates"], probe["read_gbs"], batch, prefill_m, **mix)
        out.update(probed_ceiling_tok_s=ceiling["tok_s"], fraction_of_probed_roofline=window["tok_s"] / ceiling["tok_s"])
    return out


def probe_roofline(args, dtype: str, tmp: Path) -> dict | None:
    """The matmul rates at M = --max-num-seqs and --max-num-batched-tokens, and the read bandwidth, now
    (roofline.py with short timings, in its own process): the machine's speed drifts by tens of percent
    within minutes, so a ceiling for one run is best measured next to it."""
    out = tmp / "probe.json"
    ms = f"{args.max_num_seqs},{args.max_num_batched_tokens}"
    cmd = [sys.executable, str(HERE / "roofline.py"), "--dtypes", dtype, "--ms", ms, "--batch", str(args.max_num_seqs),
           "--min-time", "0.3", "--repeats", "2", "--bw-mib", "256", "--threads", str(args.threads), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=str(REPO), env=env)
    if done.returncode != 0:
        print(f"  roofline probe failed (exit {done.returncode}): {done.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    record = json.loads(out.read_text())
    return {"rates": record["matmul"][dtype], "read_gbs": record["bandwidth"]["read_gbs"]}


def mean_probe(before: dict | None, after: dict | None) -> dict | None:
    """Rates and bandwidth averaged over the probes taken before and after a run."""
    probes = [p for p in (before, after) if p]
    if not probes:
        return None
    rates = [{"m": r["m"], "gflops": statistics.mean(p["rates"][i]["gflops"] for p in probes)}
             for i, r in enumerate(probes[0]["rates"])]
    return {"rates": rates, "read_gbs": statistics.mean(p["read_gbs"] for p in probes),
            "gflops_by_probe": [{str(r["m"]): r["gflops"] for r in p["rates"]} for p in probes]}


def summarize(runs: list[dict], engines: list[str], roofline: dict | None, dtype: str,
              steady: dict | None = None) -> dict:
    summary = {}
    for e in engines:
        ok = [r for r in runs if r.get("engine") == e and "error" not in r]
        if not ok:
            errs = [r.get("error") for r in runs if r.get("engine") == e]
            summary[e] = {"error": errs[0] if errs else "no run"}
            continue
        tps = [r["tok_s"] for r in ok]
        summary[e] = {
            "runs": len(ok),
            "tok_s_median": statistics.median(tps),
            "tok_s_min": min(tps),
            "tok_s_max": max(tps),
            "wall_s_median": statistics.median(r["wall_s"] for r in ok),
            "load_s_median": statistics.median(r["load_s"] for r in ok),
            "peak_rss_mib_max": max(r["peak_rss_mib"] for r in ok),
            "peak_pss_mib_max": max(r.get("peak_pss_mib", 0.0) for r in ok),
            "output_tokens": ok[0]["output_tokens"],
            "num_requests": ok[0]["num_requests"],
            "count_ok": all(r["count_ok"] for r in ok),
        }
        windows = [r["full_batch"] for r in ok if r.get("full_batch")]
        if windows:
            summary[e]["full_batch_tok_s_median"] = statistics.median(w["tok_s"] for w in windows)
            summary[e]["full_batch_share_of_wall"] = statistics.median(w["share_of_wall"] for w in windows)
            for key in ("fraction_of_roofline", "fraction_of_probed_roofline"):
                fractions = [w[key] for w in windows if key in w]
                if fractions:
                    summary[e][f"full_batch_{key}"] = statistics.median(fractions)
                    summary[e][f"full_batch_{key}_range"] = [min(fractions), max(fractions)]
    base = summary.get("conveyor", {}).get("tok_s_median")
    ceiling = None
    if roofline:
        ceiling = roofline.get("ceilings", {}).get(dtype, {}).get("tok_s")
    for s in summary.values():
        if "tok_s_median" not in s:
            continue
        if base:
            s["ratio_to_conveyor"] = s["tok_s_median"] / base
            s["conveyor_over_engine"] = base / s["tok_s_median"] if s["tok_s_median"] else None
        if ceiling:
            s["fraction_of_decode_roofline"] = s["tok_s_median"] / ceiling
        if steady:
            s["fraction_of_roofline"] = s["tok_s_median"] / steady["tok_s"]
    return summary


def print_table(summary: dict, dtype: str, seq_n: int, roofline: dict | None, steady: dict | None) -> None:
    head = (f"{'engine':<24} {'dtype':<9} {'tok/s med':>10} {'spread (min-max)':>18} {'wall s':>8} "
            f"{'RSS MiB':>8} {'PSS MiB':>8} {'x conveyor':>10} {'conveyor/x':>10} {'roofline':>9} {'count':>6}")
    print(head)
    print("-" * len(head))
    for e, s in summary.items():
        label = f"sequential ({seq_n} req)" if e == "sequential" else e
        if "error" in s:
            print(f"{label:<24} {dtype:<9} {'-':>10}  {s['error']}")
            continue
        spread = f"{s['tok_s_min']:.1f}-{s['tok_s_max']:.1f}"
        ratio = f"{s['ratio_to_conveyor']:.2f}x" if "ratio_to_conveyor" in s else "-"
        inv = f"{s['conveyor_over_engine']:.2f}x" if s.get("conveyor_over_engine") else "-"
        roof = f"{100 * s['fraction_of_roofline']:.1f}%" if "fraction_of_roofline" in s else "-"
        print(f"{label:<24} {dtype:<9} {s['tok_s_median']:>10.1f} {spread:>18} {s['wall_s_median']:>8.2f} "
              f"{s['peak_rss_mib_max']:>8.0f} {s['peak_pss_mib_max']:>8.0f} {ratio:>10} {inv:>10} {roof:>9} {'ok' if s['count_ok'] else 'BAD':>6}")
    for e, s in summary.items():
        if e != "conveyor" and "conveyor_over_engine" in s and s.get("conveyor_over_engine"):
            print(f"  conveyor / {e} = {s['conveyor_over_engine']:.2f}x")
    fast, slow = summary.get("conveyor-avx2", {}), summary.get("torch-avx2", {})
    if fast.get("tok_s_median") and slow.get("tok_s_median"):
        print(f"  conveyor-avx2 / torch-avx2 = {fast['tok_s_median'] / slow['tok_s_median']:.2f}x (the AVX2 route "
              "against the fallback an AVX2 CPU runs)")
    if steady:
        print(f"  roofline: this workload's steady-state ceiling {steady['tok_s']:.0f} tok/s ({steady['batch']} "
              f"decoding at {steady['decode_gflops']:.0f} GFLOP/s, mean context {steady['decode_context']:.0f}; "
              f"{steady['prompt_per_output']:.2f} prompt tokens per output token at {steady['prefill_gflops']:.0f} "
              f"GFLOP/s), from benchmarks/roofline.json's rates")
    for e, s in summary.items():
        if "full_batch_tok_s_median" in s:
            print(f"  {e} at steady state (steps running a full batch, {100 * s['full_batch_share_of_wall']:.0f}% of "
                  f"the wall time): {s['full_batch_tok_s_median']:.0f} tok/s")
            for key, source in (("fraction_of_roofline", "roofline.json's rates"),
                                ("fraction_of_probed_roofline", "rates probed before and after each run")):
                if f"full_batch_{key}" in s:
                    lo, hi = s[f"full_batch_{key}_range"]
                    print(f"    {100 * s[f'full_batch_{key}']:.1f}% ({100 * lo:.1f}-{100 * hi:.1f}%) of the roofline "
                          f"ceiling of the same work, from {source}")
    decode = (roofline or {}).get("ceilings", {}).get(dtype)
    if decode:
        print(f"  decode-only ceiling at batch {decode['batch']}, context 0: {decode['tok_s']:.0f} tok/s "
              "(fraction_of_decode_roofline in the JSON)")
    if "sequential" in summary:
        print(f"  sequential: tok/s on the first {seq_n} requests only (one request at a time)")
    print("  RSS / PSS: peak over the engine's whole process tree (vLLM: front end + engine core + worker);"
          " RSS counts pages shared between processes once per process, PSS splits them")


def _span(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ALL_ENGINES), help="comma list of " + ",".join(ALL_ENGINES))
    p.add_argument("--n", type=int, default=256, help="requests in the workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=2.0, help="KV cache budget (GiB) for the batching engines")
    p.add_argument("--threads", type=int, default=cpu_count(), help="torch threads / vLLM bound cores")
    p.add_argument("--static-batch", type=int, default=16)
    p.add_argument("--sequential-n", type=int, default=16)
    p.add_argument("--warmup-n", type=int, default=4, help="untimed warm-up requests (other prompts)")
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--max-tokens-cap", type=int, default=None, help="cap every request's max_tokens (smoke tests)")
    p.add_argument("--prompt-words", type=_span, default=(3, 300), metavar="MIN,MAX",
                   help="words per prompt, log-uniform (default 3,300: about 10-400 tokens with the chat template)")
    p.add_argument("--output-tokens", type=_span, default=(8, 256), metavar="MIN,MAX",
                   help="clip of the skewed max_tokens distribution (default 8,256)")
    p.add_argument("--model", default=None, help="a model folder every engine loads (default: the embedded SmolLM2; "
                   "a quantized folder, say, from benchmarks/quantized.py)")
    p.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("VLLM_VENV", HERE / ".venv-vllm")))
    p.add_argument("--vllm-eager", action="store_true", help="vLLM enforce_eager=True (no torch.compile)")
    p.add_argument("--timeout", type=int, default=7200, help="seconds per engine process")
    p.add_argument("--baseline", default=None, metavar="REF",
                   help="also run conveyor as of git revision REF, as engine conveyor@REF (before/after in one run)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--roofline", type=Path, default=HERE / "roofline.json",
                   help="ceilings from benchmarks/roofline.py (used when the file exists)")
    p.add_argument("--probe", action="store_true",
                   help="also time the matmul rates at the decode batch and the prompt step right before and after "
                        "each conveyor run (~10-40 s each) and report its steady state against that ceiling too")
    args = p.parse_args()

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ALL_ENGINES]
    if args.baseline:
        engines.insert(engines.index("conveyor") + 1 if "conveyor" in engines else 0, f"conveyor@{args.baseline}")
    if unknown:
        p.error(f"unknown engine(s) {unknown}; choose from {ALL_ENGINES}")
    if "vllm" in engines and vllm_command(args.vllm_venv, Path("x")) is None:
        print(f"vllm: skipped, no venv at {args.vllm_venv} (run: bash benchmarks/setup_vllm.sh)", file=sys.stderr)
        engines.remove("vllm")
    if not engines:
        p.error("no engine left to run")
    out_path = args.out or HERE / "results" / f"throughput-{args.dtype}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    log_dir = out_path.parent / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    from conveyor.core.model_loader import ensure_embedded

    folder = args.model or str(ensure_embedded("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    shape = {"min_words": args.prompt_words[0], "max_words": args.prompt_words[1],
             "min_tokens": args.output_tokens[0], "max_tokens": args.output_tokens[1]}
    requests = build_requests(tokenizer, args.n, args.seed, args.max_tokens_cap, **shape)
    warmup = build_requests(tokenizer, args.warmup_n, args.seed + 1, args.warmup_tokens)
    for w in warmup:
        w["id"] = "warmup-" + w["id"]
    common = {"model": folder, "dtype": args.dtype, "threads": args.threads, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "kv_gib": args.kv_gib,
              "static_batch": args.static_batch, "vllm_eager": args.vllm_eager, "warmup": warmup}
    roofline = load_roofline(args.roofline)

    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-") as tmp:
        args.baseline_path = baseline_package(args.baseline, Path(tmp)) if args.baseline else None
        spec_paths = {}
        for e in engines:
            reqs = requests[:args.sequential_n] if e == "sequential" else requests
            spec_paths[e] = Path(tmp) / f"spec-{e}.json"
            spec_paths[e].write_text(json.dumps({**common, "requests": reqs}))
        for rep in range(args.reps):
            for e in engines:
                log_path = log_dir / f"{args.dtype}-{e}-rep{rep}.log"
                print(f"[rep {rep + 1}/{args.reps}] {e} ...", file=sys.stderr, flush=True)
                probing = args.probe and e == "conveyor"
                before = probe_roofline(args, args.dtype, Path(tmp)) if probing else None
                res = run_one(e, spec_paths[e], args, log_path)
                after = probe_roofline(args, args.dtype, Path(tmp)) if probing else None
                res["rep"] = rep
                if probing and "error" not in res:
                    res["probe"] = mean_probe(before, after)
                if "error" not in res:
                    res["full_batch"] = full_batch_fraction(res, roofline, folder, args.dtype, requests,
                                                            args.max_num_seqs, args.max_num_batched_tokens)
                runs.append(res)
                if "error" in res:
                    print(f"  {e}: ERROR {res['error']}", file=sys.stderr)
                    for line in res.get("log_tail", []):
                        print(f"    {line}", file=sys.stderr)
                else:
                    bad = "" if res["count_ok"] else f"  COUNT MISMATCH {res['count_mismatches']}"
                    print(f"  {e}: {res['output_tokens']} tokens in {res['wall_s']:.2f}s = {res['tok_s']:.1f} tok/s,"
                          f" load {res['load_s']:.1f}s, peak RSS {res['peak_rss_mib']:.0f} MiB{bad}",
                          file=sys.stderr, flush=True)
        if args.baseline:
            remove_baseline(Path(tmp))

    steady = steady_state_ceiling(roofline, folder, args.dtype, requests, args.max_num_seqs,
                                  args.max_num_batched_tokens)
    summary = summarize(runs, engines, roofline, args.dtype, steady)
    print_table(summary, args.dtype, min(args.sequential_n, args.n), roofline, steady)
    import torch
    import transformers

    record = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "engines": engines,
        "machine": {"cpu": cpu_signature(), "cores": cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "transformers": transformers.__version__},
        "model": folder,
        "workload": {"n": len(requests), "output_tokens": sum(r["max_tokens"] for r in requests),
                     "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests)},
        "roofline": roofline,
        "steady_state_ceiling": steady,
        "summary": summary,
        "runs": runs,
    }
    out_path.write_text(json.dumps(record, indent=2))
    print(f"wrote {out_path}")
    failed = [e for e, s in summary.items() if "error" in s or not s.get("count_ok", False)]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
