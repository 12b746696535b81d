"""Input pins: the files and code a contract makes a run read, each with its content hash
(``contract.pins.json``). Editing any of them is a new contract: ``ExperimentContract``
folds these hashes into its own."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_rl.run.overrides import ContractError

if TYPE_CHECKING:
    from agent_rl.run.contract import EnvSection

DATASET_ENV = "agent_rl/Dataset-v0"  # kwargs.path: the tasks' file; kwargs.reward: maybe code
AGENT_ENV = "agent_rl/Agent-v0"  # kwargs.agent: code; kwargs.tasks: a file or dataset spec


def env_pins(env: EnvSection) -> dict[str, dict[str, Any]]:
    """The files an env section makes the run read, by dotted key, each as ``{path, sha256}``
    (a user reward as ``{function, sha256}`` of the file that defines it): the module that
    defines an env registered from outside agent-rl (``env.id`` as ``{id, sha256}``: a
    scaffolded or plugin env's scoring is its code), the holdout's
    ``task_ids_file``, and for Dataset-v0 the data (``env.kwargs.path``) and a user reward
    function (``env.kwargs.reward``: ``path/file.py:fn`` pins that file, ``module:fn`` the
    module's source file); for Agent-v0 the agent (``env.kwargs.agent``, as a reward), the
    tasks (``env.kwargs.tasks``, or ``env.kwargs.tasks.path`` of a dataset spec) and a user
    reward. Editing any of them is a new contract."""
    pins: dict[str, dict[str, Any]] = {}
    source = user_env_source(env.id)
    if source is not None:
        pins["env.id"] = {"id": env.id, "sha256": content_hash(str(source), "env.id")}
    if env.holdout is not None and env.holdout.task_ids_file is not None:
        path = env.holdout.task_ids_file
        pins["env.holdout.task_ids_file"] = {
            "path": path, "sha256": content_hash(path, "env.holdout.task_ids_file")}
    if env.id not in (DATASET_ENV, AGENT_ENV):
        return pins
    path, reward = env.kwargs.get("path"), env.kwargs.get("reward")
    path_key = "env.kwargs.path"
    if env.id == AGENT_ENV:
        agent, path, path_key = env.kwargs.get("agent"), env.kwargs.get("tasks"), "env.kwargs.tasks"
        if isinstance(path, dict):
            path, path_key = path.get("path"), "env.kwargs.tasks.path"
        if isinstance(agent, str):
            pins["env.kwargs.agent"] = function_pin(agent, "agent", "env.kwargs.agent")
    if isinstance(path, str):
        pins[path_key] = {"path": path, "sha256": content_hash(path, path_key)}
    if isinstance(reward, str) and ":" in reward:
        pins["env.kwargs.reward"] = function_pin(reward, "reward", "env.kwargs.reward")
    return pins


def function_pin(spec: str, what: str, key: str) -> dict[str, str]:
    """``{function, sha256}`` of a user function ``spec`` (``trajectories.functions``: its
    source file, or a function passed from Python, its source); a ``ContractError`` naming
    ``key`` when it cannot be found (a passed function not passed again says so)."""
    from trajectories.functions import function_digest

    try:
        return {"function": spec, "sha256": function_digest(spec, what)}
    except (ImportError, ValueError) as exc:
        raise ContractError(f"{key}: {exc}") from None


def user_env_source(env_id: str) -> Path | None:
    """The source file of ``env_id``'s class or factory when it lies outside the agent-rl
    packages (a plugin, a scaffolded package, a test's env), else None: a built-in env's code
    is the installed agent-rl, pinned by its version in every episode's verifier id."""
    import envs
    from envs.registry import entry_point_source

    try:
        source = entry_point_source(env_id)
    except (LookupError, ImportError) as exc:
        raise ContractError(f"env.id: {exc}") from None
    root = Path(envs.__file__).resolve().parent.parent
    ours = [root / package for package in ("envs", "agent_rl", "evals", "trajectories")]
    if source is None or any(source.is_relative_to(package) for package in ours):
        return None
    return source


def pin_text(pin: dict[str, Any] | None) -> str:
    if pin is None:
        return "not pinned"
    what = pin.get("path", pin.get("function", pin.get("id")))
    digest = pin.get("sha256", pin.get("bundle", ""))
    return f"{what} sha256 {digest[:12]}"


def content_hash(path: str, key: str) -> str:
    """sha256 of a file's bytes, or of a folder's files (relative names and their hashes, in
    order; a ``datasets`` folder); unreadable is a ``ContractError`` naming ``key``."""
    import hashlib

    root = Path(path)
    try:
        if root.is_dir():
            digest = hashlib.sha256()
            for file in sorted(p for p in root.rglob("*") if p.is_file()):
                digest.update(f"{file.relative_to(root)}\0".encode())
                digest.update(hashlib.sha256(file.read_bytes()).digest())
            return digest.hexdigest()
        return hashlib.sha256(root.read_bytes()).hexdigest()
    except OSError as exc:
        raise ContractError(f"{key}: cannot read {path} ({exc.strerror or exc})") from None


def init_bundle_hash(path: str) -> str:
    """The content hash of the bundle ``model.init`` names (``checkpoint.resolve_bundle``)."""
    from agent_rl.run import checkpoint

    try:
        return checkpoint.bundle_hash(checkpoint.resolve_bundle(path))
    except checkpoint.BundleError as exc:
        raise ContractError(f"model.init: {exc}") from None
