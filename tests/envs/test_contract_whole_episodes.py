"""The contract of environments that run whole episodes (``run_whole_episodes``: the runner
hands them a batch, never steps them; ``agent_rl/Agent-v0``). They have no actions to send, so
test_contract.py's stepping checks do not apply; what every consumer of their episodes relies
on does: a deterministic task pool with metadata, one valid episode per job in job order, ids
and groups as the runner names them, the policy batched across episodes, and the same
episodes for the same inputs. Each such id needs its keyword arguments here (an agent and
tasks): ``test_every_whole_episode_env_is_covered`` fails for one that has none."""

from __future__ import annotations

from pathlib import Path

import pytest

import envs
from envs.datasets import DEFAULT_PATH
from envs.runner import Sampling, run_episodes
from tests.envs.test_contract import ReplayPolicy, assert_valid_episode

HERE = Path(__file__).resolve().parent
KWARGS = {"agent_rl/Agent-v0": {"agent": f"{HERE / 'agent_scripts.py'}:ask_once",
                                "tasks": str(DEFAULT_PATH), "reward": "numeric"}}
WHOLE = [env_id for env_id in envs.list_envs() if envs.registry.runs_whole_episodes(env_id)]


def test_every_whole_episode_env_is_covered():
    assert "agent_rl/Agent-v0" in WHOLE
    assert sorted(KWARGS) == WHOLE, "give every whole-episode env its kwargs in KWARGS"


@pytest.mark.parametrize("env_id", WHOLE)
def test_it_is_never_stepped_and_says_so(env_id):
    env = envs.make(env_id, **KWARGS[env_id])
    with pytest.raises(RuntimeError, match="runs whole episodes"):
        env.reset(seed=0)
    with pytest.raises(RuntimeError, match="runs whole episodes"):
        env.step("hello")
    assert env.unwrapped.reference_action() is None
    assert sum(env.unwrapped.reward_weights.values()) > 0


@pytest.mark.parametrize("env_id", WHOLE)
def test_task_pool_is_deterministic_and_meta_is_filled(env_id):
    env = envs.make(env_id, **KWARGS[env_id]).unwrapped
    pool = env.task_pool(20, seed=7)
    assert len(pool) == 20 and len({t.task_id for t in pool}) == 20
    assert pool == envs.make(env_id, **KWARGS[env_id]).unwrapped.task_pool(20, seed=7)
    assert pool != env.task_pool(20, seed=8)
    for task in pool:
        assert task.prompt.strip() and task.meta.skills and task.meta.structure
        assert task.meta.entity_group and task.meta.length >= 1 and task.meta.difficulty >= 0


@pytest.mark.parametrize("env_id", WHOLE)
@pytest.mark.parametrize("given", ["id", "envs"])
def test_runner_returns_one_episode_per_job(env_id, given):
    """By id (``num_envs`` agents at once) or as ready envs (as many at once as given)."""
    tasks = envs.make(env_id, **KWARGS[env_id]).unwrapped.task_pool(4, seed=3)

    def run(policy):
        where = env_id if given == "id" else [envs.make(env_id, **KWARGS[env_id]) for _ in range(3)]
        return run_episodes(where, tasks, policy, sampling=Sampling(temperature=0.0),
                            samples_per_task=2, num_envs=3, seed=11, env_kwargs=KWARGS[env_id],
                            group_prefix="g/", split="holdout")

    policy = ReplayPolicy("I am not sure.")
    episodes = run(policy)
    jobs = [(task.task_id, j) for task in tasks for j in range(2)]
    assert [(e.task_id, e.sample_id) for e in episodes] == jobs
    assert [e.group_id for e in episodes] == [f"g/{task_id}" for task_id, _ in jobs]
    assert [e.episode_id for e in episodes] == [f"g/{t}#{j}@{11 + k}"
                                                for k, (t, j) in enumerate(jobs)]
    assert [e.seed for e in episodes] == list(range(11, 19))
    assert sum(policy.batches) == 8 and 1 < max(policy.batches) <= 3  # batched, 3 at once
    for episode in episodes:
        assert_valid_episode(episode, env_id)
        assert episode.split == "holdout" and episode.generation["temperature"] == 0.0
        generated = [t for s in episode.sessions for t in s.turns[s.metrics["opening_turns"]:]
                     if t.role == "assistant"]
        assert generated and all(t.token_ids == [1, 2, 3] for t in generated)
    again = run(ReplayPolicy("I am not sure."))
    assert [e.content_hash for e in again] == [e.content_hash for e in episodes]
