#!/usr/bin/env bash
# One prepared check for a machine with a CUDA GPU and no network (installs nothing), about 5 minutes on an H200:
#   1. greedy equivalence, float32, conveyor's cuda backend vs transformers `generate`, random Llama (0.28B),
#      with a roomy pool, forced preemption and forced chunking;
#      then each decoder family (tests/core/families.py) greedy float32 against transformers' full recompute;
#   2. bf16 exactness: seeded records alone vs batched, chunked and preempted (reported, not failed: the cuda
#      backend's cuBLAS linears are not batch-invariant);
#   3. speculative decoding on and off (float32, greedy; reported): equal records, acceptance, speed;
#   4. quantized checkpoints (W8A8, W4A16, GPTQ act-order, AWQ) greedy float32 on the Triton kernels against the
#      formats' torch forward;
#   5. bf16 throughput of conveyor, transformers' static batches and `generate_batch` on a random 0.63B Llama with
#      SmolLM2's tokenizer (256 requests of the benchmark workload's shape), with roofline fractions.
# Assumes torch with CUDA, Triton and transformers are installed. conveyor itself need not be: when `import
# conveyor` fails, a shim on PYTHONPATH maps conveyor.{core,io,cli} to this checkout's folders.
#
#   bash benchmarks/gpu_check.sh                          # on the GPU machine; report also in $OUT if set
#   bash benchmarks/gpu_check.sh --device cpu --tiny      # CPU dry run of every code path (Triton interpreted)
# Any other option is passed to benchmarks/gpu_check.py (see its --help), e.g. --n 256 --reps 2.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
PY="${PYTHON:-python3}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1

if ! "$PY" -c "import conveyor.core.engine" >/dev/null 2>&1; then
    SHIM="$(mktemp -d)"
    trap 'rm -rf "$SHIM"' EXIT
    mkdir -p "$SHIM/conveyor"
    : > "$SHIM/conveyor/__init__.py"
    for sub in core io cli; do ln -s "$REPO/$sub" "$SHIM/conveyor/$sub"; done
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
    echo "conveyor not installed: using a shim at $SHIM"
fi

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PY" - <<'EOF' || exit 2
import torch, transformers, conveyor.core.engine  # noqa: F401
print(f"torch {torch.__version__} (cuda {torch.version.cuda}, available: {torch.cuda.is_available()}), "
      f"transformers {transformers.__version__}")
EOF

"$PY" "$HERE/gpu_check.py" "$@"
exit $?
