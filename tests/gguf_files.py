"""Test helper: a tiny Llama as a .gguf file whose linears are of one block type (`write(path, kind)`), written with
gguf-py: its own quantizer for the types it has one for (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), random blocks with small
scales for the K-quants (the layout is the format's; the values need only be weights). A 64-token vocabulary of
single letters in the file's tokenizer, so that transformers loads the file whole."""

from __future__ import annotations

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 64  # K-quants take rows of 256


def _blocks(rng, kind: str, n: int, k: int) -> np.ndarray:
    import gguf
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        return quantize((rng.standard_normal((n, k)) * 0.1).astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)

    def f16(at, value):
        data[:, at:at + 2] = np.full((data.shape[0], 1), value, np.float16).view(np.uint8)

    if kind == "Q6_K":
        f16(size - 2, 0.0002)
    else:
        f16(0, 0.0008)
        f16(2, 0.0006)
    return data.reshape(n, -1)


def write(path, kind: str, seed: int = 0) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [chr(0x4E00 + i) for i in range(VOCAB - 3)]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([2, 3, 3] + [1] * (VOCAB - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def dense(name, shape, scale=0.1, offset=0.0):
        w.add_tensor(name, (rng.standard_normal(shape) * scale + offset).astype(np.float32))

    def quant(name, n, k):
        data = _blocks(rng, kind, n, k)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[kind])

    head = HIDDEN // HEADS
    dense("token_embd.weight", (VOCAB, HIDDEN), 1.0)
    for i in range(LAYERS):
        dense(f"blk.{i}.attn_norm.weight", (HIDDEN,), 0.1, 1.0)
        quant(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        quant(f"blk.{i}.attn_k.weight", KV_HEADS * head, HIDDEN)
        quant(f"blk.{i}.attn_v.weight", KV_HEADS * head, HIDDEN)
        quant(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        dense(f"blk.{i}.ffn_norm.weight", (HIDDEN,), 0.1, 1.0)
        quant(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        quant(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        quant(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    dense("output_norm.weight", (HIDDEN,), 0.1, 1.0)
    quant("output.weight", VOCAB, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
