"""One registry for agent-rl environments, on top of Gymnasium's.

``register("agent_rl/Name-v0", "pkg.module:Class", **spec)`` records the id with Gymnasium
(lazy string entry point) and in agent-rl's list; ``make(id, **kwargs)`` builds it. Installed
third-party packages register through the entry-point group ``agent_rl.envs``: each entry
point names a module (or a callable) that calls ``register`` when loaded, so its environments
appear in ``list_envs()`` without an import.
"""

from __future__ import annotations

import difflib
from importlib.metadata import entry_points
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
    _load_plugins()
    if id not in _REGISTERED:
        close = difflib.get_close_matches(id, list(_REGISTERED), n=3)
        hint = f" Did you mean {close}?" if close else ""
        raise gymnasium.error.UnregisteredEnv(
            f"No environment {id!r} is registered.{hint} Did you register it, or install/import "
            f"the package that registers it? Registered: {sorted(_REGISTERED)}"
        )
    return gymnasium.make(id, **kwargs)
