#!/usr/bin/env bash
# On a machine with one GPU (the device tool's lent machine), in a few minutes: install what the
# trainer needs beside the machine's own CUDA torch, then run benchmarks/gpu_check.py (HF and,
# if vllm imports, vLLM rollouts), whose last line is a JSON summary.
#   bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no GPU'; print(torch.__version__, torch.cuda.get_device_name())"
# The project without its torch pin: keep the machine's CUDA build. Wheels carried in .whl/
# (no registry on that machine) are installed first when present.
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
"$PY" -c "import pydantic, gymnasium, networkx, zstandard" 2>/dev/null || echo "missing deps: carry wheels in .whl/ (see device README)"
timeout 420 "$PY" benchmarks/gpu_check.py "$@"
