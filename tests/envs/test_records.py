"""Records-v0 and LongRecords-v0: solvability, task metadata, determinism, permissions, tool
errors, compression and branching, and Gymnasium's own env checker."""

from __future__ import annotations

import json

import pytest
from gymnasium.utils.env_checker import check_env

import envs
from envs.core import approx_token_count
from envs.records.env import WEIGHTS, LongRecordsEnv, RecordsEnv, records_reward, store_values
from envs.records.world import COLLECTIONS, LONG_STRUCTURES, STRUCTURES
from trajectories import Outcome

ENV_IDS = ["agent_rl/Records-v0", "agent_rl/LongRecords-v0"]


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def finish(env):
    """Drive the scripted solver from the current state to the end; returns the episode."""
    for _ in range(200):
        _, _, terminated, truncated, info = env.step(env.reference_action())
        if terminated or truncated:
            return info["episode"]
    raise AssertionError("the scripted solver did not end the episode")


def solve(env, task, seed: int = 0):
    env.reset(seed=seed, options={"task": task, "episode_id": "x"})
    return finish(env)


def root_chain(episode):
    """The root session and its compression continuations."""
    chain = [episode.tree.root]
    while True:
        nxt = [c for c in episode.tree.children(chain[-1].session_id) if c.origin == "compression"]
        if not nxt:
            return chain
        chain.append(nxt[-1])


# --- the scripted solver proves every task solvable --------------------------------------------


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_scripted_solver_reaches_the_maximum_reward(env_id):
    env = envs.make(env_id).unwrapped
    best = sum(env.reward_weights.values())
    pool = env.task_pool(60, seed=11)
    for seed in range(50):  # tasks drawn by the env's own seeding
        env.reset(seed=seed)
        pool.append(env.task)
    for task in pool:
        episode = solve(env, task)
        assert episode.reward.outcome == Outcome.correct, task.task_id
        assert episode.reward.total == pytest.approx(best), task.task_id
        assert episode.tool_effects == task.target["diff"], task.task_id


def test_long_records_solver_without_branching_or_compression():
    for kwargs in ({"branching": False}, {"context_budget": None}):
        env = LongRecordsEnv(**kwargs)
        for task in env.task_pool(6, seed=4):
            episode = solve(env, task)
            assert episode.reward.outcome == Outcome.correct
            origins = {s.origin for s in episode.sessions}
            assert ("branch" in origins) == env.branching
            assert ("compression" in origins) == (env.context_budget is not None)


# --- tasks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_structure_appears_in_a_60_task_pool(seed):
    short, long = RecordsEnv().task_pool(60, seed), LongRecordsEnv().task_pool(60, seed)
    assert {t.meta.structure for t in short} == set(STRUCTURES)
    assert {t.meta.structure for t in long} == set(LONG_STRUCTURES)
    assert len({t.task_id for t in short + long}) == 120
    for task in short + long:
        steps = [s for block in task.target["solution"] for s in block["steps"]]
        assert task.meta.entity_group in COLLECTIONS
        assert task.meta.length == len(steps)
        writes = sorted({s["arguments"]["id"] for s in steps if s["tool"] == "update"})
        assert task.write_scopes == writes
        assert set(task.target["diff"].get(task.meta.entity_group, {})) == set(writes)
    for task in short:
        assert task.meta.skills == task.meta.structure.split(">")
        assert [s["tool"] for s in task.target["solution"][0]["steps"]] == task.meta.skills
        assert len(task.write_scopes) == ("update" in task.meta.skills)
    for task in long:
        assert 4 <= task.meta.items <= 8 and task.meta.length >= 10
        assert len(task.target["answer"].split(", ")) == task.meta.items


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_same_seed_same_tasks_and_same_episodes(env_id):
    a, b = envs.make(env_id).unwrapped, envs.make(env_id).unwrapped
    pool = a.task_pool(20, seed=5)
    assert [t.model_dump() for t in pool] == [t.model_dump() for t in b.task_pool(20, seed=5)]
    assert a.task_pool(5, seed=5) == pool[:5]  # task i depends only on (seed, i)
    assert [t.prompt for t in a.task_pool(20, seed=6)] != [t.prompt for t in pool]
    for task in pool[:6]:
        ea, eb = solve(a, task, seed=3), solve(b, task, seed=3)
        assert ea.content_hash == eb.content_hash
        assert ea.model_dump() == eb.model_dump()
    a.reset(seed=9)
    b.reset(seed=9)
    assert a.task == b.task


# --- permissions and tool errors ---------------------------------------------------------------


@pytest.mark.parametrize("structure", ["update", "search>get"])
def test_a_write_outside_the_scope_is_a_policy_violation(structure):
    env = RecordsEnv()
    task = next(t for t in env.task_pool(60, seed=0) if t.meta.structure == structure)
    coll = task.meta.entity_group
    other = next(rid for rid in sorted(task.data[coll]) if rid not in task.write_scopes)
    field = {"people": "city", "products": "stock", "orders": "quantity"}[coll]
    env.reset(seed=0, options={"task": task})
    obs, reward, terminated, truncated, _ = env.step(
        call("update", collection=coll, id=other, field=field, value="42"))
    assert obs[-1]["content"].startswith("error: permission denied")
    assert (reward, terminated, truncated) == (0.0, False, False)
    episode = finish(env)  # then the task is solved correctly: still a violation
    assert episode.reward.outcome == Outcome.policy_violation
    assert episode.reward.total == 0.0
    assert episode.reward.audit["violations"][0]["arguments"]["id"] == other
    assert episode.tool_effects == task.target["diff"]  # the refused write changed nothing


@pytest.mark.parametrize("action, message", [
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ('<tool_call>{"name": "delete", "arguments": {}}</tool_call>', "unknown tool"),
    ('<tool_call>{"name": "get", "arguments": {"collection": 3, "id": ["x"]}}</tool_call>',
     "bad arguments for get"),
    ('<tool_call>{"name": "search", "arguments": {"collection": "people"}}</tool_call>',
     "bad arguments for search"),
    (call("get", collection="pets", id="PER-1000"), "unknown collection"),
    (call("get", collection="people", id="PER-0000"), "no record"),
    (call("search", collection="people", field="shoe", value="x"), "unknown field"),
    (call("transform", op="reverse", value="abc"), "unknown op"),
    (call("transform", op="double", value="abc"), "not an integer"),
    (call("transform", op="double", value="9" * 4300), "4300 digits"),  # 4,301 digits doubled
])
def test_bad_calls_give_a_tool_error_and_the_episode_continues(action, message):
    env = RecordsEnv()
    task = env.task_pool(4, seed=1)[3]
    env.reset(seed=0, options={"task": task})
    obs, reward, terminated, truncated, _ = env.step(action)
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert obs[-1]["role"] == "tool" and obs[-1]["content"].startswith("error")
    assert message in obs[-1]["content"]
    episode = finish(env)
    assert episode.reward.outcome == Outcome.correct
    assert episode.reward.audit["tool_errors"] == 1


# --- reward ------------------------------------------------------------------------------------


def test_records_reward():
    change = {"people": {"PER-1000": {"city": {"old": "Lyon", "new": "Graz"}}}}
    assert records_reward("Lyon", "Lyon", {}, {}) == {"answer": 1.0, "state": 1.0}
    assert records_reward("  'lyon'. ", "Lyon", {}, {})["answer"] == 1.0
    assert records_reward("a,b ,  c", "A, B, C", {}, {})["answer"] == 1.0
    assert records_reward("The city is Lyon.", "Lyon", {}, {})["answer"] == 0.5
    assert records_reward("Lyonnais", "Lyon", {}, {})["answer"] == 0.0
    assert records_reward("42", "4", {}, {})["answer"] == 0.0
    assert records_reward("ana.silva", "ana", {}, {})["answer"] == 0.0
    assert records_reward("", "Lyon", {}, {})["answer"] == 0.0
    assert records_reward("Graz", "Graz", change, change)["state"] == 1.0
    assert records_reward("Graz", "Graz", {}, change)["state"] == 0.0  # the write is missing
    assert records_reward("Lyon", "Lyon", change, {})["state"] == 0.0  # read-only task wrote
    assert RecordsEnv.reward_weights == LongRecordsEnv.reward_weights == WEIGHTS
    assert max(WEIGHTS, key=WEIGHTS.get) == "answer"


def test_partial_credit_is_shared_among_the_candidates_a_reply_names():
    store = {"people": {"PER-1000": {"city": "Lyon", "age": 34}, "PER-1001": {"city": "Porto",
                                                                             "age": 12}}}
    values = store_values(store)
    assert values == {"PER-1000", "Lyon", "34", "PER-1001", "Porto", "12"}

    def answer(reply, want="Lyon"):
        return records_reward(reply, want, {}, {}, values)["answer"]

    assert answer("Lyon") == 1.0
    assert answer("The city is Lyon.") == 0.5
    assert answer("PER-1000 lives in Lyon.") == 0.25  # two candidates: the id and the city
    assert answer("Lyon or Porto") == 0.25
    assert answer("Lyon, aged 34 since 1990") == pytest.approx(0.5 / 3)  # other integers count
    assert answer("ages: 34, 12", want="34, 12") == 0.5  # the expected list is one answer
    assert answer("Lyon Porto PER-1000 PER-1001 34 12") == pytest.approx(0.5 / 6)


def test_a_reply_listing_many_candidates_scores_as_a_wrong_one():
    """v0: every store value listed scored 0.65 on read-only get/search tasks; the numbers
    0..999 averaged 0.42. Now both earn what "no idea" earns: the state component."""
    env = RecordsEnv()
    pool = [t for t in env.task_pool(110, seed=0) if t.meta.structure in ("get", "search",
                                                                         "search>get")]
    for listing in (lambda t: ", ".join(sorted(store_values(t.data))),
                    lambda t: " ".join(map(str, range(1000)))):
        for task in pool:
            env.reset(seed=0, options={"task": task})
            _, reward, *_ = env.step(listing(task))
            assert reward == pytest.approx(WEIGHTS["state"], abs=0.02), task.task_id


def test_a_wrong_answer_scores_the_state_only():
    env = RecordsEnv()
    task = next(t for t in env.task_pool(20, seed=0) if t.meta.structure == "search>get")
    env.reset(seed=0, options={"task": task})
    _, reward, terminated, _, info = env.step("no idea")
    assert terminated and info["episode"].reward.outcome == Outcome.wrong
    assert reward == pytest.approx(WEIGHTS["state"])


# --- LongRecords: compression and branching ----------------------------------------------------


def test_long_episodes_compress_and_branch_and_the_summary_carries_the_values():
    env = envs.make("agent_rl/LongRecords-v0").unwrapped
    for task in env.task_pool(12, seed=2):
        episode = solve(env, task)
        origins = [s.origin for s in episode.sessions]
        assert origins.count("compression") >= 1 and origins.count("branch") >= 1
        chain = root_chain(episode)
        assert len(chain) >= 2 and all(s.used_by_final for s in chain)
        assert episode.final_session.session_id == chain[-1].session_id
        branches = [s for s in episode.sessions if s.origin == "branch"]
        assert all(s.used_by_final for s in branches)
        assert branches[0].boundary.returned == task.target["solution"][0]["returns"]
        # The last session sees only the task, the summary and what followed it: every value of
        # the final answer must be in that context.
        seen = "\n".join(t.content for t in episode.final_session.turns if t.role != "assistant")
        for value in task.target["answer"].split(", "):
            assert value in seen


def test_compression_inside_a_sub_agent():
    # Count only the work after the opening, with a tiny budget: every few steps compress,
    # sub-agents included.
    env = LongRecordsEnv(context_budget=100, token_counter=lambda m: approx_token_count(m[2:]),
                         max_sessions=64, max_turns=200)
    for task in env.task_pool(6, seed=0):
        episode = solve(env, task)
        assert episode.reward.outcome == Outcome.correct
        branch = next(s for s in episode.sessions if s.origin == "branch")
        if task.meta.structure != "map(get>transform)":  # a two-step sub-task that fits
            continuation = episode.tree.children(branch.session_id)
            assert [c.origin for c in continuation] == ["compression"]
            assert continuation[0].used_by_final
        assert branch.used_by_final
        assert branch.boundary.returned == task.target["solution"][0]["returns"]


def test_a_branch_whose_value_is_not_used_is_not_used_by_final():
    env = envs.make("agent_rl/LongRecords-v0").unwrapped
    task = env.task_pool(3, seed=0)[0]
    env.reset(seed=0, options={"task": task, "episode_id": "x"})
    while env.in_branch or not any(m.get("name") == "spawn" for m in env.active_messages):
        env.step(env.reference_action())  # the solver's own sub-agent runs and returns
    env.step(call("spawn", task="Reply with the word zanzibar."))
    assert env.in_branch
    env.step("zanzibar")  # the sub-agent's reply; nothing later refers to it
    assert not env.in_branch
    episode = finish(env)
    assert episode.reward.outcome == Outcome.correct
    used, unused = [s for s in episode.sessions if s.origin == "branch"]
    assert used.boundary.returned == task.target["solution"][0]["returns"] and used.used_by_final
    assert unused.boundary.returned == "zanzibar" and unused.used_by_final is False
    assert all(s.used_by_final for s in root_chain(episode))


# --- Gymnasium contract ------------------------------------------------------------------------


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_gymnasium_env_checker(env_id):
    assert env_id in envs.list_envs()
    check_env(envs.make(env_id).unwrapped)
