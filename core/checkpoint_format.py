"""What a checkpoint holds beyond a dense text model, read from its config and folder alone: quantized weights
(config.json's `quantization_config`) and inputs other than text (a vision or audio tower, an image processor);
which of them conveyor runs, and why it refuses the others before their weights are read, for every task alike.
Pure Python, but for the one question of fp8 weights that depends on the machine's GPU (torch, imported there).

Quantized weights: compressed-tensors, GPTQ and AWQ checkpoints are read by conveyor itself (`core/quant`: what
their configs ask for in `quant.formats`, refused there where conveyor does not compute it); fp8 (block-scaled
e4m3, transformers' FineGrainedFP8) runs where transformers de-quantizes it as it loads: where no GPU here computes
FP8 (transformers' own rule: no CUDA or XPU device, or a CUDA one below compute capability 8.9), or where the config
sets `dequantize`. Every other method (bitsandbytes, MXFP4, HQQ, ...) loads into modules of a library conveyor does
not run: refused, naming the method. A .gguf file loads as transformers loads it, its linears of the block types
conveyor computes kept in their blocks on the CPU (`quant/gguf_load.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conveyor.core.errors import UnsupportedModel
from conveyor.core.quant.formats import Refused, Scheme, scheme_of
from conveyor.core.task import Task

READ_METHODS = ("compressed-tensors", "gptq", "awq")  # the quantization methods conveyor reads itself

# Sub-configs that give a checkpoint inputs other than text (transformers' names for them).
MULTIMODAL_CONFIGS = {
    "vision_config": "a vision tower", "audio_config": "an audio tower", "video_config": "a video tower",
    "vlm_config": "a vision-language model", "vq_config": "an image tokenizer", "image_config": "an image tower",
    "speech_config": "a speech tower", "thinker_config": "audio, image and video towers",
}
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def quantization(cfg: Any) -> dict | None:
    """The checkpoint's `quantization_config` as a dict (None: its weights are not quantized)."""
    qc = getattr(cfg, "quantization_config", None)
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def read_scheme(cfg: Any, gguf: bool = False) -> Scheme | None:
    """The Scheme of a checkpoint conveyor reads the quantized weights of itself (None: not such a checkpoint).
    Refused where its config asks for what conveyor does not compute."""
    qc = None if gguf else quantization(cfg)
    if qc is None or str(qc.get("quant_method")) not in READ_METHODS:
        return None
    return scheme_of(qc)


def describe_quantization(qc: dict) -> str:
    """"gptq, 4 bits, groups of 128": the method and what the config says of its shape."""
    parts = [str(qc.get("quant_method", "unknown method"))]
    bits = qc.get("bits") or qc.get("w_bit") or (4 if qc.get("load_in_4bit") else 8 if qc.get("load_in_8bit") else None)
    if bits:
        parts.append(f"{bits} bits")
    group = qc.get("group_size") or qc.get("q_group_size")
    if isinstance(group, int) and group > 0:
        parts.append(f"groups of {group}")
    block = qc.get("weight_block_size")
    if isinstance(block, (list, tuple)) and block:
        parts.append(f"blocks of {'x'.join(str(b) for b in block)}")
    return ", ".join(parts)


def _fp8_kept_on(qc: dict) -> str | None:
    """The GPU on which transformers keeps fp8 weights in FP8 as they load (a CUDA device of compute capability 8.9
    or more, or an XPU), or None where it de-quantizes them: `dequantize` set, or no such GPU here."""
    if qc.get("dequantize"):
        return None
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"GPU (compute capability {major}.{minor})" if (major, minor) >= (8, 9) else None
    xpu = getattr(torch, "xpu", None)
    return "XPU" if xpu is not None and xpu.is_available() else None


def _multimodal(cfg: Any) -> str | None:
    for key, what in MULTIMODAL_CONFIGS.items():
        sub = getattr(cfg, key, None)
        if sub is not None:
            sub_type = sub.get("model_type") if isinstance(sub, dict) else getattr(sub, "model_type", None)
            return f"{key} ({what}{f', model type {sub_type}' if sub_type else ''})"
    return None


def format_refusal(cfg: Any, gguf: bool = False) -> str | None:
    """Why conveyor refuses the checkpoint `cfg` describes for any task, before its weights are read: inputs other
    than text, or quantized weights it does not compute (None: it does not). `gguf`: read from a .gguf file."""
    towers = _multimodal(cfg)
    if towers is not None:
        return (f"a multimodal checkpoint: its config has {towers}; conveyor runs text-only models and reads no "
                "images, audio or video yet. Use a text-only model")
    qc = None if gguf else quantization(cfg)
    if qc is None:
        return None
    method = str(qc.get("quant_method", "unknown"))
    if method in READ_METHODS:
        experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
        if experts:
            return (f"its weights are quantized ({describe_quantization(qc)}, config.json's quantization_config) and "
                    f"it is a mixture of {experts} experts, whose quantized expert weights conveyor does not read "
                    "yet; use an unquantized release of the model")
        try:
            scheme_of(qc)
        except Refused as e:
            return (f"its weights are quantized ({describe_quantization(qc)}, config.json's quantization_config), and "
                    f"{e}; use another quantization of the model (W8A8 or W4A16 compressed-tensors, GPTQ, AWQ) or "
                    "an unquantized release")
        return None
    if method == "fp8":
        gpu = _fp8_kept_on(qc)
        if gpu is None:
            return None
        return (f"its weights are quantized ({describe_quantization(qc)}): on this machine's {gpu} transformers "
                "keeps them in FP8 as they load, which conveyor does not compute yet; set \"dequantize\": true in "
                "config.json's quantization_config to have them de-quantized as they load, or use an unquantized "
                "release of the model")
    return (f"its weights are quantized ({describe_quantization(qc)}, config.json's quantization_config): "
            f"quantization method {method} is not supported yet; use an unquantized (bfloat16, float16 or float32) "
            "release of the model")


def check_format(cfg: Any, name: str, gguf: bool = False, task: Task | str = Task.GENERATE) -> None:
    """UnsupportedModel naming `name`, its architecture and why, where `format_refusal` refuses it, or where the
    pooling `task` is asked of a checkpoint whose quantized weights conveyor reads itself (generation only)."""
    from conveyor.core.model_support import architecture

    task = Task(task)
    why = format_refusal(cfg, gguf)
    if why is None and task.pools and read_scheme(cfg, gguf) is not None:
        why = (f"its weights are quantized ({read_scheme(cfg, gguf).describe()}), and conveyor runs quantized "
               f"checkpoints for generation only, not for --task {task}; use an unquantized release of the model")
    if why is not None:
        raise UnsupportedModel(f"model {name} ({architecture(cfg)}): {why}")


def format_lines(cfg: Any, folder: Path | None, gguf: bool = False) -> list[tuple[str, str]]:
    """What `conveyor models --check` says of a checkpoint `format_refusal` lets run: quantized weights that load
    de-quantized, and an image processor that is not used."""
    lines = []
    qc = None if gguf else quantization(cfg)
    scheme = read_scheme(cfg, gguf)
    if scheme is not None:
        lines.append(("weights", f"quantized: {scheme.describe()}, read by conveyor from the format's tensors"))
        lines.append(("routes", "every backend: de-quantized as they load, the dense routes compute them"
                      if scheme.dequantized else
                      "cpu (fused forward): kept quantized (weight-only: de-quantized in the kernel's registers, the "
                      "same sums as the dense route over the de-quantized weights; W8A8: int8 products, int32 sums, "
                      "activations quantized per row); cpu (torch backend): the format's definition in torch; cuda: "
                      "kept quantized, Triton kernels (weight-only: de-quantized per tile; W8A8: int8 dot products)"))
    elif qc is not None:
        lines.append(("weights", f"quantized ({describe_quantization(qc)}): transformers de-quantizes them as they "
                                 "load here, and the routes below compute the de-quantized weights"))
    processor = next((name for name in IMAGE_PROCESSOR_FILES if folder is not None and (folder / name).is_file()),
                     None)
    if processor is not None:
        lines.append(("inputs", f"text only: its image processor ({processor}) is not used; conveyor reads no "
                                "images yet"))
    return lines
