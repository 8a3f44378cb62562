"""One engine, one fresh process: load, warm up, time one pass over a tokenized workload, print one JSON line.

Run by benchmarks/throughput.py (never imported by it): with this interpreter for conveyor, hf-static, hf-cb
and sequential, and with the vLLM venv's interpreter for vllm. Only the standard library is imported at the top,
so the file runs in either environment; each engine imports what it needs.

    python benchmarks/bench_worker.py --engine conveyor --spec spec.json

spec.json (written by throughput.py):
    {"model": folder, "dtype": "float32"|"bfloat16", "device": "cpu"|"cuda" (default cpu), "threads": int,
     "max_num_seqs": int,
     "max_num_batched_tokens": int, "kv_gib": float, "static_batch": int, "vllm_eager": bool,
     "requests": [{"id", "prompt_token_ids", "max_tokens"}, ...],      # the timed workload
     "warmup":   [{"id", "prompt_token_ids", "max_tokens"}, ...],      # untimed, same engine instance
     optional: "backend" (conveyor's, default auto); (benchmarks/structured.py) "ignore_eos": bool (default
     true), "return_texts": bool, and per
     request "json_schema": the text of a JSON schema its output must match (conveyor and vllm)}

Timing rule, identical for every engine: `load_s` = model load + engine construction; then the warm-up requests
(other prompts than the workload's, a few tokens each) run untimed through the same engine instance; then
`wall_s` = perf_counter around the one call that generates the whole workload (prompts are already token ids,
so tokenization is outside; each engine's own detokenization, if it does any, is inside).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

RESULT_PREFIX = "BENCH_RESULT "


def _torch_setup(spec: dict):
    import torch

    torch.set_num_threads(int(spec["threads"]))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    return torch, dtype


def _device(spec: dict) -> str:
    return spec.get("device", "cpu")


def _hf_model(spec: dict, attn: str = "sdpa"):
    torch, dtype = _torch_setup(spec)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype, attn_implementation=attn)
    model.to(_device(spec)).eval()
    return torch, model


# --------------------------------------------------------------------------------------------- engines
# Each returns (load_s, wall_s, produced: dict id -> number of useful output tokens, extra: dict).


def run_conveyor(spec: dict):
    _torch_setup(spec)
    from conveyor.core.config import EngineConfig
    from conveyor.core.engine import Engine
    from conveyor.core.outputs import GenerationRequest
    from conveyor.core.sampling_params import SamplingParams

    t0 = time.perf_counter()
    config = EngineConfig(dtype=spec["dtype"], device=_device(spec), max_num_seqs=spec["max_num_seqs"],
                          max_num_batched_tokens=spec["max_num_batched_tokens"],
                          kv_cache_memory=int(spec["kv_gib"] * 1024**3),
                          max_waiting=max(256, len(spec["requests"])),
                          # (only when asked: --baseline runs this file against revisions without backends)
                          **({"backend": spec["backend"]} if spec.get("backend", "auto") != "auto" else {}))
    engine = Engine.from_pretrained(spec["model"], config)
    load_s = time.perf_counter() - t0

    from conveyor.core import Grammar

    ignore_eos = spec.get("ignore_eos", True)

    def reqs(items):
        return [GenerationRequest(r["id"], r["prompt_token_ids"], SamplingParams(
            temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=ignore_eos,
            grammar=Grammar("json_schema", r["json_schema"]) if r.get("json_schema") else None)) for r in items]

    grammar_s = _time_grammar_masks(engine)
    list(engine.generate(reqs(spec["warmup"])))
    grammar_s.update(seconds=0.0, steps=0, rows=0)  # the warm-up's masks are not the run's
    work = reqs(spec["requests"])
    full = _StepTally()  # the steps that ran a full batch (max_num_seqs requests): the steady state
    t0 = time.perf_counter()
    outs = []
    for r in work:  # max_waiting >= the workload: what engine.generate() does, one step at a time
        engine.add_request(r)
    while engine.has_unfinished():
        outs.extend(engine.step())
        last = engine.last_step
        if last is not None and last.num_requests >= spec["max_num_seqs"]:
            full.add(last)
    wall_s = time.perf_counter() - t0
    produced = {o.req_id: o.num_output_tokens for o in outs}
    st = engine.stats()
    backend = getattr(engine, "backend", None)
    extra = {"backend": backend.describe() if backend else None, "num_kv_blocks": engine.num_kv_blocks,
             "preemptions": st.num_preemptions,
             "prefix_cache_hit_rate": round(st.prefix_cache_hit_rate, 4), "steps": st.num_steps,
             "full_batch_steps": full.as_dict(), "grammar_masks": dict(grammar_s),
             "graph_replays": getattr(backend, "graph_replays", None)}
    grammars = engine.grammar_admission.grammars
    if grammars is not None:
        extra["grammar_compile_s"] = dict(grammars.compile_s)
    if spec.get("return_texts"):
        extra["texts"] = {o.req_id: o.text for o in outs}
        extra["produced"] = produced
    return load_s, wall_s, produced, extra


def _time_grammar_masks(engine) -> dict:
    """Time conveyor's grammar masks (filling and applying them) inside the run: seconds, steps, rows."""
    from conveyor.core.logits_processors import GrammarMask

    tally = {"seconds": 0.0, "steps": 0, "rows": 0}
    for processor in engine.runner.sampler.processors.order:
        if isinstance(processor, GrammarMask):
            apply = processor.apply

            def timed(logits, rows, entries, states, apply=apply):
                t = time.perf_counter()
                apply(logits, rows, entries, states)
                tally["seconds"] += time.perf_counter() - t
                tally["steps"] += 1
                tally["rows"] += len(rows)

            processor.apply = timed
    return tally


class _StepTally:
    """Sums of conveyor's StepInfo over a set of steps."""

    def __init__(self) -> None:
        self.steps = 0
        self.seconds = 0.0
        self.sampled = 0
        self.tokens = 0
        self.decode_rows = 0
        self.decode_keys = 0

    def add(self, info) -> None:
        self.steps += 1
        self.seconds += info.seconds
        self.sampled += info.num_sampled
        self.tokens += info.num_tokens
        self.decode_rows += info.num_decode_rows
        self.decode_keys += info.decode_keys

    def as_dict(self) -> dict:
        """Output tokens/s over these steps, and the mix of work they did (for their roofline ceiling)."""
        return {"steps": self.steps, "seconds": self.seconds, "output_tokens": self.sampled,
                "tok_s": self.sampled / self.seconds if self.seconds else None,
                "prompt_tokens": self.tokens - self.decode_rows,
                "decode_context": self.decode_keys / self.decode_rows if self.decode_rows else None}


def run_hf_static(spec: dict):
    """Static batches of `static_batch` requests in workload order; see throughput.py's docstring for the rule."""
    t0 = time.perf_counter()
    torch, model = _hf_model(spec)
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    load_s = time.perf_counter() - t0
    bs = int(spec["static_batch"])

    def run(items):
        produced, generated_total = {}, 0
        for i in range(0, len(items), bs):
            batch = items[i:i + bs]
            width = max(len(r["prompt_token_ids"]) for r in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for j, r in enumerate(batch):  # left padding
                p = r["prompt_token_ids"]
                ids[j, width - len(p):] = torch.tensor(p, dtype=torch.long)
                mask[j, width - len(p):] = 1
            new = max(r["max_tokens"] for r in batch)
            ids, mask = ids.to(model.device), mask.to(model.device)
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                     min_new_tokens=new, pad_token_id=pad_id)
            got = out.shape[1] - width
            generated_total += got * len(batch)
            for r in batch:  # useful = the request's own max_tokens, when the batch really produced that many
                produced[r["id"]] = min(got, r["max_tokens"])
        return produced, generated_total

    run(spec["warmup"])
    t0 = time.perf_counter()
    produced, generated_total = run(spec["requests"])
    wall_s = time.perf_counter() - t0
    return load_s, wall_s, produced, {"static_batch": bs, "generated_incl_padding_waste": generated_total}


def run_sequential(spec: dict):
    t0 = time.perf_counter()
    torch, model = _hf_model(spec)
    load_s = time.perf_counter() - t0

    def run(items):
        produced = {}
        for r in items:
            ids = torch.tensor([r["prompt_token_ids"]], dtype=torch.long, device=model.device)
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=r["max_tokens"], min_new_tokens=r["max_tokens"])
            produced[r["id"]] = out.shape[1] - ids.shape[1]
        return produced

    run(spec["warmup"][:1])
    t0 = time.perf_counter()
    produced = run(spec["requests"])
    wall_s = time.perf_counter() - t0
    return load_s, wall_s, produced, {}


def run_hf_cb(spec: dict):
    """transformers' continuous batching manager (the engine behind `generate_batch`), fed per-request
    max_new_tokens and eos_token_id=-1; settings explained in throughput.py's docstring."""
    t0 = time.perf_counter()
    torch, model = _hf_model(spec, attn="sdpa")
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    elem = 4 if spec["dtype"] == "float32" else 2
    page_size = int(spec.get("cb_page_size", 256))
    kv_bytes_per_token = cfg.num_hidden_layers * 2 * kv_heads * head_dim * elem
    num_blocks = max(1, int(spec["kv_gib"] * 1024**3 // (kv_bytes_per_token * page_size)))
    on_cpu = _device(spec) == "cpu"
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,  # same KV budget as the other engines (default: ~60% of RAM on a CPU)
        max_batch_tokens=spec["max_num_batched_tokens"],
        max_requests_per_batch=spec["max_num_seqs"],
        # CPU: no graphs, no double buffering, nothing flash to switch to; GPU: transformers' own defaults
        use_cuda_graph=False if on_cpu else None,
        use_async_batching=False if on_cpu else None,
        auto_switch_to_flash=not on_cpu,
        default_compile_level=0,
        allow_block_sharing=True,
    )
    everything = spec["requests"] + spec["warmup"]
    hints = WorkloadHints(max_prompt_length=max(len(r["prompt_token_ids"]) for r in everything),
                          max_generated_length=max(r["max_tokens"] for r in everything),
                          num_requests=len(spec["requests"]))
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=model.config.pad_token_id,
                                  max_new_tokens=hints.max_generated_length)

    def run(manager, items):
        for r in items:
            manager.add_request(r["prompt_token_ids"], request_id=r["id"], max_new_tokens=r["max_tokens"],
                                eos_token_id=-1)
        produced, errors = {}, []
        while len(produced) + len(errors) < len(items):
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching thread stopped")
                continue
            if res.is_finished():
                if res.error is not None:
                    errors.append(f"{res.request_id}: {res.error}")
                produced[res.request_id] = len(res.generated_tokens)
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
        return produced

    with model.continuous_batching_context_manager(generation_config=gen_config, continuous_batching_config=cb_config,
                                                   workload_hints=hints, warmup=True, block=True,
                                                   timeout=30) as manager:
        load_s = time.perf_counter() - t0
        run(manager, spec["warmup"])
        t0 = time.perf_counter()
        produced = run(manager, spec["requests"])
        wall_s = time.perf_counter() - t0
        resolved = getattr(manager, "continuous_batching_config", None)
        extra = {"attn_implementation": model.config._attn_implementation, "page_size": page_size,
                 "num_blocks": getattr(resolved, "num_blocks", num_blocks),
                 "max_batch_tokens": getattr(resolved, "max_batch_tokens", None),
                 "max_requests_per_batch": getattr(resolved, "max_requests_per_batch", None)}
    return load_s, wall_s, produced, extra


def run_vllm(spec: dict):
    import vllm
    from vllm import LLM, SamplingParams

    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # older layouts
        TokensPrompt = dict  # noqa: N806

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"], seed=0,
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              enforce_eager=bool(spec.get("vllm_eager", False)), enable_prefix_caching=True,
              kv_cache_memory_bytes=int(spec["kv_gib"] * 1024**3))
    load_s = time.perf_counter() - t0

    ignore_eos = spec.get("ignore_eos", True)

    def structured(r):
        if not r.get("json_schema"):
            return {}
        from vllm.sampling_params import StructuredOutputsParams

        return {"structured_outputs": StructuredOutputsParams(json=json.loads(r["json_schema"]))}

    def run(items):
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in items]
        params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=ignore_eos, **structured(r))
                  for r in items]
        return llm.generate(prompts, params, use_tqdm=False)

    run(spec["warmup"])
    t0 = time.perf_counter()
    outs = run(spec["requests"])
    wall_s = time.perf_counter() - t0
    ids = [r["id"] for r in spec["requests"]]
    produced = {i: len(o.outputs[0].token_ids) for i, o in zip(ids, outs)}
    if spec.get("return_texts"):
        texts = {i: o.outputs[0].text for i, o in zip(ids, outs)}
    extra = {"vllm_version": vllm.__version__, "enforce_eager": bool(spec.get("vllm_eager", False)),
             "env": {k: os.environ.get(k, "") for k in ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND",
                                                        "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE")}}
    if spec.get("return_texts"):
        extra["texts"] = texts
        extra["produced"] = produced
    try:
        llm.llm_engine.engine_core.shutdown()  # let the engine-core process exit before we report
    except Exception:
        pass
    return load_s, wall_s, produced, extra


ENGINES = {"conveyor": run_conveyor, "hf-static": run_hf_static, "hf-cb": run_hf_cb, "sequential": run_sequential,
           "vllm": run_vllm}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", required=True, choices=sorted(ENGINES))
    p.add_argument("--spec", required=True)
    a = p.parse_args()
    with open(a.spec, encoding="utf-8") as f:
        spec = json.load(f)
    load_s, wall_s, produced, extra = ENGINES[a.engine](spec)
    gpu_peak = None
    if _device(spec).startswith("cuda"):
        import torch

        gpu_peak = torch.cuda.max_memory_allocated() / 1024**2
    asked = {r["id"]: r["max_tokens"] for r in spec["requests"]}
    wrong = [i for i, n in asked.items() if produced.get(i) != n]
    tokens = sum(asked.values())
    mib = 1024 * 1024
    self_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    child_maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    result = {
        "engine": a.engine,
        "dtype": spec["dtype"],
        "num_requests": len(asked),
        "output_tokens": tokens,  # sum of max_tokens asked for
        "output_tokens_produced": sum(min(produced.get(i, 0), n) for i, n in asked.items()),
        "count_ok": not wrong,
        "count_mismatches": [[i, asked[i], produced.get(i)] for i in wrong[:5]],
        "wall_s": wall_s,
        "tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "load_s": load_s,
        "maxrss_self_mib": self_maxrss / mib,  # the process tree's peak RSS / PSS: sampled by throughput.py
        "maxrss_children_mib": child_maxrss / mib,
        "threads": spec["threads"],
        "device": _device(spec),
        "gpu_peak_allocated_mib": gpu_peak,
        "pid": os.getpid(),
        "python": sys.executable,
        "extra": extra,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    sys.stdout.flush()
    # vLLM and transformers' CB leave non-daemon threads / atexit hooks behind; the result is out, so leave now.
    os._exit(0)


if __name__ == "__main__":
    main()
