#!/usr/bin/env bash
# `make test`: the whole suite with what its tests need. Installs bubblewrap and docker.io when
# missing (root with apt), starts a Docker engine when none runs (stopped again on exit, by its
# PID), builds the sandbox image (no registry: `docker import`), runs the main suite and the
# vLLM engine tests, and ends with a summary of every service that was missing and the tests
# that skipped because of it. PY and VLLM_PY name the two venvs' interpreters.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
VLLM_PY="${VLLM_PY:-.venv-vllm/bin/python}"
LOGS="${TMPDIR:-/tmp}/agent-rl-test-$$"
mkdir -p "$LOGS"
notes=()   # what is missing, printed loudly at the end

missing=()
command -v bwrap >/dev/null || missing+=(bubblewrap)
command -v dockerd >/dev/null || missing+=(docker.io)
if ((${#missing[@]})); then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        echo "test: installing ${missing[*]}"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
            >"$LOGS/apt.log" 2>&1 || echo "test: could not install ${missing[*]} (see $LOGS/apt.log)"
    fi
fi
command -v bwrap >/dev/null \
    || notes+=("bubblewrap is not installed: the bwrap sandbox tests skip (apt-get install bubblewrap)")

DOCKERD_PID=""
stop_dockerd() {
    [[ -n "$DOCKERD_PID" ]] || return 0
    kill "$DOCKERD_PID" 2>/dev/null || return 0
    for _ in $(seq 30); do kill -0 "$DOCKERD_PID" 2>/dev/null || return 0; sleep 0.5; done
    kill -9 "$DOCKERD_PID" 2>/dev/null || true
}
trap stop_dockerd EXIT

engine_up() { docker version >/dev/null 2>&1; }
if command -v docker >/dev/null && engine_up; then
    echo "test: using the Docker engine already running"
elif command -v dockerd >/dev/null && command -v docker >/dev/null && [[ "$(id -u)" == 0 ]]; then
    dockerd >"$LOGS/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do
        engine_up && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 1
    done
    if engine_up; then
        echo "test: started dockerd (pid $DOCKERD_PID; stopped when the tests end)"
    else
        kill -0 "$DOCKERD_PID" 2>/dev/null && why="did not answer within 60 s" || why="exited"
        notes+=("dockerd $why (log: $LOGS/dockerd.log): the Docker sandbox tests skip")
        stop_dockerd; DOCKERD_PID=""
    fi
else
    notes+=("no Docker engine (not installed, or not root to start dockerd): the Docker sandbox tests skip")
fi
if engine_up && ! PY="$PY" scripts/sandbox_image.sh >"$LOGS/image.log" 2>&1; then
    notes+=("building the sandbox image failed (log: $LOGS/image.log): the Docker sandbox tests skip")
fi

"$PY" -m pytest -q -rfEs | tee "$LOGS/pytest.log"
status=$?  # pytest's own (pipefail)
# the vLLM engine tests: one engine per process, so one pytest per file
for file in tests/agent_rl/test_vllm_policy.py tests/agent_rl/test_export.py \
        tests/agent_rl/test_vllm_colocation.py tests/agent_rl/test_vllm_lora.py \
        tests/agent_rl/test_vllm_ranks.py; do
    "$VLLM_PY" -m pytest -q -rfEs -m vllm "$file" || status=$?
done

skipped=$(grep -c '^SKIPPED' "$LOGS/pytest.log" || true)
echo
if ((${#notes[@]})); then
    echo "==================================================================="
    echo "test: NOT the whole suite: services were missing"
    for note in "${notes[@]}"; do echo "  - $note"; done
    echo "  ($skipped skip line(s) in pytest's summary above name each test)"
    echo "==================================================================="
else
    echo "test: every service was up; $skipped skip line(s) above (tests for other hardware)"
fi
exit $status
