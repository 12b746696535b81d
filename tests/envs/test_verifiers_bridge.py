"""The verifiers bridge: a tiny verifiers.v1 taskset (reverse a word) run as a ToolEnv."""

from __future__ import annotations

import difflib
import math
import os
import sys
import time
import types

import pytest
from gymnasium.utils.env_checker import check_env

vf = pytest.importorskip("verifiers.v1", reason="verifiers==0.4.0 is not installed")

import envs  # noqa: E402
from envs.checks import check_env_id  # noqa: E402
from envs.datasets import RewardFaultWarning  # noqa: E402
from envs.verifiers_bridge import (  # noqa: E402
    OfflineScoringError,
    TasksetEnv,
    register_taskset,
    reply_trace,
)
from trajectories import Episode, Outcome  # noqa: E402

WORDS = ["agent", "policy", "reward", "session", "branch", "summary", "verifier", "rollout"]


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.5)
    async def similarity(self, task, trace) -> float:
        return difflib.SequenceMatcher(None, trace.last_reply, task.answer).ratio()

    @vf.metric
    async def reply_chars(self, trace) -> float:
        return float(len(trace.last_reply))


class ReverseTaskset(vf.Taskset[ReverseTask, vf.TasksetConfig]):
    def load(self):
        for word in WORDS:
            data = ReverseData(prompt=f"Reverse the text: {word}", answer=word[::-1],
                               system_prompt="Reverse the given text. Reply with it only.")
            yield ReverseTask(data, self.config.task)


class JudgedTask(ReverseTask):
    @vf.reward
    async def judged(self, trace) -> float:
        judge = vf.ReferenceJudge()
        result = await judge.evaluate(trace=trace, question="q", answer="a", response="r")
        return float(result.parsed)


class JudgedTaskset(vf.Taskset[JudgedTask, vf.TasksetConfig]):
    def load(self):
        yield JudgedTask(ReverseData(prompt="Reverse: ab", answer="ba"), self.config.task)


class CuedTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    """One reward, 1.0 on the answer; on cue it sleeps an hour, exits its process or raises."""

    @vf.reward
    async def exact(self, trace) -> float:
        reply = trace.last_reply
        if reply == "sleep":
            time.sleep(3600)
        if reply == "exit":
            os._exit(3)
        if reply == "raise":
            raise ValueError("no score for this reply")
        return float(reply == self.data.answer)


class CuedTaskset(vf.Taskset[CuedTask, vf.TasksetConfig]):
    def load(self):
        for word in WORDS[:2]:
            yield CuedTask(ReverseData(prompt=f"Reverse the text: {word}", answer=word[::-1]),
                           self.config.task)


def local_taskset():
    """A reverse taskset whose classes live inside this function, so they do not pickle."""

    class LocalTask(ReverseTask):
        pass

    class LocalTaskset(vf.Taskset[LocalTask, vf.TasksetConfig]):
        def load(self):
            yield LocalTask(ReverseData(prompt="Reverse the text: ab", answer="ba"),
                            self.config.task)

    return LocalTaskset(vf.TasksetConfig())


MAX = 1.5  # exact (1.0) + similarity (0.5)


@pytest.fixture(scope="module")
def env():
    return TasksetEnv(ReverseTaskset(vf.TasksetConfig()))


def test_rows_become_task_specs(env):
    pool = env.task_pool(5, seed=3)
    assert pool == env.task_pool(5, seed=3)
    assert {t.task_id for t in pool} <= {f"ReverseTaskset-{i}" for i in range(len(WORDS))}
    spec = pool[0]
    word = spec.prompt.removeprefix("Reverse the text: ")
    assert spec.target == word[::-1] and spec.data["row"]["answer"] == word[::-1]
    assert word[::-1] not in spec.prompt
    assert env.reward_weights == {"exact": 1.0, "similarity": 0.5}
    assert len(env.task_pool(20, seed=0)) == 20  # more than the taskset has: cycles


def test_correct_answer_scores_max(env):
    for spec in env.task_pool(len(WORDS), seed=0):
        obs, info = env.reset(seed=0, options={"task": spec})
        assert obs[0]["content"].startswith("Reverse the given text")
        assert obs[1] == {"role": "user", "content": spec.prompt}
        _, reward, terminated, truncated, info = env.step(env.reference_action())
        assert terminated and not truncated
        assert reward == pytest.approx(MAX)
        episode = info["episode"]
        assert isinstance(episode, Episode) and episode.hash_ok()
        assert episode.reward.outcome is Outcome.correct
        assert episode.reward.components == {"exact": 1.0, "similarity": 1.0}
        assert episode.reward.audit["metrics"] == {"reply_chars": float(len(spec.target))}
        Episode.model_validate(episode.model_dump())


def test_wrong_answer_scores_lower(env):
    spec = env.task_pool(1, seed=1)[0]
    env.reset(options={"task": spec})
    near = spec.target[:-1]
    _, reward, terminated, _, info = env.step(near)
    assert terminated and 0 < reward < MAX
    assert info["episode"].reward.components["exact"] == 0.0
    assert info["episode"].reward.outcome is Outcome.wrong
    env.reset(options={"task": spec})
    _, far, _, _, _ = env.step("zzzz")
    assert far < reward


def test_scores_match_task_score_directly(env):
    """The bridge's reward is exactly what the taskset's own Task.score records."""
    import asyncio

    spec = env.task_pool(1, seed=2)[0]
    task = next(t for t in ReverseTaskset(vf.TasksetConfig()) if t.data.answer == spec.target)
    trace = reply_trace(task, "garbage reply")
    asyncio.run(task.score(trace))
    breakdown = env.score(spec, "garbage reply", None)
    assert breakdown.total == pytest.approx(trace.reward)


def test_gymnasium_check_env_and_contract_checks():
    check_env(TasksetEnv(ReverseTaskset(vf.TasksetConfig())), skip_render_check=True)
    env_id = "verifiers_test/Reverse-v0"
    register_taskset(env_id, f"{__name__}:ReverseTaskset")
    assert env_id in envs.list_envs()
    made = envs.make(env_id)
    assert made.unwrapped.env_id == env_id
    report = check_env_id(env_id, episodes=8)
    assert report.passed, str(report)


def test_network_judges_are_refused():
    config = vf.TasksetConfig(task=vf.TaskConfig(judges=[{"id": "reference"}]))
    with pytest.raises(OfflineScoringError, match="judges"):
        TasksetEnv(ReverseTaskset(config))
    env = TasksetEnv(JudgedTaskset(vf.TasksetConfig()))  # judge hidden inside a reward
    env.reset(seed=0)
    with pytest.raises(OfflineScoringError, match="network judge"):
        env.step("ba")


# --- scoring under reward_timeout_s ---------------------------------------------------------


def answered(env, spec, reply):
    """The episode reward of ``reply`` on ``spec``."""
    env.reset(options={"task": spec})
    _, _, terminated, _, info = env.step(reply)
    assert terminated
    return info["episode"].reward


@pytest.fixture(scope="module", params=["object", "name"])
def cued_env(request):
    """The cued taskset passed in memory (its scoring recipe pickled) or by name (loaded by
    the worker itself), its rewards stopped after 1 s."""
    taskset = CuedTaskset(vf.TasksetConfig()) if request.param == "object" else (
        f"{__name__}:CuedTaskset")
    return TasksetEnv(taskset, reward_timeout_s=1)


def test_a_reward_that_hangs_is_stopped_at_reward_timeout_s_and_the_next_reply_scores(cued_env):
    spec = cued_env.task_pool(1)[0]
    started = time.monotonic()
    with pytest.warns(RewardFaultWarning) as said:
        reward = answered(cued_env, spec, "sleep")
    assert time.monotonic() - started < 10  # the reward sleeps 3600 s
    assert reward.outcome is Outcome.sandbox_error and reward.is_infrastructure_fault
    assert reward.total == 0.0 and reward.components == {"exact": 0.0}
    assert reward.audit["task_id"] == spec.task_id
    assert "DeadlineExceeded: no reward within reward_timeout_s=1 s" in reward.audit["reward_error"]
    message = str(said[0].message)
    assert f"task {spec.task_id}" in message and "sandbox_error" in message
    # a fresh worker loads the taskset again (outside the 1 s) and scores as before
    assert answered(cued_env, spec, spec.target).outcome is Outcome.correct
    assert answered(cued_env, spec, spec.target).total == 1.0
    assert answered(cued_env, spec, "nope").outcome is Outcome.wrong


def test_a_reward_that_kills_its_process_is_a_fault_and_one_that_raises_scores_zero(cued_env):
    spec = cued_env.task_pool(1)[0]
    with pytest.warns(RewardFaultWarning, match=f"task {spec.task_id}"):
        died = answered(cued_env, spec, "exit")
    assert died.outcome is Outcome.sandbox_error and died.audit["task_id"] == spec.task_id
    assert "WorkerDied" in died.audit["reward_error"] and "exit code 3" in died.audit[
        "reward_error"]
    raised = answered(cued_env, spec, "raise")  # the function's fault: scored, as verifiers does
    assert raised.outcome is Outcome.wrong and raised.total == 0.0
    assert "no score for this reply" in raised.audit["scoring_error"]
    assert answered(cued_env, spec, spec.target).total == 1.0


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, True, "10"])
def test_reward_timeout_s_is_a_finite_positive_number_checked_first(value):
    with pytest.raises(ValueError, match="reward_timeout_s must be a finite number of seconds"):
        TasksetEnv("no_such_module:Nothing", reward_timeout_s=value)  # not imported


def test_a_taskset_that_does_not_pickle_is_refused_and_scores_when_passed_by_name():
    with pytest.raises(TypeError, match=r"taskset LocalTaskset cannot be scored in a worker "
                                        r"process: its task classes or config do not pickle.* "
                                        r"pass the taskset by name"):
        TasksetEnv(local_taskset())
    env = TasksetEnv(f"{__name__}:local_taskset", reward_timeout_s=5)
    spec = env.task_pool(1)[0]
    assert answered(env, spec, "ba").total == pytest.approx(MAX)
    assert answered(env, spec, "ab").outcome is Outcome.wrong


def test_a_taskset_defined_in_main_is_refused_naming_main():
    taskset = local_taskset()
    task_cls = type(next(iter(taskset)))
    task_cls.__module__ = "__main__"  # as a script's or a notebook's classes are
    with pytest.raises(TypeError, match=r"classes \['local_taskset.<locals>.LocalTask'\] are "
                                        r"defined in __main__"):
        TasksetEnv(taskset)


def test_a_taskset_a_worker_cannot_load_is_refused_at_construction(monkeypatch):
    """A module that exists only in this process's memory imports here, not in a worker: the
    env says so when it is built, not at the first reply."""
    module = types.ModuleType("taskset_only_in_this_process")
    module.make = local_taskset
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(TypeError, match=r"LocalTaskset cannot be scored in a worker process: "
                                        r"loading it there failed \(ModuleNotFoundError"):
        TasksetEnv("taskset_only_in_this_process:make")
