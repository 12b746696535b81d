"""envs.runner: a distinct, reproducible sampling stream per job and call, the split and hint
options every reset gets, the policy's tokenizer counting context budgets, and concurrent
steps for envs that wait."""

from __future__ import annotations

import threading
import time

import pytest

import envs
from envs.arithmetic import ArithmeticEnv
from envs.runner import Completion, Sampling, run_episodes, stream_seed


class Recorder:
    """A Policy that writes a note first (Relay-like two-turn episodes) and logs its calls."""

    def __init__(self, count_tokens=None):
        self.calls: list[tuple[int, Sampling]] = []
        if count_tokens is not None:
            self.count_tokens = count_tokens

    def generate(self, batch, sampling):
        self.calls.append((len(batch), sampling))
        return [Completion("12", token_ids=[1, 2], logprobs=[-0.1, -0.2]) for _ in batch]


def test_stream_seed_is_reproducible_and_keyed():
    assert stream_seed(7, 0) == stream_seed(7, 0)
    seeds = {stream_seed(7, k) for k in range(100)} | {stream_seed(8, k) for k in range(100)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 for s in seeds)
    assert stream_seed(7, 1, 2) != stream_seed(7, 2, 1)


def test_every_call_of_a_job_gets_its_own_stream():
    """Turn 2 of an episode must not replay turn 1's random numbers, and a job's stream is
    named by the job (its reset seed) and the call, never by its row in the batch."""
    policy = Recorder()
    tasks = envs.make("agent_rl/Records-v0").unwrapped.task_pool(2, seed=0)
    call = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    policy.generate = lambda batch, sampling: (policy.calls.append((len(batch), sampling)) or
                                               [Completion(call, [1], [-0.1]) for _ in batch])
    run_episodes("agent_rl/Records-v0", tasks, policy, Sampling(seed=11), num_envs=2, seed=40,
                 env_kwargs={"max_turns": 3})
    assert [s.seed for _, s in policy.calls] == [11, 11, 11]
    assert [s.streams for _, s in policy.calls] == [((40, 0), (41, 0)), ((40, 1), (41, 1)),
                                                    ((40, 2), (41, 2))]
    assert "streams" not in Sampling(seed=11, streams=((1, 2),)).to_dict()  # not recorded
    with pytest.raises(ValueError, match="names 1 streams for a batch of 2"):
        Sampling(streams=((0,),)).check_batch(2)


class StreamEcho:
    """Answers with a number drawn from each row's own stream (as HFPolicy seeds its rows)."""

    def generate(self, batch, sampling):
        sampling.check_batch(len(batch))
        return [Completion(str(stream_seed(sampling.seed, *sampling.stream(b)) % 97))
                for b in range(len(batch))]


def test_a_jobs_samples_do_not_depend_on_its_batch_or_shard():
    """What one job samples is the same whether it runs with every other job, with 2 envs, or
    in a shard of the jobs given seed + its first global job index (as train.run shards)."""
    tasks = envs.make("agent_rl/Arithmetic-v0").unwrapped.task_pool(4, seed=0)
    sampling = Sampling(seed=3)

    def answers(tasks, num_envs, seed):
        return [(e.episode_id, e.sessions[0].turns[-1].content) for e in
                run_episodes("agent_rl/Arithmetic-v0", tasks, StreamEcho(), sampling,
                             samples_per_task=2, num_envs=num_envs, seed=seed)]

    whole = answers(tasks, 8, seed=100)
    assert len({a for _, a in whole}) > 4  # the jobs really sample differently
    assert answers(tasks, 2, seed=100) == whole
    assert answers(tasks[:1], 8, seed=100) + answers(tasks[1:], 3, seed=102) == whole


def test_split_and_hints_reach_every_episode():
    tasks = envs.make("agent_rl/Arithmetic-v0").unwrapped.task_pool(3, seed=0)
    assert all(t.hint for t in tasks)
    hinted_env = [envs.make("agent_rl/Arithmetic-v0", hints=True)]
    shown = run_episodes(hinted_env, tasks, Recorder())
    assert all(e.hint and e.hint["shown"] for e in shown) and {e.split for e in shown} == {"train"}
    hidden = run_episodes(hinted_env, tasks, Recorder(), split="holdout_iid", hints=False)
    assert not any(e.hint for e in hidden) and {e.split for e in hidden} == {"holdout_iid"}
    assert not any("Hint:" in t.content for e in hidden for t in e.sessions[0].turns)


@pytest.mark.parametrize("tokens, compresses", [(1, False), (1000, True)])
def test_context_budgets_are_counted_with_the_policy_tokenizer(tokens, compresses):
    """With a budget of 100 tokens, the ~4-characters-a-token fallback would compress at once
    (the opening alone is ~610); the policy's own count decides instead."""
    counts = []

    def count(messages):
        counts.append(len(messages))
        return tokens

    task = envs.make("agent_rl/LongRecords-v0").unwrapped.task_pool(1, seed=0)[0]
    call = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    policy = Recorder(count_tokens=count)
    policy.generate = lambda batch, sampling: [Completion(call, [1], [-0.1]) for _ in batch]
    (episode,) = run_episodes("agent_rl/LongRecords-v0", [task], policy,
                              env_kwargs={"max_turns": 3, "context_budget": 100})
    assert counts  # the env asked the policy's counter
    assert any(s.origin == "compression" for s in episode.sessions) == compresses


def test_hints_can_be_decided_per_job():
    """A sequence of bools shows the hint on exactly the jobs it marks (job = task i, sample j ->
    i * samples + j); a task without a hint stays unhinted; a wrong length is refused."""
    tasks = envs.make("agent_rl/Arithmetic-v0").unwrapped.task_pool(3, seed=0)
    tasks[2] = tasks[2].model_copy(update={"hint": None})
    shown = [True, False, False, True, True, True]
    episodes = run_episodes("agent_rl/Arithmetic-v0", tasks, Recorder(), samples_per_task=2,
                            hints=shown)
    assert [e.hint is not None for e in episodes] == [True, False, False, True, False, False]
    for e in episodes:
        prompt = e.sessions[0].turns[1].content
        assert ("Hint:" in prompt) == (e.hint is not None)
        if e.hint:
            task = next(t for t in tasks if t.task_id == e.task_id)
            assert e.hint == {**task.hint, "shown": True}
    with pytest.raises(ValueError, match="hints: 2 values for 6 jobs"):
        run_episodes("agent_rl/Arithmetic-v0", tasks, Recorder(), samples_per_task=2,
                     hints=[True, False])


class _SlowArithmetic(ArithmeticEnv):
    """Arithmetic whose steps wait 50 ms (as a sandboxed run does) and count the counter."""

    concurrent_steps = True
    lock = threading.Lock()
    running = 0
    most = 0
    counting = 0

    def step(self, action):
        cls = type(self)
        with cls.lock:
            cls.running += 1
            cls.most = max(cls.most, cls.running)
        try:
            self.token_counter([{"role": "user", "content": "x"}])
            time.sleep(0.05)
            return super().step(action)
        finally:
            with cls.lock:
                cls.running -= 1


def test_concurrent_steps_overlap_and_give_the_same_episodes():
    """Envs that set concurrent_steps are stepped from threads; the episodes are exactly those
    of stepping one after another, and the shared token counter never runs twice at once."""
    tasks = envs.make("agent_rl/Arithmetic-v0").unwrapped.task_pool(3, seed=0)
    inside = []

    def count(messages):
        inside.append(1)
        assert len(inside) == 1, "the counter ran on two threads at once"
        time.sleep(0.002)
        inside.pop()
        return 5

    def run(workers):
        _SlowArithmetic.most = 0
        policy = StreamEcho()
        policy.count_tokens = count
        episodes = run_episodes([_SlowArithmetic() for _ in range(6)], tasks, policy,
                                Sampling(seed=3), samples_per_task=2, step_workers=workers)
        return [e.to_json() for e in episodes], _SlowArithmetic.most

    one, most_one = run(1)
    many, most_many = run(6)
    assert most_one == 1 and most_many == 6
    assert many == one and len(one) == 6


def test_bad_step_workers_and_a_shared_env_are_refused():
    tasks = envs.make("agent_rl/Arithmetic-v0").unwrapped.task_pool(2, seed=0)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="step_workers must be a positive int or None"):
            run_episodes("agent_rl/Arithmetic-v0", tasks, Recorder(), step_workers=bad)
    env = envs.make("agent_rl/Arithmetic-v0")
    with pytest.raises(ValueError, match="got the same environment twice"):
        run_episodes([env, env], tasks, Recorder())
