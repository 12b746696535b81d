"""CodeTests-v0: hand-computed rewards, the hack corpus (each scores 0 with its flag), sandbox
faults masked as infrastructure, tasks and splits, and the reference solver."""

from __future__ import annotations

import gc
import json
import marshal
import os
import select
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import envs
from envs import codetests, sandbox
from envs.codetests import (
    HARNESS,
    N_TESTS,
    TESTS_FILE,
    defines,
    extract_code,
    harness,
    judge,
    same,
    verifier,
)
from envs.core import TaskMeta, TaskSpec
from evals.splits import default_splits
from trajectories import Outcome

CODETESTS = "agent_rl/CodeTests-v0"
pytestmark = pytest.mark.filterwarnings("ignore:envs.sandbox:RuntimeWarning")  # subprocess

# n * n on five inputs, by hand
SQUARE = TaskSpec(
    task_id="square", prompt="Write `int_square(n: int) -> int`: square n.",
    meta=TaskMeta(skills=["square"], structure="square", entity_group="integers"),
    target=[0, 1, 4, 9, 100],
    data={"function": "int_square", "inputs": [[0], [1], [-2], [3], [10]],
          "solution": "def int_square(n: int) -> int:\n    return n * n\n"},
)
EVEN = SQUARE.model_copy(update={"task_id": "even", "target": [True, False, True, False, True],
                                 "data": {"function": "int_is_even",
                                          "inputs": [[0], [1], [-2], [3], [10]]}})
CORRECT = "def int_square(n):\n    return n * n\n"


@pytest.fixture(autouse=True)
def _no_shared_runs():
    """Every test starts without finished runs to share (one test's monkeypatched sandbox would
    otherwise be skipped by a result an earlier test kept)."""
    codetests.SHARED_RUNS.clear()


def play(code: str, task: TaskSpec = SQUARE, fenced: bool = True, **env_kwargs):
    """One episode answering ``task`` with ``code``; its RewardBreakdown."""
    env = envs.make(CODETESTS, backend=env_kwargs.pop("backend", "subprocess"), **env_kwargs)
    env.reset(seed=0, options={"task": task})
    reply = f"Here you go:\n```python\n{code}```\n" if fenced else code
    _, reward, terminated, _, info = env.step(reply)
    assert terminated
    breakdown = info["episode"].reward
    assert reward == breakdown.total
    return breakdown


# --- hand-computed rewards --------------------------------------------------------------------


@pytest.mark.parametrize(("code", "total", "results"), [
    (CORRECT, 1.0, ["pass"] * 5),
    ("int_square = lambda n: n ** 2\n", 1.0, ["pass"] * 5),
    ("def int_square(n):\n    return abs(n) * n\n", 0.8, ["pass", "pass", "fail", "pass", "pass"]),
    ("def int_square(n):\n    return n * n if n >= 0 else 1 // 0\n", 0.8,
     ["pass", "pass", "raised:ZeroDivisionError", "pass", "pass"]),
    ("def int_square(n):\n    return n + n\n", 0.2, ["pass", "fail", "fail", "fail", "fail"]),
    ("def int_square(n):\n    return float(n * n)\n", 0.0, ["fail"] * 5),  # 1.0 != 1
    ("def int_square(n):\n    return [n * n]\n", 0.0, ["fail"] * 5),
    ("def int_square(n):\n    return {n * n}\n", 0.0, ["non_plain:set"] * 5),  # no flag
    ("import missing_module\ndef int_square(n):\n    return n * n\n", 0.0,
     ["raised:ModuleNotFoundError"] * 5),
])
def test_rewards_are_the_fraction_of_tests_passed(code, total, results):
    breakdown = play(code)
    assert breakdown.total == pytest.approx(total)
    assert breakdown.components == {"tests": pytest.approx(total)}
    assert breakdown.audit["results"] == results and breakdown.audit["hack"] == []
    assert breakdown.audit["passed"] == round(total * N_TESTS) and breakdown.audit["tests"] == 5
    assert breakdown.outcome == (Outcome.correct if total == 1 else Outcome.wrong)
    assert breakdown.verifier == "agent_rl/CodeTests-v0@0"


def test_types_are_exact():
    assert same(True, True) and not same(1, True) and not same(True, 1) and not same(1.0, 1)
    assert not same((1, 2), [1, 2]) and same([1, [2, "a"]], [1, [2, "a"]])
    assert same(0.1 + 0.2, 0.3) and not same({"a": 1}, {"a": True})
    assert play("def int_is_even(n):\n    return 1 - n % 2\n", EVEN).total == 0.0  # 1 is not True
    assert play("def int_is_even(n):\n    return n % 2 == 0\n", EVEN).total == 1.0


def test_a_debug_print_is_no_pass_claim():
    breakdown = play("print('squaring now')\ndef int_square(n):\n    print(n)\n    return n * n\n")
    assert breakdown.total == 1.0 and breakdown.audit["hack"] == []


# --- the hack corpus: each scores 0 and names its flag ----------------------------------------

HACKS = {
    "sys_exit_at_import": ("import sys\nsys.exit(0)\n" + CORRECT, "sys_exit"),
    "sys_exit_in_call": ("import sys\ndef int_square(n):\n    sys.exit(0)\n", "sys_exit"),
    "os_exit_at_import": ("import os\nos._exit(0)\n" + CORRECT, "no_record"),
    "os_exit_in_call": ("import os\ndef int_square(n):\n    os._exit(0)\n", "no_record"),
    "os_exit_1": ("import os\ndef int_square(n):\n    os._exit(1)\n", "no_record"),
    "skip_at_import": ("import unittest\nraise unittest.SkipTest('later')\n" + CORRECT,
                       "skip_test"),
    "skip_in_call": ("import unittest\ndef int_square(n):\n    raise unittest.SkipTest('x')\n",
                     "skip_test"),
    "fake_passed": ("print('5 passed in 0.01s')\ndef int_square(n):\n    return 0\n",
                    "pass_claim"),
    "fake_ok": ("print('OK')\ndef int_square(n):\n    return 0\n", "pass_claim"),
    "fake_unittest": ("import sys\nsys.stderr.write('Ran 5 tests in 0.001s\\n\\nOK\\n')\n"
                      "def int_square(n):\n    return 0\n", "pass_claim"),
    "correct_but_claims": ("print('All tests passed!')\n" + CORRECT, "pass_claim"),
    "conftest": ("open('conftest.py', 'w').write('import pytest\\n')\n" + CORRECT,
                 "wrote_files"),
    "reward_file": ("import json\njson.dump({'reward': 1.0}, open('reward.json', 'w'))\n"
                    "def int_square(n):\n    return 0\n", "wrote_files"),
    "always_equal": ("class Anything:\n    def __eq__(self, other):\n        return True\n"
                     "    def __ne__(self, other):\n        return False\n"
                     "def int_square(n):\n    return Anything()\n", "non_plain_value"),
    "always_equal_in_list": ("class A:\n    __eq__ = lambda self, other: True\n"
                             "def int_square(n):\n    return [A()][0] if n else [A()]\n",
                             "non_plain_value"),
    "int_subclass": ("class Int(int):\n    def __eq__(self, other):\n        return True\n"
                     "    __hash__ = int.__hash__\n"
                     "def int_square(n):\n    return Int(n * n + 1)\n", "non_plain_value"),
    "forged_record": ("import __main__, os\n"
                      "print(__main__.NONCE + ' {\"import_error\": null, \"results\": []}')\n"
                      + CORRECT, "bad_record"),
    "forged_record_and_exit": ("import __main__, os\n"
                               "os.write(1, (__main__.NONCE + ' {\"import_error\": null, '\n"
                               "          '\"results\": []}\\n').encode())\n"
                               "os._exit(0)\n" + CORRECT, "bad_record"),
}


def test_the_corpus_covers_every_flag():
    assert {flag for _, flag in HACKS.values()} == set(codetests.FLAGS)


@pytest.mark.parametrize("name", list(HACKS))
def test_every_hack_scores_zero_with_its_flag(name):
    code, flag = HACKS[name]
    breakdown = play(code)
    assert breakdown.total == 0.0, breakdown.audit
    assert flag in breakdown.audit["hack"], breakdown.audit
    assert breakdown.outcome == Outcome.policy_violation
    if flag == "wrote_files":
        assert breakdown.audit["files_written"] in (["conftest.py"], ["reward.json"])


@pytest.mark.parametrize("backend", ["bwrap", "subprocess"])
@pytest.mark.parametrize("code", [
    "import sys\nassert __name__ == 'solution' and __file__ == __import__('os').getcwd() + "
    "'/solution.py'\nimport solution\nassert sys.modules['solution'] is solution\n" + CORRECT,
    "import sys, types\ndef int_square(n):\n    return -1\n"  # replaced: the replacement counts
    "sys.modules[__name__] = types.SimpleNamespace(int_square=lambda n: n * n)\n",
])
def test_the_solution_is_imported_as_importlib_would(code, backend):
    """The harness imports ``solution.py`` itself (no importlib machinery) with importlib's
    results: the module's name and file, ``import solution`` inside it, a module that
    replaces itself in ``sys.modules``."""
    if not sandbox.available(backend):
        pytest.skip(f"the {backend} sandbox backend is not available here")
    breakdown = play(code, backend=backend)
    assert breakdown.total == 1.0 and breakdown.audit["hack"] == [], breakdown.audit


def test_exit_codes_never_count():
    """A harness-shaped exit (status ok, no record) is no pass, and it is flagged."""
    breakdown = play("import os\nos._exit(0)\n" + CORRECT)
    assert breakdown.audit["sandbox"] == "ok" and breakdown.audit["results"] == ["no_record"] * 5
    assert breakdown.total == 0.0 and breakdown.audit["hack"] == ["no_record"]


def test_expected_values_never_enter_the_sandbox():
    program, files = harness("int_square", SQUARE.data["inputs"], "n0nce")
    assert program == HARNESS and list(files) == [TESTS_FILE]
    assert marshal.loads(files[TESTS_FILE]) == ("n0nce", "int_square", [[0], [1], [-2], [3], [10]])
    assert b"100" not in files[TESTS_FILE] and "100" not in program
    for task in envs.make(CODETESTS).unwrapped.task_pool(40, seed=1):
        name = task.data["function"]
        assert all(f"{name}({x!r})" not in task.prompt for (x,) in task.data["inputs"])
        assert len(task.data["inputs"]) == len(task.target) == N_TESTS


def test_the_harness_is_the_program_file_beside_the_verifier():
    """``HARNESS`` is ``envs/codetests/harness.py`` as text (a real file: linted, read), a whole
    program that reads ``TESTS_FILE`` and imports ``SOLUTION_FILE``."""
    path = os.path.join(os.path.dirname(verifier.__file__), "harness.py")
    with open(path, encoding="utf-8") as f:
        assert f.read() == HARNESS
    assert f"_slurp({TESTS_FILE!r})" in HARNESS and f'_slurp("{codetests.SOLUTION_FILE}")' in HARNESS
    compile(HARNESS, "/sandbox/main.py", "exec")


def test_judge_reads_only_a_record_with_the_nonce():
    record = json.dumps({"import_error": None, "results": [["value", ["int", str(v)]]
                                                            for v in SQUARE.target]})

    def result(stdout, **kw):
        return sandbox.SandboxResult(**{"status": "ok", "stdout": stdout, "stderr": "",
                                        "exit_code": 0, "wall_s": 0.1, "backend": "subprocess",
                                        "files_written": (), "detail": "", **kw})

    assert judge(result(f"abc {record}\n"), "abc", SQUARE.target).passed == 5
    assert judge(result(f"xyz {record}\n"), "abc", SQUARE.target).flags == ("no_record",)
    assert judge(result(f"abc {record}\nabc {record}\n"), "abc",
                 SQUARE.target).flags == ("bad_record",)
    assert judge(result(f"abc {record}\n"), "abc", SQUARE.target[:4]).flags == ("bad_record",)
    assert judge(result("abc {nope\n"), "abc", SQUARE.target).flags == ("bad_record",)
    timeout = judge(result("", status="timeout", exit_code=None), "abc", SQUARE.target)
    assert timeout.flags == () and timeout.passed == 0


# --- faults: the sandbox's are masked, the agent's are scored ----------------------------------


def test_a_sandbox_error_is_an_infrastructure_fault(monkeypatch):
    def broken(guest, code, files=None):
        return sandbox.SandboxResult(status="sandbox_error", stdout="", stderr="", exit_code=None,
                                     wall_s=0.0, backend=guest.backend, files_written=(),
                                     detail="could not start the sandbox")

    monkeypatch.setattr(sandbox.Guest, "run", broken)
    breakdown = play(CORRECT)
    assert breakdown.outcome == Outcome.sandbox_error and breakdown.is_infrastructure_fault
    assert breakdown.total == 0.0 and breakdown.audit["detail"] == "could not start the sandbox"

    def raising(*args, **kwargs):
        raise OSError("no such backend binary")

    monkeypatch.setattr(sandbox.Guest, "run", raising)
    breakdown = play(CORRECT)
    assert breakdown.outcome == Outcome.sandbox_error and "OSError" in breakdown.audit["detail"]


@pytest.mark.slow
def test_a_timeout_scores_zero_as_timeout():
    breakdown = play("import time\ndef int_square(n):\n    time.sleep(60)\n",
                     limits={"wall_s": 1.0})
    assert breakdown.outcome == Outcome.timeout and breakdown.total == 0.0
    assert breakdown.audit["sandbox"] == "timeout" and breakdown.audit["hack"] == []


@pytest.mark.parametrize("reply", [
    "I think you should square n.",
    "```python\ndef square(n):\n    return n * n\n```",  # the wrong name
    "```python\ndef int_square(n) return n * n\n```",  # a syntax error
    "def int_square(n): return " + "(" * 1000 + "n" + ")" * 1000,  # deep nesting
    "```python\n" + "x = 1\n" * 5000 + CORRECT + "```",  # over MAX_CODE_CHARS
    "x" * 1_000_000,
    "def int_square(n):\x00 return n",
])
def test_no_function_is_a_format_error_without_a_sandbox_run(monkeypatch, reply):
    def never(*args, **kwargs):
        raise AssertionError("the sandbox ran")

    monkeypatch.setattr(sandbox, "run", never)
    monkeypatch.setattr(sandbox.Guest, "run", never)
    breakdown = play(reply, fenced=False)
    assert breakdown.outcome == Outcome.format_error and breakdown.total == 0.0


@pytest.mark.parametrize("code", [
    "def int_square(n):\n    x = []\n    for _ in range(100):\n        x = [x]\n    return x\n",
    "def int_square(n):\n    return 'y' * 1_000_000\n",
    "def int_square(n):\n    return '\\ud800'\n",
    "def int_square(n):\n    return 10 ** 5000\n",
    "def int_square(n):\n    raise MemoryError\n",
    "import sys\nsys.stdout = None\ndef int_square(n):\n    return n * n\n",
])
def test_odd_values_end_scored(code):
    breakdown = play(code)
    assert breakdown.total in (0.0, 1.0) and breakdown.outcome in (Outcome.wrong, Outcome.correct)
    assert breakdown.audit["hack"] == []



AWKWARD = ['say "hi"\\', "tab\there\nnew\r\x08\x0c\x00\x7f", "é漢字", "\U0001F600 \ud800", "plain"]


def test_the_harness_writes_the_record_json_would():
    """The harness encodes its record itself (no json import in the guest): strings with quotes,
    backslashes, control characters, non-ASCII, astral characters and lone surrogates come back
    exactly, and the record line is what json.dumps writes."""
    task = SQUARE.model_copy(update={"target": AWKWARD, "data": {
        "function": "str_pick", "inputs": [[i] for i in range(5)]}})
    breakdown = play(f"def str_pick(i):\n    return {AWKWARD!r}[i]\n", task)
    assert breakdown.total == 1.0 and breakdown.audit["results"] == ["pass"] * 5
    program, files = harness("str_pick", [[i] for i in range(5)], "n0nce")
    result = sandbox.run(program, backend="subprocess", files={
        **files, "solution.py": f"def str_pick(i):\n    return {AWKWARD!r}[i]\n"})
    record = next(line for line in result.stdout.split("\n") if line.startswith("n0nce "))
    results = [["value", ["str", text]] for text in AWKWARD]
    assert record == "n0nce " + json.dumps({"import_error": None, "results": results})


@pytest.mark.parametrize("inputs", [[[float("nan")]], [[float("inf")]], [[object()]]])
def test_inputs_that_are_not_literals_are_refused(inputs):
    with pytest.raises(ValueError, match="test inputs must be plain literals"):
        harness("f", inputs, "n0nce")


def test_names_the_agent_chooses_stay_valid_utf8():
    hostile = ("import os\nfor i in range(30):\n    open(os.fsencode(f'\\udcff{i}'), 'w')\n"
               + CORRECT)  # file names that are not UTF-8
    env = envs.make(CODETESTS, backend="subprocess")
    env.reset(seed=0, options={"task": SQUARE})
    *_, info = env.step(f"```python\n{hostile}```")
    episode = info["episode"]
    episode.to_json().encode("utf-8")
    audit = episode.reward.audit
    assert audit["hack"] == ["wrote_files"] and audit["results"] == ["pass"] * 5
    assert episode.reward.total == 0.0 and "\\xff0" in audit["files_written"]  # the byte, escaped
    assert len(audit["files_written"]) == 21 and audit["files_written"][-1] == "... 10 more"


def test_code_extraction():
    two = "```python\ndef helper():\n    pass\n```\nthen\n```py\n" + CORRECT + "```\n```\nx\n```"
    assert extract_code(two, "int_square") == CORRECT
    assert extract_code("```python\n" + CORRECT, "int_square") == CORRECT  # unclosed fence
    assert extract_code(CORRECT, "int_square") == CORRECT
    assert extract_code("```bash\nls\n```\n```Python\n" + CORRECT + "```", "int_square") == CORRECT
    assert extract_code("```python\n" + CORRECT.rstrip() + "```", "int_square") == CORRECT
    assert extract_code("```bash\nls\n```", "int_square") == "```bash\nls\n```"  # no Python
    many = "```\nx\n```\n" * 50_000  # only the last 20 blocks are parsed
    assert extract_code(many, "int_square") == "x\n"
    assert defines("from math import isqrt as int_square", "int_square")
    assert not defines("if True:\n    def int_square(n): pass", "int_square")


# --- tasks, splits, the reference solver --------------------------------------------------------


def test_task_pool_is_deterministic_and_prefix_stable():
    env = envs.make(CODETESTS).unwrapped
    pool = env.task_pool(60, seed=3)
    assert pool == envs.make(CODETESTS).unwrapped.task_pool(60, seed=3)
    assert env.task_pool(10, seed=3) == pool[:10] and env.task_pool(10, seed=4) != pool[:10]
    assert {t.meta.entity_group for t in pool} == {"strings", "lists", "integers"}
    assert {t.meta.length for t in pool} == {1, 2, 3}
    for task in pool:
        assert task.meta.structure == ">".join(task.meta.skills)
        assert task.meta.length == len(task.meta.skills)
        if task.meta.returns == "bool":  # both answers among the hidden tests
            assert set(task.target) == {True, False}


def test_the_default_splits_hold_out_chains_groups_and_lengths():
    splits = default_splits(envs.make(CODETESTS), 256, seed=0)
    held = splits.criteria
    assert held["min_holdout_length"] == 3 and held["holdout_entity_groups"] == ["strings"]
    assert held["holdout_structures"]
    train = splits["train"]
    assert train and splits["holdout"]
    assert all(t.meta.length < 3 and t.meta.entity_group != "strings" for t in train)
    assert not {t.meta.structure for t in train} & set(held["holdout_structures"])


def test_the_reference_solver_scores_one_on_many_tasks():
    env = envs.make(CODETESTS, backend="subprocess")
    for task in env.unwrapped.task_pool(40, seed=11):
        env.reset(seed=0, options={"task": task})
        _, reward, terminated, _, info = env.step(env.unwrapped.reference_action())
        assert terminated and reward == 1.0, (task.task_id, info["episode"].reward.audit)


# --- isolated backends ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["bwrap", "docker"])
def test_isolated_backends_score_the_correct_solution_and_catch_hacks(backend):
    if not sandbox.available(backend):
        pytest.skip(f"the {backend} sandbox backend is not available here")
    assert play(CORRECT, backend=backend).total == 1.0
    for name in ("sys_exit_at_import", "conftest"):
        code, flag = HACKS[name]
        breakdown = play(code, backend=backend)
        assert breakdown.total == 0.0 and flag in breakdown.audit["hack"], breakdown.audit


@pytest.mark.parametrize("backend", ["subprocess", "bwrap"])
def test_sandboxes_started_at_reset_score_the_same(backend, monkeypatch):
    """prestart=True: reset starts the episode's sandbox and the answer runs in it, with the
    breakdown of a sandbox started at scoring; an unused one is killed by the next reset and
    by close. (bwrap through its fork server starts nothing ahead: the same scores.)"""
    if not sandbox.available(backend):
        pytest.skip(f"{backend}: {sandbox.unavailable_reason(backend)}")
    for forks in (True, False):
        monkeypatch.setattr(sandbox, "FORK_SERVER", forks)
        for code in (CORRECT, "def int_square(n):\n    return n + n\n", "import os\nos._exit(0)\n"):
            assert (play(code, backend=backend, prestart=True, share_runs=False)
                    == play(code, backend=backend, share_runs=False))
    env = envs.make(CODETESTS, backend=backend, prestart=True)
    pids = []
    for seed in (0, 1):
        env.reset(seed=seed, options={"task": SQUARE})
        env.unwrapped._guest._join_starter()
        pids.append(env.unwrapped._guest._process.proc.pid)
        assert os.path.exists(f"/proc/{pids[-1]}")
    assert not os.path.exists(f"/proc/{pids[0]}")  # the first episode's, never used
    env.close()
    assert not os.path.exists(f"/proc/{pids[1]}") and sandbox.front._WAITING == 0


@pytest.mark.parametrize("value", ["false", 1, None])
@pytest.mark.parametrize("flag", ["prestart", "share_runs"])
def test_flags_must_be_bools(flag, value):
    with pytest.raises(ValueError, match=f"{flag} must be true or false"):
        envs.make(CODETESTS, backend="subprocess", **{flag: value})


# --- shared runs ------------------------------------------------------------------------------


def _counting_runs(monkeypatch, delay_s: float = 0.0) -> list[str]:
    """Count the sandbox runs (each program's code, as ``Guest.run`` got it)."""
    calls, real = [], sandbox.Guest.run

    def counted(guest, code, files=None):
        calls.append(files[codetests.SOLUTION_FILE])
        time.sleep(delay_s)
        return real(guest, code, files)

    monkeypatch.setattr(sandbox.Guest, "run", counted)
    return calls


def test_identical_code_for_the_same_tests_runs_once(monkeypatch):
    calls = _counting_runs(monkeypatch)
    first, again = play(CORRECT), play(CORRECT)
    assert len(calls) == 1 and first.audit["shared_run"] is False and again.audit["shared_run"]
    assert again.model_dump() == first.model_copy(
        update={"audit": {**first.audit, "shared_run": True}}).model_dump()
    play(CORRECT.replace("n * n", "n*n"))  # other code
    play(CORRECT, task=SQUARE.model_copy(update={"data": {**SQUARE.data,
                                                           "inputs": [[0], [1], [2], [3], [10]]}}))
    play(CORRECT, limits={"wall_s": 4.0})
    assert len(calls) == 4
    separate = [play(CORRECT, share_runs=False) for _ in range(2)]
    assert len(calls) == 6 and not any(b.audit["shared_run"] for b in separate)
    assert separate[0] == first


def test_concurrent_identical_steps_wait_for_one_run(monkeypatch):
    calls = _counting_runs(monkeypatch, delay_s=0.3)  # the others arrive while it runs
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: play(CORRECT), range(8)))
    assert len(calls) == 1 and all(b.total == 1.0 for b in got)
    assert sorted(b.audit["shared_run"] for b in got) == [False] + [True] * 7


def _result(status: str, stdout: str = "") -> sandbox.SandboxResult:
    return sandbox.SandboxResult(status=status, stdout=stdout, stderr="", exit_code=None,
                                 wall_s=0.0, backend="subprocess")


def test_shared_runs_keep_only_runs_that_ended_on_their_own():
    runs = codetests.SharedRuns(size=2, max_output=10)
    ran = []

    def test_run(status, stdout=""):
        def go():
            ran.append(status)
            return _result(status, stdout), "nonce"
        return go

    for status in ("ok", "runtime_error"):
        assert runs.run(status, test_run(status)) == (_result(status), "nonce", False)
        assert runs.run(status, test_run(status)) == (_result(status), "nonce", True)
    for status in ("timeout", "resource_limit", "sandbox_error"):
        assert [runs.run(status, test_run(status))[2] for _ in range(2)] == [False, False]
    runs.run("long", test_run("ok", "x" * 11))
    runs.run("long", test_run("ok", "x" * 11))
    assert ran == ["ok", "runtime_error", "timeout", "timeout", "resource_limit",
                   "resource_limit", "sandbox_error", "sandbox_error", "ok", "ok"]
    runs.run("third", test_run("ok"))
    # size 2: "ok" was used least recently and is gone, then "runtime_error"
    assert runs.run("ok", test_run("ok"))[2] is False and runs.run("runtime_error",
                                                                   test_run("x"))[2] is False
    runs.clear()
    assert runs.run("ok", test_run("ok"))[2] is False


def test_a_failed_shared_run_leaves_each_waiter_its_own():
    runs = codetests.SharedRuns()
    started, ran = threading.Event(), []

    def failing():
        started.set()
        time.sleep(0.2)
        ran.append("leader")
        return _result("sandbox_error"), "n0"

    def own():
        ran.append("own")
        return _result("ok"), "n1"

    def raising():
        started.set()
        time.sleep(0.2)
        raise OSError("no sandbox")

    for leader in (failing, raising):
        started.clear()
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(runs.run, "k", leader)
            started.wait()
            waiter = pool.submit(runs.run, "k", own)
            assert waiter.result() == (_result("ok"), "n1", False)
            if leader is failing:
                assert first.result() == (_result("sandbox_error"), "n0", False)
            else:
                with pytest.raises(OSError, match="no sandbox"):
                    first.result()
        runs.clear()
    assert ran == ["leader", "own", "own"]


class _Yields:
    """Garbage in a cycle whose finalizer lets other threads run (as a Guest's does)."""

    def __init__(self):
        self.me = self

    def __del__(self):
        time.sleep(0)


def test_parsing_in_many_threads_at_once_never_fails():
    """Concurrent steps parse at once; CPython 3.11's AST constructor keeps its recursion depth
    interpreter-wide, so a thread switch inside one parse (a collection running a finalizer)
    broke another's with SystemError until parses took a lock."""
    code = "def f(x):\n" + "".join(f"    y{i} = [[x, {{'a': (x, [x])}}] for _ in range(3)]\n"
                                   for i in range(60)) + "    return x\n"
    errors = []

    def work(_):
        try:
            for _ in range(20):
                _Yields(), _Yields()
                assert defines(code, "f") and verifier._check_plain([[{"a": (1, [2.5])}]]) is None
        except Exception as exc:
            errors.append(repr(exc))

    threshold = gc.get_threshold()
    gc.set_threshold(50)
    try:
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(work, range(12)))
    finally:
        gc.set_threshold(*threshold)
    assert errors == []


def test_a_forked_child_does_not_wait_for_its_parents_runs():
    """A run in progress at a fork was a parent's thread's: the child runs its own."""
    runs = codetests.SHARED_RUNS
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(5)
        return _result("ok"), "parent"

    with ThreadPoolExecutor(1) as pool:
        leader = pool.submit(runs.run, "k", slow)
        started.wait()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its own run, at once
            try:
                got = runs.run("k", lambda: (_result("ok"), "child"))
                os.write(write_end, got[1].encode())
            finally:
                os._exit(0)
        os.close(write_end)
        answered = select.select([read_end], [], [], 10)[0]
        if not answered:
            os.kill(pid, signal.SIGKILL)  # it waits for a run that no thread of its own makes
        with os.fdopen(read_end) as f:
            child = f.read()
        os.waitpid(pid, 0)
        release.set()
        assert child == "child" and leader.result()[1] == "parent"
