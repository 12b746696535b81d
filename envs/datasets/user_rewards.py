"""User reward functions of Dataset-v0 (``"module:function"`` or ``"path/to/file.py:function"``):
loading one, finding its source file to pin, reading its return value as reward components,
and ``reply_components``, what a deadline worker (``envs.deadline``) runs to score a reply
with a built-in reward or a user function."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers as _numbers
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from envs.core import TaskSpec
from envs.datasets.errors import DatasetError, RewardReturnError
from envs.datasets.rewards import built_in


def split_spec(spec: str) -> tuple[str, str]:
    """``(where, function)`` of a user reward ``module:function`` or ``file.py:function``."""
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise DatasetError(f"reward {spec!r}: a user reward is 'module:function' or "
                           "'path/to/file.py:function'", key="reward")
    return where, name


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where


def load_reward_function(spec: str) -> Callable[[str, TaskSpec], Any]:
    """The user function ``"package.module:function"`` or ``"path/to/file.py:function"``."""
    where, name = split_spec(spec)
    if _is_file(where):
        file = Path(where).resolve()
        if not file.is_file():
            raise ImportError(f"reward {spec!r}: no file {file} (relative paths are read from "
                              f"the working directory {Path.cwd()})")
        module_name = "agent_rl_reward_" + hashlib.sha256(str(file).encode()).hexdigest()[:16]
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(loader_spec)
            try:
                loader_spec.loader.exec_module(module)
            except Exception as exc:
                raise ImportError(f"reward {spec!r}: importing {file} failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
            sys.modules[module_name] = module
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise ImportError(
                f"reward {spec!r}: cannot import module {where!r} ({type(exc).__name__}: {exc}); "
                f"install it, put its folder on PYTHONPATH, or name the file: "
                f"'path/to/{where.rsplit('.', 1)[-1]}.py:{name}'") from exc
    fn = getattr(module, name, None)
    if fn is None:
        raise ImportError(f"reward {spec!r}: {where} has no attribute {name!r}")
    if not callable(fn):
        raise DatasetError(f"reward {spec!r}: {where}.{name} is {type(fn).__name__}, not a function")
    return fn


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


def reply_components(reward: str, tolerance: float, weights: tuple[tuple[str, float], ...],
                     reply: str, task: TaskSpec) -> dict[str, float]:
    """The reward components of ``reply`` on ``task`` under reward ``reward`` (a built-in
    kind, or a user function's spec with an absolute file path): what ``DatasetEnv.score``
    runs in a deadline worker (``envs.deadline``)."""
    if ":" in reward:
        return user_components(reward, load_reward_function(reward)(reply, task), dict(weights))
    return {"accuracy": built_in(reward, tolerance).score(reply, task)}


def reward_source(spec: str) -> Path:
    """The source file that defines the user reward ``spec`` (``path/to/file.py:function``:
    that file; ``module:function``: the module's file), found without running the function;
    ``ImportError`` when there is none."""
    where, _ = split_spec(spec)
    if _is_file(where):
        return Path(where).resolve()
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError) as exc:
        raise ImportError(f"reward {spec!r}: cannot find module {where!r} ({exc})") from None
    if found is None:
        raise ImportError(f"reward {spec!r}: no module {where!r}; install it, put its folder "
                          "on PYTHONPATH, or name the file: 'path/to/file.py:function'")
    if not found.origin or not Path(found.origin).is_file():
        raise ImportError(f"reward {spec!r}: module {where!r} has no source file to pin "
                          f"({found.origin}); name a .py file instead")
    return Path(found.origin)
