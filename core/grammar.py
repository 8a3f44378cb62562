"""Structured outputs: a request's Grammar compiled off the step loop, kept in a bounded cache, and a matcher per
request.

The grammar engine is xgrammar (vLLM's and SGLang's default), chosen over llguidance by measurement on a
2-core Xeon with SmolLM2's 49k-token vocabulary (benchmarks/NOTES.md): both compile a JSON schema in a few
milliseconds, but on the token streams of 64 real JSON extractions xgrammar fills a row's next-token mask
in ~4 us where llguidance took ~90 us, and at 64 rows a step that is 3-6% of a 135M model's step. Both
libraries' own CPU mask application was the slow part (xgrammar's 12.6 ms, llguidance's 640 ms per
64-row step), which conveyor does itself (`logits_processors.GrammarMask`, a C++ kernel).

A grammar can take minutes and gigabytes to compile (an enum of 100,000 strings, a deeply nested object), so:
- `Grammars.submit` queues it for MAX_COMPILING worker threads (xgrammar releases the GIL): the engine keeps
  stepping its other requests, and stops and deadlines fire, while one waits;
- a grammar bigger than `max_bytes` is refused before compiling, and one that takes longer than
  `max_compile_s` is given up (its thread runs to its end, unwaited: xgrammar cannot be interrupted);
- compiled grammars live in a bounded cache (least recently used, by count and bytes; xgrammar's own cache is
  off), while each running request holds its own matcher, so memory stays flat whatever the number of schemas.
Errors are ValueErrors with the engine's message (an invalid schema or regex) or naming the limit. JSON allows
whitespace between elements, at most MAX_WHITESPACE characters at a time (a small model left free to emit
whitespace can loop on it until max_tokens). Imports no torch.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from conveyor.core.sampling_params import Grammar

MAX_WHITESPACE = 32
MAX_CACHED = 64  # compiled grammars kept for reuse ...
MAX_CACHED_BYTES = 256 << 20  # ... and their bytes at most
MAX_COMPILING = 2  # workers compiling at once within their budget (a 2-core machine has no room for more)
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[21:40:14] /project/cpp/regex_converter.cc:94: "


WORKER_NAME = "conveyor-grammar"


def compiling() -> bool:
    """Whether a grammar is compiling in this process (a worker thread inside xgrammar: a process must then end
    with os._exit, since running the interpreter's finalizers under a compile aborts it)."""
    return any(t.name == WORKER_NAME and t.is_alive() for t in threading.enumerate())


class Grammars:
    def __init__(self, tokenizer: Any, vocab_size: int, max_compile_s: float = float("inf"),
                 max_bytes: int | None = None) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        # The cache is ours, bounded; one thread per compile, so a compile leaves the steps a core.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.max_compile_s = max_compile_s
        self.max_bytes = max_bytes
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()  # least recently used first
        self._cache_bytes = 0
        self._pending: dict[tuple[str, str], Future] = {}  # compiling or queued, by grammar
        self._queue: list[tuple[tuple[str, str], Grammar, Future]] = []  # waiting for a worker
        self._running: dict[Future, tuple[float, int]] = {}  # compiling -> (when it started, its worker)
        self._workers: set[int] = set()  # the live workers that take new work (a given-up one leaves it)
        self._next_worker = 0
        self._lock = threading.Lock()
        self.compile_s: dict[str, float] = {}  # seconds each distinct grammar took to compile ("kind:n": s)

    # -- the engine's side: submit, then poll --------------------------------------------------------------

    def submit(self, grammar: Grammar) -> Future:
        """A future of `grammar` compiled: done at once where it is cached, else compiled on a worker thread
        (requests with the same grammar share one compile). ValueError where it is bigger than `max_bytes`."""
        self._check_size(grammar)
        key = (grammar.kind, grammar.spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                done: Future = Future()
                done.set_result(self._cache[key])
                return done
            future = self._pending.get(key)
            if future is None:
                future = self._pending[key] = Future()
                self._queue.append((key, grammar, future))
        self.poll()
        return future

    def poll(self, now: float | None = None) -> None:
        """Give up compiles past their budget (ValueError naming it; their worker finishes and leaves, and a new one
        takes its place) and keep MAX_COMPILING workers taking the queued grammars."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for future, (started, worker) in list(self._running.items()):
                if future.done():
                    del self._running[future]
                elif now - started > self.max_compile_s:
                    del self._running[future]
                    self._workers.discard(worker)  # it runs to its end, unwaited, and takes no more work
                    self._fail(future, ValueError(
                        f"the grammar did not compile within {self.max_compile_s:g} s (max_grammar_compile_s; "
                        "--max-grammar-compile-s): simplify it, or raise the limit"))
            while len(self._workers) < MAX_COMPILING and self._queue:
                self._next_worker += 1
                self._workers.add(self._next_worker)
                threading.Thread(target=self._work_loop, args=(self._next_worker,), daemon=True,
                                 name=WORKER_NAME).start()

    @staticmethod
    def wait(futures: list[Future], timeout: float) -> None:
        """Block until one of `futures` is done or `timeout` seconds pass (the engine, with nothing else to do)."""
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures

        wait_futures(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def matcher_of(self, compiled: Any):
        """A matcher at the start of a compiled grammar (`submit`'s result), for one request
        (xgrammar.GrammarMatcher)."""
        return self._xgr.GrammarMatcher(compiled)

    # -- blocking, for checks before a run and `conveyor validate` -----------------------------------------

    def compiled(self, grammar: Grammar):
        """`grammar` compiled (xgrammar.CompiledGrammar), within the limits; ValueError where not."""
        future = self.submit(grammar)
        deadline = time.monotonic() + self.max_compile_s
        while not future.done():
            self.wait([future], min(1.0, max(0.0, deadline - time.monotonic()) + 0.01))
            self.poll()
        return future.result()

    def matcher(self, grammar: Grammar):
        """A matcher at the start of `grammar`, compiled here and now (blocking); ValueError where it cannot be."""
        return self.matcher_of(self.compiled(grammar))

    # -- the worker's side ---------------------------------------------------------------------------------

    def _work_loop(self, worker: int) -> None:
        """A worker: the queued grammars one after another, while it is one of the live workers and there is work
        (long-lived threads: a thread per compile left glibc a heap arena each, and memory grew with them)."""
        while True:
            with self._lock:
                if worker not in self._workers or not self._queue:
                    self._workers.discard(worker)
                    return
                key, grammar, future = self._queue.pop(0)
                self._running[future] = (time.monotonic(), worker)
            self._compile_into(key, grammar, future)

    def _compile_into(self, key: tuple[str, str], grammar: Grammar, future: Future) -> None:
        start = time.perf_counter()
        try:
            compiled = self._compile(grammar)
        except ValueError as e:
            with self._lock:
                self._fail(future, e)
            return
        with self._lock:
            self._pending.pop(key, None)
            self._running.pop(future, None)
            if not future.done():  # (given up meanwhile: nobody waits for it any more)
                self.compile_s[f"{grammar.kind}:{len(self.compile_s) + 1}"] = time.perf_counter() - start
                self._keep(key, compiled)
                future.set_result(compiled)

    def _fail(self, future: Future, error: Exception) -> None:
        """(Under the lock.) End `future` with `error`, once; forget its grammar so a later request tries again."""
        for key, pending in list(self._pending.items()):
            if pending is future:
                del self._pending[key]
        self._running.pop(future, None)
        if not future.done():
            future.set_exception(error)

    def _keep(self, key: tuple[str, str], compiled: Any) -> None:
        """(Under the lock.) Cache `compiled`, evicting the least recently used past the bounds."""
        size = int(getattr(compiled, "memory_size_bytes", 0))
        self._cache[key] = compiled
        self._cache_bytes += size
        while len(self._cache) > MAX_CACHED or (self._cache_bytes > MAX_CACHED_BYTES and len(self._cache) > 1):
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= int(getattr(old, "memory_size_bytes", 0))

    def _check_size(self, grammar: Grammar) -> None:
        size = len(grammar.spec.encode())
        if self.max_bytes is not None and size > self.max_bytes:
            raise ValueError(f"the grammar is {size:,} bytes, more than max_grammar_bytes ({self.max_bytes:,}; "
                             "--max-grammar-bytes): simplify it, or raise the limit")

    def _compile(self, grammar: Grammar):
        compiled = self._compile_only(grammar)
        if not self._allows_anything(compiled):
            raise ValueError(f"{_what(grammar)}: it matches no text at all (not even an empty output)")
        return compiled

    def _allows_anything(self, compiled) -> bool:
        """Whether a matcher at the grammar's start allows some token (its end included)."""
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        return bool(bitmask.any())

    def _compile_only(self, grammar: Grammar):
        c = self._compiler
        try:
            if grammar.kind == "json_schema":
                _refuse_external_refs(json.loads(grammar.spec))
                return c.compile_json_schema(grammar.spec, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE)
            if grammar.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=True,
                                             max_whitespace_cnt=MAX_WHITESPACE)
            if grammar.kind == "regex":
                return c.compile_regex(grammar.spec)
            choices = json.loads(grammar.spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(s, str) and s for s in choices):
                raise ValueError("a choice must be a non-empty list of non-empty strings")
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in choices))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError (and others) for bad input
            raise ValueError(f"{_what(grammar)}: {_message(e)}") from None


def _refuse_external_refs(schema: Any) -> None:
    """A `$ref` outside the schema itself (a URL, another file) cannot be followed offline: refused, rather than
    left unconstrained."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                raise ValueError(f"$ref {ref!r} points outside the schema; only references inside it (\"#/...\") "
                                 "can be followed")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _what(grammar: Grammar) -> str:
    return {"json_schema": "invalid JSON schema", "json_object": "invalid JSON object grammar",
            "regex": "invalid regex", "choice": "invalid choice"}[grammar.kind]


def _message(e: Exception) -> str:
    lines = [_CPP_PREFIX.sub("", line.strip()) for line in str(e).strip().splitlines() if line.strip()]
    return (" ".join(lines[:3]) or type(e).__name__)[:300]
