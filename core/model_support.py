"""Which models conveyor runs and how, read from a transformers config alone (no weights, no torch): the decoder
families with a fused forward of their own, what is refused before the weights are read and why, and the context a
rotary that changes with the sequence's length limits a model to. Pure Python.

The checks here are what a config says; what the model's own forward asks of its attention is checked once it is
loaded, before any record runs (`backends/attention_probe.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.core.errors import UnsupportedModel


@dataclass(frozen=True)
class Family:
    """What a decoder layer of the family computes besides attention (`backends/decoder_plan.py` reads it)."""

    layout: str  # where the norms sit: "pre" (before each sublayer), "sandwich" (before and after), "post" (after)
    norm: str = "dtype"  # "dtype": weight * (x r, rounded); "one_plus": (1 + w) in float32; "float": w in float32
    qk_norm: str | None = None  # "head": q and k norms per head; "whole": over all of q, all of k
    fused_mlp: bool = False  # q/k/v and gate/up stored as one linear each (Phi-3)
    moe: str | None = None  # "dtype_weights" (Qwen3-MoE) or "float_weights" (Mixtral): sparse MoE layers
    multipliers: bool = False  # embedding, residual and logit multipliers (Granite)
    final_softcap: bool = False  # final_logit_softcapping (Gemma 2 and 3)
    rope_per_layer_type: bool = False  # a rotary table per layer type: local and global bases (Gemma 3)
    nope_global_layers: bool = False  # where the model slides, its global (not sliding) layers have no rotary (EXAONE 4)


FUSED_FAMILIES: dict[str, Family] = {
    "llama": Family("pre"),
    "mistral": Family("pre"),
    "qwen2": Family("pre"),
    "qwen3": Family("pre", qk_norm="head"),
    "qwen3_moe": Family("pre", qk_norm="head", moe="dtype_weights"),
    "mixtral": Family("pre", moe="float_weights"),
    "granite": Family("pre", multipliers=True),
    "smollm3": Family("pre"),
    "phi3": Family("pre", fused_mlp=True),
    "gemma": Family("pre", norm="one_plus"),
    "gemma2": Family("sandwich", norm="one_plus", final_softcap=True),
    "gemma3_text": Family("sandwich", norm="one_plus", qk_norm="head", final_softcap=True, rope_per_layer_type=True),
    "olmo2": Family("post", norm="float", qk_norm="whole"),
    "exaone4": Family("post", qk_norm="head", nope_global_layers=True),
}
FUSED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

# Model types whose layers keep state other than plain per-head K/V (SSM, linear attention, recurrent layers,
# latent attention): conveyor's KV pool cannot hold it.
NOT_PLAIN_KV = {
    "mamba": "Mamba (state-space) layers", "mamba2": "Mamba-2 (state-space) layers",
    "falcon_mamba": "Mamba (state-space) layers", "falcon_h1": "hybrid attention and Mamba-2 layers",
    "jamba": "hybrid attention and Mamba layers", "bamba": "hybrid attention and Mamba-2 layers",
    "zamba": "hybrid attention and Mamba layers", "zamba2": "hybrid attention and Mamba-2 layers",
    "nemotron_h": "hybrid attention and Mamba-2 layers", "granitemoehybrid": "hybrid attention and Mamba-2 layers",
    "lfm2": "hybrid attention and short-convolution layers", "lfm2_moe": "hybrid attention and short-convolution "
    "layers", "qwen3_next": "hybrid gated DeltaNet (linear attention) layers", "recurrent_gemma": "recurrent "
    "(RG-LRU) layers", "rwkv": "RWKV (recurrent) layers", "xlstm": "xLSTM (recurrent) layers",
    "minimax": "lightning (linear) attention layers", "plamo2": "hybrid attention and Mamba layers",
    "kimi_linear": "hybrid linear attention layers", "hunyuan_v1_moe_hybrid": "hybrid Mamba layers",
}
ENCODERS = {"bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "modernbert", "distilbert", "electra",
            "deberta", "deberta-v2", "albert", "ernie", "mpnet", "nomic_bert", "data2vec-text", "megatron-bert",
            "rembert", "roformer", "xmod", "big_bird", "nezha", "mobilebert", "funnel", "canine", "luke", "esm",
            "jina_bert", "squeezebert", "layoutlm", "ibert", "flaubert", "xlm", "splinter", "yoso", "nystromformer",
            "mra", "fnet", "convbert", "bros", "lilt", "markuplm", "ernie_m", "qdqbert", "realm", "eurobert",
            "neobert"}
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
DYNAMIC_ROPE = ("dynamic", "longrope")


def architecture(cfg: Any) -> str:
    archs = getattr(cfg, "architectures", None) or []
    return archs[0] if archs else f"{getattr(cfg, 'model_type', '?')} (no architectures in its config)"


def refusal(cfg: Any) -> str | None:
    """Why conveyor refuses the model `cfg` describes, before its weights are read (None: it does not, from the
    config; its forward's attention is checked at load)."""
    model_type = getattr(cfg, "model_type", "") or ""
    archs = list(getattr(cfg, "architectures", None) or [])
    if getattr(cfg, "is_encoder_decoder", False):
        return (f"an encoder-decoder model ({architecture(cfg)}); conveyor generates with decoder-only causal "
                "language models")
    heads = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
             "ForMultipleChoice", "ForPreTraining", "ForNextSentencePrediction", "Model")
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs):
        kind = next((h for h in heads if archs[0].endswith(h)), None)
        what = {"ForMaskedLM": "a masked language model", "Model": "a base model without a language-model head",
                None: "not a causal language model"}.get(kind, f"a {kind.removeprefix('For')} model")
        task = "--task classify (or score, reward)" if kind == "ForSequenceClassification" else \
            "--task embed for its embeddings"
        return (f"its checkpoint is {what} ({', '.join(archs)}), not a causal language model: it cannot generate "
                f"text; run it with {task}")
    if model_type in ENCODERS and not getattr(cfg, "is_decoder", False):
        return (f"a bidirectional encoder ({model_type}), not a causal language model: it cannot generate text; run "
                "it with --task embed for its embeddings")
    if getattr(cfg, "kv_lora_rank", None):
        return (f"multi-head latent attention (kv_lora_rank={cfg.kv_lora_rank}): its cache is a compressed latent, "
                "not the per-head K/V conveyor's pool holds")
    if model_type in NOT_PLAIN_KV:
        return f"{NOT_PLAIN_KV[model_type]}: their state is not the per-head K/V conveyor's pool holds"
    other = sorted({str(t) for t in getattr(cfg, "layer_types", None) or () if t not in ATTENTION_LAYER_TYPES})
    if getattr(cfg, "attention_chunk_size", None) or "chunked_attention" in other:
        return (f"chunked attention (attention_chunk_size={getattr(cfg, 'attention_chunk_size', None)}), which "
                "conveyor does not compute")
    if other:
        return (f"layers of type {', '.join(other)}: conveyor runs full and sliding-window attention layers only")
    if getattr(cfg, "alibi", False) or model_type in ("bloom", "mpt"):
        return "ALiBi position biases, which conveyor's attention does not add"
    return None


def check_supported(cfg: Any, name: str) -> None:
    """UnsupportedModel naming `name`, its architecture and why, where `refusal` refuses it."""
    why = refusal(cfg)
    if why is not None:
        raise UnsupportedModel(f"model {name} ({architecture(cfg)}): {why}")


def _rope_params(cfg: Any) -> list[dict]:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return []
    if all(isinstance(v, dict) for v in params.values()) and params:  # per layer type (Gemma 3)
        return list(params.values())
    return [params]


def rotary_context_limit(cfg: Any) -> tuple[int, str] | None:
    """(positions, why) where the model's rotary changes with the sequence's length past its original context
    ("dynamic" NTK, "longrope"): transformers recomputes every position's rotary once a sequence grows past it,
    which keys already in a KV cache cannot follow; below it the rotary is fixed. None where it is fixed."""
    limits = []
    for p in _rope_params(cfg):
        kind = p.get("rope_type", p.get("type"))
        if kind in DYNAMIC_ROPE:
            original = p.get("original_max_position_embeddings") or getattr(
                cfg, "original_max_position_embeddings", None) or getattr(cfg, "max_position_embeddings", None)
            if original:
                limits.append((int(original), kind))
    if not limits:
        return None
    positions, kind = min(limits)
    return positions, (f"its {kind!r} rotary changes with the sequence's length past {positions} positions, which "
                       "a KV cache cannot follow")


def fused_family(cfg: Any) -> tuple[str | None, str]:
    """(the family whose fused forward the model takes where its modules are that family's, or None; why not)."""
    model_type = getattr(cfg, "model_type", "") or ""
    if model_type not in FUSED_FAMILIES:
        return None, f"no fused forward for model type {model_type!r}"
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act not in FUSED_ACTIVATIONS:
        return None, f"activation {act!r} (the fused forward has {', '.join(FUSED_ACTIVATIONS)})"
    return model_type, ""


def attention_features(cfg: Any) -> list[str]:
    """What the config says of its layers' attention beyond plain causal attention (the loaded model's own forward
    is what the engine reads: `backends/attention_probe.py`)."""
    out = []
    window = getattr(cfg, "sliding_window", None)
    layer_types = list(getattr(cfg, "layer_types", None) or ())
    if window and getattr(cfg, "use_sliding_window", True) is not False:
        sliding = layer_types.count("sliding_attention") if layer_types else None
        where = f"on {sliding} of {len(layer_types)} layers" if sliding is not None else "on every layer"
        out.append(f"sliding window of {window} tokens {where}")
    for name, what in (("attn_logit_softcapping", "attention logit softcap"),
                       ("final_logit_softcapping", "final logit softcap")):
        if getattr(cfg, name, None):
            out.append(f"{what} {getattr(cfg, name):g}")
    if getattr(cfg, "query_pre_attn_scalar", None):
        out.append(f"attention scaled by query_pre_attn_scalar {cfg.query_pre_attn_scalar:g}")
    if getattr(cfg, "attention_multiplier", None):
        out.append(f"attention multiplier {cfg.attention_multiplier:g}")
    if getattr(cfg, "model_type", "") == "gpt_oss":
        out.append("attention sinks")
    rope = [p.get("rope_type", p.get("type")) for p in _rope_params(cfg)]
    rope = sorted({r for r in rope if r and r != "default"})
    if rope:
        out.append(f"rotary scaling {', '.join(rope)}")
    return out


def generation_routes(cfg: Any) -> list[tuple[str, str]]:
    """What `conveyor models --check` says of a model it generates with (`refusal` lets it): (what, value) for its
    route on each backend, its attention and its context."""
    lines = []
    family, why_not = fused_family(cfg)
    if family is not None:
        lines.append(("cpu backend", f"fused {family} forward: conveyor's exact kernels (a record's output does not "
                                     "depend on its batch; bitwise the same after a resume)"))
        lines.append(("cuda backend", f"lean {family} forward, Triton attention (not batch-invariant: cuBLAS)"))
    else:
        lines.append(("cpu backend", f"its transformers forward with conveyor's attention ({why_not}): correct, "
                                     "not batch-invariant (torch's linears)"))
        lines.append(("cuda backend", "its transformers forward with Triton attention (not batch-invariant)"))
    lines.append(("torch backend", "its transformers forward with SDPA attention (not batch-invariant)"))
    features = attention_features(cfg)
    lines.append(("attention", "; ".join(features) if features else "full causal attention"))
    context = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    rotary = rotary_context_limit(cfg)
    if rotary is not None:
        lines.append(("context", f"{min(context or rotary[0], rotary[0])} tokens ({rotary[1]})"))
    elif context:
        lines.append(("context", f"{context} tokens"))
    lines.append(("checked at load", "each layer's attention as its transformers forward hands it over (window, "
                                     "softcap, sinks, scaling), before any record runs"))
    return lines
