"""The one way a request's tokens become its RequestOutput: the text decoded once, stop strings checked as tokens
arrive, logprobs gathered, a reasoning section split from the answer, a JSON schema's output validated, the output
built. Pure Python.

A request's state lives on the request (`Request.output_state`), made when the engine adds it where it needs one
(stop strings, logprobs), and when its text is decoded. Where the output has a reasoning section, stop strings are
looked for in the answer only (from its first character on), and the schema validates the answer. The scheduler
asks `check_stop` after appending each sampled token, inside `update_from_output`, so a stop string finishes a
request exactly where an EOS would, and `check_output` before it finishes a request that stopped, so an output that
cannot be decoded or that its schema refuses ends as an error there, like any other; the engine hands the runner's
logprobs over with `record` before that, and takes each finished request's `output`. Nothing here writes a
request's status (an output the scheduler finished without asking `check_output`, an abort's, is judged in
`output` alone).
"""

from __future__ import annotations

from conveyor.core.detokenizer import IncrementalDetokenizer
from conveyor.core.errors import failed_while_running, failure
from conveyor.core.outputs import RequestOutput
from conveyor.core.request import FinishReason, Request
from conveyor.core.schedule_types import RunnerOutput, TokenLogprobs
from conveyor.core.schema_check import SchemaCheck
from conveyor.core.stopping import find_stop_string


class OutputState:
    """What a request's output gathers while it runs (`Request.output_state`, written by the output processor
    only)."""

    __slots__ = ("detokenizer", "logprobs", "prompt_logprobs", "answer_char", "decoded")

    def __init__(self, detokenizer: IncrementalDetokenizer | None, logprobs: list[TokenLogprobs] | None,
                 prompt_logprobs: list[TokenLogprobs | None] | None, answer_char: int | None = 0) -> None:
        self.detokenizer = detokenizer  # where it has stop strings: its text so far, decoded as tokens arrive
        self.logprobs = logprobs  # one per output token so far, where asked for
        self.prompt_logprobs = prompt_logprobs  # one per prompt token (the first: None), where asked for
        self.answer_char = answer_char  # where the answer begins in the detokenizer's text (None: still reasoning)
        self.decoded: tuple[str, str | None] | None = None  # (answer, reasoning), once `check_output` decoded them


class OutputProcessor:
    def __init__(self, tokenizer, speculative: bool = False) -> None:
        self.tokenizer = tokenizer
        self.schemas = SchemaCheck()
        self.speculative = speculative  # outputs say how many draft tokens their request was fed and accepted

    def start(self, request: Request, output_logprobs=None) -> None:
        """Give `request` the state its output needs (none for most); a continued request's is replayed over the
        tokens it generated before (`output_logprobs`: theirs, where it asks for logprobs)."""
        s = request.sampling
        if not s.stop and s.logprobs is None and s.prompt_logprobs is None:
            return
        detokenizer, answer_char = None, 0
        if s.stop:
            detokenizer = IncrementalDetokenizer(self.tokenizer)
            answer_start = _answer_start(request)
            if answer_start is None:
                answer_char = None
            elif answer_start:  # a continued request past its reasoning: where its answer's text began
                detokenizer.update(request.output_token_ids[:answer_start])
                answer_char = len(detokenizer.text)
            if request.num_output_tokens:  # text it had, with no stop string found in it: none is looked for there
                detokenizer.update(request.output_token_ids)
        request.output_state = OutputState(
            detokenizer, list(output_logprobs or ()) if s.logprobs is not None else None,
            [None] * request.num_prompt_tokens if s.prompt_logprobs is not None else None, answer_char)

    def logprobs_so_far(self, request: Request) -> tuple[TokenLogprobs, ...] | None:
        """The logprobs of the tokens `request` has generated, where it asks for them."""
        state = request.output_state
        return None if state is None or state.logprobs is None else tuple(state.logprobs[:request.num_output_tokens])

    def record(self, result: RunnerOutput, requests: dict[str, Request]) -> None:
        """The step's logprobs, kept by the requests that asked for them (before their tokens are accepted)."""
        for req_id, found in result.logprobs.items():
            requests[req_id].output_state.logprobs.extend(found)
        for req_id, (first, found) in result.prompt_logprobs.items():
            slots = requests[req_id].output_state.prompt_logprobs
            for position, lp in enumerate(found, first):
                if slots[position] is None:  # a recompute after preemption gives the same values again
                    slots[position] = lp

    def check_stop(self, request: Request) -> FinishReason | None:
        """STOP where the text its newest token completed ends a stop string (from min_tokens on); the scheduler
        calls this after appending a token that no token stop ended."""
        state = request.output_state
        detok = state.detokenizer if state is not None else None
        if detok is None:
            return None
        delta = detok.update(request.output_token_ids)
        if state.answer_char is None:  # reasoning: no stop string is looked for until the answer begins
            if _answer_start(request) is not None:
                state.answer_char = len(detok.text)
            return None
        if not delta or request.num_output_tokens < request.sampling.min_tokens:
            return None
        found = find_stop_string(detok.text, request.sampling.stop, len(delta), state.answer_char)
        return FinishReason.STOP if found is not None else None

    def check_output(self, request: Request) -> str | None:
        """What is wrong with the output of a request that stopped (None: nothing): its text cannot be decoded, or
        it completed its JSON schema's grammar but the schema refuses it (a keyword the grammar engine does not
        enforce while generating). The scheduler asks before it finishes the request; the text is kept for
        `output`."""
        try:
            text, reasoning = self._text(request)
        except Exception as e:  # noqa: BLE001 - one request's tokens, never the run's
            return failed_while_running(failure("decoding its output", e))
        if request.output_state is None:
            request.output_state = OutputState(None, None, None)
        request.output_state.decoded = (text, reasoning)
        if _completed_schema(request):
            mismatch = self.schemas.mismatch(text, request.sampling.grammar.spec)
            if mismatch is not None:
                return f"the output does not match its JSON schema: {mismatch}"
        return None

    def output(self, request: Request) -> RequestOutput:
        """The finished request's output: its text (cut at the first stop string), logprobs and timings; for one
        that ended in error, what failed (with its text where it had one: an output its schema refused)."""
        state = request.output_state
        error = request.error
        if state is None or state.decoded is None:
            if error is None:  # finished without `check_output` (an abort): judged here
                error = self.check_output(request)
                state = request.output_state
        text, reasoning = ("", None) if state is None or state.decoded is None else state.decoded
        first_scheduled = request.first_scheduled_time or request.arrival_time
        return RequestOutput(
            req_id=request.req_id,
            output_token_ids=request.output_token_ids,
            text=text,
            reasoning=reasoning,
            finish_reason=FinishReason.ERROR.value if error is not None else request.finish_reason.value,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            arrival_time=request.arrival_time,
            first_scheduled_time=first_scheduled,
            first_token_time=request.first_token_time or request.finish_time,
            finish_time=request.finish_time,
            # (a step that sampled past a stop, after draft tokens, recorded logprobs its output does not keep)
            logprobs=self.logprobs_so_far(request),
            prompt_logprobs=None if state is None or state.prompt_logprobs is None else tuple(state.prompt_logprobs),
            note=None if error is not None else _grammar_note(request),
            num_draft_tokens=_drafts(request, self.speculative)[0],
            num_accepted_draft_tokens=_drafts(request, self.speculative)[1],
            error=error,
        )

    def _text(self, request: Request) -> tuple[str, str | None]:
        """(the answer, cut at its first stop string; the reasoning, where the output has a section of it)."""
        state = request.output_state
        output_ids = request.output_token_ids
        if state is None or state.detokenizer is None:
            text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        else:
            text = state.detokenizer.finish(output_ids)
        reasoning, parser = None, request.sampling.reasoning
        answer_start = _answer_start(request)
        if parser is not None:
            reasoning, text = parser.split(text, answer_start)
        if request.sampling.stop and answer_start is not None:
            cut = find_stop_string(text, request.sampling.stop, len(text))
            text = text if cut is None else text[:cut]
        return text, reasoning


def _drafts(request: Request, speculative: bool) -> tuple[int | None, int | None]:
    """(draft tokens fed for `request`, of those accepted), where speculation is on (else None, None)."""
    if not speculative:
        return None, None
    state = request.draft_state
    return (0, 0) if state is None else (state.drafted, state.accepted)


def _answer_start(request: Request) -> int | None:
    """The output token where its answer begins: 0 without a reasoning section, None while it is reasoning."""
    state = request.logits_state
    return 0 if request.sampling.reasoning is None or state is None else state.answer_start


def _completed_schema(request: Request) -> bool:
    """Whether `request` ended its JSON schema's grammar (an output cut short is said so by `_grammar_note`)."""
    grammar, state = request.sampling.grammar, request.logits_state
    return (grammar is not None and grammar.kind == "json_schema" and state is not None
            and state.grammar_complete and not state.grammar_failed)


def _grammar_note(request: Request) -> str | None:
    """What a user should know of an output its grammar did not complete."""
    state = request.logits_state
    if state is None or state.matcher is None:
        return None
    if request.finish_reason is FinishReason.LENGTH and not state.grammar_complete:
        return (f"max_tokens ({request.sampling.max_tokens}) ran out before the output completed its "
                f"{request.sampling.grammar.kind.replace('_', ' ')}: the output is incomplete")
    if state.grammar_failed:
        return "the grammar allowed no token the model could continue with: the output stops there"
    return None
