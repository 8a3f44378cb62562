"""(torch) A model's own transformers forward over the paged pool: the route for architectures a backend has
no forward of its own for.

The model runs one flat batch [1, num_tokens] per step with attention implementation "conveyor_paged",
registered with transformers' AttentionInterface: for each layer it hands the layer's new K/V and queries
to the step's `StepAttention` (the backend's: the C++ kernel, Triton or SDPA), which stores them in the pool
and attends, with the layer's sliding window, softcap and sinks as the model hands them over (`attention_probe`
checks once, before any record runs, that these are all it asks for). The step's attention is the one this module
holds while the model's unmodified forward runs (`_running`): not a keyword, which a model's forward need not
pass down to its layers (Falcon's does not); transformers builds no mask (the causal structure is in the
metadata).
"""

from __future__ import annotations

import contextlib

import torch

from conveyor.core.backends.step import Step, with_embeds

ATTN_IMPLEMENTATION = "conveyor_paged"
_probing = False  # while `probing()`: masks are handed over as their mask functions, calls recorded
_step = None  # the StepAttention (or, probing, the AttentionProbe) of the forward running now


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, softcap: float | None = None,
                            s_aux: torch.Tensor | None = None, **kwargs):
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> (output [1, T, H, D], None)."""
    step = _step
    if step is None:
        raise RuntimeError("conveyor_paged attention needs the step's metadata (run the model via ModelRunner)")
    if _probing:
        return step.record(module, query, key, value, attention_mask, scaling, dropout, sliding_window,
                                     softcap, s_aux, kwargs), None
    layer = module.layer_idx
    k_new = key[0].transpose(0, 1)  # [T, Hkv, D]
    v_new = value[0].transpose(0, 1)
    step.store(layer, k_new, v_new)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)  # [T, H, D]
    window = sliding_window if isinstance(sliding_window, int) and sliding_window > 0 else None
    out = step.attend(layer, q, k_new, v_new, scale, window=window, softcap=softcap or None,
                                sinks=None if s_aux is None else s_aux.float())
    return out.to(query.dtype).unsqueeze(0), None


def _no_mask(*args, mask_function=None, **kwargs):
    """The causal structure lives in the step's metadata; transformers need not build a mask. (While probing, the
    mask function stands for the mask, as the probe wraps it (`AttentionProbe.mask`), so the probe can read which
    keys each query sees.)"""
    if _probing:
        return _step.mask(mask_function)
    return None


@contextlib.contextmanager
def _running(step):
    """`step` is the attention of the model's forward while it runs."""
    global _step
    before, _step = _step, step
    try:
        yield
    finally:
        _step = before


@contextlib.contextmanager
def probing(probe):
    """The attention function and the masks in probe mode, recording into `probe` (`attention_probe`)."""
    global _probing
    _probing = True
    try:
        with _running(probe):
            yield
    finally:
        _probing = False


def register(model: torch.nn.Module) -> None:
    """Register "conveyor_paged" with transformers and switch `model` to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


def transformers_forward(model: torch.nn.Module, step: Step) -> torch.Tensor:
    """Logits at the step's logit rows through the model's own forward."""
    impl = getattr(model.config, "_attn_implementation", None)
    # Any other attention would ignore the paged cache: wrong tokens, silently.
    if impl != ATTN_IMPLEMENTATION:
        raise RuntimeError(f"the model's attention implementation is {impl!r}, not {ATTN_IMPLEMENTATION!r}; "
                           "it was changed after the engine was built")
    # where the step gives embeddings for some rows (images), the model takes its token embeddings with them in place
    inputs = ({"input_ids": step.input_ids.unsqueeze(0)} if step.embeds is None else
              {"inputs_embeds": with_embeds(model.get_input_embeddings()(step.input_ids), step.embeds).unsqueeze(0)})
    with _running(step.attention):
        return model(**inputs, position_ids=step.positions.unsqueeze(0), use_cache=False,
                     logits_to_keep=step.logit_rows).logits[0]
