"""KV blocks a sliding-window model holds, with the blocks out of every layer's window given back and without.

    python benchmarks/window_blocks.py                         # window 512: 16 requests of 1500 + 500 tokens
    python benchmarks/window_blocks.py --window 4096 --prompt 6000 --output 2000 --requests 4

A Mistral-shaped model whose every layer slides (tiny: the pool's arithmetic does not depend on the width),
random weights, greedy; the same requests twice on the cpu backend: once as it runs (`BlockManager` gives back the
blocks wholly before each request's next window), once with that turned off (every block kept until the request
ends, as for a model with full layers). Prints the peak and mean blocks in use between steps, the KV bytes they
would be for Mistral 7B (32 layers, 8 KV heads of 128, bf16: 128 KiB a token), and checks both runs give the same
tokens.
"""

from __future__ import annotations

import argparse


def run(window: int, requests: int, prompt: int, output: int, release: bool) -> tuple[int, float, list]:
    import torch
    import transformers as tf

    from conveyor.core import EngineConfig, GenerationRequest, SamplingParams
    from conveyor.core.engine import Engine

    class Tokens:
        eos_token_id = None

        def decode(self, ids, **kwargs):
            return " ".join(map(str, ids))

    torch.manual_seed(0)
    cfg = tf.MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                           max_position_embeddings=prompt + output + 16, initializer_range=0.2)
    model = tf.MistralForCausalLM(cfg).eval()
    total = requests * -(-(prompt + output) // 16)
    engine = Engine(model, Tokens(), EngineConfig(device="cpu", dtype="float32", backend="cpu",
                                                  num_kv_blocks=total + 16, max_num_seqs=requests,
                                                  max_num_batched_tokens=2048))
    if not release:
        engine.block_manager.window = None
    g = torch.Generator().manual_seed(1)
    work = [GenerationRequest(f"r{i}", torch.randint(3, 512, (prompt,), generator=g).tolist(),
                              SamplingParams(temperature=0, max_tokens=output, ignore_eos=True))
            for i in range(requests)]
    bm = engine.block_manager
    used, outs = [], {}
    for finished in engine.stream(work):
        used.append(bm.num_blocks - bm.num_free_blocks)
        outs.update({o.req_id: o.output_token_ids for o in finished})
    return max(used), sum(used) / len(used), [outs[r.req_id] for r in work]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=1500)
    p.add_argument("--output", type=int, default=500)
    a = p.parse_args()
    per_block = 16 * 32 * 2 * 8 * 128 * 2  # Mistral 7B: 16 tokens x 32 layers x K and V x 8 heads x 128 x bf16
    results = {}
    for release in (False, True):
        peak, mean, tokens = run(a.window, a.requests, a.prompt, a.output, release)
        results[release] = (peak, mean, tokens)
        label = "given back" if release else "kept"
        print(f"blocks out of the window {label:10s}: peak {peak:5d} blocks ({peak * per_block / 2**30:5.2f} GiB for "
              f"Mistral 7B), mean {mean:7.1f}")
    assert results[True][2] == results[False][2], "the tokens differ"
    print(f"the same tokens; peak blocks {results[True][0] / results[False][0]:.2f}x, mean "
          f"{results[True][1] / results[False][1]:.2f}x of keeping them")


if __name__ == "__main__":
    main()
