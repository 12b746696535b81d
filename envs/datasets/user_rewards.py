"""User reward functions of Dataset-v0 (``"module:function"``, ``"path/to/file.py:function"``
or a function passed from Python: ``trajectories.functions`` loads them all): finding the
source to pin, how a worker gets the function, reading its return value as reward
components, and ``reply_components``, what a deadline worker (``envs.deadline``) runs to
score a reply with a built-in reward or a user function."""

from __future__ import annotations

import hashlib
import math
import numbers as _numbers
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.core import TaskSpec
from envs.datasets.errors import DatasetError, RewardReturnError
from envs.datasets.rewards import built_in
from trajectories import functions


def split_spec(spec: str) -> tuple[str, str]:
    """``(where, function)`` of a user reward ``module:function`` or ``file.py:function``."""
    try:
        return functions.split_spec(spec, "reward")
    except functions.FunctionSpecError as exc:
        raise DatasetError(str(exc), key="reward") from None


def load_reward_function(spec: str) -> Callable[[str, TaskSpec], Any]:
    """The user function ``"package.module:function"`` or ``"path/to/file.py:function"``, or
    one passed from Python (``trajectories.functions``)."""
    try:
        return functions.load_function(spec, "reward")
    except functions.FunctionSpecError as exc:
        raise DatasetError(str(exc), key="reward") from None


def worker_reward(spec: str) -> str | PassedFunction:
    """How a deadline worker gets the user reward ``spec``: a file path made absolute
    (``/abs/rewards.py:fn``, imported there), or a function passed from Python by value
    (``PassedFunction``: a worker cannot import a script's ``__main__``)."""
    if functions.is_passed(spec):
        return PassedFunction.of(spec, load_reward_function(spec))
    return f"{reward_source(spec)}:{split_spec(spec)[1]}"


@dataclass(frozen=True)
class PassedFunction:
    """A function passed from Python, pickled by value (``cloudpickle``, which gymnasium
    brings) so a worker process can call it; unpickled once per worker (``_UNPICKLED``)."""

    spec: str
    blob: bytes

    @classmethod
    def of(cls, spec: str, fn: Callable[..., Any]) -> PassedFunction:
        import cloudpickle

        try:
            return cls(spec, cloudpickle.dumps(fn))
        except Exception as exc:
            raise DatasetError(f"reward {spec!r}: the function does not pickle, so a scoring "
                               f"worker cannot run it ({type(exc).__name__}: {exc}); define it "
                               "at module level", key="reward") from None

    def load(self) -> Callable[..., Any]:
        digest = hashlib.sha256(self.blob).hexdigest()
        if digest not in _UNPICKLED:
            _UNPICKLED[digest] = pickle.loads(self.blob)
        return _UNPICKLED[digest]


_UNPICKLED: dict[str, Callable[..., Any]] = {}  # in a worker: passed functions by blob hash


def user_components(spec: str, value: Any, weights: Mapping[str, float]) -> dict[str, float]:
    """A user function's return value as reward components; ``RewardReturnError`` naming
    ``spec`` and the value for anything but a finite number (not a bool) or a dict of them
    holding every weighted key."""
    def number(v: Any, what: str) -> float:
        if isinstance(v, bool):
            raise RewardReturnError(f"reward function {spec} returned {what}{v!r} (bool); a "
                                    "score is a float: return float(...) or 1.0 / 0.0")
        if not isinstance(v, _numbers.Real) or not math.isfinite(float(v)):
            raise RewardReturnError(f"reward function {spec} returned {what}{v!r:.80} "
                                    f"({type(v).__name__}); it must return a finite float or a "
                                    "dict of them")
        return float(v)

    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise RewardReturnError(f"reward function {spec} returned a dict key {k!r}; "
                                        "keys are component names (str)")
            out[k] = number(v, f"component {k!r} = ")
        missing = sorted(set(weights) - set(out))
        if missing:
            raise RewardReturnError(
                f"reward function {spec} returned components {sorted(out)} without the "
                f"weighted {missing}; return them, or pass weights naming your components, "
                f"e.g. weights={dict.fromkeys(sorted(out), 1.0)}")
        return out
    if set(weights) != {"accuracy"}:
        raise RewardReturnError(f"reward function {spec} returned a float, but weights name "
                                f"{sorted(weights)}: return a dict with those keys")
    return {"accuracy": number(value, "")}


def reply_components(reward: str | PassedFunction, tolerance: float,
                     weights: tuple[tuple[str, float], ...], reply: str,
                     task: TaskSpec) -> dict[str, float]:
    """The reward components of ``reply`` on ``task`` under reward ``reward`` (a built-in
    kind, a user function's spec with an absolute file path, or a ``PassedFunction``): what
    ``DatasetEnv.score`` runs in a deadline worker (``envs.deadline``)."""
    if isinstance(reward, PassedFunction):
        return user_components(reward.spec, reward.load()(reply, task), dict(weights))
    if ":" in reward:
        return user_components(reward, load_reward_function(reward)(reply, task), dict(weights))
    return {"accuracy": built_in(reward, tolerance).score(reply, task)}


def reward_source(spec: str) -> Path:
    """The source file that defines the user reward ``spec`` (``path/to/file.py:function``:
    that file; ``module:function``: the module's file), found without running the function;
    ``ImportError`` when there is none."""
    try:
        return functions.function_source(spec, "reward")
    except functions.FunctionSpecError as exc:
        raise DatasetError(str(exc), key="reward") from None
