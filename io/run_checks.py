"""The checks a run makes before any model work, shared by the local run (`run.py`), validation
(`validate_run.py`) and the split-run driver (`split_run.py`): the output path and format, and a chat option for
a model without a chat template. Each raises SpecError naming the option at fault."""

from __future__ import annotations

from collections.abc import Callable

from conveyor.io.errors import SpecError
from conveyor.io.records.prompts import has_chat_template
from conveyor.io.rows.writers import STDOUT, check_keep_fields, infer_output_format
from conveyor.io.run_spec import RunSpec
from conveyor.io.state.paths import check_output_path


def check_output(spec: RunSpec) -> str:
    """The output's format (from its name or --output-format), its path and --keep-fields checked."""
    output = spec.output
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
    """Said once at the start: chat records of a model without a chat template become error rows."""
    if spec.build.chat_template is None and not has_chat_template(tokenizer):
        say(f"note: {spec.model} has no chat template: chat records (a messages field, an OpenAI chat body) become "
            "error rows saying so; give one with --chat-template FILE")
