"""Quantized checkpoints: what their configs ask for (`formats`, pure Python), their weights read from each format's
own tensors (`tensors`: compressed-tensors, GPTQ, AWQ; `gguf_blocks`: GGUF's block types) into one form
(`weights.QuantWeight`), and the model built around them (`load`, `gguf_load`)."""
