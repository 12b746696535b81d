#!/usr/bin/env bash
# Builds the Docker sandbox image (agent-rl-sandbox:pyXY) from this host's /usr/bin/python3 with
# `docker import` (no registry needed; envs.sandbox.build_image). A no-op when it exists;
# `--force` rebuilds it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
force=False
[[ "${1:-}" == "--force" ]] && force=True
"$PY" -c "from envs.sandbox import build_image; print(build_image(force=$force))"
