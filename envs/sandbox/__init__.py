"""Run untrusted Python programs: bubblewrap, Docker, or a plain subprocess (not isolation).

    from envs.sandbox import Limits, run
    result = run("print(open('data.txt').read())", files={"data.txt": "hi"},
                 limits=Limits(wall_s=5))
    result.status        # "ok" | "runtime_error" | "timeout" | "resource_limit" | "sandbox_error"
    result.stdout        # "hi\\n"

``code`` runs as ``python3 -I -S /sandbox/main.py`` under the system interpreter, read-only, its
cwd a writable work dir holding ``files``. ``backend="auto"`` takes Docker when an engine answers,
else bubblewrap, else a plain subprocess (which warns once that it is no isolation boundary).
``Limits`` are enforced from outside the guest, and nothing of a run outlives ``run``.
``prepare(limits, backend)`` starts a sandbox before its program is known (a ``Guest``).

``docs/sandboxes.md`` is the manual: what the guest sees, each status, how each limit is
enforced, what each backend isolates and what it does not, the fork server, and the measured
costs. The modules, in the order a run goes through them:

    front         run, prepare, Guest; choose_backend, available
    limits        Limits, SandboxResult and its statuses, the watch that stops a run
    workdir       runs_root, the checked files, the run's folder, files_written
    process       the subprocess backend and a fresh bwrap per run: the launcher
    cgroups       the run's pids and memory cgroups; killing and waiting for processes
    forkserver/   bwrap's fork server: client (this process) and server.py (the guest program)
    docker        the docker backend and its image
    settings      what a caller may change (below)

Settings (``settings``): ``RUNS_ROOT``, ``RAM_ROOT_MIN_FREE_MB``, ``FORK_SERVER``,
``MAX_WAITING`` and ``MAX_PRELOADED`` are read at each use; set them here
(``envs.sandbox.FORK_SERVER = False``), and this package passes the value on to ``settings``.
"""

from __future__ import annotations

import sys
import types

from envs.sandbox import settings
from envs.sandbox.docker import IMAGE_REPOSITORY, build_image, image_tag
from envs.sandbox.forkserver.client import preload
from envs.sandbox.front import Guest, available, choose_backend, prepare, run, unavailable_reason
from envs.sandbox.limits import (
    BACKENDS,
    GUEST_UID,
    PYTHON,
    SUBPROCESS_UID,
    Limits,
    SandboxResult,
    SandboxStatus,
)
from envs.sandbox.workdir import runs_root

__all__ = [
    "BACKENDS",
    "FORK_SERVER",
    "GUEST_UID",
    "IMAGE_REPOSITORY",
    "MAX_PRELOADED",
    "MAX_WAITING",
    "PYTHON",
    "RAM_ROOT_MIN_FREE_MB",
    "RUNS_ROOT",
    "SUBPROCESS_UID",
    "Guest",
    "Limits",
    "SandboxResult",
    "SandboxStatus",
    "available",
    "build_image",
    "choose_backend",
    "image_tag",
    "preload",
    "prepare",
    "run",
    "runs_root",
    "unavailable_reason",
]


def _setting(name: str) -> property:
    """``envs.sandbox.NAME``, read from and written to ``settings.NAME``."""
    return property(lambda _: getattr(settings, name), lambda _, value: setattr(settings, name, value),
                    doc=f"``envs.sandbox.settings.{name}``")


class _Package(types.ModuleType):
    """``envs.sandbox`` itself: its settings (``settings.NAMES``) are properties that read and
    write ``envs.sandbox.settings``, where the modules that use them look, so that
    ``envs.sandbox.FORK_SERVER = False`` turns the fork server off."""

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *settings.NAMES})


for _name in settings.NAMES:
    setattr(_Package, _name, _setting(_name))
sys.modules[__name__].__class__ = _Package
