"""The bwrap backend's fork server: a guest program, never imported by the host.

The host (``client.py``) reads this file and starts it as the guest (uid 65534) inside one
bubblewrap sandbox, under the Debian interpreter (``python3 -I -S -c SOURCE``, stdlib only: the
sandbox's read-only root holds no file of this package), with capabilities in that sandbox's
user namespace (``--cap-add ALL``; no further user namespaces), its control socket's fd as its
one argument, the host's runs folder at ``/runs`` and the run cgroups' parent folders at
``/cg/CONTROLLER``, and an empty environment (bwrap's ``--setenv``s only). It makes itself undumpable first
(``PR_SET_DUMPABLE`` 0: its ``/proc`` files belong to root, so other processes of its uid on the
host cannot open them); C, which runs a program, is dumpable again.

Each request names one run (its folder under ``/runs``, its cgroups' ``cgroup.procs``, its
rlimits, its ``/dev/shm`` size) and carries four fds (stdout, stderr, status, go). For each the
server makes a new pid namespace for its next child only (``unshare``, then ``setns`` back to
its own) and forks; the program ends up two processes down, each fork a copy of this warm
interpreter (no interpreter start-up, no bwrap start-up):

* B, pid 1 of the new pid namespace: joins the run's cgroups and its net namespace (below),
  then new mount, cgroup, uts and ipc namespaces; mounts a new ``/proc`` (``/proc/sys``,
  ``sysrq-trigger``, ``irq``, ``bus`` read-only as bwrap does), the run's ``work`` at
  ``/work`` and its ``prog`` read-only at ``/sandbox``, empty read-only tmpfs over ``/runs``
  and ``/cg`` (no other run's folder, no cgroup file is reachable) and a fresh ``/dev/shm``;
  reaps orphans until C exits,
  then exits with C's code (128 + N after signal N), which ends the namespace.
* C, pid 2: sets its rlimits, stdin ``/dev/null``, stdout and stderr to the host's pipes, drops
  every capability (ambient, effective, permitted, inheritable; the server emptied the bounding
  set all its forks inherit when it started), then waits for a
  ``g`` on the go fd (the host writes the program first; EOF: the run was closed unused, exit
  0), writes ``started`` on the status fd, closes every other fd and runs
  ``/sandbox/main.py`` as ``python3 -I -S`` would: ``sys.argv`` [path], a fresh ``__main__``.

Net namespaces are kept (``_NETS``): the server makes one with loopback up (its only device)
when none is idle, gives it to one run, and takes it back once that run's B is reaped (its pid
namespace's init: every process of the run is gone by then, and with them every socket); a
later run gets it again. No two running runs share one, and no run can change one: C holds no
capability and ``/proc/sys`` is read-only (a TCP port a run closed may still be in
``TIME_WAIT`` for the next). Making and tearing down a net namespace and its loopback device
cost ~0.75 ms of the machine's CPU a run (measured: forks that unshare one against forks that
do not).

Everything about a run comes back on its own pipes: C writes ``started`` on the status fd just
before the program, and the server, once B has ended (a pidfd says so; ``wait4`` reaps it),
``exit CODE CPU_SECONDS`` (B's and everything it reaped); a setup failure is written there
instead of ``started`` (the run exits 125: a sandbox error). Only the server can write that
report (B and C close the status fd first). The server answers nothing; EOF on its control
socket ends it (and with it, bwrap's init, every run still going).

A message with no fds, ``{"preload": SOURCE}`` (``envs.sandbox.preload``), has the server
compile a trusted program once: a run whose ``/sandbox/main.py`` holds exactly that text
executes the compiled code instead of compiling it in its fork (a fork's first compile touches
a few hundred of the server's pages: ~2 ms for a 4 KB program). Work every run's forks would
otherwise each repeat (the compiler's first-use set-up, looking up the C functions) is done
once, before the first request (``_warm``); ``warnings``, which preloading uses, is imported
here, so a run's ``import warnings`` (a common one) costs nothing.
"""

import ctypes
import fcntl
import gc
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import warnings

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 4, 24, 47, 4
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
SETUP_FAILED = 125
_IFREQ = "16sH22x"  # struct ifreq: name, flags

_libc = ctypes.CDLL(None, use_errno=True)
_COMPILED = {}  # a preloaded program's bytes: its code
_NETS = []  # idle net namespaces (fds), loopback up, for the next runs
_NETS_KEPT = 64  # idle ones kept at most (more runs than that at once: the rest are closed)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _encode(text):
    return None if text is None else text.encode()


def _mount(source, target, fstype, flags, data=None):
    _check(_libc.mount(_encode(source), _encode(target), _encode(fstype), ctypes.c_ulong(flags),
                       _encode(data)), f"mount {target}")


def _bind_read_only(source, target):
    _mount(source, target, None, MS_BIND)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _loopback_up():
    """Bring ``lo`` up in this (new, empty) net namespace, as bwrap does in its own."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack(_IFREQ, fcntl.ioctl(sock, SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | IFF_UP))


def _new_net():
    """A new net namespace with loopback up, as an fd. Made by a child that sends it here: the
    server could not go back into its own (bwrap's, owned by a user namespace above the one it
    holds its capabilities in)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            _check(_libc.unshare(CLONE_NEWNET), "unshare net")
            _loopback_up()
            fd = os.open("/proc/self/ns/net", os.O_RDONLY)
            socket.send_fds(theirs, [b"net"], [fd])
        except BaseException as exc:
            theirs.send(f"{type(exc).__name__}: {exc}"[:1000].encode("utf-8", "replace"))
        finally:
            os._exit(0)
    theirs.close()
    try:
        message, fds, _, _ = socket.recv_fds(ours, 1024, 1)
    finally:
        ours.close()
        os.waitpid(pid, 0)
    if message != b"net" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise OSError(f"no net namespace: {message.decode('utf-8', 'replace') or 'no answer'}")
    return fds[0]


def _give_back_net(fd):
    if len(_NETS) < _NETS_KEPT:
        _NETS.append(fd)
    else:
        os.close(fd)


def _empty_bounding_set():
    """Once, in the server: no capability can come back through an exec in any process forked
    from it (its own, effective and permitted, stay for B's namespaces and mounts)."""
    cap = 0
    while _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1


def _drop_capabilities():
    """C's: ambient, effective, permitted and inheritable (the bounding set is empty already)."""
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all zero
    _check(_libc.capset(header, data), "capset")


def _exit_code(status):
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _setup_failed(status_fd, stage, exc):
    """Say why on the status fd and exit 125 (the server reports the exit)."""
    try:
        os.write(status_fd, f"{stage}: {exc}"[:4000].encode("utf-8", "replace"))
    finally:
        os._exit(SETUP_FAILED)


def _run(job, out, err, status, go, net):
    """B, then C; returns only in C, once the host said go. ``net``: the run's net namespace."""
    try:  # B: pid 1 of its own pid namespace
        null = os.open("/dev/null", os.O_RDWR)
        for target in (0, 1, 2):  # not the server's stderr (the host's pipe): nothing of it
            os.dup2(null, target)
        os.close(null)
        for procs in job["cgroups"]:
            fd = os.open(procs, os.O_WRONLY)
            os.write(fd, b"0")
            os.close(fd)
        _check(_libc.setns(net, CLONE_NEWNET), "setns net")
        os.close(net)
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC), "unshare")
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
    except BaseException as exc:
        _setup_failed(status, "namespaces", exc)
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        for name in ("sys", "sysrq-trigger", "irq", "bus"):
            if os.path.exists("/proc/" + name):
                _bind_read_only("/proc/" + name, "/proc/" + name)
        folder = "/runs/" + job["dir"]
        _mount(folder + "/work", "/work", None, MS_BIND)
        _bind_read_only(folder + "/prog", "/sandbox")
        for hidden in ("/runs", "/cg"):
            _mount("tmpfs", hidden, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                   "size=4k,mode=755")
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={job['shm']},mode=1777")
        pid_c = os.fork()
    except BaseException as exc:
        _setup_failed(status, "mounts", exc)
    if pid_c:
        for fd in (out, err, status, go):
            os.close(fd)
        while True:  # as init: reap every orphan, end with the program
            try:
                pid, wait_status = os.waitpid(-1, 0)
            except ChildProcessError:
                os._exit(SETUP_FAILED)
            if pid == pid_c:
                os._exit(_exit_code(wait_status))
    try:  # C: the program's process
        for name, (soft, hard) in job["rlimits"].items():
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (soft, hard))
        os.chdir("/work")
        null = os.open("/dev/null", os.O_RDONLY)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
        _drop_capabilities()
        # dumpable again, as a fresh interpreter (its own processes may read its /proc files):
        # nothing of the server's is secret here; B, which holds capabilities, stays undumpable
        _check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "set dumpable")
        if os.read(go, 1) != b"g":
            os._exit(0)  # the host closed the run unused
        os.write(status, b"started")
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        gc.enable()
    except BaseException as exc:
        _setup_failed(status, "process", exc)
    return job


def _warm():
    """Set up once, here, what each run's forks would otherwise each set up again (writing to
    pages they share with the server): the compiler's first use, the C functions looked up,
    the ioctl format parsed, a socket and a file opened."""
    compile(b"pass\n", "/sandbox/main.py", "exec")
    for name in ("mount", "unshare", "setns", "prctl", "capset"):
        getattr(_libc, name)
    struct.calcsize(_IFREQ)
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()
    with open("/dev/null", "rb") as f:
        f.read()


def _preload(source):
    """Compile a trusted program now (``_program`` then skips compiling it). One that does not
    compile cleanly (an error, or a warning its runs should print) is left to its runs."""
    data = source.encode("utf-8", "surrogatepass")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _COMPILED[data] = compile(data, "/sandbox/main.py", "exec")
    except Exception:
        pass


def _serve():
    """The server's loop: runs started, their ends reported; returns only in a run's C."""
    control_fd = int(sys.argv[1])
    # not dumpable: its /proc files (environ, mem, fds) belong to root, not to the uid it runs
    # as, so no other process of that uid on the host can open them; its forks inherit it (B
    # keeps it, C sets itself dumpable again for the program)
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "set not dumpable")
    # pid 1 of a pid namespace of its own: one owned by the user namespace it holds its
    # capabilities in (bwrap's --disable-userns nests one under the pid namespace's owner),
    # so that it may setns back into it after each run's
    _check(_libc.unshare(CLONE_NEWPID), "unshare")
    server = os.fork()
    if server:
        os.close(control_fd)
        os._exit(_exit_code(os.waitpid(server, 0)[1]))
    control = socket.socket(fileno=control_fd)
    own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY)
    _empty_bounding_set()
    _warm()
    gc.disable()
    gc.freeze()  # a run's collections leave the server's objects (and their pages) alone
    poller = select.poll()
    poller.register(control_fd, select.POLLIN)
    running = {}  # a run's B: pidfd -> (pid, status fd, net namespace fd)
    while True:
        for fd, _ in poller.poll():
            if fd in running:
                poller.unregister(fd)
                os.close(fd)
                _report_end(*running.pop(fd))
                continue
            message, fds, _, _ = socket.recv_fds(control, 1 << 17, 4)
            if not message:
                os._exit(0)  # the host is gone
            job = json.loads(message)
            preload = "preload" in job
            if preload or len(fds) != 4:  # a run without its 4 fds: no report comes
                for fd in fds:
                    os.close(fd)
                if preload:
                    _preload(job["preload"])
                    gc.freeze()
                continue
            pid, net = -1, -1
            try:
                net = _NETS.pop() if _NETS else _new_net()
                _check(_libc.unshare(CLONE_NEWPID), "unshare")  # for the next child only
                pid = os.fork()
            except OSError as exc:
                os.write(fds[2], f"fork: {exc}".encode())
            if pid == 0:
                control.detach()
                for fd in (control_fd, own_pid_ns, *_NETS, *running,
                           *(fd for _, status, other in running.values() for fd in (status, other))):
                    os.close(fd)
                return _run(job, *fds, net)
            _check(_libc.setns(own_pid_ns, CLONE_NEWPID), "setns")  # later children: ours
            for fd in fds[:2] + fds[3:]:
                os.close(fd)
            if pid < 0:
                os.close(fds[2])
                if net >= 0:
                    _give_back_net(net)
                continue
            pidfd = os.pidfd_open(pid)
            running[pidfd] = (pid, fds[2], net)
            poller.register(pidfd, select.POLLIN)


def _report_end(pid, status, net):
    """Reap a run's B; write its exit code and CPU seconds (B's and all it reaped). Its net
    namespace goes back to ``_NETS``: the pid namespace's init is reaped only once every process
    in it has gone."""
    _, wait_status, usage = os.wait4(pid, 0)
    _give_back_net(net)
    try:
        os.write(status, f"\nexit {_exit_code(wait_status)} {usage.ru_utime + usage.ru_stime}\n".encode())
    except OSError:
        pass  # the host closed the run
    os.close(status)


def _program(job):
    """Run ``/sandbox/main.py`` as ``python3 -I -S /sandbox/main.py`` would (``envs.sandbox.process``'s
    ``_BOOT`` does the same for a fresh interpreter): ``sys.argv`` [path], a fresh ``__main__``
    module;
    then exit as the interpreter does (``SystemExit``'s code, an uncaught exception's traceback
    and 1, non-daemon threads joined, ``atexit`` run, stdout and stderr flushed) but without
    tearing the interpreter down: that would write to every object this fork shares with the
    server, copying its whole heap page by page (~7 ms a run)."""
    path = "/sandbox/main.py"
    sys.argv[:] = [path]
    code = _code(path)
    module = type(sys)("__main__")  # this file's own __main__ stays behind, unseen
    module.__dict__.update(__file__=path, __cached__=None, __builtins__=__builtins__)
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
        status = 0
    except SystemExit as exc:
        status = _system_exit_status(exc)
    except BaseException as exc:
        status = _report(exc)
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        import atexit
        atexit._run_exitfuncs()
    except SystemExit as exc:
        status = _system_exit_status(exc)
    except BaseException as exc:
        status = _report(exc)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            status = status or 120  # as the interpreter when flushing at exit fails
    os._exit(status)


def _code(path):
    """The program at ``path`` compiled: the server's code when it was preloaded."""
    with open(path, "rb") as f:
        source = f.read()
    return _COMPILED.get(source) or compile(source, path, "exec")


def _system_exit_status(exc):
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except BaseException:
        pass
    return 1


def _report(exc):
    """An uncaught exception: its traceback (this file's frames left out), exit status 1; a
    KeyboardInterrupt ends the process by SIGINT, as the interpreter does."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
        tb = tb.tb_next
    try:
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
    except BaseException:
        pass
    if isinstance(exc, KeyboardInterrupt):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return 1


if __name__ == "__main__":
    _program(_serve())
