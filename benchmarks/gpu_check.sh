#!/usr/bin/env bash
# On a machine with one GPU (the device tool's lent machine: its own CUDA torch and
# transformers, no registry), in a few minutes: install the wheels carried in .whl/ (made here
# by scripts/gpu_wheels.sh, with SmolLM2's tokenizer) beside the machine's packages, then run
# benchmarks/gpu_check.py on the project from source. Stops at once, naming it, when something is missing (exit 2).
#   bash benchmarks/gpu_check.sh             # needs a GPU
#   bash benchmarks/gpu_check.sh --smoke     # CPU, tiny sizes, the same code paths (CI)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
SITE=${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/agent-rl-gpu-check-site}
for arg in "$@"; do
  case "$arg" in
    "--smoke"|"-h"|"--help") ;;
    *) echo "gpu_check.sh: unknown option $arg (takes --smoke)" >&2; exit 2 ;;
  esac
done
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  # --no-deps: the folder holds the whole closure; --target: the machine's packages stay as
  # they are, the carried ones go first on the path
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl; then
    echo "gpu_check.sh: pip could not install the wheels in $WHEELS/ (above); remake them with" \
      "bash scripts/gpu_wheels.sh" >&2
    exit 2
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check.sh: installed $(ls "$WHEELS"/*.whl | wc -l) carried wheels into $SITE"
fi
# the project from source (not installed: pip would replace the machine's CUDA torch)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 540 "$PY" benchmarks/gpu_check.py --tokenizer "$WHEELS/smollm2-tokenizer" "$@"
