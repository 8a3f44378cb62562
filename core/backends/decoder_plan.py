"""(torch) What a model of a supported decoder family computes, layer by layer, read off its modules: the plan the
backends' own forwards run (the CPU's fused forward, the CUDA lean forward) instead of its transformers forward.

A family (`core/model_support.py`: Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Gemma 1/2/3, Phi-3, OLMo-2,
Granite, SmolLM3, EXAONE 4) fixes where a layer's norms sit (before the sublayers, around them, after them), the
norms' form (the weight multiplied in the model's dtype, or in float32: Gemma's 1 + w, OLMo-2's w), q/k norms (per
head, or over all of q and k), the MLP (gated, dense or MoE), the embedding and logit scalings, and which rotary
table a layer takes (one for every layer, one per layer type, none on a sliding model's global layers). The attention
(scale, window, softcap) is the probe's (`attention_probe`), the rotary tables the model's own rotary modules',
computed once per position (`RotaryTable`). `decoder_plan` returns None, with the reason, for anything else: the
model then runs its own transformers forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from conveyor.core.attention_spec import ModelAttention
from conveyor.core.model_shape import context_of
from conveyor.core.model_support import FUSED_FAMILIES, Family
from conveyor.core.quant.weights import QuantLinear, QuantWeight

ROPE_BLOCK = 4096  # positions per extension of a rotary table
ACTIVATIONS = {"SiLUActivation": "silu", "SiLU": "silu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh"}
NORM_ROLES = {  # norm position -> module name, per family layout
    "pre": {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"},
    "sandwich": {"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
                 "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"},
    "post": {"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"},
}


@dataclass
class NormPlan:
    weight: torch.Tensor  # the model's dtype (Llama's form), or float32 (multiplied in float, rounded once)
    eps: float


@dataclass
class MoePlan:
    router: torch.Tensor  # [experts, hidden]
    gate_up: torch.Tensor  # [experts, 2 I, hidden]: gate rows first
    down: torch.Tensor  # [experts, hidden, I]
    top_k: int
    renormalize: bool
    weights_in_dtype: bool  # the routing weights rounded to the model's dtype before they scale (Qwen3-MoE)


@dataclass
class LayerPlan:
    norms: dict[str, NormPlan]  # attn_in, attn_out, mlp_in, mlp_out: where the family has them
    qkv: tuple[torch.Tensor, torch.Tensor | None]  # [q; k; v] rows, bias
    o: tuple[torch.Tensor, torch.Tensor | None]
    gate_up: tuple[torch.Tensor, torch.Tensor | None] | None  # [gate; up] rows (None: MoE)
    down: tuple[torch.Tensor, torch.Tensor | None] | None
    moe: MoePlan | None
    act: str  # "silu" or "gelu_tanh"
    rope: int | None  # index of the layer's rotary table (None: no rotary)
    q_norm: NormPlan | None = None
    k_norm: NormPlan | None = None
    qk_norm_whole: bool = False
    residual_multiplier: float = 1.0

    @property
    def intermediate(self) -> int:
        return self.gate_up[0].shape[0] // 2


@dataclass
class DecoderPlan:
    family: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    embed: Callable[[torch.Tensor], torch.Tensor]  # input ids -> the residual stream's first rows
    layers: list[LayerPlan]
    final_norm: NormPlan
    lm_head: tuple[torch.Tensor, torch.Tensor | None] | None  # None: a model without one (an embedding model's)
    rotaries: list[RotaryTable] = field(default_factory=list)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    logits_divisor: float | None = None  # logits / this (Granite's logits_scaling)


class RotaryTable:
    """cos, sin [T, rotary dims] of each position, looked up in a table of every position so far: computed by the
    model's own rotary module ROPE_BLOCK positions at a time, so a position's values never depend on the step it
    comes in (torch's vectorized cos/sin would round a step's tail elements apart)."""

    def __init__(self, rotary: Callable, like: torch.Tensor, block: int = ROPE_BLOCK) -> None:
        self.rotary = rotary  # (like, positions [1, n]) -> (cos, sin) [1, n, dims]
        self.block = block  # positions per call: no more than the model's context (a dynamic rotary stays fixed)
        self.like = like[:1]  # gives the rotary module its dtype and device
        self.cos = like.new_empty(0, 0)
        self.sin = like.new_empty(0, 0)

    def reserve(self, num_positions: int) -> None:
        """Compute the table up to `num_positions` now (a CUDA graph must not grow it)."""
        while self.cos.shape[0] < num_positions:
            start = self.cos.shape[0]
            positions = torch.arange(start, start + self.block, device=self.like.device).unsqueeze(0)
            cos, sin = self.rotary(self.like, positions)
            self.cos = cos[0] if start == 0 else torch.cat([self.cos, cos[0]])
            self.sin = sin[0] if start == 0 else torch.cat([self.sin, sin[0]])

    @property
    def dims(self) -> int:
        self.reserve(1)
        return self.cos.shape[1]

    def __call__(self, positions: torch.Tensor, known_max: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rows of `positions`; `known_max`, the largest position where the caller knows it, spares
        reading it from the device."""
        need = (int(positions.max()) if known_max is None else known_max) + 1
        if self.cos.shape[0] < need:
            self.reserve(need)
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def concat_linears(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor | QuantWeight, torch.Tensor | None]:
    """One [sum(N), K] weight (and bias, zeros for a module that has none; None where none has one) whose slices
    the modules' parameters become, so the weights are held once: one matmul for q/k/v, one for gate/up. Quantized
    linears (`QuantLinear`) stack their quantized weights the same way."""
    quantized = [isinstance(m, QuantLinear) for m in modules]
    if any(quantized):
        if not all(quantized):
            raise _Decline("a matmul of quantized and unquantized linears")
        return _concat_quantized(modules)
    weight = torch.cat([m.weight.detach() for m in modules])
    bias = None
    if any(m.bias is not None for m in modules):
        bias = torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.weight.shape[0])
                          for m in modules])
    offset = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight.data = weight[offset:offset + n]
        if m.bias is not None:
            m.bias.data = bias[offset:offset + n]
        offset += n
    return weight, bias


def _concat_quantized(modules: list[QuantLinear]) -> tuple[QuantWeight, torch.Tensor | None]:
    try:
        weight = QuantWeight.cat([m.quant for m in modules])
    except ValueError as e:
        raise _Decline(str(e)) from None
    bias = None
    if any(m.bias is not None for m in modules):
        bias = torch.cat([m.bias.detach() if m.bias is not None else torch.zeros(m.out_features, dtype=m.dtype)
                          for m in modules])
    offset = 0
    for m in modules:  # each module keeps views of the stacked weight, so it is held once
        m.quant = weight.rows(offset, offset + m.out_features)
        offset += m.out_features
    return weight, bias


def _linear(m: torch.nn.Linear) -> tuple[torch.Tensor | QuantWeight, torch.Tensor | None]:
    if isinstance(m, QuantLinear):
        return m.quant, None if m.bias is None else m.bias.detach()
    return m.weight.detach(), None if m.bias is None else m.bias.detach()


class _Decline(Exception):
    """This model is not one the plan covers (the message says why)."""


def _children(module: torch.nn.Module) -> set[str]:
    """Its submodules' names, dropouts left out (identities in eval mode)."""
    return {name for name, child in module.named_children() if not isinstance(child, torch.nn.Dropout)}


def _norm(module: torch.nn.Module, form: str) -> NormPlan:
    if {name for name, _ in module.named_parameters()} != {"weight"}:
        raise _Decline(f"a norm ({type(module).__name__}) with parameters other than its weight")
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if eps is None:
        raise _Decline(f"a norm ({type(module).__name__}) without eps")
    w = module.weight.detach()
    if form == "one_plus":
        w = 1.0 + w.float()
    elif form == "float":
        w = w.float()
    return NormPlan(w, float(eps))


def _activation(module: torch.nn.Module) -> str:
    act = ACTIVATIONS.get(type(module).__name__)
    if act is None:
        raise _Decline(f"activation {type(module).__name__}")
    return act


def _mlp(mlp: torch.nn.Module, family: Family):
    """(gate_up, down, moe, act)."""
    kids = _children(mlp)
    if kids == {"gate_proj", "up_proj", "down_proj", "act_fn"}:
        return concat_linears([mlp.gate_proj, mlp.up_proj]), _linear(mlp.down_proj), None, _activation(mlp.act_fn)
    if family.fused_mlp and kids == {"gate_up_proj", "down_proj", "activation_fn"}:
        return _linear(mlp.gate_up_proj), _linear(mlp.down_proj), None, _activation(mlp.activation_fn)
    if family.moe and kids == {"gate", "experts"}:
        gate, experts = mlp.gate, mlp.experts
        if {n for n, _ in gate.named_parameters()} != {"weight"} or \
                {n for n, _ in experts.named_parameters(recurse=False)} != {"gate_up_proj", "down_proj"} or \
                _children(experts) != {"act_fn"}:
            raise _Decline("an MoE block of another shape")
        moe = MoePlan(gate.weight.detach(), experts.gate_up_proj.detach(), experts.down_proj.detach(),
                      int(gate.top_k), bool(getattr(gate, "norm_topk_prob", True)), family.moe == "dtype_weights")
        return None, None, moe, _activation(experts.act_fn)
    raise _Decline(f"an MLP of modules {sorted(kids)}")


def _attention_linears(attn: torch.nn.Module, family: Family):
    kids = _children(attn) - {"q_norm", "k_norm"}
    if kids == {"q_proj", "k_proj", "v_proj", "o_proj"}:
        return concat_linears([attn.q_proj, attn.k_proj, attn.v_proj]), _linear(attn.o_proj)
    if family.fused_mlp and kids == {"qkv_proj", "o_proj"}:
        return _linear(attn.qkv_proj), _linear(attn.o_proj)
    raise _Decline(f"an attention of modules {sorted(_children(attn))}")


def _rotaries(model: torch.nn.Module, like: torch.Tensor, family: Family
              ) -> tuple[list[RotaryTable], Callable[[int], int | None]]:
    """The model's rotary tables and which one layer i uses (None: none)."""
    inner, cfg = inner_model(model), model.config
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        raise _Decline("no rotary module")
    layer_types = getattr(cfg, "layer_types", None)
    block = min(ROPE_BLOCK, context_of(cfg))
    if family.rope_per_layer_type:  # a table per layer type (local and global bases)
        kinds = sorted(set(layer_types))
        tables = [RotaryTable(lambda x, p, kind=kind: rotary(x, p, kind), like, block) for kind in kinds]
        return tables, lambda i: kinds.index(layer_types[i])
    tables = [RotaryTable(rotary, like, block)]

    def which(i: int) -> int | None:
        attn = inner.layers[i].self_attn
        if getattr(attn, "use_rope", True) in (0, False):  # SmolLM3's NoPE layers
            return None
        if family.nope_global_layers and not (attn.sliding_window is None or attn.is_sliding):
            return None  # a global layer of a sliding model: NoPE
        return 0

    return tables, which


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of `model`: its `model` (a causal LM's, a sequence classifier's), or itself (a base model,
    as an embedding checkpoint loads)."""
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def decoder_plan(model: torch.nn.Module, attention: ModelAttention) -> tuple[DecoderPlan | None, str | None]:
    """(the plan of `model`, None), or (None, why it is not covered)."""
    try:
        return _plan(model, attention), None
    except _Decline as e:
        return None, str(e)
    except AttributeError as e:
        return None, f"a module the family has is missing ({e})"


def _plan(model: torch.nn.Module, attention: ModelAttention) -> DecoderPlan:
    cfg = model.config
    family = FUSED_FAMILIES.get(getattr(cfg, "model_type", ""))
    if family is None:
        raise _Decline(f"model type {getattr(cfg, 'model_type', '?')!r} has no fused forward")
    if any(layer.sinks for layer in attention.layers):
        raise _Decline("attention sinks")
    inner = inner_model(model)
    roles = NORM_ROLES[family.layout]
    like = inner.embed_tokens.weight.detach()
    rotaries, which = _rotaries(model, like, family)
    num_heads = cfg.num_attention_heads
    head_dim = attention.head_dim
    layers = []
    for i, layer in enumerate(inner.layers):
        expected = {"self_attn", "mlp", *roles.values()}
        if _children(layer) != expected:
            raise _Decline(f"a decoder layer of modules {sorted(_children(layer))}, not {sorted(expected)}")
        attn = layer.self_attn
        qkv, o = _attention_linears(attn, family)
        if qkv[0].shape[0] != (num_heads + 2 * attention.num_kv_heads) * head_dim:
            raise _Decline("q/k/v widths that are not the heads'")
        gate_up, down, moe, act = _mlp(layer.mlp, family)
        has_qk = {"q_norm", "k_norm"} & _children(attn)
        if bool(has_qk) != bool(family.qk_norm):
            raise _Decline("q/k norms where the family has none, or none where it has them")
        rope = which(i)
        if rope is not None and (rotaries[rope].dims > head_dim or rotaries[rope].dims % 2):
            raise _Decline(f"{rotaries[rope].dims} rotary dims for heads of {head_dim}")
        plan = LayerPlan({role: _norm(getattr(layer, name), family.norm) for role, name in roles.items()}, qkv, o,
                         gate_up, down, moe, act, rope,
                         residual_multiplier=float(getattr(cfg, "residual_multiplier", 1.0) or 1.0)
                         if family.multipliers else 1.0)
        if family.qk_norm:
            plan.q_norm, plan.k_norm = _norm(attn.q_norm, family.norm), _norm(attn.k_norm, family.norm)
            plan.qk_norm_whole = family.qk_norm == "whole"
            want = (num_heads * head_dim, attention.num_kv_heads * head_dim) if plan.qk_norm_whole else \
                (head_dim, head_dim)
            if (plan.q_norm.weight.numel(), plan.k_norm.weight.numel()) != want:
                raise _Decline("q/k norms of another width")
        layers.append(plan)
    embed_module = inner.embed_tokens
    multiplier = float(getattr(cfg, "embedding_multiplier", 1.0) or 1.0) if family.multipliers else 1.0
    if multiplier != 1.0:
        def embed(ids):
            return embed_module(ids) * multiplier
    else:
        embed = embed_module
    softcap = getattr(cfg, "final_logit_softcapping", None) if family.final_softcap else None
    divisor = float(getattr(cfg, "logits_scaling", 1.0) or 1.0) if family.multipliers else 1.0
    return DecoderPlan(cfg.model_type, num_heads, attention.num_kv_heads, head_dim, embed, layers,
                       _norm(inner.norm, family.norm),
                       _linear(model.lm_head) if getattr(model, "lm_head", None) is not None else None, rotaries,
                       float(softcap) if softcap else None, divisor if divisor != 1.0 else None)
