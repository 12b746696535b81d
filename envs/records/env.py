"""Records-v0 and LongRecords-v0: a tool agent over a small in-memory record store.

The world and the task generator live in ``envs.records.world``; this module holds the tools,
the reward (``records_reward``, a pure function reused by evaluation) and the scripted solver
(``reference_action``, built from the pure helpers ``solver_plan``, ``solver_progress`` and
``solver_summary`` at the end of the file).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable
from itertools import groupby
from typing import Any

from envs.core import PermissionDenied, TaskSpec, ToolEnv, ToolError, tool
from envs.records.world import (
    SCHEMA,
    apply_transform,
    coerce,
    long_records_task_pool,
    records_task_pool,
    store_diff,
)
from envs.sessions import content_tokens, used_by_data_flow, words
from trajectories import Episode, Outcome, RewardBreakdown, Session

WEIGHTS = {"answer": 0.7, "state": 0.3}

# ---------------------------------------------------------------------------------------------
# Reward
# ---------------------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """Lower case, single spaces, ', ' between list items, no surrounding quotes or full stop."""
    text = " ".join(text.split()).lower()
    text = re.sub(r"\s*,\s*", ", ", text)
    return text.strip(" .'\"`")


_BEFORE, _AFTER = r"(?<![\w@.-])", r"(?![\w@-]|\.\w)"  # not inside a word, id, email, number
_INTEGER = re.compile(rf"{_BEFORE}\d+{_AFTER}")


def _whole(value: str) -> re.Pattern:
    """``value`` as a whole token sequence of a normalised reply."""
    return re.compile(_BEFORE + re.escape(value) + _AFTER)


def records_reward(answer: str | None, expected_answer: str, diff: dict[str, Any],
                   expected_diff: dict[str, Any],
                   candidates: Iterable[str] = ()) -> dict[str, float]:
    """The two reward components (also used by evaluation).

    ``answer``: 1 when the normalised reply equals the expected answer; when the expected
    answer appears as a whole token sequence inside a longer reply, ``0.5 / n``, where ``n``
    counts the distinct candidate answers the reply names: the expected one, plus every other
    integer and every other value of ``candidates`` (the task's record ids and field values,
    ``store_values``) outside it; else 0. A reply that lists many values is not an answer.
    ``state``: 1 when the store diff equals the expected diff (read-only tasks: no write).
    """
    got, want = normalize_answer(answer or ""), normalize_answer(expected_answer)
    if got == want:
        score = 1.0
    elif want and (want_pattern := _whole(want)).search(got):
        rest = want_pattern.sub(" ", got)  # what the reply says besides the expected answer
        others = {c for c in map(normalize_answer, candidates)
                  if c and c != want and c in rest and _whole(c).search(rest)}
        score = 0.5 / (1 + len(others | set(_INTEGER.findall(rest))))
    else:
        score = 0.0
    return {"answer": score, "state": float(diff == expected_diff)}


def store_values(store: dict[str, dict[str, dict[str, Any]]]) -> set[str]:
    """Every record id and field value of a store, as text: the candidate answers it holds."""
    return {str(v) for records in store.values() for rid, record in records.items()
            for v in (rid, *record.values())}


def record_facts(task: TaskSpec) -> set[str]:
    """The words of every record id and field value in the task's store and of its expected
    answer: what a value found in this world can consist of."""
    texts = [task.target["answer"]]
    for records in task.data.values():
        for rid, record in records.items():
            texts += [rid, *map(str, record.values())]
    return words(" ".join(texts))


# ---------------------------------------------------------------------------------------------
# The environments
# ---------------------------------------------------------------------------------------------

_FIELDS = "; ".join(f"{coll} ({', '.join(spec['fields'])})" for coll, spec in SCHEMA.items())


class RecordsEnv(ToolEnv):
    """Records-v0: search, read, transform and update records, alone or chained.

    Description
        Each task has its own store of ``people``, ``products`` and ``orders`` (ids
        ``PER-####``, ``PRD-####``, ``ORD-####``). Atomic tasks use one skill (``search``,
        ``get``, ``transform``, ``update``); composed tasks chain 2-4 of them: ``search>get``,
        ``get>transform``, ``search>update``, ``search>get>transform``,
        ``search>transform>update``, ``get>transform>update``, ``search>get>transform>update``
        (e.g. "apply 'double' to the stock of the product whose sku is 'KX-4821' and write the
        result back"). ``TaskMeta`` carries skills, structure, entity_group (the collection),
        length (tool steps a correct agent needs) and difficulty (number of skills).

    Tools
        ``search(collection, field, value)`` -> the matching ids (case-insensitive equality);
        ``get(collection, id)`` -> the record as JSON; ``transform(op, value)`` with ops
        upper, lower, title, strip_domain, increment, double; ``update(collection, id, field,
        value)``, a write tool: an id outside ``task.write_scopes`` (the target id for update
        tasks, none for read-only tasks) is refused with ``PermissionDenied``. Unknown
        collections, ids, fields or ops come back as tool errors.

    Observation
        The active session's messages: system (instructions and tool schemas), the task, then
        assistant turns and tool results.

    Reward
        ``records_reward``: ``answer`` (normalised exact match of the final reply: 1; the
        expected value inside a longer reply: 0.5 divided by the number of distinct candidate
        answers the reply names, the expected one, other integers and other record ids or
        field values of the task's store; else 0) with weight 0.7, and ``state`` (the final
        store diff equals the expected diff, empty for read-only tasks: 1 or 0) with weight
        0.3. The answer is scored as a single value: listing the store (or the numbers 0-999)
        earns ~0 for ``answer``, as much as a wrong reply. Outcome ``correct`` when both are
        1, else ``wrong``. A refused write ends the episode ``policy_violation`` with reward 0
        and the violation in ``reward.audit``.
        ``Episode.tool_effects`` is the store diff ``{collection: {id: {field: {old, new}}}}``.

    Episode end
        The first reply without a tool call is the final answer. Truncated after ``max_turns``
        (24) assistant turns.

    Version history
        v0: first release.
        v1 (same id): partial ``answer`` credit is divided by the candidates the reply names;
        in v0 a reply listing every store value scored 0.65 on read-only tasks.
    """

    env_id = "agent_rl/Records-v0"
    version = 1
    instructions = (
        f"You work on a record store with three collections: {_FIELDS}. Every record has an "
        "id. Use the tools to solve the task, one step at a time, and only update records the "
        "task asks you to change. When you are done, reply with the final answer as plain text, "
        "without a tool call."
    )
    reward_weights = WEIGHTS

    # --- hooks ---------------------------------------------------------------------------
    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        return records_task_pool(n, seed)

    def new_state(self, task: TaskSpec) -> dict[str, Any]:
        target = task.target
        if not (isinstance(target, dict) and isinstance(target.get("answer"), str)
                and isinstance(target.get("diff"), dict)):
            raise ValueError(f"Records task {task.task_id!r} has no valid target (got "
                             f"{str(target)[:80]}): it needs a dict with 'answer' (str) and "
                             "'diff' (the expected store diff), and 'solution' for the solver")
        return copy.deepcopy(task.data)

    def score(self, task: TaskSpec, answer: str, state: dict[str, Any]) -> RewardBreakdown:
        components = records_reward(answer, task.target["answer"], store_diff(task.data, state),
                                    task.target["diff"], store_values(task.data))
        outcome = Outcome.correct if min(components.values()) == 1.0 else Outcome.wrong
        return RewardBreakdown.from_components(components, dict(WEIGHTS), outcome,
                                               f"{self.env_id}@{self.version}")

    def tool_effects(self, task: TaskSpec, state: dict[str, Any]) -> dict[str, Any]:
        return store_diff(task.data, state)

    def session_used(self, session: Session, episode: Episode) -> bool | None:
        """Data flow (``envs.sessions``) with task knowledge: what a sub-agent's returned value
        carries is only the record ids and values of this task's store (and the values the
        expected answer derives from them), so "I found the record" carries nothing."""
        facts = record_facts(self.task)
        return used_by_data_flow(episode, self.parser.parse,
                                 lambda text: content_tokens(text) & facts)[session.session_id]

    # --- tools ---------------------------------------------------------------------------
    @tool
    def search(self, collection: str, field: str, value: str) -> list[str]:
        """Ids of the records in `collection` whose `field` equals `value` (case-insensitive)."""
        records = self._collection(collection)
        self._check_field(collection, field)
        want = value.strip().lower()
        return sorted(rid for rid, rec in records.items() if str(rec[field]).lower() == want)

    @tool
    def get(self, collection: str, id: str) -> dict[str, Any]:
        """The record `id` of `collection`, as JSON."""
        return {"id": id, **self._record(collection, id)}

    @tool
    def transform(self, op: str, value: str) -> str:
        """Apply `op` to `value`. Ops: upper, lower, title, strip_domain, increment, double."""
        try:
            return apply_transform(op, value)
        except ValueError as exc:
            raise ToolError(str(exc)) from None

    @tool(writes=True)
    def update(self, collection: str, id: str, field: str, value: str) -> dict[str, Any]:
        """Set `field` of record `id` in `collection` to `value` (only ids the task allows)."""
        scopes = self.task.write_scopes
        if scopes is not None and id not in scopes:
            raise PermissionDenied(f"this task may not write {collection}/{id}")
        record = self._record(collection, id)
        self._check_field(collection, field)
        try:
            new = coerce(collection, field, value)
        except ValueError as exc:
            raise ToolError(f"{field} holds integers: {exc}") from None
        old, record[field] = record[field], new
        return {"id": id, "field": field, "old": old, "new": new}

    def _collection(self, collection: str) -> dict[str, dict[str, Any]]:
        if collection not in self.state:
            raise ToolError(f"unknown collection {collection!r}; collections: {sorted(self.state)}")
        return self.state[collection]

    def _record(self, collection: str, id: str) -> dict[str, Any]:
        records = self._collection(collection)
        if id not in records:
            raise ToolError(f"no record {id!r} in {collection}")
        return records[id]

    def _check_field(self, collection: str, field: str) -> None:
        if field not in SCHEMA[collection]["fields"]:
            raise ToolError(f"unknown field {field!r} of {collection}; fields: "
                            f"{list(SCHEMA[collection]['fields'])}")

    # --- scripted solver -----------------------------------------------------------------
    def reference_action(self) -> str | None:
        """The next action of the solution in ``task.target``, worked through the real tools.

        Where it is comes from the active session: the progress line of its own summary (after a
        compression) plus the successful tool results since. With ``branching``, blocks marked
        delegable go to a sub-agent via ``spawn``; inside a branch it solves its sub-task.
        """
        if self.task is None:
            return None
        messages = self.active_messages
        steps, answer = solver_plan(self.task, self.branching,
                                    messages[1]["content"] if self.in_branch else None)
        done, notes = solver_progress(messages, steps)
        if self.awaiting_summary:
            return solver_summary(done, steps, notes)
        if done < len(steps):
            step = steps[done]
            call = {"name": step["tool"], "arguments": step["arguments"]}
            return f"<tool_call>{json.dumps(call)}</tool_call>"
        return answer


class LongRecordsEnv(RecordsEnv):
    """LongRecords-v0: a Records chain repeated over K entities, too long for one context.

    Description
        The same world and tools as Records-v0. A task repeats a chain over K entities and
        asks for the per-entity results joined by commas, in order: ``map(search>get)`` and
        ``map(get>transform)`` (K = 5-8) and ``map(search>get>transform>update)`` (K = 4-6,
        K writes). ``TaskMeta.items`` is K; ``length`` is K times the chain length (10-24).
        The default ``context_budget`` (1100 tokens by ``approx_token_count``; the opening
        system message with the tool schemas alone is ~610) makes a correct agent compress at
        least once; with ``branching=True`` (the default) it may ``spawn`` sub-agents. The
        first entity of every task is phrased as a self-contained sub-task the scripted solver
        delegates; its returned value reaches the final answer (``used_by_final``).

    Tools
        Those of Records-v0, plus ``spawn(task)`` at the top level and ``return(value)`` in a
        sub-agent.

    Observation
        The active session's messages. After a compression: system, the task plus the summary,
        and what followed; in a sub-agent: system and the sub-task.

    Reward
        As Records-v0 (``records_reward``, answer 0.7 + state 0.3; a reply naming several
        candidate values earns only a share of the partial credit).

    Episode end
        The first top-level reply without a tool call. Truncated after ``max_turns`` (64)
        assistant turns or ``max_sessions`` (16) sessions. The scripted solver needs at most
        30 turns and 3-5 sessions (root, 1-3 compressions, one branch).

    Version history
        v0: first release.
        v1 (same id): the answer scoring of Records-v0 v1.
    """

    env_id = "agent_rl/LongRecords-v0"
    instructions = RecordsEnv.instructions + (
        " The task is long: when your context fills up you will be asked for a summary and "
        "continue from it, so keep every value you found in it. You can hand a sub-task to a "
        "sub-agent with spawn."
    )

    def __init__(self, context_budget: int | None = 1100, branching: bool = True,
                 max_turns: int = 64, **kwargs: Any):
        super().__init__(context_budget=context_budget, branching=branching,
                         max_turns=max_turns, **kwargs)

    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        return long_records_task_pool(n, seed)


# ---------------------------------------------------------------------------------------------
# The scripted solver's pieces (pure functions of the task and the active messages)
# ---------------------------------------------------------------------------------------------

_PROGRESS = re.compile(r"^Steps done: (\d+) of \d+\.$", re.MULTILINE)
_NOTE = re.compile(r"^- \[item (\d+)\] (.+)$", re.MULTILINE)


def solver_plan(task: TaskSpec, branching: bool,
                branch_prompt: str | None = None) -> tuple[list[dict[str, Any]], str]:
    """(steps, final reply) for the root agent, or for the sub-agent whose prompt is given."""
    blocks = task.target["solution"]
    if branch_prompt is not None:
        block = next((b for b in blocks
                      if b["delegate"] and branch_prompt.startswith(b["delegate"])), None)
        if block is None:  # not a sub-task of this solution
            return [], "unknown sub-task"
        return [dict(s, item=block["item"]) for s in block["steps"]], block["returns"]
    steps: list[dict[str, Any]] = []
    for block in blocks:
        if branching and block["delegate"]:
            steps.append({"tool": "spawn", "arguments": {"task": block["delegate"]},
                          "item": block["item"]})
        else:
            steps += [dict(s, item=block["item"]) for s in block["steps"]]
    return steps, task.target["answer"]


def solver_progress(messages: list[dict[str, Any]],
                    steps: list[dict[str, Any]]) -> tuple[int, list[tuple[int, str]]]:
    """Steps completed so far and the notes on them, read from the active session.

    The opening prompt carries the previous summary (progress line + notes); each later tool
    result of the expected tool that is not an error completes the next step.
    """
    prompt = messages[1]["content"]
    done, notes = 0, []
    match = _PROGRESS.search(prompt)
    if match:
        done = int(match.group(1))
        notes = [(int(item) - 1, text) for item, text in _NOTE.findall(prompt[match.end():])]
    for msg in messages[2:]:
        if msg["role"] != "tool" or done >= len(steps):
            continue
        if msg.get("name") == steps[done]["tool"] and not msg["content"].startswith("error"):
            notes.append((steps[done]["item"], _note(steps[done], msg["content"])))
            done += 1
    return done, notes


def solver_summary(done: int, steps: list[dict[str, Any]], notes: list[tuple[int, str]]) -> str:
    """A faithful summary: progress, the values found (the last per finished item), next step."""
    current = steps[done]["item"] if done < len(steps) else None
    kept: list[tuple[int, str]] = []
    for item, group in groupby(notes, key=lambda note: note[0]):
        group = list(group)
        kept += group if item == current else group[-1:]
    lines = [f"Steps done: {done} of {len(steps)}.", "Found so far:"]
    lines += [f"- [item {item + 1}] {text}" for item, text in kept] or ["- nothing yet"]
    if done < len(steps):
        step = steps[done]
        lines.append(f"Next: {step['tool']} {json.dumps(step['arguments'])}")
    else:
        lines.append("Next: reply with the final answer.")
    return "\n".join(lines)


def _note(step: dict[str, Any], result: str) -> str:
    """One line on what a completed step found, from its real tool result."""
    args = step["arguments"]
    if step["tool"] == "search":
        ids = json.loads(result)
        return f"{args['collection']} whose {args['field']} is '{args['value']}': " \
               f"{', '.join(ids) or 'none'}"
    if step["tool"] == "get":
        return f"{args['id']} {step['field']}: {json.loads(result).get(step['field'])}"
    if step["tool"] == "transform":
        return f"{args['op']}('{args['value']}') = {result}"
    if step["tool"] == "update":
        return f"{args['id']} {args['field']} set to {args['value']}"
    return f"sub-agent result: {result}"


__all__ = ["WEIGHTS", "LongRecordsEnv", "RecordsEnv", "normalize_answer", "record_facts",
           "records_reward", "solver_plan", "solver_progress", "solver_summary",
           "store_values"]
