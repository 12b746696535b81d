"""envs.sandbox: an escape corpus over the isolating backends (bwrap, docker), the resource cases
over every backend, the sandbox's own failures, and input checks that run nothing.

A backend that is not available here skips with the reason (CI starts dockerd and installs
bubblewrap first, so both run there)."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import importlib.util
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

import envs.sandbox as sandbox
from envs.sandbox import Limits, SandboxResult, available, run
from envs.sandbox import cgroups as sb_cgroups
from envs.sandbox import docker as sb_docker
from envs.sandbox import front as sb_front
from envs.sandbox import process as sb_process
from envs.sandbox import workdir as sb_workdir
from envs.sandbox.forkserver import client as sb_forks

REPO = Path(__file__).resolve().parents[2]
ISOLATING = ("bwrap", "docker")
# test ids -> (backend, sandbox.FORK_SERVER): bwrap runs both through its fork server (the
# default) and each in its own fresh bwrap
MODES = {"docker": ("docker", True), "bwrap": ("bwrap", True), "bwrap-fresh": ("bwrap", False),
         "subprocess": ("subprocess", True)}


def _need(backend: str) -> str:
    if not available(backend):
        pytest.skip(f"{backend} sandbox unavailable: {sandbox.unavailable_reason(backend)}")
    return backend


def _fork_server_possible() -> bool:
    """Root with a v1 pids cgroup: where the fork server must come up."""
    return os.geteuid() == 0 and "pids" in sb_cgroups.cgroup_parents()


def _mode(mode: str, monkeypatch) -> str:
    """The backend of ``mode``, with the fork server on or off; where it can run the server
    must be up (it is the default path: a silent fallback would leave it untested)."""
    name, forks = MODES[mode]
    _need(name)
    monkeypatch.setattr(sandbox, "FORK_SERVER", forks)
    if name == "bwrap" and forks and _fork_server_possible():
        assert sb_forks._FORKS.get() is not None, sb_forks._FORKS.off
    return name


@pytest.fixture(params=list(MODES))
def backend(request, monkeypatch) -> str:
    return _mode(request.param, monkeypatch)


@pytest.fixture(params=["bwrap", "bwrap-fresh", "docker"])
def isolating(request, monkeypatch) -> str:
    return _mode(request.param, monkeypatch)


@pytest.fixture(autouse=True)
def _fork_server_back_on():
    """A test that breaks the host on purpose may turn the fork server off; not for the next."""
    yield
    sb_forks._FORKS.off = ""


@pytest.fixture(autouse=True)
def _quiet_subprocess_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "envs.sandbox: the 'subprocess' backend", RuntimeWarning)
        yield


def _marked(marker: str) -> str:
    """Code naming the guest's processes ``marker`` (children inherit it), to find survivors."""
    return f"import ctypes\nctypes.CDLL(None).prctl(15, {marker.encode()!r}, 0, 0, 0)\n"


def _live(marker: str, zombies: bool = False) -> list[int]:
    """Live processes named ``marker``; with ``zombies``, those not yet reaped too."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if comm == marker and (zombies or state not in "ZX"):
            out.append(int(pid))
    return out


def _assert_no_survivors(marker: str) -> None:
    deadline = time.monotonic() + 1.0  # SIGKILLed processes may take a moment to exit
    while (left := _live(marker)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert left == [], f"processes outlived the run: {left}"


def _marker() -> str:
    return "sbx" + uuid.uuid4().hex[:10]


def go(code: str, backend: str, ahead: bool, files=None, limits: Limits | None = None
       ) -> SandboxResult:
    """``run``, or the same run through a sandbox started ahead (``prepare``), which waits a
    moment before its program comes."""
    if not ahead:
        return run(code, files=files, limits=limits, backend=backend)
    guest = sandbox.prepare(limits, backend)
    time.sleep(0.2)
    return guest.run(code, files=files)


def _cgroups_here() -> set[str]:
    cgroup = sb_cgroups.Cgroup(1, 1 << 30)
    cgroup.close()
    return set(cgroup.dirs)


# --- normal programs -------------------------------------------------------------------------

def test_normal_program(backend):
    code = ("import os, sys\n"
            "print(open('data.txt').read().upper(), sorted(os.listdir('.')))\n"
            "open('out.txt', 'w').write('made')\n"
            "open('sub/changed.txt', 'a').write('+')\n"
            "open('conftest.py', 'w').write('import pytest')\n"
            "os.remove('gone.txt')\n"
            "sys.stderr.write('to stderr')\n")
    files = {"data.txt": "hello", "sub/changed.txt": b"v1", "sub/same.txt": "kept", "gone.txt": ""}
    r = run(code, files=files, backend=backend)
    assert r == SandboxResult(status="ok", stdout="HELLO ['data.txt', 'gone.txt', 'sub']\n",
                              stderr="to stderr", exit_code=0, wall_s=r.wall_s, backend=backend,
                              files_written=("conftest.py", "out.txt", "sub/changed.txt"),
                              detail="")
    assert 0 < r.wall_s < 10


def test_runtime_error_and_exit_code(backend):
    r = run("import sys\nprint('before')\nsys.exit(7)", backend=backend)
    assert (r.status, r.exit_code, r.stdout, r.detail) == ("runtime_error", 7, "before\n", "exit code 7")
    r = run("raise ValueError('boom')", backend=backend)
    assert r.status == "runtime_error" and r.exit_code == 1 and "ValueError: boom" in r.stderr
    r = run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", backend=backend)
    assert (r.status, r.exit_code, r.detail) == ("runtime_error", 128 + 11, "killed by SIGSEGV")


def test_guest_interpreter_is_isolated_python(backend):
    code = ("import os, sys\n"
            "print(sys.flags.isolated, sys.flags.no_site, sys.executable, os.getcwd() in sys.path, "
            "'' in sys.path, any('site-packages' in p or 'venv' in p for p in sys.path), "
            "sorted(k for k in os.environ if k.startswith(('PYTHON', 'VIRTUAL'))))\n"
            "print(os.getuid() if os.getuid() != 65534 else 'nobody')\n")
    r = run(code, backend=backend)
    assert r.status == "ok", r.stderr
    first, second = r.stdout.splitlines()
    assert first == "1 1 /usr/bin/python3 False False False []"
    if os.geteuid() == 0 and backend == "subprocess":  # never the uid of bwrap's fork server
        assert second == str(sandbox.SUBPROCESS_UID) != str(sandbox.GUEST_UID)
    else:
        assert second == ("nobody" if os.geteuid() == 0 or backend == "docker" else str(os.getuid()))


def _at_once(runs: int, one: Callable[[int], SandboxResult]) -> dict[int, SandboxResult]:
    """``one(i)`` for each i, all on their own threads at once."""
    results: dict[int, SandboxResult] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, one(i))) for i in range(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_runs_at_once_stay_apart(backend):
    results = _at_once(4, lambda i: run(f"print(open('n.txt').read() * 2)\nopen('w{i}', 'w')",
                                        files={"n.txt": str(i)}, backend=backend))
    for i, r in results.items():
        assert (r.status, r.stdout, r.files_written) == ("ok", f"{i}{i}\n", (f"w{i}",))


def test_files_written_are_named_in_utf8_text(backend):
    """A guest names files with any bytes: each byte that is not UTF-8 reads ``\\xNN``; valid
    names stay as they are; a given file left as given is not listed."""
    code = ("import os\n"
            "open(b'\\xff\\xfe.txt', 'w').close()\n"
            "os.mkdir(b'd\\xff')\n"
            "open(b'd\\xff/ok.txt', 'w').close()\n"
            "open('caf\\u00e9.txt', 'w').close()\n"
            "open('given.txt', 'w').write('same')\n")
    r = run(code, files={"given.txt": "same"}, backend=backend)
    assert r.status == "ok", r
    assert r.files_written == ("\\xff\\xfe.txt", "caf\u00e9.txt", "d\\xff/ok.txt")
    assert [name.encode("utf-8") for name in r.files_written] == [
        b"\\xff\\xfe.txt", b"caf\xc3\xa9.txt", b"d\\xff/ok.txt"]


# --- sandboxes started ahead of their program (prepare) --------------------------------------

def test_a_guest_started_ahead_runs_like_run(backend):
    """The sandbox starts first (bwrap, subprocess: its interpreter waits), the program comes
    later: the result is ``run``'s (argv, __main__, files, files_written, exit code), the wait
    is not the program's (it outlasts ``wall_s``), and a guest runs one program."""
    code = ("import sys\n"
            "print(sys.argv == [__file__], __name__, open('data.txt').read())\n"
            "open('out.txt', 'w').write('made')\n"
            "if __name__ == '__main__':\n"
            "    sys.exit(4)\n")
    cold = run(code, files={"data.txt": "hi"}, backend=backend)
    guest = sandbox.prepare(Limits(wall_s=1.0), backend)
    time.sleep(1.3)
    warm = guest.run(code, files={"data.txt": "hi"})
    assert warm == dataclasses.replace(cold, wall_s=warm.wall_s)
    assert (warm.status, warm.exit_code, warm.stdout) == ("runtime_error", 4, "True __main__ hi\n")
    assert warm.files_written == ("out.txt",) and warm.wall_s < 1.0
    with pytest.raises(RuntimeError, match="already ran its program"):
        guest.run("print(1)")


@pytest.mark.parametrize("mode", ["subprocess", "bwrap-fresh", "bwrap"])
@pytest.mark.parametrize("how", ["close", "collected"])
def test_a_guest_never_run_leaves_nothing(mode, how, monkeypatch):
    """A guest closed (or garbage-collected) before its program: its processes (an interpreter
    waiting for its go; through the fork server, the run's two) killed and reaped, its work
    dir and cgroups removed, and it runs nothing afterwards."""
    _mode(mode, monkeypatch)
    guest = sandbox.prepare(Limits(), MODES[mode][0])
    guest._join_starter()  # prepare returned at once; a fresh launch ran on a thread
    process = guest._process
    root, cgroups = process.workdir.root, list(process.cgroup.dirs.values())
    time.sleep(0.2)
    if isinstance(process, sb_forks.ForkedRun):
        pids = [int(p) for p in (cgroups[0] / "cgroup.procs").read_text().split()]
        assert mode == "bwrap" and len(pids) == 2  # its init and the program's process, waiting
    else:
        pids = [process.proc.pid]
    assert all(Path(f"/proc/{pid}").exists() for pid in pids) and root.exists()
    if how == "close":
        guest.close()
        with pytest.raises(RuntimeError, match="already ran"):
            guest.run("print(1)")
    else:
        del guest, process
        gc.collect()
    deadline = time.monotonic() + 2  # the fork server's processes are reaped by the server
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)  # killed and reaped
    assert not root.exists() and not any(d.exists() for d in cgroups)
    assert sb_front._WAITING == 0


def test_guests_waiting_are_capped(monkeypatch):
    """Past MAX_WAITING guests waiting for their program, ``prepare`` gives one that starts in
    its ``run``; both kinds run, and the count comes back to zero."""
    _need("subprocess")
    monkeypatch.setattr(sandbox, "MAX_WAITING", 1)
    first, second = sandbox.prepare(Limits(), "subprocess"), sandbox.prepare(Limits(), "subprocess")
    first._join_starter()
    assert first._process is not None and second._process is None and second._starter is None
    assert sb_front._WAITING == 1
    assert second.run("print(2)").stdout == "2\n" and first.run("print(1)").stdout == "1\n"
    assert sb_front._WAITING == 0


# --- bwrap's fork server ---------------------------------------------------------------------

def _need_fork_server(monkeypatch) -> None:
    if not _fork_server_possible():
        pytest.skip("the fork server needs root and a v1 pids cgroup (the guest uid, its runs' cgroups)")
    _mode("bwrap", monkeypatch)


def test_fork_server_runs_start_fresh_and_apart(monkeypatch):
    """Runs at once, each a fork of the same warm interpreter: each its own pid namespace (its
    init and itself), no capability, loopback only, no other run's folder nor any cgroup file,
    and nothing an earlier program left in the interpreter."""
    _need_fork_server(monkeypatch)
    code = ("import os, sys\n"
            "print(os.getpid(), sorted(p for p in os.listdir('/proc') if p.isdigit()), "
            "os.listdir('/runs'), os.listdir('/cg'))\n"
            "caps = dict(line.split(':') for line in open('/proc/self/status') if line.startswith('Cap'))\n"
            "print(sorted((name, value.strip()) for name, value in caps.items()))\n"
            "print([line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:]])\n"
            "print(hasattr(sys, 'left_behind'), sorted(os.listdir('.')))\n"
            "sys.left_behind = True\nopen('mine', 'w')\n")
    for _ in range(2):  # the second round runs after programs that set sys.left_behind
        results = _at_once(4, lambda i: run(code, files={f"n{i}.txt": "x"}, backend="bwrap"))
        for i, r in results.items():
            assert r.status == "ok", r
            none = "0000000000000000"
            assert r.stdout.splitlines() == ["2 ['1', '2'] [] []", str(sorted(
                (name, none) for name in ("CapAmb", "CapBnd", "CapEff", "CapInh", "CapPrm"))), "['lo']",
                                             f"False ['n{i}.txt']"]
            assert r.files_written == ("mine",)


def test_fork_server_runs_at_once_have_net_namespaces_of_their_own(monkeypatch):
    """Net namespaces are kept and given again (``_NETS`` in the fork server), but never to two
    runs at once: three runs that overlap (each holds the same port half a second) all bind it,
    each in a net namespace of its own; later runs get them again, loopback up, with no socket
    of an earlier run left (the port it held binds again)."""
    _need_fork_server(monkeypatch)
    code = ("import os, socket, time\n"
            "server = socket.create_server(('127.0.0.1', 45678))\n"
            "time.sleep(0.5)\n"
            "print(os.readlink('/proc/self/ns/net'))\n")
    results = _at_once(3, lambda i: run(code, backend="bwrap"))
    assert all(r.status == "ok" for r in results.values()), results
    assert len({r.stdout for r in results.values()}) == 3
    later = [run(code.replace("time.sleep(0.5)", "pass"), backend="bwrap") for _ in range(3)]
    assert all(r.status == "ok" for r in later), later
    assert any(r.stdout in {r.stdout for r in results.values()} for r in later)  # given again


def test_fork_server_takes_many_runs_at_once(monkeypatch):
    """48 runs at once through one server (each run's first process briefly counts in the
    server's pids cgroup): every one runs."""
    _need_fork_server(monkeypatch)
    results = _at_once(48, lambda i: run(f"print({i})", backend="bwrap"))
    assert [results[i].stdout for i in range(48)] == [f"{i}\n" for i in range(48)]


_EXITS = [
    "import sys\nprint(sys.argv == ['/sandbox/main.py'], __name__, __file__)\nsys.exit(7)",
    "import sys\nsys.exit('bye')",
    "import sys\nsys.exit(300)",
    "def f():\n    raise ValueError('boom')\nf()",
    "raise KeyboardInterrupt",
    "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)",
    "import sys\nprint(repr(sys.stdin.read()))\nsys.stdout.write('no newline')",
    "import threading, time\n"
    "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
    "print('main done')",
    "import atexit\natexit.register(print, 'atexit ran')\nraise SystemExit(3)",
    "import __main__, sys\nprint(__main__.__file__, sys.modules['__main__'] is __main__)\n"
    "class C: pass\nimport pickle\nprint(type(pickle.loads(pickle.dumps(C()))).__name__)",
    "import socket\nserver = socket.create_server(('127.0.0.1', 0))\n"
    "socket.create_connection(server.getsockname(), timeout=2)\nprint('loopback up')",
]


@pytest.mark.parametrize("preloaded", [False, True], ids=["compiled", "preloaded"])
@pytest.mark.parametrize("code", _EXITS)
def test_fork_server_runs_end_as_a_fresh_interpreter(code, preloaded, monkeypatch):
    """Each program's result through the fork server is the fresh bwrap's: exit codes,
    SystemExit's message, an uncaught exception's traceback (less the boot's own frames),
    KeyboardInterrupt's SIGINT, threads joined, atexit run, stdout flushed; the same when the
    server compiled the program beforehand (``preload``)."""
    _need_fork_server(monkeypatch)
    if preloaded:
        monkeypatch.setattr(sb_forks, "_PRELOADED", [])
        sandbox.preload(code)
    forked = run(code, backend="bwrap")
    monkeypatch.setattr(sandbox, "FORK_SERVER", False)
    fresh = run(code, backend="bwrap")

    def seen(r: SandboxResult) -> tuple:
        stderr = "".join(line for line in r.stderr.splitlines(keepends=True)
                         if not line.startswith('  File "<string>"'))
        return r.status, r.exit_code, r.stdout, stderr, r.files_written, r.detail

    assert seen(forked) == seen(fresh)


def _fork_server_module():
    """``envs/sandbox/forkserver/server.py`` imported here (the guest program's functions,
    nothing run)."""
    spec = importlib.util.spec_from_file_location("fork_server_under_test", sb_forks._FORK_SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_preloaded_program_is_compiled_once_and_used_only_for_its_exact_text(tmp_path):
    server = _fork_server_module()
    server._preload("x = 1\nprint(x)\n")
    server._preload("def f(:\n")  # a syntax error: its runs report it
    server._preload("print(1 is 1)\n")  # a compile-time SyntaxWarning: its runs print it
    assert list(server._COMPILED) == [b"x = 1\nprint(x)\n"]
    main = tmp_path / "main.py"
    main.write_bytes(b"x = 1\nprint(x)\n")
    assert server._code(str(main)) is server._COMPILED[b"x = 1\nprint(x)\n"]
    assert server._COMPILED[b"x = 1\nprint(x)\n"].co_filename == "/sandbox/main.py"
    main.write_bytes(b"x = 1\nprint(x)\n\n")  # one byte more: compiled as it is
    code = server._code(str(main))
    assert code is not server._COMPILED[b"x = 1\nprint(x)\n"] and code.co_filename == str(main)


def test_preload_keeps_what_runs_would_print_and_reaches_a_new_server(monkeypatch):
    _need_fork_server(monkeypatch)
    monkeypatch.setattr(sb_forks, "_PRELOADED", [])
    sandbox.preload("print(1 is 1)\n")
    result = run("print(1 is 1)\n", backend="bwrap")
    assert result.stdout == "True\n" and "SyntaxWarning" in result.stderr
    sent = []
    original = sb_forks.ForkServer.preload
    monkeypatch.setattr(sb_forks.ForkServer, "preload",
                        lambda self, code: (sent.append(code), original(self, code)))
    sb_forks._FORKS.server.close()  # gone: the next run starts a server, given every preload
    assert run("print(2)", backend="bwrap").stdout == "2\n" and sent == ["print(1 is 1)\n"]


def test_preload_refuses_bad_arguments_and_holds_at_most_its_cap(monkeypatch):
    monkeypatch.setattr(sb_forks, "_PRELOADED", [])
    with pytest.raises(TypeError, match="source as a str"):
        sandbox.preload(b"print(1)")
    with pytest.raises(ValueError, match="at most 65536 bytes"):
        sandbox.preload("x = 1\n" * 20000)
    for i in range(sandbox.MAX_PRELOADED + 3):
        sandbox.preload(f"print({i})")
    sandbox.preload("print(0)")  # again: once
    assert sb_forks._PRELOADED == [f"print({i})" for i in range(sandbox.MAX_PRELOADED)]


def test_fork_server_that_cannot_start_is_said_once_and_runs_go_on(monkeypatch, tmp_path):
    _need_fork_server(monkeypatch)
    broken = tmp_path / "server.py"
    broken.write_text("import sys\nsys.stderr.write('no server today')\nraise SystemExit(5)\n")
    monkeypatch.setattr(sb_forks, "_FORK_SOURCE", broken)
    monkeypatch.setattr(sb_forks, "_FORKS", sb_forks._Forks())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run("print(1)", backend="bwrap").stdout == "1\n"  # in its own bwrap
        assert run("print(2)", backend="bwrap").stdout == "2\n"
    assert [str(w.message) for w in caught] == [
        "envs.sandbox: the bwrap fork server is off (a trivial program failed: sandbox_error: "
        "the bwrap fork server exited with 5: no server today); every bwrap run starts its own "
        "sandbox"]


def test_fork_server_run_that_cannot_be_set_up_is_a_sandbox_error(monkeypatch):
    _need_fork_server(monkeypatch)
    made = sb_cgroups.Cgroup.__init__

    def broken(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.dirs["pids"] = Path("/nonexistent/agent-rl-test-cgroup")

    monkeypatch.setattr(sb_cgroups.Cgroup, "__init__", broken)
    r = run("print(1)", backend="bwrap")
    assert r.status == "sandbox_error" and r.stdout == "" and r.exit_code is None
    assert r.detail.startswith("bwrap could not start the program: namespaces: [Errno 2]"), r.detail
    assert "/cg/pids/agent-rl-test-cgroup/cgroup.procs" in r.detail
    monkeypatch.undo()
    assert run("print(1)", backend="bwrap").stdout == "1\n"


def test_fork_server_run_cannot_reach_its_init_or_the_server(monkeypatch):
    """The program (no capabilities) cannot read its pid 1's memory, fds or root (pid 1 keeps
    the capabilities it mounted with), signal it, mount, unmount the covers over ``/runs`` and
    ``/cg``, or make a user namespace; it has no other process to signal; the server lives on."""
    _need_fork_server(monkeypatch)
    code = ("import ctypes, os, signal\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "for path in ('/proc/1/environ', '/proc/1/mem', '/proc/1/fd/2', '/proc/1/root/runs'):\n"
            "    try:\n"
            "        os.listdir(path) if path.endswith('runs') else open(path, 'rb').read(1)\n"
            "        print(path, 'OPEN')\n"
            "    except OSError as exc:\n"
            "        print(path, type(exc).__name__)\n"
            "print('mount', libc.mount(b'none', b'/work', b'tmpfs', 0, None), ctypes.get_errno())\n"
            "print('umount', libc.umount2(b'/runs', 2), ctypes.get_errno())\n"
            "print('userns', libc.unshare(0x10000000), ctypes.get_errno())\n"
            "os.kill(1, signal.SIGKILL)\n"
            "print('init alive', os.path.exists('/proc/1'))\n"
            "try:\n"
            "    os.kill(-1, signal.SIGKILL)\n"
            "except OSError as exc:\n"
            "    print('kill -1', type(exc).__name__)\n")
    r = run(code, backend="bwrap")
    lines = r.stdout.splitlines()
    assert lines[:4] == ["/proc/1/environ PermissionError", "/proc/1/mem PermissionError",
                         "/proc/1/fd/2 PermissionError", "/proc/1/root/runs PermissionError"], r
    assert lines[4:] == ["mount -1 1", "umount -1 1", "userns -1 28", "init alive True",
                         "kill -1 ProcessLookupError"], r  # EPERM, EPERM, ENOSPC; no one to kill
    assert r.status == "ok", r
    assert run("print(1)", backend="bwrap").stdout == "1\n"


def test_a_forked_process_runs_through_its_own_fork_server(monkeypatch):
    """``os.fork`` after the server started: the child starts its own (the parent's socket
    closed in the child), the parent's goes on."""
    _need_fork_server(monkeypatch)
    parent_server = sb_forks._FORKS.get()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without pytest's teardown
        try:
            r = run("print(2)", backend="bwrap")
            mine = sb_forks._FORKS.server
            os.write(write_end, f"{r.stdout.strip()} {mine is not None and mine.proc.pid}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        stdout, server_pid = f.read().split()
    os.waitpid(pid, 0)
    assert stdout == "2" and int(server_pid) != parent_server.proc.pid
    assert sb_forks._FORKS.get() is parent_server and run("print(1)", backend="bwrap").stdout == "1\n"
    left = list(Path(sandbox.runs_root()).glob(f"agent-rl-forks-{pid}-*"))
    assert len(left) == 1  # the child left by os._exit: no atexit, its runs folder stayed
    sb_forks._sweep_runs_dirs()  # as every server start does
    assert not any(p.exists() for p in left) and parent_server.runs_dir.exists()


@pytest.mark.slow
def test_a_fork_server_that_stops_reading_fails_the_run_not_the_program(monkeypatch):
    """A server stopped (SIGSTOP) never starts the run: past ``wall_s`` that is a
    ``sandbox_error``, not the program's timeout; once it goes on, so do runs."""
    _need_fork_server(monkeypatch)
    serving = _serving_interpreter()
    os.kill(serving, signal.SIGSTOP)
    try:
        r = run("print(1)", limits=Limits(wall_s=1), backend="bwrap")
    finally:
        os.kill(serving, signal.SIGCONT)
    assert r.status == "sandbox_error" and r.exit_code is None, r
    assert r.detail.startswith("the bwrap fork server did not start the program within 1 s"), r
    assert run("print(1)", backend="bwrap").stdout == "1\n"


def test_a_fork_server_stopped_mid_run_fails_the_run_not_the_program(monkeypatch):
    """The server reports each run's end; stopped after the run started, it reports nothing:
    the run's processes have ended by the wall-clock stop, so it is a ``sandbox_error``, not
    the program's timeout."""
    _need_fork_server(monkeypatch)
    monkeypatch.setattr(sb_forks, "_DRAIN_AFTER_STOP_S", 0.5)
    guest = sandbox.prepare(Limits(wall_s=1.5), "bwrap")  # its processes made, waiting
    time.sleep(0.2)
    serving = _serving_interpreter()
    os.kill(serving, signal.SIGSTOP)
    try:
        r = guest.run("print('done')")
    finally:
        os.kill(serving, signal.SIGCONT)
    assert r.status == "sandbox_error" and r.exit_code is None and r.stdout == "done\n", r
    assert r.detail.startswith("the bwrap fork server did not report the end of the run"), r
    assert run("print(1)", backend="bwrap").stdout == "1\n"


def _serving_interpreter() -> int:
    """The fork server's serving process: the interpreter bwrap started forks it (pid 1 of a pid
    namespace of its own) and waits."""
    def parent(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    def named(pid: int) -> str:
        return Path(f"/proc/{pid}/comm").read_text().strip()

    live = _live_children_of(sb_forks._FORKS.get().proc.pid)
    started = [p for p in live if named(p) == "python3" and named(parent(p)) == "bwrap"]
    assert len(started) == 1, live
    serving = [p for p in live if parent(p) == started[0]]
    assert len(serving) == 1 and named(serving[0]) == "python3", live
    return serving[0]


def _live_children_of(pid: int) -> list[int]:
    """Every live descendant of ``pid``."""
    parents: dict[int, int] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    found, frontier = [], [pid]
    while frontier:
        top = frontier.pop()
        kids = [p for p, parent in parents.items() if parent == top]
        found += kids
        frontier += kids
    return found


def test_runs_go_under_the_runs_root(monkeypatch, tmp_path):
    """RUNS_ROOT when set; else $TMPDIR when set; else /dev/shm when it is a tmpfs with room;
    else the system's temp dir. A run's work dir is made there."""
    monkeypatch.delenv("TMPDIR", raising=False)
    sb_workdir._ram_root.cache_clear()
    shm_ok = any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in open("/proc/self/mounts"))
    default = "/dev/shm" if shm_ok else tempfile.gettempdir()
    assert sandbox.runs_root() == default
    if _fork_server_possible() and sb_forks._FORKS.get() is not None:
        assert sb_forks._FORKS.get().runs_dir.parent == Path(default)
    monkeypatch.setattr(sandbox, "RAM_ROOT_MIN_FREE_MB", 1 << 40)  # no tmpfs has that room
    sb_workdir._ram_root.cache_clear()
    try:
        assert sandbox.runs_root() == tempfile.gettempdir()
    finally:
        monkeypatch.undo()
        sb_workdir._ram_root.cache_clear()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read $TMPDIR again
    assert sandbox.runs_root() == str(tmp_path)
    runs = Path(tempfile.mkdtemp(dir="/tmp"))  # the guest's uid must reach it: not tmp_path
    try:
        runs.chmod(0o711)
        monkeypatch.setattr(sandbox, "RUNS_ROOT", str(runs))
        r = run("import os\nprint(os.getcwd())", backend="subprocess")
        assert r.stdout.startswith(str(runs / "agent-rl-sandbox-")), r
        assert list(runs.iterdir()) == []
    finally:
        runs.rmdir()


def test_a_work_dir_cleaned_twice_leaves_its_parent_alone(tmp_path):
    """A second cleanup finds the dir gone and changes nothing around it (it once chmod'ed the
    parent, the fork server's runs folder, to 0700: every later run failed to mount)."""
    tmp_path.chmod(0o755)
    workdir = sb_workdir.WorkDir(None, parent=tmp_path)
    locked = workdir.work / "locked" / "deeper"
    locked.mkdir(parents=True)
    locked.parent.chmod(0o000)  # a guest may leave a dir like this
    workdir.cleanup()
    workdir.cleanup()
    assert not workdir.root.exists() and (tmp_path.stat().st_mode & 0o777) == 0o755


def test_fork_server_closed_leaves_nothing(monkeypatch):
    _need_fork_server(monkeypatch)
    server = sb_forks.ForkServer()
    assert server.run("print(1)", {}, Limits()).stdout == "1\n"
    cgroups = list(server.cgroup.dirs.values())
    assert server.runs_dir.exists() and all(d.exists() for d in cgroups) and server.proc.poll() is None
    server.close()
    assert server.proc.poll() is not None and not server.runs_dir.exists()
    assert not any(d.exists() for d in cgroups)
    r = server.run("print(1)", {}, Limits())
    assert r.status == "sandbox_error", r


# --- the trainer's environment: in no process a guest can read ------------------------------

_ENVIRON_WALK = """
import os
for pid in sorted(filter(str.isdigit, os.listdir("/proc")), key=int):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            print(pid, f.read().replace(b"\\0", b" ").decode("latin-1"))
    except OSError as exc:
        print(pid, type(exc).__name__)
"""


def _secret(monkeypatch) -> str:
    """A secret put in this process's environment (as an API key would be)."""
    secret = "sk-" + uuid.uuid4().hex
    monkeypatch.setenv("AGENT_RL_TEST_API_KEY", secret)
    return secret


def test_no_guest_reads_the_trainers_environment(backend, monkeypatch):
    """Each guest prints every ``/proc/*/environ`` it can read while a bwrap fork server, started
    after the secret was set, is live (as root: its processes run as the bwrap guests' uid):
    the secret is in none. (A subprocess guest once read it from the server's bwrap processes.)"""
    if backend == "subprocess" and os.geteuid() != 0:
        pytest.skip("as non-root a subprocess guest is this user and reads its processes "
                    "(the subprocess backend is no isolation, and says so)")
    secret = _secret(monkeypatch)
    server = sb_forks.ForkServer() if _fork_server_possible() and available("bwrap") else None
    try:
        if server is not None:
            assert server.run("print(1)", {}, Limits()).stdout == "1\n" and server.alive()
        r = run(_ENVIRON_WALK, backend=backend)
    finally:
        if server is not None:
            server.close()
    assert r.status == "ok", r
    assert "LANG=C.UTF-8" in r.stdout  # it read its own environment at least
    assert secret not in r.stdout


def test_the_fork_server_holds_no_secret_and_no_process_of_its_uid_reads_it(monkeypatch):
    """The fork server's processes (bwrap's, which ``--clearenv`` does not clean, and its
    interpreters) hold none of this process's environment, and a process of the guest uid on
    the host, outside any sandbox, cannot open the interpreters' ``/proc`` files (undumpable)."""
    _need_fork_server(monkeypatch)
    secret = _secret(monkeypatch)
    server = sb_forks.ForkServer()
    try:
        assert server.run("print(1)", {}, Limits()).stdout == "1\n"
        pids = [int(pid) for pid in sb_cgroups.read_lines(server.cgroup.dirs["pids"] / "cgroup.procs")]
        interpreters = {pid for pid in pids if "python" in os.readlink(f"/proc/{pid}/exe")}
        assert len(pids) == 4 and len(interpreters) == 2, pids  # bwrap twice, pid 1, the server
        assert not [pid for pid in pids if secret.encode() in Path(f"/proc/{pid}/environ").read_bytes()]
        uid = str(sandbox.GUEST_UID)
        walk = subprocess.run(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sandbox.PYTHON,
             "-I", "-S", "-c", _ENVIRON_WALK], env={}, capture_output=True, text=True, timeout=30)
    finally:
        server.close()
    assert walk.returncode == 0, walk.stderr
    assert secret not in walk.stdout
    seen = dict(line.split(" ", 1) for line in walk.stdout.splitlines())
    assert {seen[str(pid)] for pid in interpreters} == {"PermissionError"}, seen


# --- the escape corpus: bwrap and docker -----------------------------------------------------

_CONNECT = """
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=3)
    print("connected")
except OSError as exc:
    print("failed", type(exc).__name__)
"""


def _listener() -> socket.socket:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    return srv


@pytest.mark.parametrize("ahead", [False, True])
def test_no_tcp_to_the_host(isolating, ahead):
    with _listener() as srv:
        r = go(_CONNECT.format(port=srv.getsockname()[1]), isolating, ahead)
        assert r.status == "ok", r.stderr
        assert r.stdout.startswith("failed"), r.stdout
        with pytest.raises(BlockingIOError):
            srv.accept()  # nothing reached the listener


def test_subprocess_backend_is_not_isolation():
    """The same probes succeed under ``subprocess``: proof that the corpus can fail."""
    with _listener() as srv:
        r = run(_CONNECT.format(port=srv.getsockname()[1]), backend="subprocess")
        assert r.stdout == "connected\n"
        srv.settimeout(5)
        srv.accept()[0].close()
    r = run(f"print(open({str(REPO / 'pyproject.toml')!r}).read())", backend="subprocess")
    assert 'name = "agent-rl"' in r.stdout


def test_no_name_resolution(isolating):
    code = ("import socket\n"
            "for host in ('pypi.org', 'example.com'):\n"
            "    try:\n"
            "        print(host, socket.getaddrinfo(host, 443))\n"
            "    except OSError as exc:\n"
            "        print(host, 'failed', type(exc).__name__)\n")
    r = run(code, backend=isolating)
    assert r.status == "ok", r.stderr
    assert r.stdout.splitlines() == ["pypi.org failed gaierror", "example.com failed gaierror"]


@pytest.mark.parametrize("ahead", [False, True])
def test_files_outside_the_work_dir_are_invisible(isolating, tmp_path, ahead):
    secret = uuid.uuid4().hex
    planted = [tmp_path / "sentinel.txt", Path("/root") / f"agent-rl-sandbox-sentinel-{secret[:8]}"]
    targets = [*map(str, planted), str(REPO / "pyproject.toml"), "/etc/shadow",
               f"/proc/{os.getpid()}/environ"]
    try:
        for path in planted:
            path.write_text(secret)
        code = ("import os\n"
                f"for path in {targets!r}:\n"
                "    try:\n"
                "        print(path, 'READ', open(path).read())\n"
                "    except OSError as exc:\n"
                "        print(path, type(exc).__name__)\n"
                f"for d in {[str(tmp_path), '/root', str(REPO), '/tmp']!r}:\n"
                "    try:\n"
                "        print(d, os.listdir(d))\n"
                "    except OSError as exc:\n"
                "        print(d, type(exc).__name__)\n")
        r = go(code, isolating, ahead)
    finally:
        for path in planted:
            path.unlink(missing_ok=True)
    assert r.status == "ok", r.stderr
    out = r.stdout + r.stderr
    assert secret not in out and "READ" not in out and 'name = "agent-rl"' not in out, out
    lines = r.stdout.splitlines()
    assert all(line.endswith(("FileNotFoundError", "PermissionError")) for line in lines[:len(targets)])


@pytest.mark.parametrize("ahead", [False, True])
def test_writes_outside_the_work_dir_fail(isolating, tmp_path, ahead):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    stray = Path("/tmp") / f"agent-rl-sandbox-stray-{uuid.uuid4().hex[:8]}"
    beside = Path(sandbox.runs_root()) / f"agent-rl-sandbox-stray-{uuid.uuid4().hex[:8]}"
    targets = [str(victim), str(stray), str(beside), "/usr/lib/agent-rl-evil", "/sandbox/main.py", "/evil",
               "/etc/passwd", "/dev/evil"]
    code = (f"for path in {targets!r}:\n"
            "    try:\n"
            "        open(path, 'a').write('pwned')\n"
            "        print(path, 'WROTE')\n"
            "    except OSError as exc:\n"
            "        print(path, type(exc).__name__)\n")
    r = go(code, isolating, ahead)
    assert r.status == "ok", r.stderr
    wrote = [line for line in r.stdout.splitlines() if line.endswith("WROTE")]
    # the guest's /dev/shm is its own tmpfs: a runs root there is out of its sight
    assert wrote == [] or (wrote == [f"{beside} WROTE"] and beside.parent == Path("/dev/shm")), r.stdout
    assert victim.read_text() == "original"
    assert not stray.exists() and not Path("/usr/lib/agent-rl-evil").exists() and not Path("/evil").exists()
    assert not beside.exists()


# --- resource cases: every backend -----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("ahead", [False, True])
def test_fork_bomb(backend, ahead):
    marker = _marker()
    code = _marked(marker) + ("import os\n"
                              "while True:\n"
                              "    try:\n"
                              "        os.fork()\n"
                              "    except OSError:\n"
                              "        os._exit(3)\n")
    r = go(code, backend, ahead, limits=Limits(wall_s=20, processes=32))
    assert r.status in ("resource_limit", "runtime_error"), r
    assert r.wall_s < 20
    _assert_no_survivors(marker)


@pytest.mark.slow
def test_fork_bomb_that_swallows_errors_ends_at_the_wall_clock(backend):
    if backend == "subprocess" and "pids" not in _cgroups_here():
        pytest.skip("no pids cgroup here: the subprocess backend cannot find processes that "
                    "left its session")
    marker = _marker()
    code = _marked(marker) + ("import os, time\n"
                              "while True:\n"
                              "    try:\n"
                              "        if os.fork() == 0:\n"
                              "            os.setsid()\n"
                              "    except OSError:\n"
                              "        time.sleep(0.01)\n")
    r = run(code, limits=Limits(wall_s=2, processes=32), backend=backend)
    assert r.status == "timeout" and r.exit_code is None, r
    _assert_no_survivors(marker)


_LINGERING = """
import os, signal, time
r, w = os.pipe()
if os.fork() == 0:  # a daemon: a new session, then a second fork (its parent exits at once)
    os.setsid()
    if os.fork() == 0:
        os.write(w, b"d")
        time.sleep(60)
    os._exit(0)
if os.fork() == 0:  # a child that ignores SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.write(w, b"t")
    time.sleep(60)
os.close(w)
print(sorted(os.read(r, 1) + os.read(r, 1)), flush=True)
"""


@pytest.mark.parametrize("ending", ["exits", "times_out"])
def test_nothing_of_a_run_outlives_it(backend, ending):
    """A daemon that left the session and a child that ignores SIGTERM, both running when the
    program ends (or times out): right after ``run`` returns, no process of the run is left,
    not even a zombie (every one named by the marker it inherited, looked for in ``/proc``)."""
    if backend == "subprocess" and os.geteuid() != 0:
        pytest.skip("the subprocess backend gets a pid namespace only as root: without one, a "
                    "process that leaves the run's session outlives it (the module doc says so)")
    marker = _marker()
    code = _marked(marker) + _LINGERING + ("time.sleep(60)\n" if ending == "times_out" else "")
    r = run(code, limits=Limits(wall_s=1 if ending == "times_out" else 10), backend=backend)
    left = _live(marker, zombies=True)
    assert (r.status, r.stdout) == ("ok" if ending == "exits" else "timeout", f"{[100, 116]}\n"), r
    assert left == [], f"processes of the run left after it returned: {left}"


def test_subprocess_runs_without_a_pid_namespace_where_none_can_be_made(monkeypatch):
    """As root, a subprocess run is pid 2 of its own pid namespace (its ``sh`` init is pid 1);
    where ``unshare`` fails (a container without ``CAP_SYS_ADMIN``), runs go on without one."""
    _need("subprocess")
    if os.geteuid() != 0:
        pytest.skip("only root gives subprocess runs a pid namespace")
    code = "import os\nprint(os.getpid(), os.getppid())"
    assert run(code, backend="subprocess").stdout == "2 1\n"
    tool = sb_process.system_tool
    monkeypatch.setattr(sb_process, "system_tool", lambda name: "/bin/false" if name == "unshare" else tool(name))
    sb_process._pid_namespaces.cache_clear()
    try:
        r = run(code, backend="subprocess")
        assert not sb_process._pid_namespaces()
    finally:
        sb_process._pid_namespaces.cache_clear()
    assert r.status == "ok" and int(r.stdout.split()[0]) > 2, r


def test_allocate_10_gb(backend):
    r = run("x = b'x' * (10 * 1024 ** 3)\nprint('allocated')", backend=backend)
    assert r.status == "resource_limit" and r.detail == "memory over 512 MiB", r
    assert "allocated" not in r.stdout


@pytest.mark.slow
def test_memory_limit_covers_every_process(backend):
    """Four processes of 200 MB each under a 300 MB limit: one cgroup/container, not per process."""
    if backend != "docker" and "memory" not in _cgroups_here():
        pytest.skip("no writable memory cgroup here: only the per-process RLIMIT_AS applies")
    code = ("import os, time\n"
            "for _ in range(4):\n"
            "    if os.fork() == 0:\n"
            "        x = b'x' * (200 * 1024 ** 2)\n"
            "        time.sleep(3)\n"
            "        os._exit(0)\n"
            "codes = [os.waitstatus_to_exitcode(os.wait()[1]) for _ in range(4)]\n"
            "raise SystemExit(1 if any(codes) else 0)\n")
    r = run(code, limits=Limits(memory_mb=300), backend=backend)
    assert r.status == "resource_limit" and r.detail == "memory over 300 MiB", r


@pytest.mark.slow
def test_busy_loop_and_sleep_hit_the_wall_clock(backend):
    for code in ("while True: pass", "import time\ntime.sleep(3600)"):
        marker = _marker()
        child = "import os, time\nif os.fork() == 0:\n    time.sleep(3600)\n"  # a background child
        r = run(_marked(marker) + child + code, limits=Limits(wall_s=1.5, cpu_s=60), backend=backend)
        assert r.status == "timeout" and r.detail == "wall time over 1.5 s", r
        assert 1.5 <= r.wall_s < 1.5 + 1.5
        _assert_no_survivors(marker)


@pytest.mark.slow
def test_cpu_limit(backend):
    r = run("while True: pass", limits=Limits(wall_s=20, cpu_s=1), backend=backend)
    assert r.status == "timeout" and r.detail == "CPU time over 1 s", r
    assert r.wall_s < 10


def test_print_100_mb(backend):
    code = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1024 ** 2)\nprint('done')"
    r = run(code, backend=backend)
    assert r.status == "resource_limit", r.status
    assert r.detail == "output over 1000000 bytes on stdout or stderr"
    assert r.stdout == "x" * 1_000_000 and r.exit_code is None


def test_output_is_decoded_with_replacement(backend):
    r = run("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe end')", backend=backend)
    assert (r.status, r.stdout) == ("ok", "ok \ufffd\ufffd end")


@pytest.mark.slow
def test_disk_limit(backend):
    one_file = "open('big', 'wb').write(b'x' * 200 * 1024 ** 2)\nprint('wrote')"
    many = ("for i in range(200):\n"
            "    with open(f'part{i}', 'wb') as f:\n"
            "        f.write(b'x' * 1024 ** 2)\n"
            "print('wrote')")
    r = run(one_file, limits=Limits(disk_mb=64, wall_s=30), backend=backend)
    assert r.status == "resource_limit" and "64 MiB" in r.detail, r
    assert "wrote" not in r.stdout and "File too large" in r.stderr
    r = run(many, limits=Limits(disk_mb=64, wall_s=30), backend=backend)
    assert r.status == "resource_limit" and r.detail == "work dir over 64 MiB", r


# --- the sandbox's own failures --------------------------------------------------------------

def _children_named(name: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if comm == name and ppid == os.getpid():
            out.append(int(pid))
    return out


def _kill_engine_soon(backend: str, marker: str) -> threading.Thread:
    """Kill our bwrap, or remove the container running ``marker``, once the program runs."""
    def kill() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.3)
            if backend == "bwrap":
                found = _children_named("bwrap")
                for pid in found:
                    os.kill(pid, 9)
            else:
                import docker
                client = docker.from_env(version="auto")
                found = [c for c in client.containers.list(filters={"label": sandbox.IMAGE_REPOSITORY})
                         if marker in str(c.top(ps_args="-o pid,comm"))]
                for container in found:
                    container.remove(force=True)
            if found:
                return

    thread = threading.Thread(target=kill)
    thread.start()
    return thread


@pytest.mark.slow
def test_engine_killed_mid_run_is_a_sandbox_error(isolating):
    marker = _marker()
    killer = _kill_engine_soon(isolating, marker)
    r = run(_marked(marker) + "import time\nprint('started', flush=True)\ntime.sleep(60)",
            limits=Limits(wall_s=30), backend=isolating)
    killer.join()
    assert r.status == "sandbox_error" and r.exit_code is None and r.wall_s < 15, r
    assert r.detail in ("bwrap was killed by SIGKILL", "the container vanished mid-run",
                        "the container was killed from outside (exit code 137)")
    _assert_no_survivors(marker)
    assert run("print(1)", backend=isolating).stdout == "1\n"  # a fresh fork server, if that died


def test_docker_engine_unreachable_or_image_missing(monkeypatch):
    _need("docker")
    import docker
    monkeypatch.setattr(sb_docker, "image_tag", lambda: "agent-rl-sandbox:no-such-tag")
    r = run("print(1)", backend="docker")
    assert r.status == "sandbox_error" and "agent-rl-sandbox:no-such-tag missing" in r.detail
    monkeypatch.setattr(sb_docker, "_DOCKER_CLIENT", docker.DockerClient(
        base_url="unix:///nonexistent/docker.sock", version="1.41"))
    r = run("print(1)", backend="docker")
    assert r.status == "sandbox_error" and r.detail.startswith("could not create the container")


def test_bwrap_that_cannot_start_is_a_sandbox_error(monkeypatch):
    _mode("bwrap-fresh", monkeypatch)
    monkeypatch.setattr(sb_process, "PYTHON", "/usr/bin/no-such-python")
    r = run("print(1)", backend="bwrap")
    assert r.status == "sandbox_error" and r.detail.startswith("bwrap failed to start the program")
    assert "no-such-python" in r.detail



@pytest.mark.parametrize("mode", ["subprocess", "bwrap-fresh", "bwrap"])
def test_the_guest_starts_under_its_rlimits_uid_and_cgroups(mode, monkeypatch):
    """The launcher (sh, prlimit, setpriv: no ``preexec_fn``), or the fork server's run
    process, sets what the guest sees."""
    name = _mode(mode, monkeypatch)
    limits = Limits(cpu_s=3.2, memory_mb=300, disk_mb=7)
    code = ("import os, resource\n"
            "print([resource.getrlimit(getattr(resource, 'RLIMIT_' + r)) for r in "
            "('CPU', 'AS', 'FSIZE', 'CORE')])\n"
            "print(os.getuid(), os.getgid(), os.getgroups())\n"
            "print(open('/proc/self/cgroup').read())\n")
    r = run(code, limits=limits, backend=name)
    assert r.status == "ok", r
    rlimits, ids, cgroups = r.stdout.split("\n", 2)
    assert rlimits == str([(4, 5), (300 << 20, 300 << 20), (7 << 20, 7 << 20), (0, 0)])
    if os.geteuid() == 0:
        uid = 65533 if name == "subprocess" else 65534
        assert ids == f"{uid} {uid} []"
        if name == "subprocess":  # bwrap's cgroup namespace hides the path
            run_dirs = [line for line in cgroups.splitlines() if "/agent-rl-sandbox/" in line]
            assert {line.split(":")[1] for line in run_dirs} >= {"pids", "memory"}


@pytest.mark.parametrize("name", ["subprocess", "bwrap"])
def test_a_launch_that_cannot_join_its_cgroup_is_a_sandbox_error(name, monkeypatch):
    _mode(name + "-fresh" if name == "bwrap" else name, monkeypatch)
    made = sb_cgroups.Cgroup.__init__

    def broken(self, *args):
        made(self, *args)
        self.dirs["pids"] = Path("/nonexistent/agent-rl-test-cgroup")

    monkeypatch.setattr(sb_cgroups.Cgroup, "__init__", broken)
    r = run("print(1)", backend=name)
    assert r.status == "sandbox_error" and r.stdout == "" and r.exit_code is None
    assert "agent-rl-sandbox: cannot join the cgroup /nonexistent/agent-rl-test-cgroup" in r.detail


def test_missing_util_linux_tools_are_named(monkeypatch):
    _need("subprocess")
    as_root = "prlimit, unshare and setpriv" if sb_process._pid_namespaces() else "prlimit and setpriv"
    monkeypatch.setattr(sb_process, "system_tool", lambda name: None)
    r = run("print(1)", backend="subprocess")
    assert r.status == "sandbox_error"
    assert r.detail == f"subprocess could not start: {as_root if os.geteuid() == 0 else 'prlimit'}" \
        " not found (util-linux)"


# --- inputs, checked before anything runs ----------------------------------------------------

@pytest.mark.parametrize("name", ["/etc/passwd", "../up.txt", "a/../../b", "a/../b/../../c", "",
                                  ".", "./", "x\x00y"])
def test_bad_file_names_raise_before_running(name, monkeypatch):
    monkeypatch.setattr(sb_workdir.WorkDir, "__init__", None)  # anything that ran would fail on this
    with pytest.raises(ValueError, match="file name"):
        run("print(1)", files={"ok.txt": "", name: "x"}, backend="subprocess")


def test_conflicting_file_names_raise(monkeypatch):
    monkeypatch.setattr(sb_workdir.WorkDir, "__init__", None)
    with pytest.raises(ValueError, match="also given as a file"):
        run("", files={"a": "", "a/b": ""}, backend="subprocess")
    with pytest.raises(ValueError, match="given twice"):
        run("", files={"a/b": "", "a/./b": ""}, backend="subprocess")
    with pytest.raises(TypeError, match="content must be str or bytes"):
        run("", files={"a": 3}, backend="subprocess")
    with pytest.raises(ValueError, match="unknown sandbox backend 'gvisor'"):
        run("", backend="gvisor")


@pytest.mark.parametrize(("field", "value"), [
    ("wall_s", 0), ("wall_s", -1.0), ("cpu_s", float("nan")), ("cpu_s", float("inf")),
    ("memory_mb", 1.5), ("memory_mb", "512"), ("processes", True), ("processes", 0),
    ("output_bytes", -5), ("disk_mb", None),
])
def test_bad_limits_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^Limits\.{field} must be a positive"):
        Limits(**{field: value})


def test_settings_set_on_the_package_reach_the_modules_that_read_them(monkeypatch):
    """``envs.sandbox.FORK_SERVER = False`` and the other settings, set on the package (as the
    docs say), are what the package's modules read (``envs.sandbox.settings``)."""
    from envs.sandbox import settings
    assert set(settings.NAMES) <= set(dir(sandbox)) & set(sandbox.__all__)
    sandbox.RUNS_ROOT = "/nonexistent/runs-root"
    try:
        assert settings.RUNS_ROOT == "/nonexistent/runs-root" == sandbox.runs_root()
    finally:
        sandbox.RUNS_ROOT = None
    assert settings.RUNS_ROOT is None
    monkeypatch.setattr(sandbox, "FORK_SERVER", False)
    assert settings.FORK_SERVER is False and sb_forks.fork_server() is None
    monkeypatch.setattr(sandbox, "MAX_WAITING", 0)
    with sandbox.prepare(Limits(), "subprocess") as guest:
        assert guest._slot is None and guest._starter is None  # none may wait: starts in run
    monkeypatch.undo()
    assert (settings.FORK_SERVER, settings.MAX_WAITING) == (True, 32)


def test_limits_are_frozen_keywords():
    assert Limits(wall_s=2).wall_s == 2 and Limits().memory_mb == 512
    with pytest.raises(TypeError):
        Limits(5)  # keywords only
    with pytest.raises(AttributeError):
        Limits().wall_s = 1  # frozen
    with pytest.raises(TypeError, match="Limits"):
        run("", limits={"wall_s": 1}, backend="subprocess")


def test_subprocess_backend_warns_once(monkeypatch):
    monkeypatch.setattr(sb_process, "_WARNED_SUBPROCESS", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run("pass", backend="subprocess").status == "ok"
        assert run("pass", backend="subprocess").status == "ok"
    assert [str(w.message)[:60] for w in caught] == [
        "envs.sandbox: the 'subprocess' backend is not an isolation b"]


def test_auto_prefers_docker_then_bwrap(monkeypatch):
    really = {b: available(b) for b in ISOLATING}
    monkeypatch.setattr(sb_front, "_AVAILABLE", {"docker": False, "bwrap": False, "subprocess": True})
    assert run("pass").backend == "subprocess"
    for b in ("bwrap", "docker"):
        if really[b]:
            monkeypatch.setitem(sb_front._AVAILABLE, b, True)
            assert run("pass").backend == b


def test_prctl_marker_works_on_this_host():
    """The survivor checks above name processes with prctl(PR_SET_NAME); make sure they can."""
    libc = ctypes.CDLL(None)
    comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm")
    old = comm.read_text().strip()
    assert libc.prctl(15, b"sbxselfcheck", 0, 0, 0) == 0
    try:
        assert comm.read_text().strip() == "sbxselfcheck"
    finally:
        libc.prctl(15, old.encode(), 0, 0, 0)
