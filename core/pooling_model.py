"""(torch) A model loaded for a pooling task, and how its sequences become results.

What a checkpoint is decides what it can do: an embedder (a base model, or a causal LM whose hidden states are
pooled) gives a vector per sequence; a sequence classifier (`...ForSequenceClassification`) gives its head's
logits: a classifier's probabilities, a cross-encoder's score (one label), a reward model's reward. A task the
checkpoint cannot do is refused before its weights are read, naming both.

Two routes run them:
- packed (the CPU with conveyor's kernels, the BERT-family encoders and the fused decoder families): many sequences
  in one pass, exact (`backends/cpu/packed_pooling.py`); the heads' linears are the kernels' too;
- alone (anything else, and other devices): the model's own transformers forward, one sequence at a time, so a
  sequence's result never depends on the others (slower: it says so).
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from conveyor.core.backends import packed_pooling
from conveyor.core.checkpoint_format import check_format
from conveyor.core.errors import ConfigError, UnsupportedModel
from conveyor.core.model_source import ModelSource
from conveyor.core.pooling_config import ModelKind, PoolingConfig, check_task, context_limit, model_kind, pooling_config
from conveyor.core.pooling_params import TokenSequence
from conveyor.core.sentence_transformers_text import lowercase_texts
from conveyor.core.task import Task


class PoolingModel:
    """A loaded model as the pooling engine runs it: `run(sequences)` gives, per sequence, its pooled hidden state
    (an embedder) or its head's logits (a classifier), float32."""

    def __init__(self, model: torch.nn.Module, kind: ModelKind, pooling: str, name: str) -> None:
        self.model = model
        self.kind = kind
        self.pooling = pooling
        self.name = name
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # (a BERT-style pair's token types, where the model's forward takes them: DistilBERT's does not)
        self._takes_types = "token_type_ids" in inspect.signature(model.forward).parameters
        self.packed, self.why_alone = packed_pooling(model, kind.encoder, kind.classifier, name, pooling, _pool)

    @property
    def exact_packing(self) -> bool:
        return self.packed is not None

    def describe(self) -> str:
        kind = "encoder" if self.kind.encoder else "decoder"
        if self.packed is not None:
            return f"cpu (packed {kind} forward)"
        return f"{self.device.type} (its transformers forward, one sequence at a time: {self.why_alone})"

    @torch.inference_mode()
    def run(self, sequences: list[TokenSequence]) -> list[torch.Tensor]:
        if self.packed is None:
            return [self._alone(s) for s in sequences]
        return self.packed.run(sequences)

    def _alone(self, s: TokenSequence) -> torch.Tensor:
        ids = torch.tensor([s.token_ids], device=self.device)
        kwargs = {}
        if s.token_type_ids is not None and self._takes_types:
            kwargs["token_type_ids"] = torch.tensor([s.token_type_ids], device=self.device)
        out = self.model(input_ids=ids, **kwargs)
        if self.kind.classifier:
            return out.logits[0].float()
        return _pool(out.last_hidden_state[0], 0, len(s.token_ids), self.pooling)


def _pool(hidden: torch.Tensor, first: int, n: int, method: str) -> torch.Tensor:
    """The pooled vector of a sequence whose rows are hidden[first:first + n], float32. The mean is summed row by row
    over a copy of its own rows: the order is the sequence's alone."""
    if method == "cls":
        return hidden[first].float().clone()
    if method == "last":
        return hidden[first + n - 1].float().clone()
    rows = hidden[first:first + n].float().clone()
    total = rows[0].clone()
    for row in rows[1:]:
        total += row
    return total / n


def load_pooling_model(model: str | ModelSource, task: Task | str, device: str, dtype: str, pooling: str | None
                       ) -> tuple[PoolingModel, object, PoolingConfig, int]:
    """(the model for `task`, its tokenizer (lowercasing texts where the checkpoint's sentence-transformers config
    asks), its pooling config, its context in tokens). UnsupportedModel before the weights are read where the
    checkpoint cannot do the task; ConfigError (model) where its weights are not all there."""
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    from conveyor.core.backends import resolve_device
    from conveyor.core.model_loader import checkpoint_folder, gguf_parsed_once, load_config, resolve, resolve_dtype
    from conveyor.core.model_support import architecture
    from conveyor.core.weight_files import check_weight_files

    task = Task(task)
    source = ModelSource.of(model)
    model = source.name
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    path, gguf_file = resolve(source)
    cfg = load_config(source)
    check_format(cfg, model, gguf=gguf_file is not None, task=task)
    folder = checkpoint_folder(source, path)
    kind = model_kind(cfg, model, folder)
    check_task(kind, task, model, architecture(cfg))
    config = pooling_config(folder, model, kind.encoder, pooling)
    if gguf_file is None:
        check_weight_files(model, path)
    loader = AutoModelForSequenceClassification if kind.classifier else AutoModel
    try:
        with gguf_parsed_once() if gguf_file else contextlib.nullcontext():
            tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
            if config.lower_case:  # (before the weights: a tokenizer it cannot lowercase in refuses the model)
                lowercase_texts(tokenizer, model, config.lower_case)
            loaded, info = loader.from_pretrained(path, gguf_file=gguf_file, dtype=torch_dtype,
                                                  output_loading_info=True)
    except UnsupportedModel:  # (a refusal of the checkpoint's own: said as it is, not as a load that failed)
        raise
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError("model", f"model {model}: could not load it ({first}); check the name or path") from e
    # (a base model's pooler: embeddings pool the hidden states themselves, never through it)
    missing = sorted(k for k in set(info.get("missing_keys") or ()) if kind.classifier or not k.startswith("pooler."))
    if missing:
        raise ConfigError("model", f"model {model}: its weight files do not hold {len(missing)} of the model's "
                          f"weights ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); transformers "
                          "would fill them with random values")
    loaded.to(dev).eval()
    return PoolingModel(loaded, kind, config.pooling, model), tokenizer, config, context_limit(cfg, config)
