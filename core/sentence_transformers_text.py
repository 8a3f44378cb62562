"""What a sentence-transformers checkpoint does to a text before its model reads it, read from its files as the
installed sentence-transformers (6.x) reads a checkpoint of any version:
- the prompt `encode` (and a cross-encoder's `predict`) prepends to every text: config_sentence_transformers.json's
  default_prompt_name, naming one of its prompts; the prompt and the text are joined as they are, then tokenized as
  one text, so the prompt's tokens count within the length limit (a prompts dict without a default changes nothing);
- lowercasing: do_lower_case in the Transformer module's config (5.x's sentence_bert_config.json), which 6.x applies
  as a Lowercase normalizer put first in the tokenizer; `lowercase_texts` does the same;
- the Transformer module's other settings: one that changes the tokens or the model in a way conveyor does not
  reproduce (processing_kwargs for texts, arguments for the tokenizer, the model or its config, another tokenizer,
  another transformers task, a key conveyor does not know) refuses the model, naming the file and the key.
Pure Python but `lowercase_texts`, which edits a loaded tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from conveyor.core.errors import UnsupportedModel

PROMPTS_FILE = "config_sentence_transformers.json"
# The Transformer module's config, under each name sentence-transformers has given it, in the order it looks for it.
TRANSFORMER_FILES = ("sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
                     "sentence_camembert_config.json", "sentence_albert_config.json",
                     "sentence_xlm-roberta_config.json", "sentence_xlnet_config.json")
# Its keys that change nothing `encode` computes: bookkeeping, flash-attention's unpadded layout (the same sums), the
# per-task lengths that only encode_query / encode_document pass, where the files were kept, the backend (the caller
# picks it).
_INERT = {"module_output_name", "unpad_inputs", "query_length", "document_length", "query_expansion", "cache_dir",
          "backend"}
# Arguments for from_pretrained, by the name 6.x gives them and the one earlier versions did: what they load.
_LOAD_ARGUMENTS = {"model_kwargs": "the model", "model_args": "the model", "processor_kwargs": "the tokenizer",
                   "tokenizer_args": "the tokenizer", "config_kwargs": "the model's config",
                   "config_args": "the model's config"}
# Entries of those that sentence-transformers replaces with its own caller's (where to find the files), or drops.
_LOCATION = {"subfolder", "token", "cache_dir", "revision", "local_files_only", "trust_remote_code"}
# processing_kwargs entries that reach a text: the text modality's own, and those common to every modality.
_TEXT_PROCESSING = ("text", "common")
TASKS = ("feature-extraction", "sequence-classification")


@dataclass(frozen=True)
class TextSettings:
    prompt: str  # what `encode` prepends to every text ("": nothing)
    lower_case: str  # the file whose do_lower_case has texts lowercased ("": none asks)
    max_seq_length: int | None  # the Transformer config's own length limit (5.x), where it sets one


def text_settings(folder: Path, name: str) -> TextSettings:
    """What sentence-transformers does to a text of model `name`, whose files (with a modules.json) are in `folder`;
    UnsupportedModel naming the file and the key where it does what conveyor does not."""
    path, config = _transformer_config(folder, name)
    where = f"model {name}: {path}"
    for key, value in config.items():
        _check_setting(key, value, where)
    length = config.get("max_seq_length")
    return TextSettings(_default_prompt(folder, name), path.name if config.get("do_lower_case") else "",
                        length if isinstance(length, int) and length > 0 else None)


def _transformer_config(folder: Path, name: str) -> tuple[Path, dict]:
    """(the Transformer module's config file, its settings): the first of its names that holds any."""
    for file in TRANSFORMER_FILES:
        path = folder / file
        if not path.is_file():
            continue
        config = _json_object(path, f"model {name}")
        if config:
            return path, config
    return folder / TRANSFORMER_FILES[0], {}


def _check_setting(key: str, value, where: str) -> None:
    """UnsupportedModel where the Transformer config's `key` changes what the model reads or how it is loaded in a
    way conveyor does not reproduce."""
    if key in _INERT or key in ("max_seq_length", "do_lower_case"):
        return
    if key == "modality_config":
        if isinstance(value, dict) and "message" in value:
            raise UnsupportedModel(f"{where}: modality_config has \"message\": sentence-transformers renders each "
                                   "text through the tokenizer's chat template before running the model, which "
                                   "conveyor does not do. Embed this model with sentence-transformers, or, where it "
                                   "was trained on plain texts, remove \"message\" from modality_config")
    elif key == "transformer_task":
        if value not in TASKS:
            raise UnsupportedModel(f"{where}: transformer_task {json.dumps(value)} has sentence-transformers load the "
                                   f"model for a task conveyor does not compute ({' or '.join(TASKS)}); run this "
                                   "model with sentence-transformers")
    elif key == "processing_kwargs":
        given = {k: v for k, v in value.items() if k in _TEXT_PROCESSING and v} if isinstance(value, dict) else value
        if given:
            raise UnsupportedModel(f"{where}: processing_kwargs {json.dumps(given)}: sentence-transformers passes "
                                   "these to the tokenizer for every text, which conveyor does not do. Run this "
                                   "model with sentence-transformers, or remove them where the model does not need "
                                   "them")
    elif key in _LOAD_ARGUMENTS:
        given = sorted(set(value) - _LOCATION) if isinstance(value, dict) else [json.dumps(value)] if value else []
        if given:
            raise UnsupportedModel(f"{where}: {key} has {', '.join(given)}, which sentence-transformers passes on "
                                   f"loading {_LOAD_ARGUMENTS[key]} and conveyor does not. Run this model with "
                                   "sentence-transformers, or remove them where the model does not need them")
    elif key == "tokenizer_name_or_path":
        if value is not None:
            raise UnsupportedModel(f"{where}: tokenizer_name_or_path {json.dumps(value)}: sentence-transformers reads "
                                   "the tokenizer from there, conveyor from the model's own files. Copy that "
                                   "tokenizer's files into the model's folder and remove the key")
    else:
        raise UnsupportedModel(f"{where}: key \"{key}\" is not a setting conveyor knows, and it may change what the "
                               "model reads. Run this model with sentence-transformers, or remove the key where it "
                               "changes nothing")


def _default_prompt(folder: Path, name: str) -> str:
    """The prompt config_sentence_transformers.json has `encode` prepend to every text ("": none): its prompts entry
    default_prompt_name names (an entry of null is no prompt, as sentence-transformers reads it)."""
    path = folder / PROMPTS_FILE
    if not path.is_file():
        return ""
    where = f"model {name}: {path}"
    config = _json_object(path, f"model {name}")
    default = config.get("default_prompt_name")
    if default is None:
        return ""
    prompts = config.get("prompts")
    names = ", ".join(json.dumps(k) for k in prompts) if isinstance(prompts, dict) and prompts else "none"
    if not isinstance(default, str) or not isinstance(prompts, dict) or default not in prompts:
        raise UnsupportedModel(f"{where}: default_prompt_name {json.dumps(default)} names none of its prompts "
                               f"({names}), so sentence-transformers does not load the model either; name one of "
                               "them, or set it to null for no prompt")
    prompt = prompts[default]
    if prompt is not None and not isinstance(prompt, str):
        raise UnsupportedModel(f"{where}: prompts[{json.dumps(default)}], the default prompt, is "
                               f"{json.dumps(prompt)}, not a text; give the text sentence-transformers prepends to "
                               "every input")
    return prompt or ""


def _json_object(path: Path, named: str) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedModel(f"{named}: {path} cannot be read ({e}); sentence-transformers cannot load it either, "
                               "fix or remove the file") from None
    if not isinstance(value, dict):
        raise UnsupportedModel(f"{named}: {path} is not a JSON object; sentence-transformers cannot load it either, "
                               "fix or remove the file")
    return value


def lowercase_texts(tokenizer, name: str, config_file: str) -> None:
    """Have `tokenizer` lowercase every text it reads, as sentence-transformers does for the do_lower_case of model
    `name`'s `config_file`: a Lowercase normalizer before the tokenizer's own, unless it has one."""
    from tokenizers.normalizers import Lowercase, Sequence

    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        raise UnsupportedModel(f"model {name}: {config_file} sets do_lower_case, but its tokenizer "
                               f"({type(tokenizer).__name__}) is not a fast tokenizer, the one conveyor lowercases "
                               "texts in; lowercase your texts and set do_lower_case to false")
    normalizer = backend.normalizer
    own = list(normalizer) if isinstance(normalizer, Sequence) else [] if normalizer is None else [normalizer]
    if not any(isinstance(n, Lowercase) for n in own):
        backend.normalizer = Sequence([Lowercase(), *own])
