"""How a checkpoint pools, read from its sentence-transformers files where it has them (`modules.json`, the pooling
module's `config.json`, `sentence_bert_config.json`) in every layout sentence-transformers has written (5.x's
`sentence_transformers.models.*` and `pooling_mode_*` booleans, 6.x's `sentence_transformers.base.modules.*` and
`"pooling_mode": "mean"`), else the default of its kind: the last token for decoders, the first ([CLS]) for encoders,
normalized; `--pooling` overrides the mode either gives. What sentence-transformers does to a text first (the default
prompt it prepends, lowercasing) comes with it (`sentence_transformers_text`). A module conveyor does not compute (a
Dense projection, a custom class, max or weighted pooling, a default prompt left out of the mean, texts rendered
through a chat template) refuses the model, naming it. And what a checkpoint is (`ModelKind`): an embedder or a
sequence classifier (a classifier, a cross-encoder, a reward model, with the activation its sentence-transformers
files name), which decides the tasks it can do (`check_task`) and the one `--task auto` picks (`default_task`). Pure
Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from conveyor.core.errors import UnsupportedModel
from conveyor.core.model_shape import context_of
from conveyor.core.sentence_transformers_text import PROMPTS_FILE, text_settings
from conveyor.core.task import Task

SEQUENCE_CLASSIFIER = "ForSequenceClassification"
_SIGMOID = "torch.nn.modules.activation.Sigmoid"
_IDENTITY = "torch.nn.modules.linear.Identity"
# The sentence-transformers modules conveyor computes, in the order they run. A module is known by its class name
# under the sentence-transformers package, wherever a version put it (5.x: sentence_transformers.models.Pooling;
# 6.x: sentence_transformers.sentence_transformer.modules.pooling.Pooling).
_COMPUTED = ("Transformer", "Pooling", "Normalize")
_PACKAGE = "sentence_transformers."
# A pooling mode as sentence-transformers names it -> conveyor's --pooling.
_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
# 5.x's booleans, in the order sentence-transformers reads them (6.x still reads them; where none is on, mean).
_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


@dataclass(frozen=True)
class PoolingConfig:
    pooling: str  # "last", "mean" or "cls"
    normalize: bool
    max_seq_length: int | None  # the sentence-transformers length limit, where the checkpoint sets one
    source: str  # where it was read: "modules.json", "--pooling" or "the default for decoders" / "... for encoders"
    prompt: str = ""  # what sentence-transformers prepends to every text ("": nothing)
    lower_case: str = ""  # the sentence-transformers file whose do_lower_case has texts lowercased ("": none asks)


def pooling_config(folder: Path | None, name: str, encoder: bool, pooling: str | None = None) -> PoolingConfig:
    """The pooling of model `name` (its files in `folder`; None: a hub id not in the cache), `encoder`: whether it
    is a bidirectional encoder; `pooling` (--pooling), where given, in place of the checkpoint's mode."""
    kind = "encoders" if encoder else "decoders"
    default = PoolingConfig(pooling or ("cls" if encoder else "last"), True, None,
                            "--pooling" if pooling else f"the default for {kind}")
    if folder is None or not (folder / "modules.json").is_file():
        return default
    where = f"model {name}: modules.json"
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedModel(f"{where} cannot be read ({e})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise UnsupportedModel(f"{where} is not a list of modules")
    classes = [_computed_class(m, i, where) for i, m in enumerate(modules)]
    if classes[:1] != ["Transformer"] or classes != sorted(set(classes), key=_COMPUTED.index):
        raise UnsupportedModel(f"{where}: its modules {', '.join(classes) or '(none)'} are not a Transformer "
                               "followed by at most one Pooling and one Normalize, the order conveyor computes")
    settings = text_settings(folder, name)
    mode = default.pooling
    if "Pooling" in classes and pooling is None:
        module = modules[classes.index("Pooling")]
        mode = _pooling_mode(folder / str(module.get("path", "")) / "config.json", f"model {name}", settings.prompt)
    source = "--pooling" if pooling else "modules.json"
    return PoolingConfig(mode, "Normalize" in classes, _max_seq_length(folder, settings.max_seq_length), source,
                         settings.prompt, settings.lower_case)


def _computed_class(module: dict, index: int, where: str) -> str:
    """The class name of a module conveyor computes; UnsupportedModel naming the class and its path otherwise."""
    ref = str(module.get("type", ""))
    cls = ref.rsplit(".", 1)[-1]
    if ref.startswith(_PACKAGE) and cls in _COMPUTED:
        return cls
    which = f"module {module.get('idx', index)} ({module.get('path') or 'the model folder'})"
    if not cls:
        raise UnsupportedModel(f"{where}: {which} has no \"type\"; give it its sentence-transformers class")
    origin = "a sentence-transformers module" if ref.startswith(_PACKAGE) else "a custom module"
    raise UnsupportedModel(f"{where}: {which} is class {cls} (type {ref}), {origin} conveyor does not compute: it "
                           "computes only sentence-transformers' own Transformer, Pooling and Normalize. Embed this "
                           "model with sentence-transformers")


def _max_seq_length(folder: Path, own: int | None) -> int | None:
    """The length sentence-transformers truncates texts to: the Transformer config's own max_seq_length (5.x's, in
    sentence_bert_config.json), else the tokenizer's model_max_length (where 6.x keeps it, and what 5.x falls back
    to)."""
    value = _json_object(folder / "tokenizer_config.json").get("model_max_length")
    return own if own is not None else value if isinstance(value, int) and value > 0 else None


def _json_object(path: Path) -> dict:
    """The JSON object in `path`, or {} where there is none to read."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _pooling_mode(path: Path, named: str, prompt: str) -> str:
    """The mode of the pooling config in `path`, for a model whose texts get `prompt` first."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedModel(f"{named}: its pooling config {path} cannot be read ({e})") from None
    if not isinstance(config, dict):
        raise UnsupportedModel(f"{named}: its pooling config {path} is not a JSON object")
    modes = _pooling_modes(config, path, named)
    choose = "; give --pooling last, mean or cls to pool by one of those instead"
    if len(modes) != 1:
        raise UnsupportedModel(f"{named}: its pooling config {path} joins {len(modes)} poolings "
                               f"({', '.join(modes)}) into one vector; conveyor computes one{choose}")
    if modes[0] not in _MODES:
        raise UnsupportedModel(f"{named}: its pooling config {path} asks for {modes[0]} pooling; conveyor pools by "
                               f"the last token (lasttoken), the mean (mean) or the first token (cls){choose}")
    if prompt and not config.get("include_prompt", True):  # (without a prompt, every token is pooled)
        raise UnsupportedModel(f"{named}: its pooling config {path} leaves the prompt out of the pooled tokens "
                               f"(include_prompt: false), and its {PROMPTS_FILE} prepends a default prompt to every "
                               f"text; conveyor pools the prompt's tokens too{choose}")
    return _MODES[modes[0]]


def _pooling_modes(config: dict, path: Path, named: str) -> tuple[str, ...]:
    """The modes a pooling config joins, as sentence-transformers reads them: 6.x's "pooling_mode" (a name or a
    list of names), else 5.x's pooling_mode_* booleans."""
    if "pooling_mode" not in config:
        return tuple(mode for key, mode in _LEGACY_MODES.items() if config.get(key)) or ("mean",)
    given = config["pooling_mode"]
    modes = (given,) if isinstance(given, str) else tuple(given) if isinstance(given, list) else ()
    if not modes or not all(isinstance(m, str) for m in modes):
        raise UnsupportedModel(f"{named}: its pooling config {path} has pooling_mode {json.dumps(given)}, neither a "
                               "mode's name nor a list of them; give it \"lasttoken\", \"mean\" or \"cls\"")
    return modes


@dataclass(frozen=True)
class ModelKind:
    """What a checkpoint is, from its config alone."""

    classifier: bool  # has a sequence-classification head
    encoder: bool  # a bidirectional encoder
    num_labels: int
    labels: tuple[str, ...]  # the head's label per class (id2label)
    score_activation: str  # a cross-encoder's: "sigmoid" or "identity" (sentence-transformers' activation_fn)
    similarity: str | None = None  # an embedder's similarity_fn_name (None: not named, cosine)


def model_kind(cfg, name: str, folder: Path | None) -> ModelKind:
    """What model `name` is, from its config `cfg` and the sentence-transformers files in `folder` (None: none)."""
    from conveyor.core.model_support import ENCODERS

    archs = list(getattr(cfg, "architectures", None) or [])
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModel(f"model {name} ({', '.join(archs) or cfg.model_type}): an encoder-decoder model; "
                               "conveyor pools encoders and decoders")
    classifier = any(a.endswith(SEQUENCE_CLASSIFIER) for a in archs)
    num_labels = int(getattr(cfg, "num_labels", 0) or 0) if classifier else 0
    id2label = getattr(cfg, "id2label", None) or {}
    labels = tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels))
    saved = _json_object(folder / "config_sentence_transformers.json") if folder is not None else {}
    given = _activation(cfg, saved) if classifier else None  # (an embedder has no activation to compute)
    if given not in (None, _SIGMOID, _IDENTITY):
        raise UnsupportedModel(f"model {name}: its cross-encoder activation {given} is not one conveyor computes "
                               "(Sigmoid or Identity)")
    activation = "identity" if given == _IDENTITY else "sigmoid"
    similarity = saved.get("similarity_fn_name")
    return ModelKind(classifier, cfg.model_type in ENCODERS, num_labels, labels, activation,
                     str(similarity) if similarity else None)


def _activation(cfg, saved: dict) -> str | None:
    """The activation a cross-encoder's checkpoint names, where sentence-transformers looks for it first: 6.x's
    config_sentence_transformers.json (`saved`), then config.json's "sentence_transformers" (4.x, 5.x), then its
    sbert_ce_default_activation_function (before 4.0)."""
    st = getattr(cfg, "sentence_transformers", None)
    for given in (saved.get("activation_fn"), st.get("activation_fn") if isinstance(st, dict) else None,
                  getattr(cfg, "sbert_ce_default_activation_function", None)):
        if given:
            return str(given)
    return None


def check_task(kind: ModelKind, task: Task | str, name: str, arch: str) -> None:
    """UnsupportedModel where `task` is not one the checkpoint can do."""
    task = Task(task)
    if task.labels and not kind.classifier:
        raise UnsupportedModel(f"--task {task} needs a checkpoint with a sequence-classification head "
                               f"(...{SEQUENCE_CLASSIFIER}); model {name} is {arch}. Use --task embed for its "
                               "vectors")
    if task is Task.EMBED and kind.classifier:
        raise UnsupportedModel(f"--task embed: model {name} is a sequence classifier ({arch}); use --task classify "
                               "(or score, reward) for its head, or an embedding model")
    if task is Task.REWARD and kind.num_labels != 1:
        raise UnsupportedModel(f"--task reward: model {name} has a head of {kind.num_labels} labels; a reward model "
                               "gives one score. Use --task classify for its labels")
    if task.pairs and not kind.classifier and kind.similarity not in (None, "cosine"):
        raise UnsupportedModel(f"--task {task}: model {name}'s config_sentence_transformers.json names the similarity "
                               f"{kind.similarity}, and conveyor scores an embedder's pairs by cosine; score them with "
                               "sentence-transformers, or embed them (--task embed) and compare the vectors yourself")
    if task.pairs and kind.classifier and kind.num_labels != 1:
        raise UnsupportedModel(f"--task {task}: model {name} is a classifier of {kind.num_labels} labels; a "
                               "cross-encoder has one (its score); use --task classify for its labels")


def default_task(cfg, has_pooling_config: bool) -> Task:
    """What `--task auto` does with a checkpoint whose input is not batch lines: a sequence classifier classifies; a
    model with a sentence-transformers pooling config, or a base model without a head (BertModel, Qwen3Model: what
    it can do is embed), embeds; anything else generates (a masked or causal LM: generation runs it or refuses it,
    saying which task would)."""
    archs = list(getattr(cfg, "architectures", None) or [])
    if any(a.endswith(SEQUENCE_CLASSIFIER) for a in archs):
        return Task.CLASSIFY
    if has_pooling_config or (archs and all(a.endswith("Model") and "Head" not in a for a in archs)):
        return Task.EMBED  # (GPT2LMHeadModel ends in "Model" too, but has its LM head: it generates)
    return Task.GENERATE


def context_limit(cfg, config: PoolingConfig) -> int:
    """Tokens a sequence may hold: the position table's (RoBERTa's counts its padding offset), within the
    sentence-transformers length where the checkpoint sets one."""
    limit = context_of(cfg)
    if cfg.model_type in ("roberta", "xlm-roberta", "camembert"):
        limit -= int(cfg.pad_token_id) + 1
    if config.max_seq_length is not None:
        limit = min(limit, config.max_seq_length)
    return limit
