"""BuildOptions: the run's settings for turning records into requests (which fields hold the prompt, the chat and
the id, the template, the system prompt, the run seed, n, truncation, the served model names).
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.core import ConfigError, check_fields, option

MAX_SAMPLES = 128  # completions per record (n): more is a typo or a job for another input
TEMPLATE_AS = ("prompt", "chat")  # --prompt-template-as: a raw prompt, or the user message of a chat


@dataclass(frozen=True)
class BuildOptions:
    """How records become requests (the sampling defaults and the model's context come apart: RequestBuilder)."""

    seed: int = option(0)  # the run seed; a record's effective seed is derive_seed(seed, id) unless it sets one
    # (a record without an id: index_seed(seed, index))
    system_prompt: str | None = option(None)  # prepended to chat records that have no system message
    prompt_field: str = option("prompt")  # the field holding a raw prompt
    messages_field: str = option("messages")  # the field holding chat messages
    id_field: str = option("id")  # the field holding the record's id
    keep_fields: tuple[str, ...] = option(())  # input fields copied to the output row
    n: int = option(1)  # completions per record (a record's own `n` replaces it); sample k > 0: sample_seed
    chat_field: str | None = option(None)  # a field whose text is the user message of a chat (the chat template)
    prompt_template: str | None = option(None)  # "{field}" placeholders filled from the record (prompt_template.py)
    # what the template builds: a raw "prompt" or the "chat" user message
    prompt_template_as: str = option(TEMPLATE_AS[0], choices=TEMPLATE_AS)
    # keep a prompt's last K tokens; "auto": what max_tokens leaves
    truncate_prompt_tokens: int | str | None = option(None)
    # an OpenAI body's model must be one; (): the model's name and path
    served_model_names: tuple[str, ...] = option((), name="served_model_name")
    chat_template: str | None = option(None)  # builds chat prompts instead of the tokenizer's own (Jinja text)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_fields", tuple(self.keep_fields))
        object.__setattr__(self, "served_model_names", tuple(self.served_model_names))
        # n first: its message gives the range (check_fields would only say "expected an integer" for true)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_SAMPLES:
            raise ConfigError("n", f"n must be an integer from 1 to {MAX_SAMPLES} (completions per record), "
                              f"got {self.n!r}")
        check_fields(self)
