"""Test helper (torch): tiny random-weight models of every decoder family conveyor runs, built from each family's
transformers config (4 layers, hidden 64, a 16-token sliding window where the family has one), and the route each
takes on the cpu backend. Nothing is downloaded."""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 512
WINDOW = 16
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               initializer_range=0.2)


def _configs() -> dict:
    c = _COMMON
    return {
        "llama": lambda: tf.LlamaConfig(**c),
        "llama3-rope": lambda: tf.LlamaConfig(**c, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        "qwen2": lambda: tf.Qwen2Config(**c),
        "qwen2-window": lambda: tf.Qwen2Config(**c, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
        "qwen3": lambda: tf.Qwen3Config(**c, head_dim=16),
        "qwen3-moe": lambda: tf.Qwen3MoeConfig(**c, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=32),
        "mistral-window": lambda: tf.MistralConfig(**c, sliding_window=WINDOW),
        "mixtral": lambda: tf.MixtralConfig(**c, num_local_experts=4, num_experts_per_tok=2),
        "gemma": lambda: tf.GemmaConfig(**c, head_dim=16),
        "gemma2": lambda: tf.Gemma2Config(**c, head_dim=16, sliding_window=WINDOW),
        "gemma3": lambda: tf.Gemma3TextConfig(**{**c, "num_hidden_layers": 6}, head_dim=16, sliding_window=WINDOW),
        "phi3": lambda: tf.Phi3Config(**c),
        "phi3-partial-window": lambda: tf.Phi3Config(**c, partial_rotary_factor=0.5, sliding_window=WINDOW),
        "olmo2": lambda: tf.Olmo2Config(**c),
        "granite": lambda: tf.GraniteConfig(**c, embedding_multiplier=12.0, residual_multiplier=0.22,
                                            attention_multiplier=0.0078125, logits_scaling=8.0),
        "smollm3": lambda: tf.SmolLM3Config(**c),
        "exaone4": lambda: tf.Exaone4Config(**c, sliding_window=WINDOW, sliding_window_pattern=4),
        "starcoder2": lambda: tf.Starcoder2Config(**c, sliding_window=WINDOW),
        "gpt-neox": lambda: tf.GPTNeoXConfig(**{k: v for k, v in c.items() if k != "num_key_value_heads"},
                                             rotary_pct=0.25),
        "falcon": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                          multi_query=True, max_position_embeddings=512, pad_token_id=0,
                                          bos_token_id=1, eos_token_id=2, initializer_range=0.2),
        "falcon-gqa": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
                                              num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                                              max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                                              eos_token_id=2, initializer_range=0.2),
        "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=512,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2),
        "cohere": lambda: tf.CohereConfig(**c),
        "glm4": lambda: tf.Glm4Config(**c, head_dim=16),
        "gpt-oss": lambda: tf.GptOssConfig(**c, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                           sliding_window=WINDOW),
    }


CONFIGS = _configs()
# The families the cpu backend runs with its fused forward (exact); the others take their transformers forward.
FUSED = {"llama": "llama", "llama3-rope": "llama", "qwen2": "qwen2", "qwen2-window": "qwen2", "qwen3": "qwen3",
         "qwen3-moe": "qwen3_moe", "mistral-window": "mistral", "mixtral": "mixtral", "gemma": "gemma",
         "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3", "phi3-partial-window": "phi3",
         "olmo2": "olmo2", "granite": "granite", "smollm3": "smollm3", "exaone4": "exaone4"}
# Families whose layers have a sliding window (all of them: Mistral's, Phi-3's, StarCoder2's; some: the rest).
WINDOWED = {"qwen2-window", "mistral-window", "gemma2", "gemma3", "phi3-partial-window", "exaone4", "starcoder2",
            "gpt-oss"}


class CharTokenizer:
    """Stand-in tokenizer: token i decodes to one distinct character; no EOS."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x4E00 + int(i)) for i in ids)


def build(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The family's tiny model, seeded (the same weights every call), in eval mode; norm weights and sinks moved
    off their initial values so that every norm's form and every sink counts."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or "sinks" in n or n.endswith("ln_f.weight") or ".ln_" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model.to(dtype).eval()


@torch.inference_mode()
def reference(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of transformers' own full-recompute forward (eager attention, every step from the start)."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        ids = list(prompt)
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    finally:
        model.set_attn_implementation(before)
    return ids[len(prompt):]


def prompts(seed: int = 1) -> dict[str, list[int]]:
    """8 prompts of 5 to 70 tokens (most longer than the window), four of them sharing a 40-token prefix."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (40,), generator=g).tolist()
    out = {}
    for i in range(8):
        own = torch.randint(3, VOCAB, (5 + 4 * i,), generator=g).tolist()
        out[f"p{i}"] = shared + own if i % 2 else own
    return out
