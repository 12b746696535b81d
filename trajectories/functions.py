"""User functions named in a contract: ``"module:function"``, ``"path/to/file.py:function"``,
or a function passed from Python (``agent_rl.train(..., reward=fn, assigner=fn)``).

One loader for every kind of user function the contract can name (a Dataset-v0 reward, a
credit assigner): ``load_function(spec, what)`` imports it with errors that say the fix (no
such module or file, no such attribute, not callable), before any work starts.

A function passed from Python is written into the contract by its qualified name
(``function_spec``): a module-level function of an importable module becomes plain
``"module:function"``, the same as in YAML, and needs nothing more. Any other function (one
defined in a script, i.e. in ``__main__``, a lambda, a closure) cannot be imported by name:
it is kept in this process (``PASSED``) under ``"module:qualname"`` (``"__main__:my_reward"``)
and the contract records that name. Such a spec resolves only in the process it was passed
to: a resumed run, or ``agent-rl train`` on the run's ``contract.yaml``, must be handed the
function again (``agent_rl.train(RUN/contract.yaml, resume=True, reward=my_reward)``) and says
so when it is not (``NotPassedError``).

``function_digest(spec, what)`` is the content the contract hash pins: the sha256 of the file
that defines the function (a module's source file), or of a passed function's own source.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import marshal
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

PASSED: dict[str, Callable[..., Any]] = {}  # "module:qualname" -> a function passed from Python


class FunctionSpecError(ValueError):
    """A spec that is not ``module:function`` / ``file.py:function``, or names no function."""


class NotPassedError(ImportError):
    """A spec that names a function passed from Python, not passed in this process."""


def split_spec(spec: str, what: str) -> tuple[str, str]:
    """``(where, name)`` of ``"module:function"`` or ``"path/to/file.py:function"``."""
    where, _, name = spec.rpartition(":")
    if not where or not name or not (name.isidentifier() or is_passed(spec)):
        raise FunctionSpecError(f"{what} {spec!r}: a user {what} is 'module:function' or "
                                "'path/to/file.py:function'")
    return where, name


def is_passed(spec: str) -> bool:
    """Whether ``spec`` names a function that only a Python caller can pass (defined in
    ``__main__``, a lambda, a closure): it cannot be imported by name."""
    where, _, name = spec.rpartition(":")
    return where == "__main__" or not name.isidentifier()


def is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where


def function_spec(fn: Callable[..., Any], what: str) -> str:
    """The name the contract records for ``fn``: ``"module:function"`` when that imports
    ``fn`` itself; otherwise ``"module:qualname"``, with ``fn`` kept in ``PASSED`` for this
    process (module docstring)."""
    if not callable(fn):
        raise TypeError(f"{what} must be a function, got {type(fn).__name__} {fn!r:.60}")
    module = getattr(fn, "__module__", None) or "__main__"
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    spec = f"{module}:{qualname}"
    if not is_passed(spec):
        try:
            if getattr(importlib.import_module(module), qualname, None) is fn:
                return spec
        except ImportError:
            pass
        spec = f"__main__:{qualname}" if module == "__main__" else f"{module}:<{qualname}>"
    PASSED[spec] = fn
    return spec


def load_function(spec: str, what: str) -> Callable[..., Any]:
    """The function ``spec`` names (module docstring): ``FunctionSpecError`` for a malformed
    spec or a value that is not callable, ``ImportError`` naming the fix for a module, file or
    attribute that is not there, ``NotPassedError`` for a passed function not passed here."""
    if spec in PASSED:
        return PASSED[spec]
    where, name = split_spec(spec, what)
    if is_passed(spec):
        raise NotPassedError(
            f"{what} {spec!r} is a function that was passed from Python (defined in a script, "
            f"a lambda or a closure), not importable by name; pass it again, e.g. "
            f"agent_rl.train('RUN/contract.yaml', resume=True, {what}={name}), or move it into "
            f"an importable module and name it 'module:function'")
    module = _load_file(spec, what, where) if is_file(where) else _import(spec, what, where, name)
    fn = getattr(module, name, None)
    if fn is None:
        raise ImportError(f"{what} {spec!r}: {where} has no attribute {name!r}")
    if not callable(fn):
        raise FunctionSpecError(f"{what} {spec!r}: {where}.{name} is {type(fn).__name__}, "
                                "not a function")
    return fn


def _import(spec: str, what: str, where: str, name: str) -> Any:
    try:
        return importlib.import_module(where)
    except Exception as exc:
        raise ImportError(
            f"{what} {spec!r}: cannot import module {where!r} ({type(exc).__name__}: {exc}); "
            f"install it, put its folder on PYTHONPATH, or name the file: "
            f"'path/to/{where.rsplit('.', 1)[-1]}.py:{name}'") from exc


def _load_file(spec: str, what: str, where: str) -> Any:
    file = Path(where).resolve()
    if not file.is_file():
        raise ImportError(f"{what} {spec!r}: no file {file} (relative paths are read from "
                          f"the working directory {Path.cwd()})")
    module_name = "agent_rl_user_" + hashlib.sha256(str(file).encode()).hexdigest()[:16]
    module = sys.modules.get(module_name)
    if module is None:
        loader_spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(loader_spec)
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:
            raise ImportError(f"{what} {spec!r}: importing {file} failed: "
                              f"{type(exc).__name__}: {exc}") from exc
        sys.modules[module_name] = module
    return module


def function_source(spec: str, what: str) -> Path:
    """The source file that defines ``spec`` (``file.py:function``: that file;
    ``module:function``: the module's file), found without running the function;
    ``ImportError`` when there is none (a passed function has none: ``function_digest``)."""
    where, _ = split_spec(spec, what)
    if is_file(where):
        return Path(where).resolve()
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError) as exc:
        raise ImportError(f"{what} {spec!r}: cannot find module {where!r} ({exc})") from None
    if found is None:
        raise ImportError(f"{what} {spec!r}: no module {where!r}; install it, put its folder "
                          "on PYTHONPATH, or name the file: 'path/to/file.py:function'")
    if not found.origin or not Path(found.origin).is_file():
        raise ImportError(f"{what} {spec!r}: module {where!r} has no source file to pin "
                          f"({found.origin}); name a .py file instead")
    return Path(found.origin)


def function_digest(spec: str, what: str) -> str:
    """What the contract hash pins for ``spec``: the sha256 of its source file, or for a
    passed function the sha256 of its own source (of its code object when the source cannot
    be read, e.g. a function typed at a prompt). ``NotPassedError`` for a passed function
    that was not passed in this process."""
    if not is_passed(spec):
        source = function_source(spec, what)
        try:
            return hashlib.sha256(source.read_bytes()).hexdigest()
        except OSError as exc:
            raise ImportError(f"cannot read {source} ({exc.strerror or exc}), the source of "
                              f"{what} {spec!r}") from None
    fn = load_function(spec, what)
    try:
        text = inspect.getsource(fn).encode()
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None) or getattr(type(fn).__call__, "__code__", None)
        text = marshal.dumps(code) if code is not None else repr(fn).encode()
    return hashlib.sha256(text).hexdigest()
