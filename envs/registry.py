"""One registry for agent-rl environments, on top of Gymnasium's.

``register("agent_rl/Name-v0", "pkg.module:Class", **spec)`` records the id with Gymnasium
(lazy string entry point) and in agent-rl's list; ``make(id, **kwargs)`` builds it. Installed
third-party packages register through the entry-point group ``agent_rl.envs``: each entry
point names a module (or a callable) that calls ``register`` when loaded, so its environments
appear in ``list_envs()`` without an import.
"""

from __future__ import annotations

import difflib
import inspect
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import gymnasium

ENTRY_POINT_GROUP = "agent_rl.envs"
_REGISTERED: dict[str, dict[str, Any]] = {}
_plugins_loaded = False


def register(id: str, entry_point: str | Any, **spec: Any) -> None:
    """Register an environment id (versioned: ``namespace/Name-vN``)."""
    if "-v" not in id.rsplit("/", 1)[-1]:
        raise ValueError(f"environment id {id!r} must be versioned, e.g. 'agent_rl/Records-v0'")
    spec.setdefault("disable_env_checker", True)
    spec.setdefault("order_enforce", False)
    gymnasium.register(id=id, entry_point=entry_point, **spec)
    _REGISTERED[id] = {"entry_point": entry_point, **spec}


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = ep.load()
        except Exception as exc:  # a broken plugin must not hide the others
            import warnings

            warnings.warn(f"agent_rl.envs plugin {ep.name!r} ({ep.value}) failed to load: {exc}",
                          stacklevel=2)
            continue
        if callable(loaded):
            loaded()


def list_envs() -> list[str]:
    _load_plugins()
    return sorted(_REGISTERED)


def make(id: str, **kwargs: Any) -> gymnasium.Env:
    """Build a registered environment. Unknown ids get a suggestion and the fix."""
    _check_registered(id)
    return gymnasium.make(id, **kwargs)


def accepted_kwargs(id: str) -> set[str] | None:
    """The keyword arguments ``make(id, ...)`` accepts, read off the entry point's constructor
    (following ``**kwargs`` up the ``__init__`` chain) without building the environment;
    ``None`` for a factory taking ``**kwargs``, whose names are not knowable. Raises
    ``UnregisteredEnv`` (a ``LookupError``) or ``ImportError`` for an id that cannot be built."""
    creator = env_creator(id)
    inits = ([vars(k)["__init__"] for k in creator.__mro__[:-1] if "__init__" in vars(k)]
             if inspect.isclass(creator) else [creator])
    takes: set[str] = set()
    for init in inits:
        params = inspect.signature(init).parameters.values()
        takes |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return takes - {"self"}  # this constructor passes nothing further up
    return takes - {"self"} if inspect.isclass(creator) else None


def entry_point_source(id: str) -> Path | None:
    """The source file that defines the class or factory ``make(id)`` builds from (None when
    it has none, e.g. a compiled one), importing it but building nothing. Raises as
    ``accepted_kwargs`` does for an id that cannot be built."""
    creator = env_creator(id)
    try:
        source = inspect.getsourcefile(creator)
    except TypeError:
        return None
    return Path(source).resolve() if source else None


def env_creator(id: str) -> Any:
    """The class or factory ``make(id)`` builds from, imported, nothing built. Raises as
    ``accepted_kwargs`` does for an id that cannot be built."""
    _check_registered(id)
    entry = _REGISTERED[id]["entry_point"]
    return entry if callable(entry) else gymnasium.envs.registration.load_env_creator(entry)


def runs_whole_episodes(id: str) -> bool:
    """Is ``id`` an environment the runner hands whole batches of tasks to and never steps
    (its class has ``run_whole_episodes``: ``agent_rl/Agent-v0``)? Such an env has no
    ``reset``/``step`` loop for stepping checks to drive; it is checked by its own contract
    test (``tests/envs/test_contract_whole_episodes.py``)."""
    return hasattr(env_creator(id), "run_whole_episodes")


def _check_registered(id: str) -> None:
    _load_plugins()
    if id not in _REGISTERED:
        close = difflib.get_close_matches(id, list(_REGISTERED), n=3)
        hint = f" Did you mean {close}?" if close else ""
        raise UnregisteredEnv(
            f"No environment {id!r} is registered.{hint} Did you register it, or install/import "
            f"the package that registers it? Registered: {sorted(_REGISTERED)}"
        )


class UnregisteredEnv(gymnasium.error.UnregisteredEnv, LookupError):
    """An id nothing registered (a ``LookupError`` as well as Gymnasium's error)."""
