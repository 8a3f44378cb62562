"""(torch) Log-probabilities of chosen tokens and their top alternatives, from the model's own logits.

As vLLM by default: the distribution before any logits processor, temperature or truncation. Each row is
one float32 log_softmax over the vocabulary and one top-k, computed the same way whatever rows come with
it, so logprobs are as batch-invariant as the logits (tests/core/test_exactness_engine.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from conveyor.core.schedule_types import TokenLogprobs


def token_logprobs(logits: torch.Tensor, targets: Sequence[int], top_n: Sequence[int]) -> list[TokenLogprobs]:
    """logits [n, V] (any float dtype), targets [n] token ids, top_n [n] alternatives per row -> n entries."""
    if not len(targets):
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(list(targets), dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()
    most = max(top_n)
    top_values = top_ids = None
    if most:
        top_values, top_ids = torch.topk(logp, most, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out = []
    for i, (token, n) in enumerate(zip(targets, top_n)):
        top = tuple(zip(top_ids[i][:n], top_values[i][:n])) if n else ()
        out.append(TokenLogprobs(int(token), chosen[i], top))
    return out
