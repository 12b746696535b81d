"""Relay-v0: facts must cross a compression boundary to be used.

Description
    The root session shows 3-5 short facts, one per line: the ones the question needs and
    distractors, in a random order. The context then overflows (a session that shows facts
    is over budget by construction) and the env asks at once for a note: "Copy the line that
    starts with "The red box has code"." A fresh session opens that sees only the note and the
    question; its reply is the answer. With two compressions (``meta.length == 3``) the first
    note keeps the fact(s) of the first half, the next session shows that note plus the rest
    of the facts and asks for a second note naming every needed fact; a third session answers
    from it. Notes are cut to ``note_words`` words when they cross.

    Compositions (``meta.structure``) of three skills: ``recall`` (one fact's number),
    ``recall>combine`` (two facts: their sum, or the larger), ``recall>transform`` (one fact's
    number plus 1, or times 2) and ``recall>combine>transform`` (the sum plus 1, or twice the
    larger). Entity groups (``meta.entity_group``): ``boxes`` ("The red box has code 47."),
    ``people`` ("Anna is 34 years old.") and ``cities`` ("The city of Varn has 52 museums.";
    invented names, so no world knowledge helps). ``meta.length`` is the number of sessions
    a correct agent needs (2 or 3), ``meta.facts`` the facts shown and ``meta.position`` where
    the (first) needed fact stands among them.

    Every session opens with one worked example of its own kind (other entities, the same
    request or the same operation), shown as a user turn and an assistant reply: SmolLM2-135M
    answers with a bare number after one (1.0 greedy on perfect notes) and almost never without
    (docs/concepts.md, "Relay-v0"). The examples are prompt, never trained on.

Tools
    None by default. With ``branching=True`` there is no compression: the root sees every
    fact at once and is asked to ``spawn`` a sub-agent with a task that copies the needed
    lines and asks the question (one worked example call shown); the sub-agent sees only that
    task and answers, its reply returns to the root as the tool result, and the root's next
    reply is the answer. The embedded model makes a valid spawn call on 60% of these tasks
    greedy, 56% at T=0.7 (``benchmarks/spawn_rate.py``; 0% on LongRecords-v0's first turn).

    With ``optional=True`` as well (it needs ``branching``) sessions are optional: the root sees
    every fact and is asked to spawn a sub-agent with a task that copies "the line it needs"
    and the question, the line not named, so picking it is the root's work (the worked example
    spawns one with the needed line). Nothing requires the spawn: a root that answers at once
    is scored the same, and after each result it may answer or spawn again, as many as
    ``max_sessions - 1`` sub-agents, each seeing only the task the root wrote. A sub-agent
    asked about a distractor line is useless; one whose wrong number the root answers with is
    harmful. A sub-agent opens with
    that example's sub-task answered by a bare number (``branch_examples``), and after each
    sub-agent's result the root is asked "The sub-agent answered: N\nAnswer with just the
    number, or spawn another sub-agent." (``return_request``), as its worked example shows in a
    second turn; without these the base model answered sub-tasks with "1" or prose and spawned
    again.

Observation
    The active session's messages. Root: ``[system, user: example facts + request, assistant:
    example note, user: facts + request]``; answering session: ``[system, user: example note +
    question, assistant: example answer, user: "Your note: ..." + question]``.

Reward
    ``relay_reward`` (a pure function, reused by evaluation): ``answer`` (weight 0.6) the
    last number of the reply is the expected value; ``format`` (0.1) the reply is a bare
    number; ``relayed`` (0.3) what crossed the last boundary: the share of the needed numbers
    in the note the answering session saw, times the share of that note's numbers that were
    needed (copying every fact does not pay). With ``branching`` the note is the last
    sub-agent's task without the question (whose "plus 1" is no fact). A right bare number
    after a clean note: 1.0. With ``optional`` no note is required: ``answer`` (0.9) and
    ``format`` (0.1) only (``OPTIONAL_WEIGHTS``), whatever the sub-agents were asked.

Episode end
    The answering session's first reply. Truncated after ``max_turns`` (8) assistant turns.

Usage (``session_used``)
    A note-writing session is used when what crossed from it kept every needed number it had
    seen; the answering session when it answered. With ``branching`` (and ``optional``) by data
    flow (``envs.sessions.used_by_data_flow``): a sub-agent is used when a word or number it
    returned is in the root's final answer (or a later spawn task of the root).

Version history
    v0: first release.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from envs.core import TaskMeta, TaskSpec, ToolEnv
from envs.scoring import answer_breakdown
from trajectories import Episode, RewardBreakdown, Session

WEIGHTS = {"answer": 0.6, "format": 0.1, "relayed": 0.3}
OPTIONAL_WEIGHTS = {"answer": 0.9, "format": 0.1}  # sessions optional: no note is required
_NUMBER = re.compile(r"(?<!\d)-?\d{1,18}(?!\d)")  # longer digit runs are not numbers here


def numbers(text: str) -> list[int]:
    """The integers written in ``text``, in order."""
    return [int(n) for n in _NUMBER.findall(text)]


INSTRUCTIONS = ("You are a careful assistant. When asked for a note, copy the needed facts "
                "exactly, numbers included. When asked a question, reply with only the final "
                "number.")
ANSWER_REQUEST = "Answer with just the number."
AFTER_RESULT_REQUEST = "Answer with just the number, or spawn another sub-agent."


def result_request(value: str) -> str:
    """What a root with optional sessions is asked after a sub-agent answered ``value``."""
    return f"The sub-agent answered: {value}\n{AFTER_RESULT_REQUEST}"

FAMILIES: dict[str, dict[str, Any]] = {
    "boxes": {"fact": "The {s} box has code {n}.", "noun": "the code of the {s} box",
              "subjects": ("red", "blue", "green", "yellow", "black", "white", "orange",
                           "purple", "brown", "pink"),
              "example": ("gray", "gold", "silver")},
    "people": {"fact": "{s} is {n} years old.", "noun": "the age of {s}",
               "subjects": ("Anna", "Ben", "Carla", "David", "Elena", "Felix", "Greta",
                            "Hugo", "Ines", "Jonas"),
               "example": ("Zara", "Omar", "Lena")},
    "cities": {"fact": "The city of {s} has {n} museums.", "noun": "the number of museums in {s}",
               "subjects": ("Varn", "Tolm", "Kesh", "Orro", "Pell", "Drim", "Asto", "Belk",
                            "Cind", "Ulme"),
               "example": ("Quill", "Yarrow", "Brisk")},
}
EXAMPLE_NUMBERS = (25, 61, 83)

# operation -> (question template over the needed nouns a, b; value from the numbers)
OPERATIONS: dict[str, tuple[str, Any]] = {
    "id": ("What is {a}?", lambda x: x[0]),
    "sum": ("What is {a} plus {b}?", lambda x: x[0] + x[1]),
    "max": ("Which is larger: {a} or {b}? Give the larger number.", max),
    "plus1": ("What is {a} plus 1?", lambda x: x[0] + 1),
    "double": ("What is {a} times 2?", lambda x: 2 * x[0]),
    "sum_plus1": ("What is {a} plus {b}, plus 1?", lambda x: x[0] + x[1] + 1),
    "max_double": ("Which is larger: {a} or {b}? Give the larger number times 2.",
                   lambda x: 2 * max(x)),
}
STRUCTURES = {"recall": ("id",), "recall>combine": ("sum", "max"),
              "recall>transform": ("plus1", "double"),
              "recall>combine>transform": ("sum_plus1", "max_double")}
# numbers 12-98 whose digits differ and whose last digit is not 0 (easy to copy, no look-alikes)
NUMBERS = tuple(n for n in range(12, 99) if n % 10 and n // 10 != n % 10)


def answer_reward(reply: str, target: int) -> dict[str, float]:
    """``answer``: the last number of ``reply`` is ``target``; ``format``: a bare number."""
    said = numbers(reply)
    return {"answer": float(bool(said) and said[-1] == target),
            "format": float(re.fullmatch(r"\s*-?\d+\s*\.?\s*", reply) is not None)}


def relay_reward(reply: str, target: int, needed: list[int], note: str) -> dict[str, float]:
    """The three reward components of a final reply (also used by evaluation); ``note`` is
    what the answering session saw of the last note."""
    carried = set(numbers(note))
    kept = len(set(needed) & carried) / len(needed)
    clean = min(1.0, len(set(needed)) / len(carried)) if carried else 0.0
    return {**answer_reward(reply, target), "relayed": kept * clean}


def _head(fact: str) -> str:
    """What a fact line starts with before its number: "The red box has code"."""
    return fact[: _NUMBER.search(fact).start()].strip()


def note_request(facts: list[str]) -> str:
    heads = " and ".join(f'"{_head(f)}"' for f in facts)
    return (f"Copy the line that starts with {heads}." if len(facts) == 1 else
            f"Copy the lines that start with {heads}.")


def delegate_request(facts: list[str], asked: str) -> str:
    """What a branching root is asked: hand the needed lines and the question to a sub-agent."""
    heads = " and ".join(f'"{_head(f)}"' for f in facts)
    lines = "line that starts" if len(facts) == 1 else "lines that start"
    return (f"Use the spawn tool to start a sub-agent with a task that copies the {lines} with "
            f"{heads} and asks: {asked} Reply with only the tool call.")


def optional_request(asked: str) -> str:
    """What a root with optional sessions is asked: delegate the question with the line it
    needs, which the root picks itself (no line is named; a direct answer scores as well)."""
    return (f"Use the spawn tool to start a sub-agent with a task that copies the line it needs "
            f"and asks: {asked} Reply with only the tool call.")


def spawn_task(lines: str, asked: str) -> str:
    """A sub-agent's task: ``lines`` and the question."""
    return f"{lines} {asked} {ANSWER_REQUEST}"


def spawn_call(lines: str, asked: str) -> str:
    """The tool call that hands ``lines`` and the question to a sub-agent."""
    task = spawn_task(lines, asked)
    return f'<tool_call>{json.dumps({"name": "spawn", "arguments": {"task": task}})}</tool_call>'


def question(op: str, nouns: list[str]) -> str:
    return OPERATIONS[op][0].format(a=nouns[0], b=nouns[-1])


class RelayEnv(ToolEnv):
    env_id = "agent_rl/Relay-v0"
    version = 0
    instructions = INSTRUCTIONS
    reward_weights = WEIGHTS

    def __init__(self, note_words: int = 40, max_turns: int = 8, max_facts: int = 5,
                 optional: bool = False, **kwargs: Any):
        if optional and not kwargs.get("branching"):
            raise ValueError("Relay-v0: optional=True makes sub-agents optional, so it needs "
                             "branching=True too (env.kwargs: {branching: true, optional: true})")
        if note_words < 5:
            raise ValueError(f"note_words must be >= 5, got {note_words}")
        if not 3 <= max_facts <= 8:
            raise ValueError(f"max_facts must be in 3..8, got {max_facts}")
        super().__init__(max_turns=max_turns, **kwargs)
        self.note_words = note_words
        self.max_facts = max_facts
        self.optional = optional
        if optional:
            self.reward_weights = OPTIONAL_WEIGHTS

    # --- tasks -----------------------------------------------------------------------------
    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        return [self._task(seed, i) for i in range(n)]

    def _task(self, seed: int, i: int) -> TaskSpec:
        """Task ``i`` of ``seed``: every 24 consecutive tasks hold each (structure, family,
        compressions) once, in a seeded order; the rest is drawn from ``(seed, i)``."""
        combos = [(s, f, c) for s in STRUCTURES for f in FAMILIES for c in (1, 2)]
        order = np.random.default_rng([seed, 7, i // len(combos)]).permutation(len(combos))
        structure, family, compressions = combos[int(order[i % len(combos)])]
        rng = np.random.default_rng([seed, 8, i])
        spec = FAMILIES[family]
        op = str(rng.choice(STRUCTURES[structure]))
        k = 2 if "combine" in structure else 1
        shown = int(rng.integers(max(3, k + 1), self.max_facts + 1))
        subjects = [str(s) for s in rng.choice(spec["subjects"], size=shown, replace=False)]
        values = [int(x) for x in rng.choice(NUMBERS, size=shown, replace=False)]
        facts = [spec["fact"].format(s=s, n=n) for s, n in zip(subjects, values, strict=True)]
        # facts 0..k-1 are needed; batch order is shuffled so no position gives them away
        if compressions == 1:
            batches = [[int(j) for j in rng.permutation(shown)]]
        else:  # the first needed fact early; the second one (or a distractor) comes later
            late = 1 if k == 2 else shown - 1
            early = [j for j in range(shown) if j != late]
            batches = [[early[int(j)] for j in rng.permutation(len(early))], [late]]
        needed = list(range(k))
        nouns = [spec["noun"].format(s=subjects[j]) for j in needed]
        return TaskSpec(
            task_id=f"relay-{seed}-{i}",
            prompt="\n".join(facts[j] for j in batches[0]),
            meta=TaskMeta(skills=structure.split(">"), structure=structure, entity_group=family,
                          length=compressions + 1,
                          difficulty=len(structure.split(">")) + compressions - 1,
                          facts=shown, position=batches[0].index(0), operation=op),
            target={"answer": int(OPERATIONS[op][1]([values[j] for j in needed])),
                    "needed": [values[j] for j in needed]},
            data={"facts": facts, "values": values, "needed": needed, "batches": batches,
                  "question": question(op, nouns), "family": family, "operation": op})

    # --- the session flow ----------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        obs, info = super().reset(seed=seed, options=options)
        if self.branching:  # the facts reach a sub-agent through the task given to spawn
            data = self.task.data
            later = [data["facts"][j] for batch in data["batches"][1:] for j in batch]
            if later:  # the facts of every batch, one list
                self._recorder.ask("\n".join(later), separator="\n")
            self._recorder.ask(
                optional_request(data["question"]) if self.optional else
                delegate_request([data["facts"][j] for j in data["needed"]], data["question"]))
            obs, info = self.active_messages, self._info()
        return obs, info

    def compression_due(self) -> bool:
        """A session that shows facts is over budget: every batch of facts is relayed (in a
        note; with ``branching`` in the task of a sub-agent instead)."""
        return not self.branching and self._recorder.compressions < len(self.task.data["batches"])

    def summary_request(self, compressions: int) -> str:
        return note_request([self.task.data["facts"][j] for j in self._needed_seen(compressions)])

    def continuation_prompt(self, summary: str, compressions: int) -> str:
        data = self.task.data
        text = f"Your note: {self._cut(summary)}"
        if compressions < len(data["batches"]):  # more facts before the question
            more = "\n".join(data["facts"][j] for j in data["batches"][compressions])
            return f"{text}\n\nMore facts:\n{more}"
        return f"{text}\n\nQuestion: {data['question']}\n{ANSWER_REQUEST}"

    def examples(self, compressions: int) -> list[tuple[str, str]]:
        """The root shows a worked note, the answering session a worked answer (same family,
        same operation, other entities); a middle session (two compressions) shows none."""
        if 0 < compressions < len(self.task.data["batches"]):
            return []  # a middle session (two compressions) shows none
        # as many example facts as the note must keep (root) or the question uses
        k = (len(self.task.data["needed"]) if self.branching
             else len(self._needed_seen(compressions)))
        facts, picked, asked = self._example(k)
        note = " ".join(facts[j] for j in picked)
        if compressions == 0 and self.optional:  # spawn, then answer with the result
            value = str(self._example_value(picked))
            return [("\n".join(facts) + "\n\n" + optional_request(asked), spawn_call(note, asked)),
                    (result_request(value), value)]
        if compressions == 0 and self.branching:
            request = delegate_request([facts[j] for j in picked], asked)
            return [("\n".join(facts) + "\n\n" + request, spawn_call(note, asked))]
        if compressions == 0:
            return [("\n".join(facts) + "\n\n" + note_request([facts[j] for j in picked]), note)]
        value = self._example_value(picked)
        return [(f"Your note: {note}\n\nQuestion: {asked}\n{ANSWER_REQUEST}", str(value))]

    def branch_examples(self, compressions: int) -> list[tuple[str, str]]:
        """With ``optional``, a sub-agent's session opens with the root example's sub-task
        answered with a bare number; plain branching shows none."""
        if not self.optional or compressions:
            return []
        facts, picked, asked = self._example(len(self.task.data["needed"]))
        return [(spawn_task(" ".join(facts[j] for j in picked), asked),
                 str(self._example_value(picked)))]

    def return_request(self, value: str) -> str | None:
        """With ``optional``, after a sub-agent's answer the root is asked for the final
        number (or another sub-agent); plain branching asks nothing."""
        return result_request(value) if self.optional else None

    def _example(self, k: int) -> tuple[list[str], list[int], str]:
        """The worked example's facts (the task's family, other entities), the ``k`` of them
        its question uses and that question."""
        data = self.task.data
        spec = FAMILIES[data["family"]]
        facts = [spec["fact"].format(s=s, n=n)
                 for s, n in zip(spec["example"], EXAMPLE_NUMBERS, strict=True)]
        picked = [0, 2] if k == 2 else [1]
        nouns = [spec["noun"].format(s=spec["example"][j]) for j in picked]
        return facts, picked, question(data["operation"], nouns)

    def _example_value(self, picked: list[int]) -> int:
        """The worked example's answer from its ``picked`` facts."""
        return OPERATIONS[self.task.data["operation"]][1]([EXAMPLE_NUMBERS[j] for j in picked])

    def _cut(self, note: str) -> str:
        """What of a note crosses the boundary: its first ``note_words`` words."""
        return " ".join(note.split()[: self.note_words])

    def _needed_seen(self, compressions: int) -> list[int]:
        """The needed facts shown up to the session after ``compressions`` notes."""
        data = self.task.data
        seen = {j for batch in data["batches"][: compressions + 1] for j in batch}
        return [j for j in data["needed"] if j in seen]

    # --- scoring, usage and the solver -------------------------------------------------------
    def score(self, task: TaskSpec, answer: str, state: Any) -> RewardBreakdown:
        if self.optional:  # no note is required: the answer alone
            components = answer_reward(answer, task.target["answer"])
        else:
            components = relay_reward(answer, task.target["answer"], task.target["needed"],
                                      self._last_note(task))
        return answer_breakdown(components, self.reward_weights, f"{self.env_id}@{self.version}",
                                correct=components["answer"] == 1.0,
                                answered=bool(numbers(answer)))

    def _last_note(self, task: TaskSpec) -> str:
        """What the answering session saw of the last note; with ``branching`` the last
        sub-agent's task, less the question."""
        if self.branching:
            tasks = [s.turns[s.metrics["opening_turns"] - 1].content
                     for s in self._recorder.sessions() if s.origin == "branch"]
            return tasks[-1].replace(task.data["question"], " ") if tasks else ""
        prompt = [t.content for t in self._recorder.turns() if t.role == "user"][-1]
        return prompt.split("Your note: ", 1)[-1].split("\n\nQuestion: ", 1)[0]

    def session_used(self, session: Session, episode: Episode) -> bool | None:
        if self.branching:  # a sub-agent is used when the answer consumes what it returned
            return super().session_used(session, episode)
        if episode.final_session_id is None:
            return False
        if session.session_id == episode.final_session_id:
            return True
        k = [s.session_id for s in episode.sessions].index(session.session_id)
        want = {self.task.data["values"][j] for j in self._needed_seen(k)}
        note = session.last_reply.content if session.last_reply else ""
        return want <= set(numbers(self._cut(note)))

    def reference_action(self) -> str | None:
        if self.task is None:
            return None
        data = self.task.data
        if self.awaiting_summary:
            facts = data["facts"]
            return " ".join(facts[j] for j in self._needed_seen(self._recorder.compressions))
        delegated = any(m["role"] == "tool" and m.get("name") == "spawn"
                        for m in self.active_messages)
        if self.branching and not self.in_branch and not delegated:
            return spawn_call(" ".join(data["facts"][j] for j in data["needed"]), data["question"])
        return str(self.task.target["answer"])
