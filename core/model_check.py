"""What `conveyor models --check` says of a model: the task `conveyor run` does with it (`--task auto`: what the
checkpoint is for, as run decides where no batch line's url says), the checks run makes before loading it for that
task (so a refusal here is run's, for the same reason), and, for a model run takes: for generation its route on each
backend, attention, context and chat template; for a pooling task its pooling, normalization, vector size or labels,
length limit and route. Reads the config, the weight files' headers and the tokenizer's files, never the weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conveyor.core.checkpoint_format import format_lines
from conveyor.core.config import EngineConfig
from conveyor.core.errors import ConfigError
from conveyor.core.model_source import ModelSource
from conveyor.core.model_support import architecture, fused_family, generation_routes
from conveyor.core.task import Task

Lines = list[tuple[str, str]]


def model_report(model: str | ModelSource, task: Task | str = Task.AUTO) -> tuple[Lines, str | None]:
    """What `conveyor models --check` says of `model` doing `task` (auto: as `run --task auto` decides) from its
    config, its weight files' headers and its tokenizer alone: (lines: (what, value), why run refuses it for `task`
    or None). ModelLoadError where there is nothing to check (no such file or folder, no config)."""
    from conveyor.core.loading import auto_task, check_before_loading, check_pooling_model
    from conveyor.core.model_loader import checkpoint_folder, load_config, resolve

    task = Task(task)
    source = ModelSource.of(model)
    model = source.name
    path, gguf_file = resolve(source)
    cfg = load_config(source)
    local = Path(path).expanduser()
    folder = checkpoint_folder(source, path)
    lines = [("model", model), ("architecture", f"{architecture(cfg)} (model type {getattr(cfg, 'model_type', '?')})")]
    if task is Task.AUTO:
        task = auto_task(source)
        why = "the embedded model generates" if source.embedded else _auto_reason(task, cfg, local)
        lines.append(("task", f"{task} (--task auto: {why}; an input of OpenAI batch lines chooses by its url)"))
    else:
        lines.append(("task", f"{task} (--task {task})"))
    try:
        if task is Task.GENERATE:
            check_before_loading(source, EngineConfig())
        else:
            check_pooling_model(source, task)
    except ConfigError as e:
        reason = str(e)
        for prefix in (f"model {model} ({architecture(cfg)}): ", f"model {model}: "):
            reason = reason.removeprefix(prefix)
        return lines, reason
    lines += format_lines(cfg, folder, gguf=gguf_file is not None)
    if gguf_file is not None:
        from conveyor.core.quant.gguf_load import describe_gguf

        lines += describe_gguf(Path(path) / gguf_file)
    if task is Task.GENERATE:
        return lines + generation_routes(cfg) + [("chat template", _chat_template(source))], None
    return lines + _pooling_lines(model, cfg, folder, task), None


def _auto_reason(task: Task, cfg: Any, folder: Path) -> str:
    """Why `--task auto` chose `task` (`pooling_config.default_task`)."""
    if task is Task.CLASSIFY:
        return "a sequence classifier classifies"
    if task is Task.EMBED:
        return ("its sentence-transformers modules.json makes it an embedding model"
                if (folder / "modules.json").is_file() else "a base model without a head embeds")
    return (f"{architecture(cfg)} is no sequence classifier or base model, and has no sentence-transformers "
            "modules.json: a language model generates")


def _chat_template(model: ModelSource) -> str:
    """What the model's tokenizer does with chat records (run's `check_chat_template`, `no_chat_template_note`)."""
    from conveyor.core.model_loader import load_tokenizer

    if getattr(load_tokenizer(model)[0], "chat_template", None):
        return ("the tokenizer's own: chat records (a messages field, an OpenAI chat body) and --chat-field are built "
                "with it; --chat-template FILE replaces it")
    return ("none: chat records (a messages field, an OpenAI chat body) become error rows, and --chat-field and "
            "--prompt-template-as chat are refused (exit 2); give raw prompts (--prompt-field, --prompt-template), "
            "or a chat template with --chat-template FILE")


def _pooling_lines(model: str, cfg: Any, folder: Path | None, task: Task) -> Lines:
    """What run does for pooling `task` with a checkpoint `check_pooling_model` let through."""
    from conveyor.core.pooling_config import context_limit, model_kind, pooling_config

    kind = model_kind(cfg, model, folder)
    config = pooling_config(folder, model, kind.encoder)
    lines = []
    if not kind.classifier:  # an embedder: its vectors, or the cosine of a pair's two
        source = "its sentence-transformers modules.json" if config.source == "modules.json" else config.source
        lines.append(("pooling", f"{config.pooling} ({source}); --pooling replaces it"))
        if task is Task.EMBED:
            raw = "" if config.normalize else "; its modules.json has no Normalize module (sentence-transformers " \
                                              "gives them raw)"
            lines.append(("normalization", f"L2 (run's default; --no-normalize keeps the vectors raw){raw}"))
            lines.append(("dimension", f"{int(cfg.hidden_size)} (its hidden size; --dimensions N keeps the first N)"))
        else:
            lines.append(("score", "the cosine of the embeddings of a pair's two texts (each embedded alone)"))
    elif task is Task.CLASSIFY:
        how = "a sigmoid" if kind.num_labels == 1 else "a softmax"
        lines.append(("labels", f"{kind.num_labels}: {', '.join(kind.labels)} (probabilities: {how} of its head)"))
    elif task is Task.REWARD:
        lines.append(("reward", f"its head's raw score ({kind.labels[0]})"))
    else:
        through = "a sigmoid" if kind.score_activation == "sigmoid" else "no activation"
        lines.append(("score", f"its head's one logit through {through} (a cross-encoder: a pair's two texts are "
                               "one sequence)"))
    limit = context_limit(cfg, config)
    where = "its sentence-transformers length limit" if config.max_seq_length == limit else "its position table"
    lines.append(("max tokens", f"{limit} a text ({where}); a longer one is an error row, or cut with "
                                "--truncate-prompt-tokens"))
    return lines + _pooling_routes(cfg, kind.encoder)


def _pooling_routes(cfg: Any, encoder: bool) -> Lines:
    """The route of a pooling model on the CPU and elsewhere (`pooling_model.PoolingModel`; the CPU's packed route
    is built at load, where a module the kernels do not cover sends it to its transformers forward)."""
    from conveyor.core.backends.cpu.encoder import ENCODER_TYPES

    model_type = getattr(cfg, "model_type", "")
    own = "its transformers forward, one sequence at a time"
    if encoder:
        packed = "encoder" if model_type in ENCODER_TYPES else None
        why_not = f"model type {model_type!r} has no packed encoder forward"
    else:
        family, why_not = fused_family(cfg)
        packed = family and f"{family} decoder"
    if packed:
        cpu = (f"packed {packed} forward on conveyor's kernels: exact (a result does not depend on the sequences "
               f"packed with it); checked at load, where a module the kernels do not cover sends it to {own}")
    else:
        cpu = f"{own} ({why_not}): a result does not depend on the others (slower)"
    return [("cpu route", cpu), ("other devices", f"{own}: a result does not depend on the others (slower)")]
