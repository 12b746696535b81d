#!/usr/bin/env bash
# What benchmarks/gpu_check.sh needs on the device tool's lent machine (Python 3.12, x86-64,
# no registry) and that machine lacks, into .whl/ (ignored by git), the folder a device call
# carries (`carry: [".whl"]`): the wheels, downloaded here from PyPI, of the project's
# dependencies its image does not hold (pydantic and its parts, gymnasium and its parts,
# zstandard), each at one pinned version; and SmolLM2's tokenizer, saved from the embedded
# GGUF (which, at 98 MB, cannot travel) into .whl/smollm2-tokenizer. Fails when the folder
# passes 64 MiB, the most a device call carries with the working tree.
#   bash scripts/gpu_wheels.sh          # then: run with carry [".whl"]
set -euo pipefail
cd "$(dirname "$0")/.."
# the project's venv: the tokenizer is read from the GGUF package installed there
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
DEST=${GPU_WHEELS_DEST:-.whl}
LIMIT_MIB=64
# name==version, one version of each (two of one name stop pip's install there); the closure
# of the modules gpu_check imports, less what the image holds (numpy, networkx, pyyaml, rich,
# safetensors, accelerate, peft, torch, transformers, tokenizers, cloudpickle's users...)
WHEELS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0
  gymnasium==1.4.0 cloudpickle==3.1.3 farama-notifications==0.0.6
  zstandard==0.25.0
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none ${PLATFORMS[@]/#/--platform } --platform any \
  -d "$DEST" "${WHEELS[@]}"
count=$(ls "$DEST"/*.whl | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "gpu_wheels: ${#WHEELS[@]} wheels asked for, $count in $DEST/" >&2
  exit 1
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "
import sys
from agent_rl.policies.models import smollm2_tokenizer
smollm2_tokenizer().save_pretrained(sys.argv[1])" "$DEST/smollm2-tokenizer"
kib=$(du -sk "$DEST" | cut -f1)
echo "gpu_wheels: $count wheels and SmolLM2's tokenizer in $DEST/, $((kib / 1024)) MiB ($kib KiB) of the $LIMIT_MIB MiB a device call carries"
if [ "$kib" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "gpu_wheels: $DEST/ is over $LIMIT_MIB MiB: a device call would refuse it" >&2
  exit 1
fi
