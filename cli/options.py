"""Annotated option aliases shared by the commands. Every default is None: "not given on the command line", so a
config file value or the default of the field the option fills applies (cli/config.py); the `[default: ...]`
shown in --help is read from that field (`default_text`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any, Optional, TypeVar

import typer

from conveyor.cli.config import choices_text, default_of, default_text, size_text
from conveyor.core import DEFAULT_KV_CACHE_MEMORY, DEFAULT_SPECULATIVE_TOKENS, DEVICE_DEFAULTS, MIN_WAITING
from conveyor.io.run_spec import DEFAULT_ROWS_PER_FILE

_CPU, _GPU = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["cuda"]
_SHOWN = {  # defaults that depend on the device, or read better than the field's value
    "max_num_seqs": f"{_CPU['max_num_seqs']}; on a GPU {_GPU['max_num_seqs']}",
    "max_num_batched_tokens": f"{_CPU['max_num_batched_tokens']}; on a GPU {_GPU['max_num_batched_tokens']}",
    "kv_cache_memory": f"{DEFAULT_KV_CACHE_MEMORY} on the CPU; on a GPU what --gpu-memory-utilization leaves",
    "gpu_memory_utilization": _GPU["gpu_memory_utilization"],
    "max_record_bytes": size_text(default_of("max_record_bytes")),
    "max_grammar_bytes": size_text(default_of("max_grammar_bytes")),
    "lookahead": f"max(2 x --max-num-seqs, {MIN_WAITING})",
    "speculative": "off",
    "num_speculative_tokens": DEFAULT_SPECULATIVE_TOKENS,
    "pooling": "the checkpoint's sentence-transformers config, else last for decoders, cls for encoders",
    "dimensions": "all",
}


def _d(key: str) -> str:
    return default_text(key, _SHOWN.get(key))


# --help's panels, shown in the order `conveyor run` declares its first option of each (cli/run.py): what a record's
# prompt is and what the output holds first, then generation and the pooling tasks, the engine, the run's control.
PROMPT = "Input and prompt"
OUTPUT = "Output"
GEN = "Generation"
POOL = "Embeddings, classification, scoring"
ENG = "Engine"
RUN = "Run control"

TaskOpt = Annotated[Optional[str], typer.Option(
    help=f"What to compute for each record: {choices_text('task')}. auto: a batch line's url says (/v1/embeddings, "
    "/v1/score, /v1/rerank, /v1/classify), else the model: a sequence classifier classifies, an embedding model "
    f"embeds, a language model generates. {_d('task')}", rich_help_panel=POOL)]
PoolingOpt = Annotated[Optional[str], typer.Option(
    help=f"How --task embed pools the last hidden states: {choices_text('pooling')} (the first token). "
    f"{_d('pooling')}", rich_help_panel=POOL)]
NormalizeOpt = Annotated[Optional[bool], typer.Option("--normalize", help="L2-normalize the embeddings (the "
                                                      "default); --no-normalize keeps them raw.",
                                                      rich_help_panel=POOL)]
NoNormalizeOpt = Annotated[bool, typer.Option("--no-normalize", hidden=True)]
DimensionsOpt = Annotated[Optional[int], typer.Option(
    help="Keep the embeddings' first N dimensions (Matryoshka), normalized after the cut; a record's own "
    f"`dimensions` replaces it. {_d('dimensions')}", rich_help_panel=POOL)]

InputArg = Annotated[str, typer.Argument(help="Prompts: .jsonl, .json, .parquet, .csv, .tsv (.gz, .bz2, .xz, .zst), a "
                                              "datasets folder, a hub dataset name (with --split), or - for stdin.")]
OutputOpt = Annotated[str, typer.Option("--output", "-o", help="A file (.parquet or .jsonl), a folder/ for part "
                                        "files, or a URL such as s3://bucket/out/ (with --run-dir); - writes JSONL to "
                                        "stdout once the run is complete (with --run-dir).")]
ConfigOpt = Annotated[Optional[str], typer.Option("--config", "-c", help="YAML file of options; flags override it.")]

ModelOpt = Annotated[Optional[str], typer.Option(help="Embedded model name, local HF folder, .gguf file or hub id. "
                                                      f"{_d('model')}")]
DtypeOpt = Annotated[Optional[str], typer.Option(help=f"{choices_text('dtype')}. {_d('dtype')}",
                                                 rich_help_panel=ENG)]
DeviceOpt = Annotated[Optional[str], typer.Option(help=f"auto, cpu, cuda or cuda:N. {_d('device')}",
                                                  rich_help_panel=ENG)]
BackendOpt = Annotated[Optional[str], typer.Option(help="auto, cpu (conveyor's C++ kernels), cuda (Triton) or torch "
                                                       f"(plain torch, any device). {_d('backend')}",
                                                  rich_help_panel=ENG)]
CpuIsaOpt = Annotated[Optional[str], typer.Option(help="The cpu backend's kernels: auto (AVX-512 where the CPU has it, "
                                                       "else AVX2 + FMA) or avx2 (the AVX2 route on any CPU with it; "
                                                       "exact too, with bits of its own; also CONVEYOR_CPU_ISA). "
                                                       f"{_d('cpu_isa')}", rich_help_panel=ENG)]
MaxTokensOpt = Annotated[Optional[int], typer.Option(help=f"Most tokens to generate per record. {_d('max_tokens')}",
                                                     rich_help_panel=GEN)]
TemperatureOpt = Annotated[Optional[float], typer.Option(help=f"0 = greedy. {_d('temperature')}", rich_help_panel=GEN)]
TopPOpt = Annotated[Optional[float], typer.Option(help=f"Nucleus sampling mass in (0, 1]. {_d('top_p')}",
                                                  rich_help_panel=GEN)]
TopKOpt = Annotated[Optional[int], typer.Option(help=f"Keep the k most likely tokens; 0 = off. {_d('top_k')}",
                                                rich_help_panel=GEN)]
MinPOpt = Annotated[Optional[float], typer.Option(help=f"Drop tokens below min_p x the top probability. {_d('min_p')}",
                                                  rich_help_panel=GEN)]
SeedOpt = Annotated[Optional[int], typer.Option(help="Run seed; each record's seed derives from it and the record's "
                                                     f"id. {_d('seed')}", rich_help_panel=GEN)]
NOpt = Annotated[Optional[int], typer.Option("--n", help="Completions per record (1-128; a record's own n replaces "
                                                   "it): one row each, with sample_index; sample 0 is the n = 1 "
                                                   f"output. {_d('n')}", rich_help_panel=GEN)]
StopOpt = Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).", rich_help_panel=GEN)]
# A switch shows its --name alone; its --no-name (false over a --config file's true) is accepted but not listed, so
# that --help's option column stays narrow enough at 80 columns for the help beside it (`negatives`).
IgnoreEosOpt = Annotated[Optional[bool], typer.Option("--ignore-eos", help="Keep generating past EOS.",
                                                      rich_help_panel=GEN)]
NoIgnoreEosOpt = Annotated[bool, typer.Option("--no-ignore-eos", hidden=True)]
RepetitionPenaltyOpt = Annotated[Optional[float], typer.Option(
    help="Penalize tokens already in the prompt or the output: a positive logit is divided by it, a negative one "
    f"multiplied (vLLM's and transformers' repetition_penalty; 1 is off). {_d('repetition_penalty')}",
    rich_help_panel=GEN)]
MinTokensOpt = Annotated[Optional[int], typer.Option(help=f"Generate at least this many tokens. {_d('min_tokens')}",
                                                     rich_help_panel=GEN)]
JsonSchemaOpt = Annotated[Optional[str], typer.Option(help="A file with a JSON schema every output must match "
                                                           "(structured outputs).", rich_help_panel=GEN)]
ChoiceOpt = Annotated[Optional[str], typer.Option(help="Every output is one of these, e.g. bug,feature,question.",
                                                  rich_help_panel=GEN)]
RegexOpt = Annotated[Optional[str], typer.Option(help="Every output matches this regular expression.",
                                                 rich_help_panel=GEN)]
LogprobsOpt = Annotated[Optional[int], typer.Option(help="Per output token: its logprob and this many top "
                                                         "alternatives (0-20).", rich_help_panel=GEN)]
PromptLogprobsOpt = Annotated[Optional[bool], typer.Option("--prompt-logprobs",
                                                           help="The logprob of every prompt token, and their sum "
                                                                "(scoring, perplexity).", rich_help_panel=GEN)]
NoPromptLogprobsOpt = Annotated[bool, typer.Option("--no-prompt-logprobs", hidden=True)]
ReasoningParserOpt = Annotated[Optional[str], typer.Option(
    help="Put the output's reasoning section (<think>...</think>) in a `reasoning` column and the answer in `output`: "
    "deepseek_r1, qwen3, or auto (from the chat template). Grammars and stop strings apply to the answer.",
    rich_help_panel=GEN)]
SystemPromptOpt = Annotated[Optional[str], typer.Option(help="System message (TEXT, or @FILE) for chat records that "
                                                             "have none: messages records, --chat-field, "
                                                             "--prompt-template-as chat. Not with raw prompts.",
                                                        rich_help_panel=PROMPT)]
ChatTemplateOpt = Annotated[Optional[str], typer.Option(
    help="The chat template (a Jinja file, or the template itself) that builds chat records' prompts, instead of "
         "the model's own (vLLM's option); for a model that has none.", rich_help_panel=PROMPT)]
ChatFieldOpt = Annotated[Optional[str], typer.Option(help="Field whose text is the user message, sent through the "
                                                          "model's chat template (what an instruct model expects).",
                                                     rich_help_panel=PROMPT)]
PromptTemplateOpt = Annotated[Optional[str], typer.Option(
    help="TEXT or @FILE with {field} placeholders (field names only; {{ and }} are braces), filled from each "
    "record's fields. It builds a raw prompt (no chat template); with --prompt-template-as chat, the user message "
    "sent through the chat template.", rich_help_panel=PROMPT)]
PromptTemplateAsOpt = Annotated[Optional[str], typer.Option(help="What --prompt-template builds: prompt (a raw "
                                                                 "prompt) or chat (the user message). "
                                                                 f"{_d('prompt_template_as')}", rich_help_panel=PROMPT)]
TruncatePromptTokensOpt = Annotated[Optional[str], typer.Option(
    help="K or auto: keep a prompt's last K tokens (as vLLM's truncate_prompt_tokens; auto: as many as the context "
    "leaves after the record's max_tokens); rows say how many were cut (prompt_tokens_truncated). Unset: an "
    "over-long prompt is an error row.", rich_help_panel=PROMPT)]
ServedModelNameOpt = Annotated[Optional[str], typer.Option(
    help="NAME[,NAME...]: the model names an OpenAI batch body may give; another is an error line. Unset: --model "
    "as given and its last path part.", rich_help_panel=PROMPT)]
PromptFieldOpt = Annotated[Optional[str], typer.Option(help=f"Field holding a raw prompt. {_d('prompt_field')}",
                                                       rich_help_panel=PROMPT)]
MessagesFieldOpt = Annotated[Optional[str], typer.Option(help=f"Field holding chat messages. {_d('messages_field')}",
                                                         rich_help_panel=PROMPT)]
IdFieldOpt = Annotated[Optional[str], typer.Option(help=f"Field holding the record id. {_d('id_field')}",
                                                   rich_help_panel=PROMPT)]
KeepFieldsOpt = Annotated[Optional[str], typer.Option(help="Input fields to copy to the output, e.g. a,b.",
                                                      rich_help_panel=OUTPUT)]
InputFormatOpt = Annotated[Optional[str], typer.Option(help=f"{choices_text('input_format')} (default: from the "
                                                            "extension).", rich_help_panel=PROMPT)]
OutputFormatOpt = Annotated[Optional[str], typer.Option(help=f"{choices_text('output_format')} (default: from the "
                                                             "extension).", rich_help_panel=OUTPUT)]
RowsPerFileOpt = Annotated[Optional[int], typer.Option(help="Write the output as part files of N records each "
                                                          "(part-00000.parquet, ...) into the folder -o names, each as "
                                                          "soon as its records are done. -o folder/ alone: "
                                                          f"{DEFAULT_ROWS_PER_FILE:,} a part.", rich_help_panel=OUTPUT)]
SplitOpt = Annotated[Optional[str], typer.Option(help="Split of a hub dataset.", rich_help_panel=PROMPT)]
LimitOpt = Annotated[Optional[int], typer.Option(help="Only the first N records.", rich_help_panel=PROMPT)]
MaxRecordBytesOpt = Annotated[Optional[str], typer.Option(help="A record bigger than this (e.g. 4MiB) is an error "
                                                               f"row, never parsed. {_d('max_record_bytes')}",
                                                          rich_help_panel=PROMPT)]
OnErrorOpt = Annotated[Optional[str], typer.Option(help="Bad records: record (error row), skip (no row) or fail "
                                                        f"(stop). {_d('on_error')}", rich_help_panel=OUTPUT)]
MaxNumSeqsOpt = Annotated[Optional[int], typer.Option(help=f"Requests running at once. {_d('max_num_seqs')}",
                                                      rich_help_panel=ENG)]
MaxBatchedTokensOpt = Annotated[Optional[int], typer.Option(help="Tokens per forward pass. "
                                                                 f"{_d('max_num_batched_tokens')}",
                                                            rich_help_panel=ENG)]
NumKvBlocksOpt = Annotated[Optional[int], typer.Option(help="KV cache size in blocks (overrides "
                                                            "--kv-cache-memory).", rich_help_panel=ENG)]
KvMemoryOpt = Annotated[Optional[str], typer.Option(help=f"KV cache budget, e.g. 2GiB. {_d('kv_cache_memory')}",
                                                    rich_help_panel=ENG)]
GpuMemoryOpt = Annotated[Optional[float], typer.Option(help="On a GPU: the fraction of its memory conveyor may take "
                                                            "(weights, activations, KV cache). "
                                                            f"{_d('gpu_memory_utilization')}",
                                                       rich_help_panel=ENG)]
MaxGrammarCompileOpt = Annotated[Optional[float], typer.Option(
    "--max-grammar-compile-s", help="A record's grammar (JSON schema, regex, choices) must compile within this many "
    f"seconds, else the record is an error row; the run goes on meanwhile. {_d('max_grammar_compile_s')}",
    rich_help_panel=GEN)]
MaxGrammarBytesOpt = Annotated[Optional[str], typer.Option(
    help="A record's grammar bigger than this (e.g. 256KiB) is an error row, never compiled. "
    f"{_d('max_grammar_bytes')}", rich_help_panel=GEN)]
ScheduleOpt = Annotated[Optional[str], typer.Option(
    help="The order requests run in: fcfs (input order), priority (a record's priority field, lower first), sjf "
    "(shortest prompt + max_tokens first) or lpm (longest cached prefix first). The outputs are the same under "
    f"each. {_d('schedule')}", rich_help_panel=ENG)]
LookaheadOpt = Annotated[Optional[int], typer.Option(
    help="--schedule priority, sjf or lpm: the waiting records it chooses among. "
    f"{_d('lookahead')}", rich_help_panel=ENG)]
SpeculativeOpt = Annotated[Optional[str], typer.Option(
    help="ngram: speculative decoding by prompt lookup (each record's next tokens guessed from its own prompt and "
    "output, verified in the same step; faster where outputs copy their input: extraction, rewriting, code "
    f"edits). The outputs are the same with it and without. {_d('speculative')}", rich_help_panel=ENG)]
NumSpeculativeTokensOpt = Annotated[Optional[int], typer.Option(
    help=f"--speculative ngram: most draft tokens per record and step. {_d('num_speculative_tokens')}",
    rich_help_panel=ENG)]
BlockSizeOpt = Annotated[Optional[int], typer.Option(help=f"Tokens per KV block. {_d('block_size')}",
                                                     rich_help_panel=ENG)]
QuietOpt = Annotated[Optional[bool], typer.Option("--quiet", "-q", help="Print only warnings, errors and one "
                                                  "closing line (no progress, no summary table).",
                                                  rich_help_panel=RUN)]
NoQuietOpt = Annotated[bool, typer.Option("--no-quiet", hidden=True)]
SummaryJsonOpt = Annotated[Optional[str], typer.Option(help="Write the run summary as JSON here.",
                                                       rich_help_panel=RUN)]
RunDirOpt = Annotated[Optional[str], typer.Option(help="Run directory (default: <output>.conveyor).",
                                                  rich_help_panel=RUN)]
CheckpointEveryOpt = Annotated[Optional[int], typer.Option(help="Commit finished rows every N records (besides "
                                                                f"every {default_of('checkpoint_seconds'):g} s).",
                                                           rich_help_panel=RUN)]
MaxRuntimeOpt = Annotated[Optional[str], typer.Option(help="Stop cleanly after this long, e.g. 50m; exit 75.",
                                                      rich_help_panel=RUN)]
RestartOpt = Annotated[bool, typer.Option("--restart", help="Start over. Rows of other settings are set aside (a later "
                                          "run with those settings takes them back); with the settings unchanged, "
                                          "every row is computed again.",
                                          rich_help_panel=RUN)]
RetryErrorsOpt = Annotated[bool, typer.Option("--retry-errors", help="Compute again the records whose error row the "
                                              "run itself made (a step failure, a grammar over its budget, a fault); "
                                              "rows of bad input stay until their record changes.",
                                              rich_help_panel=RUN)]
ShardOpt = Annotated[Optional[str], typer.Option(help="I/N: answer only the records whose index is I mod N, in a "
                                                     "run directory of this shard's own; the last shard to finish "
                                                     "writes the output (or `conveyor merge`).", rich_help_panel=RUN)]
ExecutorOpt = Annotated[Optional[str], typer.Option(help="local (this process) or ray (one engine per worker on a Ray "
                                                        f"cluster: RAY_ADDRESS, or a local one). {_d('executor')}",
                                                   rich_help_panel=RUN)]
NumWorkersOpt = Annotated[Optional[int], typer.Option(help="--executor ray: engines to run \\[default: the cluster's "
                                                          "GPUs, else 1].", rich_help_panel=RUN)]
ProfileOpt = Annotated[Optional[bool], typer.Option("--profile", help="Print where step time goes.",
                                                    rich_help_panel=RUN)]
NoProfileOpt = Annotated[bool, typer.Option("--no-profile", hidden=True)]


def param(name: str, option: Any, default: Any = None) -> inspect.Parameter:
    """A command's parameter `name`: its option alias (Annotated) and its default (None: not given)."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=option, default=default)


REQUIRED = inspect.Parameter.empty  # the default of an argument the command cannot go without

# The model, the config file and how a record becomes a prompt: the options `conveyor run` and `conveyor validate`
# both take, in --help's order (each command's own come after).
RECORD_OPTIONS = (
    param("model", ModelOpt), param("config", ConfigOpt), param("chat_field", ChatFieldOpt),
    param("prompt_field", PromptFieldOpt), param("messages_field", MessagesFieldOpt),
    param("prompt_template", PromptTemplateOpt), param("prompt_template_as", PromptTemplateAsOpt),
    param("system_prompt", SystemPromptOpt), param("chat_template", ChatTemplateOpt), param("id_field", IdFieldOpt),
    param("input_format", InputFormatOpt), param("split", SplitOpt), param("limit", LimitOpt),
    param("max_record_bytes", MaxRecordBytesOpt), param("truncate_prompt_tokens", TruncatePromptTokensOpt),
    param("served_model_name", ServedModelNameOpt),
)

Command = TypeVar("Command", bound=Callable[..., int])


def takes(*params: inspect.Parameter) -> Callable[[Command], Command]:
    """A command `def name(**flags) -> int` given the options `params`: Typer reads them from its signature, in this
    order (--help's), and calls it with every one by name, in the same order."""

    def command(function: Command) -> Command:
        function.__signature__ = inspect.Signature(list(params), return_annotation=int)  # type: ignore[attr-defined]
        return function

    return command


_SHORT = {"--quiet": ("-q",)}  # switches' short forms


def negatives(flags: dict) -> dict:
    """`flags` with each hidden --no-NAME folded into NAME (False); where both are given, the later one on the
    command line wins (as a flag appended to a command overrides the same flag before it)."""
    from conveyor.cli.command_line import given_last
    from conveyor.cli.option_names import option_name

    out = dict(flags)
    for key in [k for k in flags if k.startswith("no_")]:
        name = key.removeprefix("no_")
        if out.pop(key):
            option = option_name(name)
            positive = (option, *_SHORT.get(option, ()))
            if not out.get(name) or given_last(*positive, "--no-" + option[2:]) not in positive:
                out[name] = False
    return out
