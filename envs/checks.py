"""Contract checks for one registered environment id (what every environment must satisfy).

``check_env_id(id)`` builds the env with ``envs.make`` and runs, each on a fresh instance:

* ``gymnasium_check_env``: Gymnasium's own ``check_env`` on the unwrapped env.
* ``reference_solver``: ``episodes`` tasks from ``task_pool(episodes, seed)``, driven by
  ``reference_action()``, all reach the maximum reward (the sum of the positive
  ``reward_weights``) and terminate, each with a valid ``Episode`` record.
* ``random_actions``: ``episodes`` episodes of random actions (random text, malformed and
  well-formed tool calls against the env's own tool schemas) never raise, end within
  ``max_turns``, and leave a valid ``Episode`` record (a single rooted session tree, matching
  reward, content hash intact).
* ``hostile_actions``: every text of ``hostile_actions`` (1,000 nested brackets, numbers of
  over 4,300 digits, lone surrogates, in plain text and in calls to the env's own tools), sent
  as the first action and again after it, ends as an observation, a tool error or a scored
  end: never an exception, always a valid ``Episode`` record.
* ``determinism``: ``task_pool`` and ``reset(seed=...)`` repeat exactly, and the same seeded
  random episode replayed on a fresh env gives the same ``Episode`` content hash.

The report lists every check with pass/fail and its message; it never raises.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium
import numpy as np
from gymnasium.utils.env_checker import check_env

from envs.registry import make
from trajectories import Episode


class CheckFailed(AssertionError):
    """A contract check failed; the message says which task and why."""


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    message: str


@dataclass
class CheckReport:
    env_id: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.passed]

    def __str__(self) -> str:
        lines = [f"{self.env_id}: {'PASS' if self.passed else 'FAIL'}"]
        for r in self.results:
            lines.append(f"  [{'pass' if r.passed else 'FAIL'}] {r.name}: {r.message}")
        return "\n".join(lines)


def check_env_id(env_id: str, episodes: int = 20, seed: int = 0,
                 env_kwargs: dict[str, Any] | None = None) -> CheckReport:
    """Run the contract checks on one registered environment id, built with ``env_kwargs``
    (e.g. ``{"branching": True}``)."""
    report = CheckReport(env_id)
    env_kwargs = dict(env_kwargs or {})
    try:
        env = make(env_id, **env_kwargs)
        name = type(env.unwrapped).__name__
        env.close()
    except Exception as exc:
        report.results.append(CheckResult("make", False, f"{type(exc).__name__}: {exc}"))
        return report
    report.results.append(CheckResult("make", True, f"builds {name}"))
    for check_name, check in CHECKS.items():
        try:
            message = check(lambda: make(env_id, **env_kwargs), episodes, seed)
            report.results.append(CheckResult(check_name, True, message))
        except Exception as exc:
            text = str(exc) if isinstance(exc, CheckFailed) else f"{type(exc).__name__}: {exc}"
            report.results.append(CheckResult(check_name, False, text))
    return report


# ---------------------------------------------------------------------------------------------
# The checks: each takes a factory of fresh envs and returns a one-line summary or raises.
# ---------------------------------------------------------------------------------------------

EnvFactory = Callable[[], gymnasium.Env]


def _gymnasium_check_env(new_env: EnvFactory, episodes: int, seed: int) -> str:
    env = new_env()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped, skip_render_check=True)
    notes = sorted({str(w.message).splitlines()[0] for w in caught})
    return "passed" + (f" with warnings: {notes}" if notes else "")


def _reference_solver(new_env: EnvFactory, episodes: int, seed: int) -> str:
    env = new_env()
    unwrapped = env.unwrapped
    best = sum(w for w in unwrapped.reward_weights.values() if w > 0)
    for i, task in enumerate(unwrapped.task_pool(episodes, seed)):
        env.reset(seed=seed + i, options={"task": task})
        for _ in range(_step_cap(unwrapped)):
            action = unwrapped.reference_action()
            if action is None:
                raise CheckFailed(f"task {task.task_id}: reference_action() returned None; "
                                  "every environment ships a scripted solver")
            _, reward, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                break
        else:
            raise CheckFailed(f"task {task.task_id}: the reference solver never ended the episode")
        if truncated:
            raise CheckFailed(f"task {task.task_id}: the reference solver was truncated "
                              f"({info['episode'].reward.audit.get('truncated_by')})")
        episode = _valid_episode(info, reward, task.task_id)
        if reward < best - 1e-6:
            raise CheckFailed(f"task {task.task_id}: reference solver scored {reward:g} < max "
                              f"{best:g} (components {episode.reward.components})")
    return f"{episodes} reference episodes reached the max reward {best:g}"


def _random_actions(new_env: EnvFactory, episodes: int, seed: int) -> str:
    env = new_env()
    outcomes: dict[str, int] = {}
    for i in range(episodes):
        episode = _random_episode(env, np.random.default_rng([seed, i]), seed + i)
        outcomes[episode.reward.outcome.value] = outcomes.get(episode.reward.outcome.value, 0) + 1
    return f"{episodes} random episodes ended cleanly; outcomes {dict(sorted(outcomes.items()))}"


def _hostile_actions(new_env: EnvFactory, episodes: int, seed: int) -> str:
    env = new_env()
    _, info = env.reset(seed=seed)
    actions = hostile_actions(info.get("tools", []))
    for k, action in enumerate(actions):
        _, info = env.reset(seed=seed + k)
        for turn in range(_step_cap(env.unwrapped)):
            try:
                _, reward, terminated, truncated, info = env.step(action if turn < 2 else "42")
            except Exception as exc:
                raise CheckFailed(f"hostile action {k} ({action[:40]!r}) raised at step {turn}: "
                                  f"{type(exc).__name__}: {str(exc)[:200]}") from exc
            if terminated or truncated:
                _valid_episode(info, reward, env.unwrapped.task.task_id)
                break
        else:
            raise CheckFailed(f"hostile action {k} ({action[:40]!r}): the episode never ended")
    return f"{len(actions)} hostile actions ended cleanly"


def _determinism(new_env: EnvFactory, episodes: int, seed: int) -> str:
    a, b = new_env(), new_env()
    pool_a = [t.model_dump() for t in a.unwrapped.task_pool(episodes, seed)]
    pool_b = [t.model_dump() for t in b.unwrapped.task_pool(episodes, seed)]
    if pool_a != pool_b:
        raise CheckFailed(f"task_pool({episodes}, seed={seed}) differs between two calls")
    for s in (seed, seed + 1):
        obs_a, _ = a.reset(seed=s)
        obs_b, _ = b.reset(seed=s)
        if obs_a != obs_b or a.unwrapped.task != b.unwrapped.task:
            raise CheckFailed(f"reset(seed={s}) gives different tasks or observations")
    for i in range(min(episodes, 3)):
        hashes = {_random_episode(env, np.random.default_rng([seed, i]), seed + i).content_hash
                  for env in (a, b)}
        if len(hashes) != 1:
            raise CheckFailed(f"the seeded random episode {i} differs between two fresh envs")
    return "task_pool, reset(seed) and seeded episodes repeat exactly"


CHECKS: dict[str, Callable[[EnvFactory, int, int], str]] = {
    "gymnasium_check_env": _gymnasium_check_env,
    "reference_solver": _reference_solver,
    "random_actions": _random_actions,
    "hostile_actions": _hostile_actions,
    "determinism": _determinism,
}

# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _step_cap(env: Any) -> int:
    return int(getattr(env, "max_turns", 100)) + 1


def _random_episode(env: gymnasium.Env, rng: np.random.Generator, seed: int) -> Episode:
    """One episode of random actions; it must end by itself within ``max_turns``."""
    env.action_space.seed(seed)
    _, info = env.reset(seed=seed)
    for _ in range(_step_cap(env.unwrapped)):
        action = _random_action(rng, env, info.get("tools", []))
        _, reward, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            return _valid_episode(info, reward, env.unwrapped.task.task_id)
    raise CheckFailed(f"a random episode (seed {seed}) did not end within max_turns")


def _random_action(rng: np.random.Generator, env: gymnasium.Env, tools: list[dict]) -> str:
    kind = int(rng.integers(6))
    if kind == 0:
        return ""
    if kind == 1:
        return '<tool_call>{"name": "' + str(rng.integers(100)) + '", "arguments": {'  # malformed
    if kind == 2:
        return '<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>'
    if kind in (3, 4) and tools:
        fn = tools[int(rng.integers(len(tools)))]["function"]
        props = fn.get("parameters", {}).get("properties", {})
        args = {k: _random_value(rng, v) for k, v in props.items() if rng.random() < 0.9}
        return f"<tool_call>{json.dumps({'name': fn['name'], 'arguments': args})}</tool_call>"
    return env.action_space.sample()


def hostile_actions(tools: list[dict]) -> list[str]:
    """Agent texts that once raised inside ``env.step``, plain and as calls to ``tools`` (the
    env's schemas): deep nesting (``RecursionError``), numbers of over 4,300 digits (Python's
    int conversion limit), lone surrogates raw and as JSON escapes (unencodable in the
    episode's UTF-8 JSON), and answers that must parse as numbers."""
    deep, huge = "[" * 1000 + "]" * 1000, "9" * 4301
    actions = [
        f"<tool_call>{deep}</tool_call>",
        '<tool_call>{"name": "x", "arguments": ' + '{"a": ' * 1000 + "1" + "}" * 1001
        + "</tool_call>",
        '<tool_call>{"name": "x", "arguments": "' + "[" * 1000 + '"}</tool_call>',
        '<tool_call>{"name": "x", "arguments": {"a": ' + "[" * 40 + "]" * 40 + "}}</tool_call>",
        deep, huge, f"-{huge}.{huge}", f"The answer is {huge}", "\ud800", "a\udfff b \ud800\udc00",
        '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
        "<tool_call>{\"name\": \"\ud800\", \"arguments\": {}}</tool_call>",
        "<masked>\ud800</masked>", "12.0", "1,000", "-0", "1e5",
    ]
    for fn in (t["function"] for t in tools):
        props = fn.get("parameters", {}).get("properties", {})
        for value in ("\ud800", "x\udc00y", "9" * 4300):
            args = dict.fromkeys(props, value)
            actions.append(f"<tool_call>{json.dumps({'name': fn['name'], 'arguments': args})}"
                           "</tool_call>")  # surrogates as JSON escapes
            actions.append("<tool_call>" + json.dumps({"name": fn["name"], "arguments": args},
                                                      ensure_ascii=False) + "</tool_call>")
        numbers = ", ".join(f'"{p}": {huge}' for p in props)
        actions.append(f'<tool_call>{{"name": "{fn["name"]}", "arguments": {{{numbers}}}}}'
                       "</tool_call>")
    return actions


def _random_value(rng: np.random.Generator, schema: dict) -> Any:
    kind = schema.get("type")
    if rng.random() < 0.15:  # wrong type on purpose
        return [None]
    if kind == "integer":
        return int(rng.integers(-5, 50))
    if kind == "number":
        return float(rng.normal())
    if kind == "boolean":
        return bool(rng.integers(2))
    if kind == "array":
        return [str(rng.integers(10)) for _ in range(int(rng.integers(3)))]
    if kind == "object":
        return {}
    return str(rng.choice(["", "a", "x", "42", "id-1", "the value", "record"]))


def _valid_episode(info: dict, reward: float, task_id: str) -> Episode:
    episode = info.get("episode")
    if not isinstance(episode, Episode):
        raise CheckFailed(f"task {task_id}: the final step's info has no Episode")
    try:
        Episode.model_validate(episode.model_dump())  # re-runs the tree validation
        episode.tree.validate()
    except ValueError as exc:
        raise CheckFailed(f"task {task_id}: invalid episode record: {exc}") from exc
    if not episode.hash_ok():
        raise CheckFailed(f"task {task_id}: episode content hash does not match its content")
    if not math.isclose(episode.reward.total, reward, rel_tol=1e-9, abs_tol=1e-9):
        raise CheckFailed(f"task {task_id}: step reward {reward} != episode reward "
                          f"{episode.reward.total}")
    return episode
