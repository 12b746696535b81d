"""The verifiers bridge: a tiny verifiers.v1 taskset (reverse a word) run as a ToolEnv."""

from __future__ import annotations

import difflib

import pytest
from gymnasium.utils.env_checker import check_env

vf = pytest.importorskip("verifiers.v1", reason="verifiers==0.4.0 is not installed")

import envs  # noqa: E402
from envs.checks import check_env_id  # noqa: E402
from envs.verifiers_bridge import OfflineScoringError, TasksetEnv, register_taskset  # noqa: E402
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
    trace = env._trace(task, "garbage reply")
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
