"""A model told apart once (`ModelSource`), torch-free, and taken by every core entry point as it is or as the name
the user gave; `load_engine` gives the pooling engine for a pooling task."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conveyor.core import DEFAULT_MODEL, EngineConfig, ModelSource, Task, check_model, load_engine
from conveyor.core.model_loader import resolve
from conveyor.core.model_source import embedded_model_dir


def test_each_kind_is_told_apart_by_its_name_and_what_is_there(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    assert ModelSource.of(DEFAULT_MODEL) == ModelSource(DEFAULT_MODEL, "embedded", str(embedded_model_dir(DEFAULT_MODEL)))
    assert ModelSource.of(str(folder)).kind == "folder"
    assert ModelSource.of("./not/there").kind == "folder"  # looks like a path: the load says it is not there
    assert ModelSource.of("x/y/z").kind == "folder"
    assert ModelSource.of(str(tmp_path / "w.gguf")).kind == "gguf"
    hub = ModelSource.of("HuggingFaceTB/SmolLM2-135M")
    assert (hub.kind, hub.location, str(hub)) == ("hub", "HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M")
    assert ModelSource.of(hub) is hub
    assert ModelSource.of(DEFAULT_MODEL).embedded and ModelSource.of("a.gguf").gguf


def test_telling_apart_fetches_nothing_and_imports_no_torch(tmp_path):
    code = ("import sys; from conveyor.core.model_source import ModelSource; ModelSource.of('smollm2-135m-instruct'); "
            "ModelSource.of('org/model'); print('torch' in sys.modules, 'transformers' in sys.modules)")
    env_dir = tmp_path / "cache"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"CONVEYOR_CACHE_DIR": str(env_dir), "PATH": "", "HF_HUB_OFFLINE": "1"})
    assert out.stdout.split() == ["False", "False"]
    assert not env_dir.exists()  # no conversion started


def test_a_source_and_its_name_are_refused_alike(tmp_path):
    from conveyor.core import ConfigError, ModelLoadError

    missing = str(tmp_path / "nope")
    for model in (missing, ModelSource.of(missing)):
        with pytest.raises(ConfigError, match=f"model {missing}: no such file or folder"):
            check_model(model)
        with pytest.raises(ModelLoadError, match=f"--model {missing}: no such file or folder"):
            resolve(model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="the folder has no config.json"):
        resolve(ModelSource.of(str(tmp_path / "empty")))


def test_load_engine_refuses_task_auto():
    with pytest.raises(ValueError, match="task auto"):
        load_engine(DEFAULT_MODEL, EngineConfig(), Task.AUTO)


def test_load_engine_gives_the_pooling_engine_for_a_pooling_task_and_the_generation_engine_else(pooling_models,
                                                                                                tiny_model):
    from conveyor.core.engine import Engine
    from conveyor.core.pooling_engine import PoolingEngine

    config = EngineConfig(dtype="float32", device="cpu", backend="torch")
    source = ModelSource.of(str(pooling_models("classifier")))
    engine = load_engine(source, config, Task.CLASSIFY)
    assert isinstance(engine, PoolingEngine) and engine.task is Task.CLASSIFY
    assert engine.labels == ("bug", "feature", "question")
    generation = load_engine(ModelSource.of(str(tiny_model)), config)
    assert isinstance(generation, Engine) and generation.info().model_path == str(tiny_model)
