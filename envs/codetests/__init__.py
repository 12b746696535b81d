"""CodeTests-v0: write a small Python function; hidden tests run in a sandbox.

``env.py`` holds the environment and its description (tasks, reward, audit flags, episode end);
the rest, in the order an episode meets it:

    tasks       the task generator: operations chained into a function, its hidden tests
    extract     the agent's code found in its reply (parsed, never executed here)
    harness.py  the trusted program that runs in the sandbox (read as text: ``HARNESS``)
    verifier    the harness's input, and the verdict read off its run (``judge``, pure)
    shared      identical code for the same tests runs once (``SHARED_RUNS``)
    env         ``CodeTestsEnv``, registered as ``agent_rl/CodeTests-v0``
"""

from envs.codetests.env import DEFAULT_LIMITS, INSTRUCTIONS, WEIGHTS, CodeTestsEnv
from envs.codetests.extract import MAX_CODE_CHARS, defines, extract_code, fenced_blocks
from envs.codetests.shared import SHARED_RUNS, SharedRuns
from envs.codetests.tasks import N_TESTS, OPS, Op, make_task
from envs.codetests.verifier import (
    FLAGS,
    HARNESS,
    SOLUTION_FILE,
    TESTS_FILE,
    Verdict,
    decode,
    harness,
    judge,
    same,
)

__all__ = [
    "DEFAULT_LIMITS",
    "FLAGS",
    "HARNESS",
    "INSTRUCTIONS",
    "MAX_CODE_CHARS",
    "N_TESTS",
    "OPS",
    "SHARED_RUNS",
    "SOLUTION_FILE",
    "TESTS_FILE",
    "WEIGHTS",
    "CodeTestsEnv",
    "Op",
    "SharedRuns",
    "Verdict",
    "decode",
    "defines",
    "extract_code",
    "fenced_blocks",
    "harness",
    "judge",
    "make_task",
    "same",
]
