"""(torch) What a model's own transformers forward asks of its attention, read by running it once on one token.

Every backend implements attention as softmax(scale * q.k) v over a causal window of keys, with an optional
softcap and sinks (`core/attention_spec.py`). Before a model runs, its transformers forward is run once with
"conveyor_paged" attention in probe mode: each layer's call records the scaling, softcap and sinks it is handed
and the K/V shapes, and each attention mask transformers asks for is kept as its mask function, evaluated here on
sample positions. What conveyor would not compute as the model defines it is refused (`UnsupportedModel`, exit 2)
naming the architecture and the feature, before any record runs: a mask that is not causal or a sliding window of
it (bidirectional, chunked, a mask the model builds itself), a keyword no backend implements, a layer whose
attention does not go through transformers' attention interface, keys and values of different widths (MLA).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from conveyor.core.attention_spec import LayerAttention, ModelAttention
from conveyor.core.backends.transformers_forward import probing, register
from conveyor.core.errors import UnsupportedModel
from conveyor.core.model_support import check_supported

# Keywords the attention function may be handed that change nothing here (the positions are the step's own) or
# that the probe reads (scaling, dropout, sliding_window, softcap, s_aux).
_HARMLESS = {"position_ids", "cache_position", "use_cache", "output_attentions", "past_key_values",
             "past_key_value", "layer_idx"}
_POSITIONS_CHECKED = (0, 1, 2, 3, 7, 15, 16, 17, 31, 63, 64, 65, 127, 255, 511, 512, 513, 1023, 2047, 4095, 4096,
                      4097, 8191, 8192, 8193, 16383, 32767, 65535, 131071)


@dataclass
class MaskProbe:
    """Stands for the attention mask transformers asked for (in probe mode): its mask function."""

    mask_function: object

    def visible(self, q: int) -> torch.Tensor:
        """Bool [q + 2]: which keys 0..q+1 a query at position q sees."""
        kv = torch.arange(q + 2)
        zero = torch.zeros((), dtype=torch.long)
        out = self.mask_function(zero, zero, torch.tensor(q), kv)
        if not isinstance(out, torch.Tensor) or out.shape != kv.shape:  # a function of scalars only
            out = torch.tensor([bool(self.mask_function(0, 0, q, int(k))) for k in kv])
        return out.bool()


@dataclass
class _Call:
    layer: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    scaling: float | None
    dropout: float
    sliding_window: int | None
    softcap: float | None
    sinks: torch.Tensor | None
    mask: object
    unknown: dict = field(default_factory=dict)
    is_causal: object = True


class AttentionProbe:
    """The attention function's step in probe mode (`transformers_forward.probing`): records each call."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []

    @staticmethod
    def mask(mask_function) -> MaskProbe:
        """What stands for a mask transformers asks for while probing: its mask function."""
        return MaskProbe(mask_function)

    def record(self, module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap, s_aux,
               kwargs) -> torch.Tensor:
        kwargs = dict(kwargs)
        causal = kwargs.pop("is_causal", None)  # handed over by some forwards: True is what conveyor computes
        if causal is None:
            causal = getattr(module, "is_causal", True)
        unknown = {k: v for k, v in kwargs.items() if k not in _HARMLESS and v is not None and v is not False}
        self.calls.append(_Call(getattr(module, "layer_idx", None), query.shape[1], key.shape[1], key.shape[-1],
                                value.shape[-1], scaling, float(dropout or 0.0), sliding_window, softcap, s_aux,
                                attention_mask, unknown, causal))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


def _window_of(mask: MaskProbe, positions: list[int]) -> int | None:
    """The sliding window of a causal mask (None: every key up to the query), or ValueError saying how the mask is
    neither (keys after the query, a gap, a window that changes with the position)."""
    window = None
    for q in positions:
        seen = mask.visible(q)
        if bool(seen[q + 1]):
            raise ValueError(f"a query at position {q} sees the key after it (the mask is not causal)")
        keys = torch.nonzero(seen[:q + 1]).flatten().tolist()
        if not keys or keys[-1] != q:
            raise ValueError(f"a query at position {q} does not see its own key")
        if keys != list(range(keys[0], q + 1)):
            raise ValueError(f"a query at position {q} sees keys with gaps between them")
        if keys[0] == 0:
            if window is not None and q + 1 > window:
                raise ValueError(f"a query at position {q} sees every key although one at an earlier position saw "
                                 f"only {window}")
            continue
        w = q + 1 - keys[0]
        if window is not None and w != window:
            raise ValueError(f"queries see {window} keys at one position and {w} at another (a chunked mask?)")
        window = w
    return window


def probe_attention(model: torch.nn.Module, name: str) -> ModelAttention:
    """Every layer's attention as `model`'s transformers forward defines it (the model must have "conveyor_paged"
    attention set: `transformers_forward.register`); UnsupportedModel (naming `name`, its architecture and what)
    where it asks for something conveyor does not compute exactly."""
    cfg = model.config
    arch = (getattr(cfg, "architectures", None) or [type(model).__name__])[0]
    num_layers = cfg.num_hidden_layers

    def refuse(what: str) -> UnsupportedModel:
        return UnsupportedModel(f"model {name} ({arch}): {what}; conveyor runs a model only where it computes it as "
                                "transformers defines it (`conveyor models --check` says what each model takes)")

    probe = AttentionProbe()
    device = next(model.parameters()).device
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    with probing(probe), torch.inference_mode():
        try:
            model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False)
        except UnsupportedModel:
            raise
        except Exception as e:  # noqa: BLE001 - whatever stops a forward that passes the step's metadata
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise refuse(f"its forward does not run with conveyor's paged attention ({type(e).__name__}: "
                         f"{first})") from e
    calls = {c.layer: c for c in probe.calls}
    if sorted(calls) != list(range(num_layers)) or len(probe.calls) != num_layers:
        seen = sorted(c.layer for c in probe.calls if c.layer is not None)
        raise refuse(f"{len(probe.calls)} attention calls for {num_layers} layers (layers {seen[:8]}) go through "
                     "transformers' attention interface: its other layers' attention (or cache) would not be "
                     "conveyor's")
    layers = []
    positions_limit = int(getattr(cfg, "max_position_embeddings", 0) or 0) or 131072
    for i in range(num_layers):
        c = calls[i]
        where = f"layer {i}"
        if c.unknown:
            raise refuse(f"its attention is handed {', '.join(sorted(c.unknown))} ({where}), which conveyor's "
                         "attention does not implement")
        if c.dropout:
            raise refuse(f"attention dropout {c.dropout} at inference ({where})")
        if not bool(c.is_causal):
            raise refuse(f"its attention is bidirectional ({where}: is_causal False), not a causal language model's")
        if c.head_dim != c.v_head_dim:
            raise refuse(f"keys of {c.head_dim} and values of {c.v_head_dim} elements per head ({where}: "
                         "multi-head latent attention or another cache that is not plain K/V)")
        if c.heads % c.kv_heads:
            raise refuse(f"{c.heads} query heads over {c.kv_heads} KV heads ({where})")
        if not isinstance(c.mask, MaskProbe):
            what = "no attention mask" if c.mask is None else f"an attention mask of its own ({type(c.mask).__name__})"
            raise refuse(f"its forward hands the attention {what} ({where}), not the causal mask transformers "
                         "builds, so conveyor cannot tell which keys a query sees")
        kw_window = c.sliding_window if isinstance(c.sliding_window, int) and c.sliding_window > 0 else None
        extra = [w - 2 for w in (kw_window,) if w] + [w - 1 for w in (kw_window,) if w] + \
            [w + d for w in (kw_window,) if w for d in (0, 1, w)]
        positions = sorted({p for p in (*_POSITIONS_CHECKED, *extra, positions_limit - 1)
                            if 0 <= p < max(positions_limit, 1)})
        try:
            window = _window_of(c.mask, positions)
        except ValueError as e:
            raise refuse(f"its attention mask is not causal or a sliding window of it ({where}: {e})") from None
        if kw_window is not None and kw_window < positions_limit and window != kw_window:
            raise refuse(f"its attention is handed sliding_window={kw_window} but its mask has "
                         f"{'no window' if window is None else f'a window of {window}'} ({where})")
        softcap = float(c.softcap) if c.softcap else None
        sinks = c.sinks is not None
        if sinks and (not isinstance(c.sinks, torch.Tensor) or c.sinks.numel() != c.heads):
            raise refuse(f"attention sinks of shape {getattr(c.sinks, 'shape', '?')} for {c.heads} heads ({where})")
        scale = float(c.scaling) if c.scaling is not None else c.head_dim ** -0.5
        layers.append(LayerAttention(scale, window, softcap, sinks))
    shapes = {(calls[i].kv_heads, calls[i].head_dim) for i in range(num_layers)}
    if len(shapes) != 1:
        raise refuse(f"its layers store K/V of different shapes {sorted(shapes)}; conveyor's pool has one")
    (kv_heads, head_dim), = shapes
    return ModelAttention(tuple(layers), kv_heads, head_dim)


def model_attention(model: torch.nn.Module) -> ModelAttention:
    """`model` switched to conveyor's attention ("conveyor_paged": `transformers_forward.register`), what the loader
    refuses before the weights checked for a model handed over as it is (`model_support.check_supported`), and its
    layers' attention as its forward defines it (`probe_attention`): what `select_backend` hands a backend."""
    register(model)  # the model's own forward runs with conveyor's attention (the probe; the transformers route)
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    check_supported(model.config, name)
    return probe_attention(model, name)
