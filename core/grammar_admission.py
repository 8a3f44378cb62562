"""Grammar admission: requests whose grammar compiles off the step loop, before they join the scheduler.

A request with a grammar waits here, in arrival order, while `Grammars` compiles it on a worker thread (within
its byte and time limits, grammar.py) and the engine steps the others. Each step the engine asks `admit_compiled`:
a request whose grammar compiled goes to the scheduler through the engine's `admit`, with a matcher of its own; one
whose grammar did not (invalid, or past a limit) ends as an error through `Scheduler.finish_request`, like every
other ending, and is handed back for its output. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from conveyor.core.grammar import Grammars
from conveyor.core.request import FinishReason, Request
from conveyor.core.sampling_params import Grammar
from conveyor.core.scheduler import Scheduler

WAIT_S = 0.05  # how long a step with nothing to run waits for a compile to end


class GrammarAdmission:
    """The requests whose grammar is compiling, oldest first. `admit(request, matcher, output_logprobs)` takes a
    request whose grammar compiled to the scheduler; `grammars` is made on the first request with a grammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_compile_s: float, max_bytes: int | None,
                 scheduler: Scheduler, admit: Callable[[Request, Any, tuple | None], None]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_compile_s = max_compile_s
        self.max_bytes = max_bytes
        self.scheduler = scheduler
        self.admit = admit
        self.grammars: Grammars | None = None
        # in arrival order: (the request, its grammar compiling, the logprobs a continued one carries)
        self.compiling: list[tuple[Request, Future, tuple | None]] = []

    def __len__(self) -> int:
        return len(self.compiling)

    def requests(self) -> list[Request]:
        return [request for request, _, _ in self.compiling]

    def submit(self, request: Request, grammar: Grammar, output_logprobs: tuple | None) -> None:
        """Queue `request` while `grammar` compiles; ValueError where the grammar is bigger than the byte limit (the
        request is then not queued: the engine refuses it)."""
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.vocab_size, self.max_compile_s, self.max_bytes)
        future = self.grammars.submit(grammar)
        self.compiling.append((request, future, output_logprobs))

    def admit_compiled(self) -> list[Request]:
        """Admit the requests whose grammar has compiled; end those whose grammar failed to (an invalid one, or past
        its time limit) through the scheduler, and return them."""
        if not self.compiling:
            return []
        self.grammars.poll()
        failed, still = [], []
        for request, future, logprobs in self.compiling:
            if not future.done():
                still.append((request, future, logprobs))
            elif future.exception() is None:
                self.admit(request, self.grammars.matcher_of(future.result()), logprobs)
            else:
                self.scheduler.finish_request(request, FinishReason.ERROR, str(future.exception()))
                failed.append(request)
        self.compiling = still
        return failed

    def wait(self) -> None:
        """Block a little, until a compile ends (the engine, with nothing to run meanwhile)."""
        if self.compiling:
            Grammars.wait([future for _, future, _ in self.compiling], timeout=WAIT_S)
