"""Names vulture cannot see used: what frameworks call or read by name (`vulture` in .ci/run reads this file)."""

# Typer calls the commands it registered.
validate_command
status_command
merge_command
models_command
_.__signature__  # a command's options, as Typer reads them (cli/options.py `takes`)
_root  # the app's callback: --version
_.metavar  # Typer reads an option's metavar to render --help (cli/app.py `_untyped_switches`)

# Signal handlers, context managers and transformers' attention interface have fixed signatures.
frame
exc_info
attention_mask
dropout
kwargs

# Written to run directories and JSON by dataclasses.asdict; read back by name.
_.input_path
_.tool_version
_.created_at
_.output_path

# The plan's record of the step's preemptions: the scheduler's invariants are checked against it.
_.preempted_req_ids

# torch's global switches, set by benchmarks/gpu_check.py; a tokenizer's, set by it too.
_.allow_tf32
_.pre_tokenizer

# io.RawIOBase methods io.BufferedReader calls (io/records/readers/compression.py).
_.readable
_.readinto

# pybind11 properties of the C++ Linear (csrc/decoder.h), written from Python; torch's module repr hook.
_.vnni
extra_repr

# llama.cpp's quantize parameters, a ctypes struct read by the library (benchmarks/gguf_vs_llama_cpp.py).
_.ftype
_.allow_requantize
_.nthread
