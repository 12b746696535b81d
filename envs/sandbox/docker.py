"""The ``docker`` backend: one container per run, from an image built out of this host's Python.

The container: ``network_mode="none"``, a read-only image root (only the interpreter, its stdlib
and its shared libraries), user 65534, all capabilities dropped, ``no-new-privileges``, an init
process, memory/pids/one-CPU limits and a ``/dev/shm`` of ``disk_mb``; the run's host temp dir is
bind-mounted (``/sandbox`` read-only, ``/work``), so the engine must run on this host. The
container is always removed. ``build_image`` makes the image without a registry.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from envs.sandbox.limits import (
    GUEST_ARGS,
    GUEST_UID,
    MIB,
    PYTHON,
    Limits,
    RunFacts,
    SandboxResult,
    Watch,
    cpu_rlimit,
    failed,
    guest_env,
    sandbox_result,
)
from envs.sandbox.workdir import WorkDir

IMAGE_REPOSITORY = "agent-rl-sandbox"
_DOCKER_CLIENT = None
_DOCKER_LOCK = threading.Lock()


class _DockerUnavailable(Exception):
    pass


def docker_client():
    """The Docker SDK client, made and pinged once per process."""
    global _DOCKER_CLIENT
    with _DOCKER_LOCK:
        if _DOCKER_CLIENT is None:
            try:
                import docker
            except ImportError as exc:
                raise _DockerUnavailable(f"the docker SDK is not installed (pip install "
                                         f"'agent-rl[docker]'): {exc}") from exc
            try:
                client = docker.from_env(version="auto", timeout=60)
                client.ping()
            except Exception as exc:  # any failure means no usable engine
                raise _DockerUnavailable(f"the Docker engine does not answer: {exc}") from exc
            _DOCKER_CLIENT = client
        return _DOCKER_CLIENT


def image_tag() -> str:
    """The sandbox image's tag, named after the host interpreter it copies (``py311``)."""
    version = re.fullmatch(r"python(\d)\.(\d+)", os.path.basename(os.path.realpath(PYTHON)))
    return f"{IMAGE_REPOSITORY}:py{version[1]}{version[2]}" if version else f"{IMAGE_REPOSITORY}:py3"


def build_image(client=None, force: bool = False) -> str:
    """Build the sandbox image from this host's ``/usr/bin/python3`` (no registry needed) and
    return its tag; a no-op when it exists (unless ``force``).

    The image holds the interpreter, its standard library, the shared libraries that ``ldd``
    lists for it and its extension modules, the usrmerge links, ``/etc/passwd``/``group`` with
    ``nobody`` (65534) and empty mount points ``/work``, ``/sandbox``, ``/tmp``.
    """
    client = docker_client() if client is None else client
    tag = image_tag()
    if not force:
        try:
            client.images.get(tag)
            return tag
        except Exception:  # docker.errors.ImageNotFound: build it below
            pass
    with tempfile.TemporaryDirectory(prefix="agent-rl-sandbox-image-") as tmp:
        tar_path = Path(tmp) / "rootfs.tar"
        _write_rootfs(tar_path)
        repository, name = tag.split(":")
        client.api.import_image_from_file(
            str(tar_path), repository=repository, tag=name,
            changes=["USER 65534:65534", "WORKDIR /work", f'CMD ["{PYTHON}"]',
                     f"LABEL agent-rl-sandbox.python={_python_version()}"])
    client.images.get(tag)
    return tag


def _python_version() -> str:
    out = subprocess.run([PYTHON, "-I", "-S", "-c", "import sys; print(sys.version.split()[0])"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _write_rootfs(tar_path: Path) -> None:
    real_python = os.path.realpath(PYTHON)
    version = os.path.basename(real_python)  # python3.11
    stdlib = Path("/usr/lib") / version
    files = {real_python}
    for path in stdlib.rglob("*"):
        if path.is_file() and not path.is_symlink() and "site-packages" not in path.parts \
                and "dist-packages" not in path.parts:
            files.add(str(path))
    extensions = [real_python, *(str(p) for p in (stdlib / "lib-dynload").glob("*.so"))]
    ldd = subprocess.run(["ldd", *extensions], capture_output=True, text=True)
    libraries = set(re.findall(r"(/\S+\.so[.\d]*)\s", ldd.stdout))
    links: dict[str, str] = {PYTHON: os.path.basename(real_python)}
    for lib in libraries:  # keep each library's symlink chain, resolved through the usrmerge links
        path = os.path.join(os.path.realpath(os.path.dirname(lib)), os.path.basename(lib))
        while os.path.islink(path):
            target = os.readlink(path)
            links[path] = target
            path = os.path.join(os.path.dirname(path), target)
            path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
        files.add(path)
    top_links = {f"/{n}": os.readlink(f"/{n}") for n in ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
                 if os.path.islink(f"/{n}")}
    passwd = b"root:x:0:0:root:/root:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/work:/usr/sbin/nologin\n"
    group = b"root:x:0:\nnogroup:x:65534:\n"

    def add_dir(tar: tarfile.TarFile, name: str, mode: int = 0o755) -> None:
        info = tarfile.TarInfo(name.lstrip("/"))
        info.type, info.mode = tarfile.DIRTYPE, mode
        tar.addfile(info)

    with tarfile.open(tar_path, "w") as tar:
        dirs = {"/etc", "/work", "/sandbox", "/proc", "/sys", "/dev"}
        for path in files | set(links):
            parent = os.path.dirname(path)
            while parent != "/" and parent not in top_links:
                dirs.add(parent)
                parent = os.path.dirname(parent)
        for d in sorted(dirs):
            add_dir(tar, d)
        add_dir(tar, "/tmp", 0o1777)
        for name, target in {**top_links, **links}.items():
            info = tarfile.TarInfo(name.lstrip("/"))
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        for path in sorted(files):
            tar.add(path, arcname=path.lstrip("/"), recursive=False)
        for name, data in (("etc/passwd", passwd), ("etc/group", group)):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))


def _docker_api_errors() -> tuple[type[BaseException], ...]:
    import docker.errors
    import requests.exceptions
    return (docker.errors.DockerException, requests.exceptions.RequestException, OSError)


def run_docker(code: str, files: dict[str, bytes], limits: Limits) -> SandboxResult:
    try:
        client = docker_client()
    except _DockerUnavailable as exc:
        return failed("docker", str(exc))
    import docker.errors
    from docker.types import LogConfig, Ulimit
    from docker.utils.socket import frames_iter

    errors = _docker_api_errors()
    workdir = WorkDir(GUEST_UID)
    container = None
    cpu, disk = cpu_rlimit(limits), limits.disk_mb * MIB
    try:
        workdir.fill(code, files)
        try:
            container = client.containers.create(
                image_tag(), [PYTHON, *GUEST_ARGS, "/sandbox/main.py"],
                user=f"{GUEST_UID}:{GUEST_UID}", working_dir="/work", environment=guest_env("/work"),
                network_mode="none", read_only=True, init=True, cap_drop=["ALL"],
                security_opt=["no-new-privileges"], ipc_mode="private", shm_size=disk,
                mem_limit=limits.memory_mb * MIB, memswap_limit=limits.memory_mb * MIB,
                pids_limit=limits.processes + 1,  # the init process counts too
                nano_cpus=1_000_000_000,
                ulimits=[Ulimit(name="cpu", soft=cpu, hard=cpu + 1),
                         Ulimit(name="fsize", soft=disk, hard=disk), Ulimit(name="core", soft=0, hard=0)],
                volumes={str(workdir.prog): {"bind": "/sandbox", "mode": "ro"},
                         str(workdir.work): {"bind": "/work", "mode": "rw"}},
                log_config=LogConfig(type="none"), labels={IMAGE_REPOSITORY: "run"},
                stdin_open=False, tty=False)
            sock = container.attach_socket(params={"stdout": 1, "stderr": 1, "stream": 1})
        except docker.errors.ImageNotFound:
            return failed("docker", f"image {image_tag()} missing: run envs.sandbox.build_image() "
                                     "or scripts/sandbox_image.sh")
        except errors as exc:
            return failed("docker", f"could not create the container: {exc}")

        def kill() -> None:
            try:
                container.kill()
            except errors:
                pass

        watch = Watch(limits, kill)

        def pump() -> None:
            try:
                for stream, data in frames_iter(sock, tty=False):
                    watch.feed(watch.stdout if stream == 1 else watch.stderr, data)
            except (OSError, ValueError):
                pass

        reader = threading.Thread(target=pump, daemon=True, name="sandbox-output")
        reader.start()
        since = time.time()
        t0 = time.monotonic()
        try:
            container.start()
            monitor = watch.monitor(t0 + limits.wall_s, workdir)
            exit_code = container.wait(timeout=limits.wall_s + 60)["StatusCode"]
            wall_s = time.monotonic() - t0
            watch.finish()
            reader.join(timeout=10)
            monitor.join()
            container.reload()
        except docker.errors.NotFound:
            return failed("docker", "the container vanished mid-run", time.monotonic() - t0)
        except errors as exc:
            return failed("docker", f"the engine failed mid-run: {exc}", time.monotonic() - t0)
        finally:
            watch.finish()
            try:
                sock.close()
            except OSError:
                pass
        state = container.attrs["State"]
        failure = ""
        if watch.stopped is None and exit_code > 128 and not state.get("OOMKilled"):
            try:  # a signal death: the guest's own, or a kill through the engine's API?
                kills = list(client.api.events(since=f"{since:.6f}", until=f"{time.time():.6f}",
                                               decode=True, filters={"container": container.id,
                                                                     "event": "kill"}))
            except errors as exc:
                kills, failure = [], f"the engine failed after the run: {exc}"
            if kills:
                failure = f"the container was killed from outside (exit code {exit_code})"
        outcome = RunFacts(exit_code=exit_code, stopped=watch.stopped,
                           stderr=watch.stderr.decode("utf-8", "replace"), failure=failure,
                           oom=bool(state.get("OOMKilled")), disk_used=workdir.usage())
        return sandbox_result(outcome, watch, wall_s, "docker", workdir)
    finally:
        if container is not None:
            try:
                container.remove(force=True)
            except errors:
                pass
        workdir.cleanup()
