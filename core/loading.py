"""Starting the engine, for callers outside core: an engine config made concrete for this machine, the engine (the
generation engine, or a pooling task's), a model's tokenizer alone, the checks before a model loads. Every function
takes the model as a `ModelSource` (`core/model_source.py`: told apart once, where the caller makes it) or as the
string the user gave, which it turns into one. Imports no torch until a function that needs it is called, so
`conveyor.core` can re-export these and stay torch-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.core.config import EngineConfig, parse_memory
from conveyor.core.errors import ConfigError
from conveyor.core.model_shape import ModelShape
from conveyor.core.model_source import EMBEDDED_MODELS, ModelSource
from conveyor.core.outputs import ModelLimits
from conveyor.core.sampling_params import Grammar
from conveyor.core.task import Task

if TYPE_CHECKING:
    from conveyor.core.engine import Engine
    from conveyor.core.pooling_engine import PoolingEngine


def resolve_engine_config(config: EngineConfig) -> tuple[EngineConfig, tuple[str, ...]]:
    """(`config` as it will run on this machine, the fields given that change nothing here); ConfigError naming
    the field (device, backend) that cannot work here. See `core.backends.resolve_engine_config`."""
    from conveyor.core.backends import resolve_engine_config as resolve

    return resolve(config)


def load_engine(model: str | ModelSource, config: EngineConfig, task: Task | str = Task.GENERATE,
                pooling: str | None = None) -> Engine | PoolingEngine:
    """The engine for `model` (an embedded name, a folder, a .gguf file or a hub id) with `config`: for
    `task` generate the generation engine, for a pooling task (embed, classify, score, rerank, reward) the pooling
    engine, pooling by `pooling` (None: the checkpoint's own, else its kind's; for a pooling task only). ValueError
    for task auto, which the caller resolves first (`auto_task`), and for a pooling method given with generation."""
    task = Task(task)
    if task is Task.AUTO:
        raise ValueError("load_engine: task auto is resolved before the engine loads (auto_task)")
    if pooling is not None and not task.pools:
        raise ValueError(f"load_engine: pooling {pooling!r} is a pooling task's; task {task} pools nothing")
    if task.pools:
        from conveyor.core.pooling_engine import PoolingEngine

        return PoolingEngine.from_pretrained(ModelSource.of(model), task, config, pooling)
    from conveyor.core.engine import Engine

    return Engine.from_pretrained(ModelSource.of(model), config)


def model_fingerprint(model: str | ModelSource) -> str | None:
    """A hash of the content of `model`'s files (weights, config, tokenizer), or None where they are not here to be
    read: a run's rows are reused only under the model files they were computed with (`core/model_files.py`).
    Never converts or downloads."""
    from conveyor.core.model_files import model_fingerprint as fingerprint

    name = ModelSource.of(model).name
    return fingerprint(name, {embedded: spec.package for embedded, spec in EMBEDDED_MODELS.items()})


def auto_task(model: str | ModelSource) -> Task:
    """What `--task auto` does with `model` when its input says nothing (`pooling_config.default_task`), from its
    config and files alone (the embedded models generate)."""
    from conveyor.core.model_loader import load_config, resolve
    from conveyor.core.pooling_config import default_task

    source = ModelSource.of(model)
    if source.embedded:
        return Task.GENERATE
    check_model_exists(source)
    path = Path(resolve(source)[0]).expanduser()
    return default_task(load_config(source), (path / "modules.json").is_file())


def check_model_exists(model: str | ModelSource) -> None:
    """ConfigError (model), at once, where `model` names nothing that can load."""
    from conveyor.core.errors import ModelLoadError
    from conveyor.core.model_loader import resolve

    try:
        resolve(model)
    except ModelLoadError as e:
        raise ConfigError("model", str(e).removeprefix("--")) from None


def load_pooling_tokenizer(model: str | ModelSource, task: Task | str, pooling: str | None = None
                           ) -> tuple[Any, ModelLimits, bool, int | None, str]:
    """(tokenizer, limits, whether a score pair is one sequence (a cross-encoder), the embedding's size or None, the
    prompt its sentence-transformers config prepends to every text) of `model` doing pooling `task` (pooling by
    `pooling`, None: the checkpoint's), from its config and files alone (`conveyor validate`). The tokenizer
    lowercases texts where that config asks, as the pooling engine's does."""
    from transformers import AutoTokenizer

    from conveyor.core.model_loader import checkpoint_folder, load_config, resolve
    from conveyor.core.pooling_config import context_limit, model_kind, pooling_config
    from conveyor.core.sentence_transformers_text import lowercase_texts

    task = Task(task)
    source = ModelSource.of(model)
    model = source.name
    check_pooling_model(source, task, pooling)
    path, gguf_file = resolve(source)
    cfg = load_config(source)
    folder = checkpoint_folder(source, path)
    kind = model_kind(cfg, model, folder)
    config = pooling_config(folder, model, kind.encoder, pooling)
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    if config.lower_case:
        lowercase_texts(tokenizer, model, config.lower_case)
    limits = ModelLimits(context_limit(cfg, config), int(getattr(cfg, "vocab_size", 0) or len(tokenizer)))
    return tokenizer, limits, kind.classifier, None if kind.classifier else int(cfg.hidden_size), config.prompt


def check_pooling_model(model: str | ModelSource, task: Task | str, pooling: str | None = None) -> None:
    """What the pooling engine would refuse once `model` loads, from its config and files alone: a model not there, a
    task the checkpoint cannot do, a pooling config conveyor does not compute where `pooling` (--pooling) does not
    replace it (UnsupportedModel), weight files missing or cut short (ConfigError model)."""
    from conveyor.core.checkpoint_format import check_format
    from conveyor.core.model_loader import checkpoint_folder, load_config, resolve
    from conveyor.core.model_support import architecture
    from conveyor.core.pooling_config import check_task, model_kind, pooling_config
    from conveyor.core.weight_files import check_weight_files

    task = Task(task)
    source = ModelSource.of(model)
    model = source.name
    check_model_exists(source)
    path, gguf_file = resolve(source)
    cfg = load_config(source)
    check_format(cfg, model, gguf=gguf_file is not None, task=task)
    folder = checkpoint_folder(source, path)
    kind = model_kind(cfg, model, folder)
    check_task(kind, task, model, architecture(cfg))
    pooling_config(folder, model, kind.encoder, pooling)
    if gguf_file is None:
        check_weight_files(model, path)


def load_tokenizer(model: str | ModelSource) -> tuple[Any, ModelLimits]:
    """(tokenizer, the model's limits: its context in tokens, its vocabulary) of `model`, without loading its
    weights."""
    from conveyor.core.model_loader import load_tokenizer as load

    return load(model)


def check_before_loading(model: str | ModelSource, config: EngineConfig, grammar: Grammar | None = None) -> None:
    """What the engine would refuse only once `model` is loaded, checked from its config and tokenizer alone (read
    only where needed): a KV budget given that holds no block (ConfigError kv_cache_memory), and a run's own
    grammar that does not compile (ConfigError grammar); and a model that is nowhere to be had (ConfigError model: a
    path not there, a hub id neither cached nor on a reachable hub). `config` as resolved (its dtype concrete)."""
    from conveyor.core.model_loader import check_model

    model = ModelSource.of(model)
    check_model(model)
    if config.kv_cache_memory is not None and config.num_kv_blocks is None:
        from conveyor.core.model_loader import load_config

        ModelShape.of_config(load_config(model)).num_kv_blocks(parse_memory(config.kv_cache_memory),
                                                                config.block_size, config.dtype)
    if grammar is not None:
        from conveyor.core.grammar import Grammars

        tokenizer, limits = load_tokenizer(model)
        try:
            Grammars(tokenizer, limits.vocab_size, config.max_grammar_compile_s, config.max_grammar_bytes).compiled(grammar)
        except ValueError as e:
            raise ConfigError("grammar", str(e)) from None
