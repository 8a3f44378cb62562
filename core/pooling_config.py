"""How a checkpoint pools, read from its sentence-transformers files where it has them (`modules.json`, the pooling
module's `config.json`, `sentence_bert_config.json`), else the default of its kind: the last token for decoders,
the first ([CLS]) for encoders, normalized. A module conveyor does not compute (a Dense projection, max or weighted
pooling, a prompt left out of the mean) refuses the model, naming it. And what a checkpoint is (`ModelKind`): an
embedder or a sequence classifier (a classifier, a cross-encoder, a reward model), which decides the tasks it can do
(`check_task`) and the one `--task auto` picks (`default_task`). Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from conveyor.core.errors import UnsupportedModel
from conveyor.core.model_shape import context_of

SEQUENCE_CLASSIFIER = "ForSequenceClassification"
_SIGMOID = "torch.nn.modules.activation.Sigmoid"
_IDENTITY = "torch.nn.modules.linear.Identity"
_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"
_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolingConfig:
    pooling: str  # "last", "mean" or "cls"
    normalize: bool
    max_seq_length: int | None  # the sentence-transformers length limit, where the checkpoint sets one
    source: str  # where it was read: "modules.json" or "the default for decoders" / "... for encoders"


def pooling_config(folder: Path | None, name: str, encoder: bool) -> PoolingConfig:
    """The pooling of model `name` (its files in `folder`; None: a hub id not in the cache), `encoder`: whether it
    is a bidirectional encoder."""
    kind = "encoders" if encoder else "decoders"
    default = PoolingConfig("cls" if encoder else "last", True, None, f"the default for {kind}")
    if folder is None or not (folder / "modules.json").is_file():
        return default
    where = f"model {name}: modules.json"
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedModel(f"{where} cannot be read ({e})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise UnsupportedModel(f"{where} is not a list of modules")
    types = [str(m.get("type", "")) for m in modules]
    other = [t for t in types if t not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if other:
        raise UnsupportedModel(f"{where}: the sentence-transformers module {other[0].rsplit('.', 1)[-1]} "
                               f"({other[0]}) is not one conveyor computes (it runs Transformer, Pooling and "
                               "Normalize)")
    if types[:1] != [_TRANSFORMER] or types.count(_POOLING) > 1 or types.count(_NORMALIZE) > 1:
        raise UnsupportedModel(f"{where}: modules {types} are not a Transformer followed by Pooling and Normalize")
    pooling = default.pooling
    if _POOLING in types:
        module = modules[types.index(_POOLING)]
        pooling = _pooling_mode(folder / str(module.get("path", "")) / "config.json", f"model {name}")
    max_len = None
    bert_config = folder / "sentence_bert_config.json"
    if bert_config.is_file():
        try:
            value = json.loads(bert_config.read_text()).get("max_seq_length")
        except (OSError, ValueError, AttributeError):
            value = None
        max_len = value if isinstance(value, int) and value > 0 else None
    return PoolingConfig(pooling, _NORMALIZE in types, max_len, "modules.json")


def _pooling_mode(path: Path, named: str) -> str:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedModel(f"{named}: its pooling config {path} cannot be read ({e})") from None
    on = [key for key, value in config.items() if key.startswith("pooling_mode_") and value is True]
    unknown = [key for key in on if key not in _MODES]
    if unknown:
        what = unknown[0].removeprefix("pooling_mode_")
        hint = "" if unknown[0] in _OTHER_MODES else " (a mode conveyor does not know)"
        raise UnsupportedModel(f"{named}: its pooling config asks for {what} pooling{hint}; conveyor pools by the "
                               "last token, the mean or the first token ([CLS])")
    if len(on) != 1:
        raise UnsupportedModel(f"{named}: its pooling config {path} turns on {len(on)} pooling modes "
                               f"({', '.join(on) or 'none'}); conveyor computes one")
    if config.get("include_prompt", True) is False:
        raise UnsupportedModel(f"{named}: its pooling config leaves the prompt out of the pooled tokens "
                               "(include_prompt: false), which conveyor does not do")
    return _MODES[on[0]]


@dataclass(frozen=True)
class ModelKind:
    """What a checkpoint is, from its config alone."""

    classifier: bool  # has a sequence-classification head
    encoder: bool  # a bidirectional encoder
    num_labels: int
    labels: tuple[str, ...]  # the head's label per class (id2label)
    score_activation: str  # a cross-encoder's: "sigmoid" or "identity" (sentence-transformers' activation_fn)


def model_kind(cfg, name: str) -> ModelKind:
    from conveyor.core.model_support import ENCODERS

    archs = list(getattr(cfg, "architectures", None) or [])
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModel(f"model {name} ({', '.join(archs) or cfg.model_type}): an encoder-decoder model; "
                               "conveyor pools encoders and decoders")
    classifier = any(a.endswith(SEQUENCE_CLASSIFIER) for a in archs)
    num_labels = int(getattr(cfg, "num_labels", 0) or 0) if classifier else 0
    id2label = getattr(cfg, "id2label", None) or {}
    labels = tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels))
    activation = "sigmoid"
    st = getattr(cfg, "sentence_transformers", None)
    if isinstance(st, dict) and st.get("activation_fn"):
        given = st["activation_fn"]
        if given not in (_SIGMOID, _IDENTITY):
            raise UnsupportedModel(f"model {name}: its cross-encoder activation {given} is not one conveyor "
                                   "computes (Sigmoid or Identity)")
        activation = "sigmoid" if given == _SIGMOID else "identity"
    return ModelKind(classifier, cfg.model_type in ENCODERS, num_labels, labels, activation)


def check_task(kind: ModelKind, task: str, name: str, arch: str) -> None:
    """UnsupportedModel where `task` is not one the checkpoint can do."""
    if task in ("classify", "reward") and not kind.classifier:
        raise UnsupportedModel(f"--task {task} needs a checkpoint with a sequence-classification head "
                               f"(...{SEQUENCE_CLASSIFIER}); model {name} is {arch}. Use --task embed for its "
                               "vectors")
    if task == "embed" and kind.classifier:
        raise UnsupportedModel(f"--task embed: model {name} is a sequence classifier ({arch}); use --task classify "
                               "(or score, reward) for its head, or an embedding model")
    if task == "reward" and kind.num_labels != 1:
        raise UnsupportedModel(f"--task reward: model {name} has a head of {kind.num_labels} labels; a reward model "
                               "gives one score. Use --task classify for its labels")
    if task in ("score", "rerank") and kind.classifier and kind.num_labels != 1:
        raise UnsupportedModel(f"--task {task}: model {name} is a classifier of {kind.num_labels} labels; a "
                               "cross-encoder has one (its score); use --task classify for its labels")


def default_task(cfg, has_pooling_config: bool) -> str:
    """What `--task auto` does with a checkpoint whose input is not batch lines: a sequence classifier classifies; a
    model with a sentence-transformers pooling config, or a base model without a head (BertModel, Qwen3Model: what
    it can do is embed), embeds; anything else generates (a masked or causal LM: generation runs it or refuses it,
    saying which task would)."""
    archs = list(getattr(cfg, "architectures", None) or [])
    if any(a.endswith(SEQUENCE_CLASSIFIER) for a in archs):
        return "classify"
    if has_pooling_config or (archs and all(a.endswith("Model") and "Head" not in a for a in archs)):
        return "embed"  # (GPT2LMHeadModel ends in "Model" too, but has its LM head: it generates)
    return "generate"


def context_limit(cfg, config: PoolingConfig) -> int:
    """Tokens a sequence may hold: the position table's (RoBERTa's counts its padding offset), within the
    sentence-transformers length where the checkpoint sets one."""
    limit = context_of(cfg)
    if cfg.model_type in ("roberta", "xlm-roberta", "camembert"):
        limit -= int(cfg.pad_token_id) + 1
    if config.max_seq_length is not None:
        limit = min(limit, config.max_seq_length)
    return limit
