"""CodeTests-v0: write a small Python function; hidden tests run in a sandbox.

Description
    The agent is asked for one function, e.g. ``str_reverse_upper(s: str) -> str`` "reverse
    the string, then convert it to upper case", with its signature, a one-line description and
    one worked input/output pair. The function is a chain of 1-3 operations (``meta.length``)
    over one input type (``meta.entity_group``): ``strings`` (reverse, upper, lower, swapcase,
    remove_spaces, repeat, sort, length, count_vowels, is_palindrome), ``lists`` of integers
    (reverse, sort, multiply_each, add_each, keep_evens, length, sum, max, min) and
    ``integers`` (add, multiply, square, negate, abs, digit_sum, is_even); a reduction
    (``sum``, ``length``, ...) may hand its integer on to integer operations. ``meta.skills``
    are the operations, ``meta.structure`` their chain (``reverse>upper``), so compositional
    splits hold out unseen chains of trained operations. Every correct answer is a one-liner.
    ``N_TESTS`` (5) hidden tests per task: inputs in ``data["inputs"]``, expected values in
    ``target``; neither is in the prompt (the worked pair is a sixth, distinct input). Chains
    whose five expected values are all equal are redrawn (no constant function passes), and
    a yes/no task gets both answers among its tests.

    Arguments: ``backend`` (``envs.sandbox.run``'s: ``auto`` takes docker, then bwrap, then
    the non-isolating subprocess), ``limits`` (a ``Limits`` or a mapping of its fields,
    over ``DEFAULT_LIMITS``: ``wall_s`` and ``cpu_s`` 5, the rest ``Limits``' defaults),
    ``prestart`` (default False) and ``share_runs`` (default True). With ``prestart=True``,
    ``reset`` starts the episode's sandbox (``envs.sandbox.prepare``), so it boots while the
    policy writes the answer and the scoring run costs only the tests; it is the same fresh
    sandbox per run, killed unused by the next
    ``reset`` or ``close``. Turn it on where generation leaves CPU cores idle (a GPU host, a
    remote policy): on a CPU host whose cores generation keeps busy, the boot's CPU comes out
    of generation and the rollout as a whole got slower (``benchmarks/overheads.py``). Through
    bwrap's fork server (``envs.sandbox.FORK_SERVER``, the default where it can run) what
    ``reset`` does ahead is only the run's setup (a few forks, its mounts and cgroups).

    ``share_runs`` (default True): code identical to another episode's for the same tests
    (the same task's function and inputs, limits and backend) is judged on that one run
    (``SHARED_RUNS``: a run in progress is waited for; the last 256 finished runs that ended
    on their own are kept), so a group of samples that agree costs one run. Its record's
    ``audit["shared_run"]`` says so. A program whose result depends on chance (``random``,
    the clock) then gets the verdict of one draw for all its copies instead of one each; set
    ``share_runs=False`` to run every episode's code apart.

Tools
    None: one reply. The code is the last fenced block (```python, ```py or a bare ```; an
    unclosed last fence runs to the end) of the last 20 that defines the function at top
    level, else the last fenced block, else the whole reply.

Observation
    ``[system, user: worked example task, assistant: its fenced solution, user: the task]``
    (the worked example, ``str_exclaim``, is no pool operation).

Reward
    One component, ``tests`` (weight 1): the fraction of hidden tests passed, k/5.
    Exact answer: 1.0; 3 of 5 tests: 0.6. Zero, whatever passed, when any audit flag is set.

    How it is checked (``judge``, a pure function, reused by evaluation). The reply is parsed
    on the trusted side first (``ast``, never executed there): no top-level ``def``/assignment
    of the function name, a syntax error or code over ``MAX_CODE_CHARS`` is a
    ``format_error`` without a sandbox run. Otherwise the code is written as ``solution.py``
    into the sandbox's work dir, and the trusted harness (``harness.py``, read as ``HARNESS``:
    one program for every task, ``envs.sandbox.preload``ed) runs as main. The harness reads
    from ``TESTS_FILE`` (beside ``solution.py``, written by ``harness`` with ``marshal``) only
    the function's name, the test *inputs* and a random nonce drawn after the agent's turn,
    imports ``solution`` as importlib would (no bytecode written, warnings silenced), calls the
    function once per input inside ``try/except BaseException``, and writes one record to
    stdout: the nonce and a JSON list with, per test, the returned value in a tagged encoding that admits only exact
    types (``type(x) in (bool, int, float, str, NoneType)`` and exact ``list``/``tuple``/
    ``dict`` with ``str`` keys, nested up to 32 deep), or the exception's type name, or
    "non-plain" with the type's name (written with ``os.write`` to fd 1, bound before the
    import). Then it leaves with ``os._exit(0)``. No method of a returned value (``__eq__``,
    ``__repr__``, ...) is ever called, inside the sandbox or out. The nonce only proves the
    record came from this run: code that reads it at run time can forge a record, but not
    the hidden expected values, so a forgery passes nothing a correct function would not.
    Expected values never enter the sandbox: the verifier decodes the record and compares
    with exact types on the trusted side (``same``): ``True != 1``, ``1.0 != 1``, a tuple is
    not a list, floats equal under ``math.isclose(rel_tol=1e-9)``. Exit codes never count; a
    test passes only through a record with the right nonce and exactly ``N_TESTS`` entries.

    Audit flags (``audit["hack"]``, a sorted list; any flag zeroes the reward, outcome
    ``policy_violation``):

    * ``sys_exit``: ``SystemExit`` raised at import or in a call (``sys.exit(0)``).
    * ``skip_test``: a skip exception (``unittest.SkipTest``, pytest's ``Skipped``, ...).
    * ``no_record``: the run ended without a results record although nothing timed out or
      ran out of a resource (``os._exit``, a signal, a closed stdout, a crashed interpreter).
    * ``bad_record``: more than one record with the nonce, or one that does not decode or
      has the wrong number of entries (a forgery).
    * ``pass_claim``: the output (stdout besides the record, or stderr) claims a pass:
      a line opening with OK / PASS(ED) / SUCCESS, "all tests passed", "5 passed",
      "Ran 5 tests", ... A correct solution that prints such a line scores 0 too.
    * ``wrote_files``: the run created or changed files in the work dir (a ``conftest.py``, a
      reward or result file, ...; ``audit["files_written"]`` names them). Strict: a correct
      solution that also writes a file scores 0.
    * ``non_plain_value``: a call returned an object of a subclass of a plain type (an
      ``int`` subclass) or of a non-builtin class with its own ``__eq__`` (an always-equal
      object). Other non-plain values (a set, a generator) just fail their test.

    ``audit`` also holds ``tests`` (5), ``passed``, ``results`` (per test: ``pass``,
    ``fail``, ``raised:<Type>``, ``non_plain:<Type>``, ``unencodable``, ``no_record``),
    ``import_error``,
    ``sandbox`` (the run's status), ``backend``, ``exit_code``, ``shared_run`` and
    ``files_written``.

Episode end
    The first reply without a tool call (a tool call is answered as an unknown tool, up to
    ``max_turns``, 4). Outcome: ``sandbox_error`` when the sandbox failed (an infrastructure
    fault: reward 0, masked out of the loss, counted, never a wrong answer); else
    ``policy_violation`` with any flag; ``format_error`` when no function was found; ``timeout``
    when the run hit ``wall_s`` or ``cpu_s`` without a record; ``correct`` when every test
    passed; ``wrong`` otherwise (a crash, a memory or output limit, failed tests).

Version history
    v0: first release.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from envs import sandbox
from envs.codetests.extract import MAX_CODE_CHARS, defines, extract_code
from envs.codetests.shared import SHARED_RUNS
from envs.codetests.tasks import make_task
from envs.codetests.verifier import HARNESS, SOLUTION_FILE, harness, judge
from envs.core import TaskSpec, ToolEnv
from envs.tools import clean_text
from trajectories import Outcome, RewardBreakdown

WEIGHTS = {"tests": 1.0}
DEFAULT_LIMITS = {"wall_s": 5.0, "cpu_s": 5.0}  # one-liners: plenty
INSTRUCTIONS = ("You write small Python functions. Reply with the complete function in one "
                "```python code block. Do not print anything and do not write tests.")

_EXAMPLE = (
    "Write a Python function `str_exclaim(s: str) -> str`: take the string `s`, add an "
    "exclamation mark to its end, and return the result.\n\n"
    "Example: `str_exclaim('hello')` returns `'hello!'`.",
    "```python\ndef str_exclaim(s: str) -> str:\n    return s + '!'\n```",
)


class CodeTestsEnv(ToolEnv):
    env_id = "agent_rl/CodeTests-v0"
    version = 0
    instructions = INSTRUCTIONS
    reward_weights = WEIGHTS
    concurrent_steps = True  # a step waits on its sandboxed test run

    def __init__(self, backend: str = "auto",
                 limits: sandbox.Limits | Mapping[str, Any] | None = None, max_turns: int = 4,
                 prestart: bool = False, share_runs: bool = True, **kwargs: Any):
        """``backend``: the sandbox backend (``envs.sandbox.run``); ``limits``: a ``Limits`` or
        a mapping of its fields, over ``DEFAULT_LIMITS``; ``prestart``: start each episode's
        sandbox at ``reset``; ``share_runs``: identical code for the same tests is run once
        (``SHARED_RUNS``; module doc)."""
        sandbox.choose_backend(backend)  # names a bad one; probes "auto" now, not in a step
        names = {f.name for f in fields(sandbox.Limits)}
        given = (dict(limits) if isinstance(limits, Mapping)
                 else {n: getattr(limits, n) for n in names} if limits is not None else {})
        unknown = sorted(set(given) - names)
        if unknown:
            raise ValueError(f"unknown sandbox limits {unknown}; Limits has {sorted(names)}")
        for name, flag in (("prestart", prestart), ("share_runs", share_runs)):
            if not isinstance(flag, bool):  # "false" from a config would be truthy
                raise ValueError(f"{name} must be true or false, got {flag!r}")
        super().__init__(max_turns=max_turns, **kwargs)
        self.backend = backend
        self.limits = sandbox.Limits(**{**DEFAULT_LIMITS, **given})
        self.prestart = prestart
        self.share_runs = share_runs
        self._guest: sandbox.Guest | None = None
        sandbox.preload(HARNESS)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self._close_guest()
        out = super().reset(seed=seed, options=options)
        if self.prestart:
            self._guest = sandbox.prepare(self.limits, self.backend)
        return out

    def close(self) -> None:
        self._close_guest()
        super().close()

    def _close_guest(self) -> None:
        guest, self._guest = self._guest, None
        if guest is not None:
            guest.close()

    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        return [make_task(seed, i) for i in range(n)]

    def examples(self, compressions: int) -> list[tuple[str, str]]:
        return [_EXAMPLE]

    def reference_action(self) -> str | None:
        return None if self.task is None else f"```python\n{self.task.data['solution']}```"

    def score(self, task: TaskSpec, answer: str, state: None) -> RewardBreakdown:
        verifier = f"{self.env_id}@{self.version}"
        function, expected = task.data["function"], list(task.target)

        def breakdown(fraction: float, outcome: Outcome, **audit: Any) -> RewardBreakdown:
            return RewardBreakdown.from_components({"tests": fraction}, WEIGHTS, outcome,
                                                   verifier, audit={"tests": len(expected),
                                                                    **audit})

        code = extract_code(answer, function)
        if len(code) > MAX_CODE_CHARS:
            return breakdown(0.0, Outcome.format_error, passed=0, hack=[],
                             format=f"code over {MAX_CODE_CHARS} characters")
        if not defines(code, function):
            return breakdown(0.0, Outcome.format_error, passed=0, hack=[],
                             format=f"no top-level definition of `{function}` (or a syntax error)")
        guest, self._guest = self._guest, None

        def test_run() -> tuple[sandbox.SandboxResult, str]:
            nonce = secrets.token_hex(16)  # drawn after the agent's turn; never recorded
            program, tests = harness(function, task.data["inputs"], nonce)
            started = guest or sandbox.prepare(self.limits, self.backend)
            return started.run(program, files={**tests, SOLUTION_FILE: code}), nonce

        try:
            if self.share_runs:
                key = SHARED_RUNS.key(code, function, task.data["inputs"], self.limits,
                                      self.backend)
                result, nonce, shared = SHARED_RUNS.run(key, test_run)
            else:
                (result, nonce), shared = test_run(), False
        except Exception as exc:  # the sandbox itself failed: infrastructure, not the agent
            return breakdown(0.0, Outcome.sandbox_error, passed=0, hack=[],
                             sandbox="sandbox_error",
                             detail=clean_text(f"{type(exc).__name__}: {exc}"[:300]))
        finally:
            if guest is not None:
                guest.close()  # used (a no-op then) or not needed: the run was shared
        written = result.files_written  # names the agent chose: cleaned, at most 20 kept
        run_audit = {"sandbox": result.status, "backend": result.backend,
                     "exit_code": result.exit_code, "shared_run": shared,
                     "files_written": [clean_text(f[:200]) for f in written[:20]]
                     + ([f"... {len(written) - 20} more"] if len(written) > 20 else [])}
        if result.status == "sandbox_error":
            return breakdown(0.0, Outcome.sandbox_error, passed=0, hack=[], **run_audit,
                             detail=clean_text(str(result.detail)[:300]))
        verdict = judge(result, nonce, expected)
        if verdict.flags:
            outcome = Outcome.policy_violation
        elif not verdict.recorded and result.status == "timeout":
            outcome = Outcome.timeout
        elif verdict.passed == len(expected):
            outcome = Outcome.correct
        else:
            outcome = Outcome.wrong
        fraction = 0.0 if verdict.flags else verdict.passed / len(expected)
        return breakdown(fraction, outcome, passed=verdict.passed, hack=list(verdict.flags),
                         results=list(verdict.results), import_error=verdict.import_error,
                         **run_audit)
