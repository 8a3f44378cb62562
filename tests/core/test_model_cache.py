"""The embedded model's first-use conversion: one converter at a time, nothing half-converted left,
the leftovers of a converter that was killed cleared (conversion faked: no torch, no download); a GGUF file
parsed once while it converts."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.core import model_loader
from conveyor.core.model_loader import DEFAULT_MODEL, ensure_embedded


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    return tmp_path


def _fake_conversion(monkeypatch, calls: list, fail: bool = False):
    def fetch(spec, scratch: Path) -> Path:
        gguf = scratch / "model.gguf"
        gguf.write_bytes(b"GGUF")
        return gguf

    def convert(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"weights")
        if fail:
            raise RuntimeError("killed mid-conversion")
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_loader, "_fetch_gguf", fetch)
    monkeypatch.setattr(model_loader, "_convert_gguf", convert)


def test_converts_once_into_place_and_clears_a_dead_converters_leftovers(cache, monkeypatch):
    dead = cache / ".models.build-dead"  # the scratch folder of a converter that was killed
    dead.mkdir(parents=True)
    (dead / "model.gguf").write_bytes(b"half")
    calls: list = []
    _fake_conversion(monkeypatch, calls)
    folder = ensure_embedded(DEFAULT_MODEL)
    assert folder == cache / "models" / DEFAULT_MODEL
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()
    assert not dead.exists()
    assert ensure_embedded(DEFAULT_MODEL) == folder and len(calls) == 1
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []


def test_a_failed_conversion_leaves_no_model_folder(cache, monkeypatch):
    calls: list = []
    _fake_conversion(monkeypatch, calls, fail=True)
    with pytest.raises(RuntimeError, match="killed mid-conversion"):
        ensure_embedded(DEFAULT_MODEL)
    assert not (cache / "models" / DEFAULT_MODEL).exists()
    _fake_conversion(monkeypatch, calls)
    assert (ensure_embedded(DEFAULT_MODEL) / "config.json").exists()


def test_a_damaged_cached_folder_is_named_with_what_to_do(cache, monkeypatch):
    from conveyor.core.model_loader import ModelLoadError

    (cache / "models" / DEFAULT_MODEL).mkdir(parents=True)  # config.json deleted by hand
    _fake_conversion(monkeypatch, [])
    with pytest.raises(ModelLoadError, match="has no config.json; delete that folder"):
        ensure_embedded(DEFAULT_MODEL)


def test_a_gguf_file_is_parsed_once_inside_the_block_and_as_often_as_asked_outside(tmp_path):
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    original = gguf.GGUFReader
    with model_loader.gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # the same parse, from a Path or its str
        assert first.fields["general.architecture"].contents() == "llama"
        assert [t.name for t in first.tensors] == ["token_embd.weight"]
        name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is name_map
        assert name_map.get_name("model.embed_tokens") == "token_embd"
    assert gguf.GGUFReader is original
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


def test_a_gguf_files_weights_convert_without_a_progress_bar_inside_the_block(capsys):
    """transformers' GGUF weight conversion draws a plain tqdm bar (carriage returns in a cron job's log, --quiet too)
    that its own progress switch does not turn off; inside the block it draws nothing, and outside it still does."""
    pytest.importorskip("gguf")
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    def convert():  # as load_gguf_checkpoint(..., return_tensors=True) iterates over the file's tensors
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass

    with model_loader.gguf_parsed_once():
        convert()
    assert capsys.readouterr().err == ""
    convert()
    assert "Converting and de-quantizing" in capsys.readouterr().err


def test_a_gguf_files_metadata_is_converted_once_inside_the_block_and_each_caller_gets_its_own_copy(tmp_path,
                                                                                                   monkeypatch):
    pytest.importorskip("gguf")
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    calls = []

    def checkpoint(path, return_tensors=False, *args, **kwargs):
        calls.append((path, return_tensors))
        return {"config": {"model_type": "llama", "layers": [1, 2]}, "tokenizer": {}}

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", checkpoint)
    path = tmp_path / "tiny.gguf"
    with model_loader.gguf_parsed_once():
        first = gguf_utils.load_gguf_checkpoint(path)
        first["config"]["layers"].append(3)  # a caller's changes stay its own
        second = gguf_utils.load_gguf_checkpoint(str(path), return_tensors=False)
        assert second == {"config": {"model_type": "llama", "layers": [1, 2]}, "tokenizer": {}}
        gguf_utils.load_gguf_checkpoint(path, return_tensors=True)  # the weights: read each time they are asked for
    assert calls == [(path, False), (path, True)]
    assert gguf_utils.load_gguf_checkpoint is checkpoint
