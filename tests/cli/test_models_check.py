"""`conveyor models --check` against `conveyor run`, model by model: the task `--task auto` picks (an embedding
model, a plain encoder, a classifier, a cross-encoder, a reward model, a causal LM), what it says of each (pooling,
normalization, vector size or labels, length limit, route; a causal LM's chat template), and a refusal with run's
exit code and reason (a task the checkpoint cannot do, quantized weights conveyor does not compute, a multimodal
checkpoint). The two never disagree."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import transformers as tf
from cli_helpers import read_rows, run_in_process, tiny_args, write_jsonl

TEXTS = [{"id": f"t{i}", "prompt": text} for i, text in enumerate(["hello world", "the capital of france"])]


def _check(model, *task):
    r = run_in_process("models", "--check", model, *task)
    lines = dict(line.split(":", 1) for line in r.out.splitlines() if ":" in line)
    return r, {what: value.strip() for what, value in lines.items()}


def _run(tmp_path, model, *extra, records=TEXTS):
    """`conveyor run` of `records` on `model` (and the task it did: the one its note names, else generate)."""
    data = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out.jsonl"
    r = run_in_process("run", data, "-o", out, "--model", model, "--restart", *extra)
    said = re.search(r"this run does --task (\w+)", r.err)
    return r, out, said.group(1) if said else "generate"


def _plain_encoder(folder):
    """A BERT base model (no head) without sentence-transformers files."""
    import pooling_models

    tokenizer = pooling_models.bert_tokenizer(folder)
    torch.manual_seed(1)
    config = tf.BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=136, pad_token_id=tokenizer.pad_token_id)
    tf.BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    return folder


POOLING = {  # model -> (task auto picks, lines --check gives)
    "bert-mean": ("embed", {"pooling": "mean (its sentence-transformers modules.json)", "dimension": "64 (",
                            "max tokens": "128 a text (its sentence-transformers length limit)",
                            "cpu route": "packed encoder forward"}),
    "plain-encoder": ("embed", {"pooling": "cls (the default for encoders)", "dimension": "64 (",
                                "max tokens": "136 a text (its position table)", "cpu route": "packed encoder"}),
    "classifier": ("classify", {"labels": "3: bug, feature, question (probabilities: a softmax"}),
    "cross-encoder": ("classify", {"labels": "1: LABEL_0 (probabilities: a sigmoid"}),
    "qwen3": ("embed", {"pooling": "last (its sentence-transformers modules.json)",
                        "cpu route": "packed qwen3 decoder forward"}),
}


@pytest.mark.parametrize("name", sorted(POOLING))
def test_check_takes_the_task_run_takes_for_a_pooling_model_and_says_how_it_runs(name, pooling_models, tmp_path):
    """It refused every one as "it cannot generate text" (exit 2) while run embedded or classified it."""
    model = _plain_encoder(tmp_path / "plain") if name == "plain-encoder" else pooling_models(name)
    task, says = POOLING[name]
    check, lines = _check(model)
    assert check.code == 0 and lines["verdict"] == "supported", check.out
    assert lines["task"].startswith(f"{task} (--task auto: "), check.out
    for what, value in says.items():
        assert lines[what].startswith(value), (what, check.out)
    run, out, ran = _run(tmp_path, model)
    assert run.code == 0 and ran == task, run.err
    assert all(row["status"] == "ok" for row in read_rows(out))


def test_check_with_a_task_refuses_what_run_refuses_with_the_same_reason(pooling_models, tmp_path):
    embedder, cross_encoder = pooling_models("bert-mean"), pooling_models("cross-encoder")
    for model, task in ((embedder, "classify"), (cross_encoder, "embed"), (embedder, "generate")):
        check, lines = _check(model, "--task", task)
        run, out, _ = _run(tmp_path, model, "--task", task)
        assert check.code == run.code == 2, (check.out, run.err)
        assert lines["task"] == f"{task} (--task {task})" and lines["refused"] in run.err, (check.out, run.err)
        assert not out.exists()
    check, lines = _check(cross_encoder, "--task", "score")
    assert check.code == 0 and lines["score"].startswith("its head's one logit through a sigmoid"), check.out
    check, lines = _check(embedder, "--task", "score")
    assert check.code == 0 and lines["score"].startswith("the cosine of the embeddings"), check.out
    run, out, _ = _run(tmp_path, embedder, "--task", "score", records=[{"text_1": "hello", "text_2": "world"}])
    assert run.code == 0 and "score" in read_rows(out)[0], run.err


def test_check_names_a_causal_lms_chat_template_or_says_it_has_none(tiny_model, tmp_path):
    check, lines = _check(tiny_model)
    assert check.code == 0 and lines["task"].startswith("generate (--task auto: "), check.out
    assert lines["chat template"].startswith("the tokenizer's own"), check.out
    bare = shutil.copytree(tiny_model, tmp_path / "no-template")
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    check, lines = _check(bare)
    assert check.code == 0 and lines["chat template"].startswith("none: chat records"), check.out
    assert "--chat-field" in lines["chat template"] and "--chat-template FILE" in lines["chat template"]
    run, _, ran = _run(tmp_path, bare, *tiny_args(bare)[2:], "--max-tokens", "2", "--chat-field", "prompt")
    assert run.code == 2 and "--chat-field" in run.err and ran == "generate", run.err


QUANTIZED = {  # name -> (quantization_config, what the refusal says)
    "gptq-3bit": ({"quant_method": "gptq", "bits": 3, "group_size": 128, "desc_act": False, "sym": True},
                  "GPTQ with 3 bits is not supported (4 and 8 are)"),
    "awq-gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv", "zero_point": True},
                 "AWQ version 'gemv' is not supported (gemm is)"),
    "compressed-tensors-nvfp4": (
        {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                               "group_size": 16}}}},
        "weight strategy 'tensor_group' is not supported"),
    "compressed-tensors-fp8-activations": (
        {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
        "FP8 activations (float 8 bits) are not computed"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
                     "quantization method bitsandbytes is not supported yet"),
    "mxfp4": ({"quant_method": "mxfp4"}, "quantization method mxfp4 is not supported yet"),
}


def _with_config(source, folder, **fields):
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return folder


@pytest.mark.parametrize("method", sorted(QUANTIZED))
def test_a_quantization_conveyor_does_not_compute_is_refused_by_check_and_run_alike(method, tiny_model, tmp_path):
    """run failed as the model loaded (exit 1: optimum, gptqmodel, compressed-tensors, bitsandbytes or a kernel
    repository missing) while --check said it was supported."""
    config, says = QUANTIZED[method]
    folder = _with_config(tiny_model, tmp_path / method, quantization_config=config)
    check, lines = _check(folder)
    run, out, _ = _run(tmp_path, folder, *tiny_args(folder)[2:])
    assert check.code == run.code == 2, (check.out, run.err)
    assert says in lines["refused"], check.out
    assert lines["refused"] in run.err and not out.exists(), run.err


def test_a_quantized_mixture_of_experts_is_refused_by_check_and_run_alike(tiny_model, tmp_path):
    config = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    folder = _with_config(tiny_model, tmp_path / "moe", quantization_config=config, num_local_experts=4)
    check, lines = _check(folder)
    run, out, _ = _run(tmp_path, folder, *tiny_args(folder)[2:])
    assert check.code == run.code == 2 and "a mixture of 4 experts" in lines["refused"], check.out
    assert lines["refused"] in run.err and not out.exists(), run.err


def test_an_embedding_model_with_quantized_weights_is_refused_alike(pooling_models, tmp_path):
    config = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    folder = _with_config(pooling_models("bert-mean"), tmp_path / "gptq", quantization_config=config)
    check, lines = _check(folder)
    run, _, ran = _run(tmp_path, folder)
    assert check.code == run.code == 2 and lines["task"].startswith("embed") and ran == "embed", (check.out, run.err)
    assert "quantized checkpoints for generation only, not for --task embed" in lines["refused"]
    assert lines["refused"] in run.err


@pytest.mark.parametrize("fmt", ["ct-w8a8", "ct-w4a16", "gptq-4", "awq"])
def test_a_quantized_checkpoint_runs_quantized_and_check_says_how(fmt, tiny_model, tmp_path):
    """compressed-tensors, GPTQ and AWQ folders: --check says the format and the routes, and run exits 0 with an ok
    row for every record (tests/core/test_quantized_checkpoints.py holds the answers to the format's forward)."""
    from quant_checkpoints import write

    folder = shutil.copytree(tiny_model, tmp_path / fmt)
    write(tf.AutoModelForCausalLM.from_pretrained(tiny_model), folder, fmt)
    check, lines = _check(folder)
    assert check.code == 0 and "refused" not in lines, check.out
    assert lines["weights"].startswith("quantized: ") and "kept quantized" in lines["routes"], check.out
    run, out, _ = _run(tmp_path, folder, *tiny_args(folder)[2:], "--max-tokens", "4")
    assert run.code == 0, run.err
    rows = read_rows(out)
    assert [r["id"] for r in rows] == ["t0", "t1"] and all(r["status"] == "ok" for r in rows), rows


def _fp8_checkpoint(source, folder):
    """`source` with each projection's weights stored as float8 e4m3 and one scale per 128x128 block (transformers'
    FineGrainedFP8 format), and a dense copy holding exactly the weights they de-quantize to."""
    from safetensors.torch import load_file, save_file

    dense = shutil.copytree(source, folder.with_name(folder.name + "-dense"))
    shutil.copytree(source, folder)
    weights, quantized, plain = load_file(source / "model.safetensors"), {}, {}
    for key, w in weights.items():
        if key.endswith("proj.weight"):
            scale = w.abs().max() / 448
            q = (w / scale).to(torch.float8_e4m3fn)
            quantized[key] = q
            quantized[key.replace(".weight", ".weight_scale_inv")] = torch.full((1, 1), float(scale))
            plain[key] = q.float() * scale
        else:
            quantized[key] = plain[key] = w
    save_file(quantized, folder / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, dense / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, dense


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU transformers may keep fp8 weights in FP8")
def test_fp8_weights_run_de_quantized_and_check_says_so(tiny_model, tmp_path):
    folder, dense = _fp8_checkpoint(tiny_model, tmp_path / "fp8")
    check, lines = _check(folder)
    assert check.code == 0 and lines["weights"].startswith("quantized (fp8, blocks of 128x128): transformers "
                                                           "de-quantizes them"), check.out
    run, out, _ = _run(tmp_path, folder, *tiny_args(folder)[2:], "--max-tokens", "4", "--temperature", "0")
    assert run.code == 0, run.err
    rows = [row["output"] for row in read_rows(out)]
    again, out, _ = _run(tmp_path, dense, *tiny_args(dense)[2:], "--max-tokens", "4", "--temperature", "0")
    assert again.code == 0 and [row["output"] for row in read_rows(out)] == rows


def _llava(folder, tiny_model):
    tokenizer = tf.AutoTokenizer.from_pretrained(tiny_model)
    text = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2)
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=32, patch_size=8)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=len(tokenizer) - 1)
    tf.LlavaForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_multimodal_checkpoint_is_refused_by_check_and_run_alike_for_every_task(tiny_model, tmp_path):
    """run failed on its nested config (exit 1) while --check said it was supported."""
    folder = _llava(tmp_path / "llava", tiny_model)
    for task in ((), ("--task", "embed")):
        check, lines = _check(folder, *task)
        run, out, _ = _run(tmp_path, folder, *task)
        assert check.code == run.code == 2, (check.out, run.err)
        assert "a multimodal checkpoint: its config has vision_config" in lines["refused"], check.out
        assert lines["refused"] in run.err and not out.exists(), run.err


def test_an_image_processor_beside_a_text_model_is_said_unused(tiny_model, tmp_path):
    folder = shutil.copytree(tiny_model, tmp_path / "with-processor")
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "CLIPImageProcessor"}))
    check, lines = _check(folder)
    assert check.code == 0 and lines["inputs"].startswith("text only: its image processor"), check.out


def test_task_is_checked_and_needs_check(tiny_model):
    r = run_in_process("models", "--check", tiny_model, "--task", "embd")
    assert r.code == 2 and "--task: 'embd' is not one of" in r.err and "did you mean embed" in r.err, r.err
    r = run_in_process("models", "--task", "embed")
    assert r.code == 2 and "--task embed" in r.err and "without --check it changes nothing" in r.err, r.err


def test_a_gguf_file_runs_with_its_linears_in_their_blocks_and_check_says_so(tmp_path):
    from gguf_files import write

    file = tmp_path / "tiny-q4k.gguf"
    write(file, "Q4_K")
    check, lines = _check(file)
    assert check.code == 0 and lines["weights"].startswith("GGUF: 15 Q4_K linears of block types kept"), check.out
    assert "cpu: the kept linears stay quantized" in lines["routes"], check.out
    run, out, _ = _run(tmp_path, file, "--kv-cache-memory", "8MiB", "--max-tokens", "4", "--dtype", "float32")
    assert run.code == 0, run.err
    assert [r["status"] for r in read_rows(out)] == ["ok", "ok"]
