"""The vectorised episode runner: many environments, one batched policy (Gymnasium's vector-env
idea for text).

``run_episodes`` keeps up to ``num_envs`` environments busy. Each round it gathers the active
session's messages from every environment that is mid-episode, asks the policy for one
completion per environment in a single ``generate`` call, and steps each environment with its
completion. Sessions of one episode follow each other (compression, branch, return happen
inside the env); different episodes interleave. A finished environment is reset with the next
(task, sample) job. RL rollouts and evaluation both use it.

Determinism: job k (task i, sample j, in order) resets with ``seed + k``, so episode ids and
any env randomness repeat for the same inputs. Every policy call of a job has its own random
stream, keyed by the job and the call: the t-th completion of job k is sampled from
``stream_seed(sampling.seed, seed + k, t)`` (``Sampling.streams``), so turn 2 never replays
turn 1's random numbers, and what a job samples does not depend on which other jobs share
its batch, how many environments run, or how the jobs are cut across processes (a caller
that shards jobs passes each shard ``seed`` + its first global job index).

Context budgets. When the policy can count a conversation's prompt tokens
(``policy.count_tokens(messages)``, its chat template), every env with a ``use_token_counter``
method counts its ``context_budget`` with it, in the tokens the policy will really see.

Concurrent steps. An environment class whose steps mostly wait outside the interpreter (a
sandboxed program, a remote service) sets ``concurrent_steps = True``; when every env in the
pool does, a round's steps run on up to ``step_workers`` threads at once. Their results are
taken in the same order as one after another, so the episodes are the same either way. Such an
env must keep its state in its own instance: the token counter is the only thing the runner
shares between them, and it is called under a lock.

Environments that run whole episodes. An environment whose unwrapped instance has a
``run_whole_episodes`` method is not stepped: its episodes are driven by code that is not the
runner's (``agent_rl/Agent-v0``: a user's agent calling the policy through the policy server,
which batches the calls of many agents). ``run_episodes`` hands it the whole batch, once: the
same tasks, policy, sampling, ``samples_per_task``, ``seed``, ``group_prefix`` and ``split``,
and the pool size (``num_envs``, or the envs given) as the number of episodes run at once. It
returns the episodes in job order, ids and seeds as named here (job k seeded ``seed + k``, its
t-th policy call sampled from the stream ``(seed + k, t)``). ``hints`` do not apply (its tasks
carry none), ``step_workers`` neither, and ``on_round`` is called once, when all are done.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import gymnasium
import numpy as np

from envs.core import TaskSpec
from envs.registry import make
from trajectories import Episode


def stream_seed(seed: int, *keys: int) -> int:
    """A reproducible seed in [0, 2**63) for the random stream named by ``(seed, *keys)``:
    different keys give independent streams (numpy's ``SeedSequence`` hashing)."""
    words = [int(k) & (2**64 - 1) for k in (seed, *keys)]
    hi, lo = np.random.SeedSequence(words).generate_state(2, dtype=np.uint32)
    return (int(hi) << 31) ^ int(lo)


@dataclass(frozen=True)
class Sampling:
    """How the policy samples. ``temperature=0`` means greedy. ``max_prompt_tokens``: a
    conversation whose prompt is longer is not generated for (finish reason
    ``prompt_too_long``); None: no limit."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int | None = None
    max_prompt_tokens: int | None = None
    # the random stream of each conversation of a batch, as keys under ``seed`` (None: its
    # index in the batch); the runner sets one per call of a job. Not part of the record.
    streams: tuple[tuple[int, ...], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["streams"]
        return out

    def stream(self, row: int) -> tuple[int, ...]:
        """The keys of row ``row``'s random stream: ``stream_seed(seed, *keys)`` seeds it."""
        return (row,) if self.streams is None else self.streams[row]

    def check_batch(self, n: int) -> None:
        """``streams``, when given, names exactly one stream per conversation of the batch."""
        if self.streams is not None and len(self.streams) != n:
            raise ValueError(f"sampling.streams names {len(self.streams)} streams for a batch "
                             f"of {n} conversations")


@dataclass(frozen=True)
class Completion:
    """One sampled reply: text, the sampled token ids, their log-probs, why it stopped, the
    revision (number of optimizer steps) of the weights that sampled it, and the prompt ids it
    was sampled after (empty where the policy does not report them: an OpenAI-compatible
    endpoint, a scripted policy)."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"  # stop | length | prompt_too_long
    prompt_tokens: int = 0
    policy_revision: int | None = None
    prompt_ids: list[int] = field(default_factory=list)

    def action(self) -> dict[str, Any]:
        """The env action carrying the generated tokens into the episode record (and the
        prompt's length, which a ``prompt_too_long`` episode records)."""
        return {"text": self.text, "token_ids": list(self.token_ids) or None,
                "logprobs": list(self.logprobs) or None, "finish_reason": self.finish_reason,
                "policy_revision": self.policy_revision, "prompt_tokens": self.prompt_tokens}


@runtime_checkable
class Policy(Protocol):
    """Anything that can continue a batch of conversations."""

    def generate(self, batch: Sequence[list[dict[str, Any]]], sampling: Sampling) -> list[Completion]: ...


@dataclass
class _Slot:
    env: gymnasium.Env
    obs: list[dict[str, Any]] | None = None
    job: int | None = None
    calls: int = 0  # policy calls made for this job so far


def run_episodes(
    envs: str | Sequence[gymnasium.Env],
    tasks: Sequence[TaskSpec],
    policy: Policy,
    sampling: Sampling | None = None,
    samples_per_task: int = 1,
    num_envs: int = 16,
    seed: int = 0,
    env_kwargs: dict[str, Any] | None = None,
    group_prefix: str = "",
    on_round: Callable[[int, int], None] | None = None,
    split: str | None = None,
    hints: bool | Sequence[bool] | None = None,
    step_workers: int | None = None,
) -> list[Episode]:
    """Run every task ``samples_per_task`` times; returns episodes in job order.

    ``envs`` is an env id (``num_envs`` copies are made with ``env_kwargs``) or ready envs.
    Episodes of one task share ``group_id`` (``group_prefix + task_id``); ``sample_id`` is
    the sample index. ``split`` is recorded on every episode (None: the env's own);
    ``hints`` shows or hides task hints whatever the envs were built with (None: as built); a
    sequence decides per job, one bool per (task, sample) job in job order (a job whose task
    has no hint is unhinted either way).
    ``on_round(done, total)`` is called after every policy round. ``step_workers``: threads
    that step a round's envs when all of them set ``concurrent_steps`` (None: the CPU cores + 4,
    as for other work that mostly waits; 1: one after another).
    """
    sampling = sampling or Sampling()
    jobs = [(task, j) for task in tasks for j in range(samples_per_task)]
    if not jobs:
        return []
    if hints is not None and not isinstance(hints, bool) and len(hints) != len(jobs):
        raise ValueError(f"hints: {len(hints)} values for {len(jobs)} jobs ({len(tasks)} tasks x "
                         f"{samples_per_task} samples); give one per job, or one bool for all")
    if isinstance(envs, str):
        pool = [make(envs, **(env_kwargs or {}))]
        size = min(num_envs, len(jobs))
        if not hasattr(pool[0].unwrapped, "run_whole_episodes"):  # one env per slot
            pool += [make(envs, **(env_kwargs or {})) for _ in range(size - 1)]
    else:
        pool = list(envs)
        if not pool:
            raise ValueError("run_episodes needs at least one environment")
        size = len(pool)
    whole = getattr(pool[0].unwrapped, "run_whole_episodes", None)
    if whole is not None:  # the env runs its episodes itself (module docstring)
        episodes = whole(tasks, policy, sampling, samples_per_task=samples_per_task, seed=seed,
                         group_prefix=group_prefix, split=split, concurrency=size)
        if on_round is not None:
            on_round(len(episodes), len(jobs))
        return episodes
    if step_workers is not None and (isinstance(step_workers, bool) or not isinstance(step_workers, int)
                                     or step_workers < 1):
        raise ValueError(f"step_workers must be a positive int or None, got {step_workers!r}")
    workers = min(step_workers or (os.cpu_count() or 1) + 4, len(pool))
    if not all(getattr(env.unwrapped, "concurrent_steps", False) for env in pool):
        workers = 1
    if len({id(env.unwrapped) for env in pool}) < len(pool):
        raise ValueError("run_episodes got the same environment twice: give one instance per slot")
    count_tokens = getattr(policy, "count_tokens", None)
    if count_tokens is not None:
        lock = threading.Lock()

        def counted(messages: Sequence[dict[str, Any]]) -> int:
            with lock:
                return count_tokens(messages)

        for env in pool:
            use = getattr(env.unwrapped, "use_token_counter", None)
            if use is not None:
                use(counted if workers > 1 else count_tokens)
    slots = [_Slot(env) for env in pool]
    results: list[Episode | None] = [None] * len(jobs)
    next_job = 0

    def start(slot: _Slot) -> None:
        nonlocal next_job
        if next_job >= len(jobs):
            slot.obs, slot.job = None, None
            return
        task, sample = jobs[next_job]
        options = {"task": task, "group_id": group_prefix + task.task_id, "sample_id": sample,
                   "episode_id": f"{group_prefix}{task.task_id}#{sample}@{seed + next_job}",
                   "generation": sampling.to_dict()}
        if split is not None:
            options["split"] = split
        if hints is not None:
            options["hints"] = hints if isinstance(hints, bool) else bool(hints[next_job])
        slot.obs, _ = slot.env.reset(seed=seed + next_job, options=options)
        slot.job, slot.calls = next_job, 0
        next_job += 1

    for slot in slots:
        start(slot)
    done = 0
    threads = ThreadPoolExecutor(workers, thread_name_prefix="env-step") if workers > 1 else None
    try:
        while any(slot.job is not None for slot in slots):
            active = [slot for slot in slots if slot.job is not None]
            streams = tuple((seed + slot.job, slot.calls) for slot in active)
            completions = policy.generate([slot.obs for slot in active],
                                          replace(sampling, streams=streams))
            for slot in active:
                slot.calls += 1
            if len(completions) != len(active):
                raise RuntimeError(f"policy returned {len(completions)} completions for "
                                   f"{len(active)} conversations")
            moves = [(slot.env, c.action()) for slot, c in zip(active, completions, strict=True)]
            if threads is None:
                outcomes = [env.step(action) for env, action in moves]
            else:  # in slot order, as above: the same episodes
                outcomes = list(threads.map(lambda move: move[0].step(move[1]), moves))
            for slot, (obs, _, terminated, truncated, info) in zip(active, outcomes, strict=True):
                if terminated or truncated:
                    results[slot.job] = info["episode"]
                    done += 1
                    start(slot)
                else:
                    slot.obs = obs
            if on_round is not None:
                on_round(done, len(jobs))
    finally:
        if threads is not None:
            threads.shutdown(cancel_futures=True)
    return [episode for episode in results if episode is not None]
