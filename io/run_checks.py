"""The checks a run makes before any model work, shared by the local run (`run.py`), validation
(`validate_run.py`) and the split-run driver (`split_run.py`): the output path and format, the fields the options
name, and a chat option for a model without a chat template. Each raises SpecError naming the option at fault."""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import os
from collections.abc import Callable

from conveyor.core import Task, option_fields, option_meta
from conveyor.io.errors import SpecError
from conveyor.io.records.batch_lines import is_batch_line, url_task
from conveyor.io.records.build_options import BuildOptions
from conveyor.io.records.prompt_template import PromptTemplate
from conveyor.io.records.prompts import has_chat_template
from conveyor.io.records.readers import Reader
from conveyor.io.rows.writers import OUTPUT_EXTENSIONS, STDOUT, check_keep_fields, infer_output_format
from conveyor.io.run_spec import RunSpec
from conveyor.io.state.paths import check_output_path
from conveyor.io.storage import check_scheme, info, is_remote


def output_folder(spec: RunSpec) -> str | None:
    """The folder of a part-file output (-o ending in "/", an existing folder not named like an output file, or
    --rows-per-file), without its trailing "/"; None for one output file."""
    output = spec.output
    path = output.path
    if path == STDOUT:
        return None
    remote = is_remote(path)
    named_as_file = os.path.splitext(path)[1].lower() in OUTPUT_EXTENSIONS  # (a folder named so is a mistake)
    folder = output.rows_per_file is not None or path.endswith("/") or not named_as_file and \
        (os.path.isdir(path) if not remote else (info(path) or {}).get("type") == "directory")
    return path.rstrip("/") or "/" if folder else None


def check_output(spec: RunSpec) -> str:
    """The output's format (from its name or --output-format; a folder's parts: Parquet unless it is given), its
    path and --keep-fields checked."""
    output = spec.output
    check_scheme(output.path, "-o")
    folder = output_folder(spec)
    if is_remote(output.path) and spec.state.run_dir is None:
        raise SpecError(f"-o {output.path}: give --run-dir too: the run's state (its journal and lock) lives in a "
                        "local or shared folder, not in the store")
    if folder is not None:
        if os.path.splitext(folder)[1].lower() in OUTPUT_EXTENSIONS and not output.path.endswith("/") and \
                not os.path.isdir(folder):
            raise SpecError(f"--rows-per-file: -o {output.path} names a file; part files go into a folder: name one "
                            f"(-o {os.path.splitext(folder)[0]}/)")
        check_keep_fields(spec.build.keep_fields)
        return output.format or "parquet"
    if output.path == STDOUT and output.rows_per_file is not None:
        raise SpecError("--rows-per-file: part files go into a folder, not to stdout; name one (-o answers/)")
    check_output_path(output.path)
    fmt = infer_output_format(output.path, output.format)
    check_keep_fields(spec.build.keep_fields)
    if output.path == STDOUT:
        if spec.state.shard is not None:
            raise SpecError("-o -: a shard does not write the output (the last one to finish does, maybe in "
                            "another process); name an output file")
        if spec.state.run_dir is None:
            raise SpecError("-o -: give --run-dir too: the run's state needs a folder, and stdout has no place "
                            "beside it for one")
    return fmt


def chat_option(spec: RunSpec) -> str | None:
    """The option that builds every prompt through a chat template (none given by --chat-template), if any."""
    b = spec.build
    if b.chat_template is not None:
        return None
    return "--chat-field" if b.chat_field is not None else \
        "--prompt-template-as chat" if b.prompt_template is not None and b.prompt_template_as == "chat" else None


def check_chat_template(spec: RunSpec, tokenizer) -> None:
    """--chat-field and --prompt-template-as chat build every prompt through a chat template: a model without
    one (and no --chat-template) is a usage error before it loads."""
    option = chat_option(spec)
    if option is not None and not has_chat_template(tokenizer):
        raise SpecError(f"{option}: every prompt goes through the model's chat template, and {spec.model} has none; "
                        "give one with --chat-template FILE, or build raw prompts (--prompt-field, --prompt-template)")


def no_chat_template_note(spec: RunSpec, tokenizer, say: Callable[[str], None]) -> None:
    """Said once at the start where a record may be a chat (a messages field, an OpenAI chat body) and the model has
    no chat template to build it with: those records become error rows. Not where the options ask for raw prompts
    (a --prompt-template, or a --prompt-field named without a --messages-field): there it would concern nothing."""
    build, default = spec.build, BuildOptions()
    raw = build.prompt_template is not None or \
        (build.prompt_field != default.prompt_field and build.messages_field == default.messages_field)
    if not raw and build.chat_template is None and not has_chat_template(tokenizer):
        say(f"note: {spec.model} has no chat template: chat records (a messages field, an OpenAI chat body) become "
            "error rows saying so; give one with --chat-template FILE")


FIELD_SAMPLE = 100  # the records of a JSON input whose fields are checked against the options (a table: its columns)
_TABLES = ("csv", "tsv", "parquet", "datasets")


def named_fields(build: BuildOptions) -> list[tuple[str, str]]:
    """(option, field) for each field of the input the options name: --chat-field, --keep-fields, the
    --prompt-template's placeholders, and --prompt-field, --messages-field and --id-field where not the default."""
    default = BuildOptions()
    out = [("--chat-field", build.chat_field)] if build.chat_field is not None else []
    for option, name in (("--prompt-field", "prompt_field"), ("--messages-field", "messages_field"),
                         ("--id-field", "id_field")):
        if getattr(build, name) != getattr(default, name):
            out.append((option, getattr(build, name)))
    if build.prompt_template is not None:
        out += [("--prompt-template", f) for f in PromptTemplate(build.prompt_template).fields]
    return out + [("--keep-fields", f) for f in build.keep_fields]


def check_named_fields(spec: RunSpec, reader: Reader) -> None:
    """A field an option names that the input does not have (a misspelled column) is a usage error before the model
    loads, with the nearest field: a table's columns are its fields; a JSON input's are those of its first
    FIELD_SAMPLE records (a field none of them has, a keep field too: records need not share their fields, but a
    field in none of the first hundred is a typo far more often than a rare field). So is an input whose records
    hold no prompt for generation (no prompt or messages column, or field in none of the first records; no
    --chat-field or --prompt-template): every row would be an error row. Not checked: stdin and pipes (read once),
    and inputs of OpenAI batch lines (their fields are the body's). The input's first records are read once."""
    build, source = spec.build, spec.input.path
    named = named_fields(build)
    needs_prompt = spec.task is Task.GENERATE and build.chat_field is None and build.prompt_template is None
    if not (named or needs_prompt) or source == "-" or not (os.path.isfile(source) or os.path.isdir(source)):
        return
    sample = 1 if reader.format in _TABLES else FIELD_SAMPLE
    records = [r.record for r in itertools.islice(reader, sample) if r.record is not None]
    if not records or any(is_batch_line(r) for r in records):
        return
    seen = list(dict.fromkeys(key for r in records for key in r))
    table = reader.format in _TABLES
    listed = ", ".join(seen) if table else f"{', '.join(seen[:20])}{', ...' if len(seen) > 20 else ''}"
    for option, name in named:
        if name in seen:
            continue
        close = difflib.get_close_matches(name, seen, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        if table:
            where = f"{source} has no column {name!r}{hint}; its columns: {listed}"
        else:
            where = f"{_none_has(records, source, f'field {name!r}')}{hint}; their fields: {listed}"
        raise SpecError(f"{option} {name}: {where}")
    if needs_prompt and build.prompt_field not in seen and build.messages_field not in seen:
        fields = f"{build.prompt_field!r} or {build.messages_field!r}"
        what = f"{source} has no {fields} column" if table else _none_has(records, source, f"{fields} field")
        kind = "column" if table else "field"
        raise SpecError(f"{what} to take each prompt from ({'its' if table else 'their'} {kind}s: {listed}); name the "
                        f"{kind} with --chat-field {kind.upper()} (its text as the user's message, through the chat "
                        f"template) or --prompt-field {kind.upper()} (raw text), or build the prompt with "
                        "--prompt-template")


def _none_has(records: list, source: str, what: str) -> str:
    """"none of the first 3 records of F has a WHAT", or "the first record of F has no WHAT"."""
    if len(records) == 1:
        return f"the first record of {source} has no {what}"
    return f"none of the first {len(records)} records of {source} has a {what}"


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _changed(part, fields=None) -> list[str]:
    """The option fields of dataclass instance `part` (of `fields` where given) that differ from their defaults."""
    out = []
    for f in option_fields(type(part)):
        if fields is not None and f.name not in fields:
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if getattr(part, f.name) != default:
            out.append(option_meta(f).name or f.name)
    return out


def check_task_options(spec: RunSpec) -> None:
    """An option that changes nothing for the run's task (resolved: not auto) is a usage error naming it: a
    pooling option where the run generates, a generation setting where it pools."""
    task = spec.task
    if not task.pools:
        given = _changed(spec.pooling)
        if given:
            raise SpecError(f"{_option(given[0])} applies to --task embed (and score, rerank: the pooling tasks); "
                            "this run generates text. Drop it, or give the task")
        return
    given = _changed(spec.sampling)
    if spec.sampling.grammar is not None:
        given.append({"regex": "regex", "choice": "choice"}.get(spec.sampling.grammar.kind, "json_schema"))
    given += [name for name in ("n", "seed") if getattr(spec.build, name) != getattr(BuildOptions(), name)]
    if spec.reasoning_parser is not None:
        given.append("reasoning_parser")
    # (the KV cache's sizes, speculation and the grammar limits: a pooling step keeps no cache and samples nothing)
    given += _changed(spec.engine, ("speculative", "num_speculative_tokens", "kv_cache_memory", "num_kv_blocks",
                                    "block_size", "gpu_memory_utilization", "max_grammar_compile_s",
                                    "max_grammar_bytes"))
    if spec.engine.schedule != "fcfs":
        given.append("schedule")
    if task is not Task.EMBED:
        given += _changed(spec.pooling, ("normalize", "dimensions"))
    if task.labels:
        given += _changed(spec.pooling, ("pooling",))
    if task.pairs and spec.build.system_prompt:
        raise SpecError(f"--system-prompt: --task {task} scores pairs of raw texts, with no chat template to hold "
                        "a system message; drop it")
    if given:
        what = "generation" if given[0] not in ("normalize", "dimensions", "pooling") else "embeddings"
        raise SpecError(f"{_option(given[0])} is a setting of {what}, which --task {task} does not use; drop it")


def first_batch_task(spec: RunSpec, reader: Reader) -> Task | None:
    """The task the input's first OpenAI batch line asks for by its url (None: the input is not batch lines, or
    cannot be read twice)."""
    source = spec.input.path
    if source == "-" or not (os.path.isfile(source) or os.path.isdir(source)):
        return None
    for raw in itertools.islice(reader, FIELD_SAMPLE):
        if raw.record is not None:
            return url_task(raw.record) if is_batch_line(raw.record) else None
    return None


def check_dimensions(spec: RunSpec, vector_size: int | None) -> None:
    """--dimensions above the model's embedding size is a usage error before any record runs."""
    wanted = spec.pooling.dimensions
    if wanted is not None and vector_size is not None and wanted > vector_size:
        raise SpecError(f"--dimensions {wanted} is more than {spec.model}'s embedding size, {vector_size}; give at "
                        f"most {vector_size}")
