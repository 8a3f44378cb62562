"""Quantized checkpoints: what their configs say (`formats`, pure Python), their weights read from the format's own
tensors (`compressed_tensors`, `gptq_awq`, `gguf_blocks`) into one form (`weights.QuantWeight`), and the model built
around them (`load`)."""
