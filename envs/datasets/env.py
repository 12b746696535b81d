"""Dataset-v0: your own question-answer tasks from a JSONL, CSV or ``datasets`` folder.

Description
    ``envs.from_dataset(path, prompt="prompt", answer="answer", reward="exact", meta=None,
    system=None, **kw)`` (or ``envs.make("agent_rl/Dataset-v0", path=..., ...)``, the same
    keywords) reads every row at construction and makes it a ``TaskSpec``: the ``prompt``
    column is the user message, the ``answer`` column what the verifier checks (never shown).

    ``path``: a ``.jsonl``/``.ndjson`` file (one JSON object per line, blank lines skipped), a
    ``.csv`` file (a header row; UTF-8, a BOM allowed) or a folder written by ``datasets``'
    ``save_to_disk`` (read with ``datasets.load_from_disk``; needs ``pip install datasets``;
    for a ``DatasetDict``, ``dataset_split`` picks the split: default its only split, else
    ``train``). Relative paths are read from the working directory. Without ``path``,
    ``Dataset-v0`` reads the bundled sample ``envs/data/qa_sample.jsonl`` (54 arithmetic word
    problems with metadata). Nothing is downloaded.

    ``meta`` maps ``TaskMeta`` fields to columns, e.g. ``{"entity_group": "topic", "length":
    "steps"}`` (other keys become extra metadata); ``None`` takes each of ``skills``,
    ``structure``, ``entity_group``, ``length``, ``difficulty`` from the column of that name
    where the file has one. ``skills`` is a list of strings or one string split at ``,`` or
    ``>``; without a ``structure`` column it is the skills joined by ``>`` (and skills default to
    the structure's steps). ``length`` is an integer >= 1, ``difficulty`` an integer >= 0.
    Unmapped fields keep ``TaskMeta``'s defaults. ``task_id`` names a column of unique ids
    (default ``"<file stem>-<row>"``); ``solution`` a column holding a correct reply for
    ``reference_action`` (default: the answer itself; a ``regex`` dataset has none without it).

    Bad data fails at construction, before any training, naming the file, the row (1-based,
    with its line in a file) and the column: a missing or null cell, an empty prompt or answer,
    a prompt that is not text, an answer the reward cannot read (``numeric``: not one number;
    ``choice``: not one letter; ``regex``: an invalid pattern), bad metadata, a repeated id, a
    byte that is not UTF-8, a CSV cell over the ``csv`` module's 131072 characters (JSONL has
    no such limit), a JSON integer over Python's 4300 digits (quote it), a row nesting lists or
    objects more than 100 levels deep. No row is dropped silently. Arguments that need no file
    (``check_arguments``) are checked first; a ``DatasetError`` about one names it (``key``).

Tools
    None.

Observation
    ``[system, user]``: ``system`` (default: a one-line instruction for the reward kind) and
    the row's prompt.

Reward
    Built-in kinds have one component, ``accuracy`` (weight 1, or ``weights={"accuracy": w}``),
    1.0 or 0.0. "Normalised" text is NFKC, case-folded, trimmed, with every run of whitespace
    one space.

    * ``exact``: the normalised reply equals the normalised answer.
    * ``numeric``: the *last* number in the reply (``envs.scoring.numeric_reward``; read as
      ``envs.scoring.numbers`` reads them: an optional minus, digits, commas only between groups of three, an optional decimal
      part; ``12.0`` is 12, ``1,000`` is 1000) is within ``tolerance`` of the answer:
      ``|said - answer| <= tolerance * max(1, |answer|)``, i.e. absolute below 1 and relative
      above (default ``tolerance=0``: equal as numbers). The answer cell is a JSON number or a
      string holding exactly one such number.
    * ``regex``: the answer cell is a Python ``re`` pattern (compiled at construction), and
      ``re.search(pattern, reply)`` finds it (anchor with ``^...$`` for a whole-reply match;
      ``(?i)`` for case-insensitive). A pattern that backtracks catastrophically on a reply
      (``^(a+)+$`` on ``"a" * 40 + "!"``) is stopped by ``reward_timeout_s``, as below.
    * ``choice``: the answer cell is one letter (``B``, ``(B)``, ``b.``); the reply's choice is,
      in order: the whole reply as such a letter; the last ``answer/option/choice (is) (:) X``
      with an upper-case ``X``; a leading ``X.``/``X)``/``X:``; the last ``(X)`` or ``[X]``.
    * ``contains``: the normalised answer is a substring of the normalised reply.
    * ``"module:function"`` (or ``"path/to/file.py:function"``): your function ``(answer: str,
      task: TaskSpec) -> float | dict[str, float]`` (``answer`` is the reply; the row's answer
      cell is ``task.target``, the whole row ``task.data["record"]``). A float is
      ``accuracy``; a dict's keys are components, weighted by ``weights`` (default
      ``{"accuracy": 1.0}``: the dict must then hold ``accuracy``; keys without a weight are
      recorded with weight 0). From Python, ``reward`` may be the function itself
      (``from_dataset(path, reward=my_reward)``; ``trajectories.functions``: a function of an
      importable module is named ``module:function``, one defined in a script is sent to the
      scoring worker by value). It is called once at construction on the first row's reference
      reply, so a wrong return type fails before training. Later, a function that raises
      scores the episode as an infrastructure fault (``sandbox_error``: masked out of the loss,
      counted by the ``max_verifier_error_rate`` guard), its message in
      ``reward.audit["reward_error"]``; one that returns something else (a bool, a string, a
      NaN) is a bug in the function: ``RewardReturnError`` naming the function and the value.

    ``weights`` are finite and >= 0, at least one of them > 0 (all zero, every reply would be
    ``correct``). Every scoring call (built-in or yours) runs in a worker process
    (``envs.deadline``: about 0.2 ms a call) and is stopped after ``reward_timeout_s`` seconds
    (default 10; a finite number > 0): the episode is then a ``sandbox_error`` like a raising
    function, with a ``RewardFaultWarning`` naming the task. Agent text never hangs scoring.

    Outcome: ``correct`` at the maximum total, ``format_error`` when the reply holds no answer
    (empty; ``numeric``: no number; ``choice``: no letter), otherwise ``wrong``.

Episode end
    The first reply without a tool call is the answer and ends the episode; ``max_turns``
    replies (tool calls only) end it ``truncated``.

Tasks
    ``task_pool(n, seed)``: the rows in a ``numpy.random.default_rng(seed)`` permutation, the
    first ``min(n, rows)``: a pool larger than the file is every row once, never repeats.
    Rows are read once per file version (cached on path, mtime and size). ``data_hash`` is the
    sha256 of the data file(s), for a data manifest.

Version history
    v0: first release.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from envs import deadline
from envs.core import TaskSpec, ToolEnv
from envs.datasets.errors import DatasetError, RewardReturnError
from envs.datasets.files import fingerprint
from envs.datasets.rewards import ANSWER_ONLY, Verifier, built_in, nonblank
from envs.datasets.tasks import jsonable, load_tasks
from envs.datasets.user_rewards import (
    load_reward_function,
    reply_components,
    split_spec,
    worker_reward,
)
from envs.scoring import (
    REWARD_TIMEOUT_S,
    answer_breakdown,
    check_reward_timeout,
    fault_reason,
    reward_fault,
)
from trajectories import RewardBreakdown
from trajectories.functions import function_spec

DEFAULT_PATH = Path(__file__).parents[1] / "data" / "qa_sample.jsonl"


class DatasetEnv(ToolEnv):
    env_id = "agent_rl/Dataset-v0"
    version = 0
    reward_weights = {"accuracy": 1.0}

    def __init__(
        self,
        path: str | os.PathLike = DEFAULT_PATH,
        prompt: str = "prompt",
        answer: str = "answer",
        reward: str | Callable[[str, TaskSpec], Any] = "exact",
        meta: Mapping[str, str] | None = None,
        system: str | None = None,
        tolerance: float = 0.0,
        weights: Mapping[str, float] | None = None,
        task_id: str | None = None,
        solution: str | None = None,
        dataset_split: str | None = None,
        reward_timeout_s: float = REWARD_TIMEOUT_S,
        **kwargs: Any,
    ):
        """Keywords: module docstring. ``kwargs`` go to ``ToolEnv`` (``max_turns``, ...)."""
        super().__init__(**kwargs)
        if callable(reward):  # a function passed from Python: by its name (functions.py)
            reward = function_spec(reward, "reward")
        check_arguments(prompt=prompt, answer=answer, reward=reward, meta=meta,
                        tolerance=tolerance, weights=weights, task_id=task_id,
                        solution=solution, reward_timeout_s=reward_timeout_s)
        custom = ":" in reward
        self.reward_weights = _weights(weights, None if custom else reward)
        self.reward_timeout_s = float(reward_timeout_s)
        self.verifier = (Verifier(reward, jsonable, load_reward_function(reward), nonblank,
                                  lambda target: None, ANSWER_ONLY)
                         if custom else built_in(reward, tolerance))
        # what a deadline worker computes: picklable, a file path made absolute
        spec = worker_reward(reward) if custom else reward
        self._components = partial(reply_components, spec, float(tolerance),
                                   tuple(self.reward_weights.items()))
        self.path = Path(path)
        if not self.path.exists():
            raise DatasetError(f"{self.path}: no such file or folder (relative paths are read "
                               f"from the working directory {Path.cwd()}); pass a .jsonl or "
                               ".csv file or a datasets folder")
        self.tasks, self.data_hash = load_tasks(
            self.path, fingerprint(self.path), prompt, answer, "custom" if custom else reward,
            tuple(sorted(meta.items())) if meta is not None else None, task_id, solution,
            dataset_split)
        self.instructions = system if system is not None else self.verifier.instructions
        if custom:
            self._probe(self.tasks[0])

    def _probe(self, task: TaskSpec) -> None:
        """Call the user function once, on the first row's reference reply."""
        reply = task.data["reference"] or ""
        checked = f"on {task.task_id} (reply {reply!r:.60}), checked at construction"
        try:
            deadline.call(self._components, reply, task, timeout_s=self.reward_timeout_s)
        except RewardReturnError as exc:
            raise DatasetError(f"{exc} ({checked})") from None
        except deadline.DeadlineExceeded:
            raise DatasetError(f"reward function {self.verifier.name} returned nothing within "
                               f"reward_timeout_s={self.reward_timeout_s:g} s {checked}; make "
                               "it faster or raise reward_timeout_s", key="reward_timeout_s"
                               ) from None
        except Exception as exc:
            raise DatasetError(f"reward function {self.verifier.name} raised "
                               f"{type(exc).__name__}: {exc} {checked}") from exc

    # --- hooks ---------------------------------------------------------------------------
    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        order = np.random.default_rng(seed).permutation(len(self.tasks))[:n]
        return [self.tasks[i] for i in order]

    def score(self, task: TaskSpec, answer: str, state: None) -> RewardBreakdown:
        """The reward of ``answer``, computed in a deadline worker within ``reward_timeout_s``;
        a reward that raises, runs past it or kills its worker is a ``sandbox_error`` (warned,
        the reason in ``audit["reward_error"]``); a user function returning a non-score raises
        ``RewardReturnError``."""
        verifier_id = f"{self.env_id}@{self.version}/{self.verifier.name}"
        try:
            components = deadline.call(self._components, answer, task,
                                       timeout_s=self.reward_timeout_s)
        except RewardReturnError:
            raise
        except Exception as exc:  # the verifier's fault, not the agent's: masked, counted
            return reward_fault(self.env_id, task.task_id, self.verifier.name,
                                fault_reason(exc, self.reward_timeout_s), self.reward_weights,
                                verifier_id)
        total = sum(self.reward_weights.get(k, 0.0) * v for k, v in components.items())
        best = sum(w for w in self.reward_weights.values() if w > 0)
        return answer_breakdown(components, self.reward_weights, verifier_id,
                                correct=total >= best - 1e-9,
                                answered=self.verifier.answered(answer))

    def reference_action(self) -> str | None:
        return None if self.task is None else self.task.data["reference"]


def check_arguments(prompt: Any = "prompt", answer: Any = "answer", reward: Any = "exact",
                    meta: Any = None, tolerance: Any = 0.0, weights: Any = None,
                    task_id: Any = None, solution: Any = None,
                    reward_timeout_s: Any = REWARD_TIMEOUT_S, **_: Any) -> None:
    """The keyword arguments of ``DatasetEnv`` that need no file, checked without reading
    one: a ``DatasetError`` naming the argument (``key``). An experiment contract calls it on
    ``env.kwargs`` before any work."""
    for name, value in (("prompt", prompt), ("answer", answer), ("task_id", task_id),
                        ("solution", solution)):
        if value is not None and (not isinstance(value, str) or not value):
            raise DatasetError(f"{name} must name a column (a non-empty string), got {value!r}",
                               key=name)
    if meta is not None and (not isinstance(meta, Mapping) or not all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in meta.items())):
        raise DatasetError(f"meta maps TaskMeta fields to column names, e.g. "
                           f"{{'entity_group': 'topic'}}; got {meta!r}", key="meta")
    if not _finite(tolerance) or tolerance < 0:
        raise DatasetError(f"tolerance must be a finite number >= 0, got {tolerance!r}",
                           key="tolerance")
    try:
        check_reward_timeout(reward_timeout_s)
    except ValueError as exc:
        raise DatasetError(str(exc), key="reward_timeout_s") from None
    if not isinstance(reward, str):
        raise DatasetError(f"reward must be a string, got {reward!r}", key="reward")
    if ":" in reward:
        split_spec(reward)
    else:
        built_in(reward)
    _weights(weights, None if ":" in reward else reward)


def _finite(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _weights(weights: Mapping[str, float] | None, kind: str | None) -> dict[str, float]:
    """The reward weights (``kind``: the built-in reward, None for a user function): finite,
    none negative, some positive (else every reply would score the best total)."""
    if weights is None:
        return {"accuracy": 1.0}
    if not isinstance(weights, Mapping) or not weights or not all(
            isinstance(k, str) and _finite(v) for k, v in weights.items()):
        raise DatasetError(f"weights must map component names to finite numbers, got "
                           f"{weights!r}", key="weights")
    if kind is not None and set(weights) != {"accuracy"}:
        raise DatasetError(f"reward {kind!r} has the one component 'accuracy'; weights "
                           f"{sorted(weights)} name others (they are for a user function)",
                           key="weights")
    negative = sorted(k for k, v in weights.items() if v < 0)
    if negative:
        raise DatasetError(f"weights {negative} are negative ({weights!r}); a weight is >= 0 "
                           "(a penalty is a component your function makes negative)",
                           key="weights")
    if not any(v > 0 for v in weights.values()):
        raise DatasetError(f"weights {weights!r} are all zero: every reply would score the best "
                           "total (outcome correct); give a weight > 0", key="weights")
    return {k: float(v) for k, v in weights.items()}


def from_dataset(path: str | os.PathLike, prompt: str = "prompt", answer: str = "answer",
                 reward: str | Callable[[str, TaskSpec], Any] = "exact", meta: Mapping[str, str] | None = None,
                 system: str | None = None, **kw: Any) -> DatasetEnv:
    """Tasks from a JSONL/CSV file or a ``datasets`` folder as a ``ToolEnv`` (the same
    keywords as ``envs.make("agent_rl/Dataset-v0", ...)``: ``tolerance``, ``weights``,
    ``task_id``, ``solution``, ``dataset_split``, ``reward_timeout_s`` and ``ToolEnv``'s;
    module docstring)."""
    return DatasetEnv(path, prompt=prompt, answer=answer, reward=reward, meta=meta,
                      system=system, **kw)
