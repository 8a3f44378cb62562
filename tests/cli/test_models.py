"""The models users bring, through the CLI: what conveyor refuses before any work (exit 2, naming the model's
architecture and the feature: latent attention, state-space and hybrid layers, encoders and masked LMs, chunked
attention, missing or cut-short weights), what `conveyor models --check` says of a model from its config alone, a
family with its own fused forward run end to end, and chat records of a model without a chat template
(--chat-template)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers as tf
from cli_helpers import read_rows, run_in_process, tiny_args

PROMPTS = [{"id": f"r{i}", "prompt": f"The number {i} is"} for i in range(3)]
CHATS = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Say {i}."}]} for i in range(3)]


def _config_only(folder, config, architecture):
    """A model folder holding a config.json and nothing else: a refusal must come before any weight is read."""
    config.architectures = [architecture]
    config.save_pretrained(folder)
    return folder


REFUSED = {
    "mla": (lambda: tf.DeepseekV3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        kv_lora_rank=32, q_lora_rank=32), "DeepseekV3ForCausalLM",
            "multi-head latent attention"),
    "mamba": (lambda: tf.MambaConfig(hidden_size=64, num_hidden_layers=2), "MambaForCausalLM", "state-space"),
    "jamba": (lambda: tf.JambaConfig(hidden_size=64, num_hidden_layers=2), "JambaForCausalLM", "Mamba"),
    "qwen3-next": (lambda: tf.Qwen3NextConfig(hidden_size=64, num_hidden_layers=4), "Qwen3NextForCausalLM",
                   "linear attention"),
    "lfm2": (lambda: tf.Lfm2Config(hidden_size=64, num_hidden_layers=2), "Lfm2ForCausalLM", "convolution"),
    "bert-mlm": (lambda: tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
                 "BertForMaskedLM", "masked language model"),
    "t5": (lambda: tf.T5Config(d_model=64, num_layers=2), "T5ForConditionalGeneration", "encoder-decoder"),
    "llama4-chunked": (lambda: tf.Llama4TextConfig(hidden_size=64, num_hidden_layers=2, attention_chunk_size=64),
                       "Llama4ForCausalLM", "chunked attention"),
}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_a_model_conveyor_does_not_run_is_refused_before_its_weights_are_read(kind, tmp_path):
    make, arch, feature = REFUSED[kind]
    folder = _config_only(tmp_path / kind, make(), arch)
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in PROMPTS) + "\n")
    r = run_in_process("run", data, "-o", tmp_path / "out.jsonl", "--model", folder)
    assert r.code == 2, r.err
    assert arch in r.err and feature in r.err and str(folder) in r.err, r.err
    assert not (tmp_path / "out.jsonl").exists()
    check = run_in_process("models", "--check", folder)
    assert check.code == 2 and "refused:" in check.out and feature in check.out, check.out


def test_a_masked_lm_with_its_weights_is_refused_and_writes_no_rows(tmp_path):
    """Tried as a user would: a BERT masked-LM folder was accepted and wrote garbage rows with status ok."""
    from conveyor.core.model_loader import ensure_embedded

    folder = tmp_path / "bert"
    tf.BertForMaskedLM(tf.BertConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64)).save_pretrained(folder)
    tf.AutoTokenizer.from_pretrained(ensure_embedded("smollm2-135m-instruct")).save_pretrained(folder)
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in PROMPTS) + "\n")
    r = run_in_process("run", data, "-o", tmp_path / "out.jsonl", *tiny_args(folder))
    assert r.code == 2 and "BertForMaskedLM" in r.err and "masked language model" in r.err, r.err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.fixture
def copy_of(tiny_model, tmp_path):
    def make(name="model"):
        folder = tmp_path / name
        shutil.copytree(tiny_model, folder)
        return folder
    return make


def _run(tmp_path, folder, records=PROMPTS, *extra):
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "out.jsonl"
    return run_in_process("run", data, "-o", out, *tiny_args(folder), "--max-tokens", "4", "--temperature", "0",
                          *extra), out


def test_a_folder_without_its_weights_exits_2_naming_it(copy_of, tmp_path):
    folder = copy_of()
    (folder / "model.safetensors").unlink()
    r, out = _run(tmp_path, folder)
    assert r.code == 2 and "has no weights" in r.err and str(folder) in r.err, r.err
    assert not out.exists()


def test_a_missing_shard_exits_2_naming_it(tiny_model, tmp_path):
    folder = tmp_path / "sharded"
    model = tf.AutoModelForCausalLM.from_pretrained(tiny_model)
    model.save_pretrained(folder, max_shard_size="2MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model / name).exists():
            shutil.copy(tiny_model / name, folder / name)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    r, out = _run(tmp_path, folder)
    assert r.code == 2 and shards[-1].name in r.err and "download the missing files" in r.err, r.err


def test_a_weight_file_cut_short_exits_2_naming_it(copy_of, tmp_path):
    folder = copy_of()
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    r, out = _run(tmp_path, folder)
    assert r.code == 2 and "cut short" in r.err and "model.safetensors" in r.err, r.err
    assert run_in_process("models", "--check", folder).code == 2


def test_weights_that_leave_some_of_the_model_out_exit_2_naming_them(copy_of, tmp_path):
    """transformers fills missing weights with random values and says so in a log line; conveyor refuses."""
    from safetensors.torch import load_file, save_file

    folder = copy_of()
    weights = load_file(folder / "model.safetensors")
    gone = sorted(k for k in weights if "layers.1.mlp" in k)
    save_file({k: v for k, v in weights.items() if k not in gone}, folder / "model.safetensors",
              metadata={"format": "pt"})
    r, out = _run(tmp_path, folder)
    assert r.code == 2 and "random values" in r.err and gone[0] in r.err, r.err
    assert not out.exists()


def test_models_check_names_the_route_of_a_supported_family(tmp_path):
    folder = tmp_path / "gemma2"
    tf.Gemma2ForCausalLM(tf.Gemma2Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         sliding_window=512)).save_pretrained(folder)
    r = run_in_process("models", "--check", folder)
    assert r.code == 0, r.out + r.err
    assert "fused gemma2 forward" in r.out and "sliding window of 512 tokens" in r.out and "softcap 50" in r.out
    assert r.out.splitlines()[-1].split() == ["verdict:", "supported"]
    gpt2 = tmp_path / "gpt2"
    tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=4)).save_pretrained(gpt2)
    r = run_in_process("models", "--check", gpt2)
    assert r.code == 0 and "transformers forward" in r.out and "not batch-invariant" in r.out, r.out


def test_a_family_with_a_fused_forward_runs_end_to_end(tmp_path):
    """Gemma 2 (sliding windows, softcaps, sandwich norms) from a folder: every row ok, the fused route named in
    the summary's backend arithmetic, and the same rows again after a restart."""
    from conveyor.core.model_loader import ensure_embedded

    tokenizer = tf.AutoTokenizer.from_pretrained(ensure_embedded("smollm2-135m-instruct"))
    folder = tmp_path / "gemma2"
    torch.manual_seed(0)
    tf.Gemma2ForCausalLM(tf.Gemma2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, sliding_window=8, bos_token_id=tokenizer.bos_token_id,
                                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
                         ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    long = [{"id": f"r{i}", "prompt": "one two three four five six seven eight nine ten " * (i + 1)}
            for i in range(4)]
    r, out = _run(tmp_path, folder, long, "--max-tokens", "12")
    assert r.code == 0, r.err
    rows = read_rows(out)
    assert [row["status"] for row in rows] == ["ok"] * 4 and all(row["completion_tokens"] == 12 for row in rows)
    info = json.loads((tmp_path / "out.jsonl.conveyor" / "run.json").read_text())
    assert "fused gemma2 forward" in info["arithmetic"], info
    again, _ = _run(tmp_path, folder, long, "--max-tokens", "12", "--restart")
    assert again.code == 0 and [row["output"] for row in read_rows(out)] == [row["output"] for row in rows]


def test_chat_records_of_a_model_without_a_chat_template(copy_of, tiny_model, tmp_path):
    """Said once at the start, each chat record an error row naming --chat-template (raw prompts of the same input
    are answered); --chat-field refused before the model loads; --chat-template FILE gives the rows the model's
    own template would."""
    folder = copy_of("no-template")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = config.pop("chat_template", None) or (folder / "chat_template.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    r, out = _run(tmp_path, folder, PROMPTS + CHATS)
    assert r.code == 3, r.err
    assert r.err.count("has no chat template") == 1 and "--chat-template" in r.err
    rows = read_rows(out)
    assert [row["status"] for row in rows] == ["ok"] * 3 + ["error"] * 3
    assert all("no chat template" in row["error"] and "--chat-template" in row["error"] for row in rows[3:])
    refused, _ = _run(tmp_path, folder, [{"id": "q", "question": "Hi?"}], "--chat-field", "question")
    assert refused.code == 2 and "--chat-field" in refused.err and "--chat-template" in refused.err
    file = tmp_path / "template.jinja"
    file.write_text(template)
    given, _ = _run(tmp_path, folder, CHATS, "--chat-template", file, "--restart")
    assert given.code == 0, given.err
    with_template = [row["output"] for row in read_rows(out)]
    own, _ = _run(tmp_path, tiny_model, CHATS, "--restart")
    assert own.code == 0 and [row["output"] for row in read_rows(out)] == with_template
    missing = run_in_process("run", tmp_path / "in.jsonl", "-o", out, *tiny_args(folder), "--chat-template",
                             tmp_path / "nope.jinja")
    assert missing.code == 2 and "--chat-template" in missing.err and "no such file" in missing.err


def test_models_check_of_nothing_is_a_usage_error(tmp_path):
    r = run_in_process("models", "--check", tmp_path / "nope")
    assert r.code == 2 and "--check" in r.err and "no such file or folder" in r.err, r.err
