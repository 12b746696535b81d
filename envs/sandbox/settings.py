"""The settings a caller may change, each read where it is used, at each use.

Set them on the package, ``envs.sandbox.FORK_SERVER = False``, which writes them here (the
package forwards these names); the modules of ``envs.sandbox`` read them here.
"""

from __future__ import annotations

RUNS_ROOT: str | None = None
"""The folder that holds each run's temp dir (and bwrap's fork server's runs folder). None:
``$TMPDIR`` when it is set, else ``/dev/shm`` when that is a writable tmpfs with
``RAM_ROOT_MIN_FREE_MB`` free, else the system's temp dir. In RAM, a run's few folders and files
cost the host less CPU than on a disk filesystem (ext4 looks for an inode to reuse at every
create; ``docs/sandboxes.md`` has the figure). What a guest writes there is also charged to its
memory cgroup (``memory_mb``), as well as counted against ``disk_mb``. Read at each run (the fork
server's folder: at its start)."""

RAM_ROOT_MIN_FREE_MB = 1024
"""MiB that ``/dev/shm`` must have free to be the default ``RUNS_ROOT`` (checked once)."""

FORK_SERVER = True
"""bwrap runs are forks of one warm sandboxed interpreter per process
(``envs.sandbox.forkserver``; ``docs/sandboxes.md`` says what each run still gets of its own).
False: every run starts its own bwrap and interpreter. Read at each run; the server needs root,
a pids cgroup and capabilities in bwrap's user namespace, and without them every run starts its
own sandbox (said once)."""

MAX_WAITING = 32
"""Guests started ahead and not yet given their program, at most, per process (each holds an
idle interpreter, ~10 MB); ``prepare`` beyond it gives a guest that starts in its ``run``."""

MAX_PRELOADED = 16
"""Programs ``preload`` keeps for the fork server to compile, at most (more are ignored)."""

NAMES = ("RUNS_ROOT", "RAM_ROOT_MIN_FREE_MB", "FORK_SERVER", "MAX_WAITING", "MAX_PRELOADED")
"""The settings above: the names ``envs.sandbox`` forwards here."""
