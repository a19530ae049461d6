#!/usr/bin/env bash
# GPU check on a fresh CUDA machine (Metal on macOS), in one command, within ~15 minutes:
#   1. detect the GPU and its compute capability (nvidia-smi)
#   2. build llama-cpp-python 0.3.36 for THAT architecture only (-j all cores), unless
#      the installed one already offloads
#   3. install localspec, pull the default pair (localspec pull)
#   4. localspec doctor, the GPU tests (pytest -m gpu), the offload tests
#   5. benchmarks: scripts/bench_core.py (none/ngram on an edit prompt) and, when the
#      command exists, localspec bench for none/ngram/model/hybrid
# Everything lands in ONE file, $OUTDIR/gpu-check.txt (the build log is kept next to it).
#
#   scripts/gpu-check.sh [OUTDIR] [all|build|check]   OUTDIR: default $OUT, else ./gpu-check-out
#
# Where one command may run at most ~10 minutes, split it: `... build` (detect, build,
# install: ~5-7 min on 16 cores) then `... check` (doctor, tests, benches: ~4 min).
#
# Re-runnable: finished steps are skipped (a GPU build, pulled models), so a second call
# after a timeout continues where the first stopped. Environment knobs:
#   PYTHON=python3              interpreter for the venv
#   GPU_CHECK_VENV=DIR          venv (default ~/.cache/localspec-gpu-venv; kept between runs)
#   GPU_CHECK_BUDGET_S=840      stop starting steps once this many seconds are spent (set it
#                               under the per-command limit of the machine you run it on)
#   CUDA_ARCH=90                skip detection (e.g. 86, 89, 90, 120; "native" lets CMake probe)
#   LLAMA_CPP_SRC=PATH          sdist/dir to build, or a prebuilt CUDA wheel (no build at all),
#                               instead of llama-cpp-python==0.3.36 from the index
#   PIP_FIND_LINKS / PIP_NO_INDEX  offline wheelhouse (pip reads them itself)
#   NO_BUILD_ISOLATION=1        build with the venv's scikit-build-core/cmake/ninja (offline)
#   LOCALSPEC_MODELS=DIR        models already on disk (no network needed for them)
#   BENCH_N=192                 tokens per benchmark generation
#   TARGET=qwen2.5-coder-1.5b DRAFT=qwen2.5-coder-0.5b   the pair for doctor and the benches
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUTDIR="${1:-${OUT:-$REPO/gpu-check-out}}"
PHASE="${2:-all}"
[[ "$PHASE" =~ ^(all|build|check)$ ]] || { echo "phase must be all, build or check" >&2; exit 2; }
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
RESULT="$OUTDIR/gpu-check.txt"
BUILD_LOG="$OUTDIR/build.log"
BUDGET="${GPU_CHECK_BUDGET_S:-840}"
BENCH_N="${BENCH_N:-192}"
TARGET="${TARGET:-qwen2.5-coder-1.5b}"
DRAFT="${DRAFT:-qwen2.5-coder-0.5b}"
VENV="${GPU_CHECK_VENV:-$HOME/.cache/localspec-gpu-venv}"
cd "$REPO"
[[ "$PHASE" == check ]] || : >"$RESULT"
export COLUMNS="${COLUMNS:-160}"  # rich tables: full width in the file, not 80 columns

command -v timeout >/dev/null 2>&1 || timeout() {  # macOS without coreutils: no limit
  while [[ "$1" == -* ]]; do shift; done; shift; "$@"
}
say() { printf '%s\n' "$*" | tee -a "$RESULT"; }
section() { say ""; say "===== $* ($(date -u +%H:%M:%S), ${SECONDS}s elapsed) ====="; }
left() { echo $((BUDGET - SECONDS)); }
# run NAME SECONDS CMD...: output into the result file, bounded by the time left
run() {
  local name="$1" limit="$2"; shift 2
  local budget; budget=$(left)
  if (( budget < 20 )); then say "SKIPPED $name: out of time budget"; return 124; fi
  (( limit > budget )) && limit=$budget
  section "$name (limit ${limit}s)"
  say "\$ $*"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$RESULT"
  local rc=${PIPESTATUS[0]}
  say "-> $name: exit $rc"
  return "$rc"
}

section "machine"
say "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(hostname)  cores: $(nproc 2>/dev/null || sysctl -n hw.ncpu)"
say "repo: $REPO @ $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?') (uncommitted changes included)"
BACKEND=cpu
if command -v nvidia-smi >/dev/null 2>&1; then
  BACKEND=cuda
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1 | tee -a "$RESULT"
elif [[ "$(uname -s)" == Darwin && "$(uname -m)" == arm64 ]]; then
  BACKEND=metal
  say "Apple Silicon: Metal"
fi
for d in /usr/local/cuda/bin /opt/cuda/bin; do [[ -x "$d/nvcc" ]] && export PATH="$d:$PATH"; done
if command -v nvcc >/dev/null 2>&1; then
  say "nvcc: $(nvcc --version | tail -n 2 | head -n 1)"
  CUDA_HOME_GUESS="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
  ls "$CUDA_HOME_GUESS"/include/cublas_v2.h /usr/local/cuda/include/cublas_v2.h >/dev/null 2>&1 \
    || say "WARNING: cublas_v2.h not found: the CUDA build needs cuBLAS (the full CUDA toolkit)"
elif [[ "$BACKEND" == cuda ]]; then
  say "WARNING: no nvcc: the CUDA build needs the CUDA toolkit (or LLAMA_CPP_SRC=a prebuilt CUDA wheel)"
fi

# Offline machines: fail fast instead of waiting on network retries.
if ! timeout 6 "${PYTHON:-python3}" -c "import urllib.request as u; u.urlopen('https://pypi.org/simple/', timeout=5)" >/dev/null 2>&1; then
  say "network: PyPI unreachable -> offline mode (HF_HUB_OFFLINE=1; pip uses PIP_FIND_LINKS only)"
  export HF_HUB_OFFLINE=1
  [[ -n "${PIP_FIND_LINKS:-}" ]] && export PIP_NO_INDEX=1
else
  say "network: PyPI reachable"
fi

# ----- 1. environment and the llama-cpp-python build ---------------------------------
if [[ ! -x "$VENV/bin/python" ]]; then
  # --system-site-packages: reuse the packages the image already has (numpy, click, ...)
  "${PYTHON:-python3}" -m venv --system-site-packages "$VENV" || { say "FAILED: venv"; exit 1; }
fi
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true

gpu_ok() {
  "$PY" - <<'EOF' 2>/dev/null
import llama_cpp, sys
llama_cpp.llama_backend_init()
sys.exit(0 if llama_cpp.__version__ == "0.3.36" and llama_cpp.llama_supports_gpu_offload() else 1)
EOF
}

if gpu_ok; then
  section "build"; say "llama-cpp-python 0.3.36 with GPU offload already installed: build skipped"
elif [[ "$BACKEND" == cpu ]]; then
  say "no GPU found (no nvidia-smi, not Apple Silicon): nothing to build"
elif [[ "$PHASE" == check ]]; then
  say "no GPU build of llama-cpp-python in $VENV: run the build phase first"
else
  if [[ "$BACKEND" == cuda ]]; then
    ARCH="${CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')}"
    [[ "$ARCH" =~ ^[0-9]+[a-z]?$ ]] || ARCH=native  # old drivers lack compute_cap
    CMAKE_ARGS_GPU="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$ARCH"
  else
    CMAKE_ARGS_GPU="-DGGML_METAL=on"
  fi
  # only what the Python package loads: no mtmd/llava, no llama.cpp tools or tests
  export CMAKE_ARGS="$CMAKE_ARGS_GPU -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF ${EXTRA_CMAKE_ARGS:-}"
  export CMAKE_BUILD_PARALLEL_LEVEL="$(nproc 2>/dev/null || sysctl -n hw.ncpu)"
  SRC="${LLAMA_CPP_SRC:-llama-cpp-python==0.3.36}"
  section "build llama-cpp-python ($SRC) with CMAKE_ARGS=$CMAKE_ARGS, -j$CMAKE_BUILD_PARALLEL_LEVEL"
  # --no-cache-dir: a cached CPU wheel of the same version must not be reused
  START=$SECONDS
  ISOLATION=()
  [[ -n "${NO_BUILD_ISOLATION:-}" ]] && ISOLATION=(--no-build-isolation)
  limit=$(left); (( limit < 60 )) && limit=60
  timeout "$limit" "$PY" -m pip install -v --no-cache-dir --force-reinstall --no-deps ${ISOLATION[@]+"${ISOLATION[@]}"} "$SRC" >"$BUILD_LOG" 2>&1
  rc=$?
  say "build: exit $rc in $((SECONDS - START))s (log: $BUILD_LOG)"
  if (( rc != 0 )); then tail -n 40 "$BUILD_LOG" | tee -a "$RESULT"; fi
fi

section "install localspec"
if ! "$PY" -m pip install -q -e ".[test]" 2>&1 | tail -n 5 | tee -a "$RESULT"; then
  # offline without hatchling or the deps: run from the checkout (deps must be present)
  say "pip install failed: using the checkout directly (PYTHONPATH) with a localspec shim"
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  printf '#!/bin/sh\nexec "%s" -m localspec "$@"\n' "$PY" >"$VENV/bin/localspec"
  chmod +x "$VENV/bin/localspec"
fi
gpu_ok && say "GPU offload: yes" || say "GPU offload: NO (the checks below run on the CPU build)"

if [[ "$PHASE" == build ]]; then
  section "build phase done"; say "results: $RESULT"; exit 0
fi

# ----- 2. models, doctor, tests --------------------------------------------------------
run "pull the default pair" 240 localspec pull
run "doctor" 60 localspec doctor
run "doctor with the default pair" 120 localspec doctor -m "$TARGET" --draft "$DRAFT"
run "GPU tests" 300 "$PY" -m pytest -o addopts= -m gpu -s -q -p no:cacheprovider tests/
run "offload and doctor tests" 180 "$PY" -m pytest -o addopts= -q -p no:cacheprovider tests/test_doctor.py

# ----- 3. benchmarks -------------------------------------------------------------------
run "bench_core (edit prompt)" 240 "$PY" scripts/bench_core.py --model "$TARGET" -n "$BENCH_N" --modes none,ngram:16,ngram:8
if localspec bench --help >/dev/null 2>&1; then
  HELP="$(localspec bench --help)"
  args=(-m "$TARGET" --draft "$DRAFT" --modes none,ngram,model,hybrid -n "$BENCH_N")
  for opt in --per-tag:1 --tags:code,edit --edit-n:$((BENCH_N * 2)) --no-log --vcurve; do
    name="${opt%%:*}"; val="${opt#*:}"
    grep -q -- "$name" <<<"$HELP" || continue
    if [[ "$opt" == *:* ]]; then args+=("$name" "$val"); else args+=("$name"); fi
  done
  run "localspec bench" 300 localspec bench "${args[@]}"
else
  say "localspec bench: not present in this checkout (skipped)"
fi

section "done"
say "results: $RESULT"
