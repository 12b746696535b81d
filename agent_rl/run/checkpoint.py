"""Checkpoint bundles: written atomically, content-addressed, verified before every load.

A bundle is one folder, `root/step-000042/`:

    model.safetensors  parameters keyed by name: the ones that require grad (LoRA adapters,
                       or the whole model when nothing is frozen), or with
                       trainable_only=False every parameter and persistent buffer
    optimizer.pt       torch.save(optimizer.state_dict())                    (when given)
    scheduler.pt       torch.save(scheduler.state_dict())                    (when given)
    rng.json           python `random` and numpy global RNG states
    rng.pt             torch CPU RNG state, and every CUDA device's once CUDA is in use
                       (both: the main rank's; written by several ranks, each file also
                       holds `ranks`, every rank's own, which `load_bundle(rank=r)` restores;
                       a rank beyond them restores the main rank's)
    meta.json          the caller's `meta` (token counts, contract hash, reference and
                       verifier ids, sampler position, data cursor, rollout-store cursor ...)
                       plus `format_version`, `step`, `created`, `trainable_only`,
                       `parameter_names` and `parameter_aliases` (tied weights)
    ...                any plain files the caller's `extra_writer` adds (a training backend's
                       state: `agent_rl.run.distributed`)
    MANIFEST.json      canonical JSON {"format_version", "files": {name: {"sha256", "size"}}}
    COMPLETE           sha256 of MANIFEST.json's canonical content: the bundle's address

Write protocol; a crash (SIGKILL, power loss) at any point leaves either the previous bundles
alone or a folder that readers skip:

    1. every file goes into `root/.tmp-step-000042-<host>-<pid>/`, each fsynced,
       then MANIFEST.json, then the temp folder is fsynced;
    2. os.rename(temp, root/step-000042), fsync root;
    3. COMPLETE is written as COMPLETE.tmp, fsynced, renamed, and the bundle folder fsynced.

A bundle counts only when COMPLETE is there, equals the manifest's hash and every file
matches its sha256 and size (`verify_bundle`). Folders without COMPLETE, `.tmp-*` and
`.broken-*` folders are never read; `apply_retention` removes `.tmp-*` folders whose process
(same host, pid) is dead. One writer per root is assumed.

RNG: a `np.random.Generator` of the caller is not captured; put its
`generator.bit_generator.state` into `meta` (JSON holds its large integers).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import socket
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from trajectories.hashing import canonical_hash, canonical_json

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_JSON_FILE = "rng.json"
RNG_TORCH_FILE = "rng.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "MANIFEST.json"
COMPLETE_FILE = "COMPLETE"
RESERVED_META_KEYS = (
    "format_version",
    "step",
    "created",
    "trainable_only",
    "parameter_names",
    "parameter_aliases",
)

_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
# safetensors' Rust writer and torch's zip writer report I/O errors as text, not OSError.
_DISK_FULL_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


class BundleError(RuntimeError):
    """A bundle is missing, incomplete, corrupt, or does not fit the model; says which file."""


class DiskFullError(BundleError):
    """No space was left while writing a bundle: says where, and which complete bundle is the
    newest (``no_space``); the partial one is gone, the earlier ones are untouched."""


# ---------------------------------------------------------------------------------------------
# Files: the one write path, fsync, hashing, canonical JSON
# ---------------------------------------------------------------------------------------------


def _write_file(path: Path, write: Callable[[Path], None]) -> None:
    """Create `path` with `write(path)` and fsync it. Every bundle file goes through here."""
    write(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _writer_bytes(data: bytes) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        with open(path, "wb") as f:
            f.write(data)

    return write


def _writer_torch(obj: Any) -> Callable[[Path], None]:
    return lambda path: save_torch(obj, path)


def save_torch(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` into a Python file object: given a path, torch's own writer reports a
    failed write (a full disk) as "unexpected pos" without its errno; through a file object
    the ``OSError`` (ENOSPC) comes out, and ``is_disk_full`` sees it."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def is_disk_full(exc: BaseException | None) -> bool:
    """Is ``exc``, or an exception in its chain, a full disk or quota (by errno, or by the text
    safetensors' and torch's writers give it)?"""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
            return True
        if any(text in str(exc) for text in _DISK_FULL_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def no_space(where: str | os.PathLike, root: str | os.PathLike, exc: BaseException) -> DiskFullError:
    """The error for a full disk while writing ``where`` (a bundle under ``root``, or a file of
    the run whose bundles are under ``root``): where, and the newest complete bundle, the one
    a resume continues from."""
    last = latest_complete(root)
    held = (f"the last complete checkpoint is step {int(_STEP_DIR.match(last.name).group(1))} "
            f"({last})" if last else "there is no complete checkpoint yet")
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return DiskFullError(f"no space left on {where} ({reason}), {held}; a half-written "
                         "checkpoint is never read. Free space, then resume (--resume)")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """`(step, path)` of every `step-NNNNNN` folder, complete or not, ascending by step."""
    if not root.is_dir():
        return []
    found = []
    for entry in os.scandir(root):
        match = _STEP_DIR.match(entry.name)
        # Only the canonical spelling, so two folders can never claim the same step.
        if match and entry.name == f"step-{int(match.group(1)):06d}" and entry.is_dir():
            found.append((int(match.group(1)), Path(entry.path)))
    return sorted(found)


def _aside_path(root: Path, name: str) -> Path:
    """A fresh `root/.broken-<name>-<utc time>-<pid>[-n]` for a bundle moved out of the way."""
    stem = f".broken-{name}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{os.getpid()}"
    path, n = root / stem, 0
    while path.exists():
        n += 1
        path = root / f"{stem}-{n}"
    return path


def _discard(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Model tensors and RNG states
# ---------------------------------------------------------------------------------------------


def _model_tensors(
    model: torch.nn.Module, trainable_only: bool
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors to save by name, and aliases (a tied name -> the saved name)."""
    if trainable_only:
        # named_parameters() lists a tied parameter once, under its first name.
        tensors = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not tensors:
            raise ValueError(
                "the model has no parameters that require grad; "
                "pass trainable_only=False to save the whole model"
            )
        return {n: t.detach().contiguous() for n, t in tensors.items()}, {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[tuple, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() and key in first_name:
            aliases[name] = first_name[key]
            continue
        first_name[key] = name
        tensors[name] = t.detach().contiguous()
    return tensors, aliases


def _load_model_tensors(model: torch.nn.Module, path: Path, meta: dict) -> None:
    state = safetensors.torch.load_file(path / MODEL_FILE, device="cpu")
    aliases = meta.get("parameter_aliases", {})
    targets = model.state_dict(keep_vars=True)
    if meta.get("trainable_only", True):
        needed = {n for n, p in model.named_parameters() if p.requires_grad}
    else:
        needed = set(targets)
    provided = set(state) | set(aliases)
    missing = sorted(needed - provided)
    unexpected = sorted(provided - set(targets))
    mismatched = [
        f"{n}: bundle {tuple(t.shape)} vs model {tuple(targets[n].shape)}"
        for n, t in state.items()
        if n in targets and t.shape != targets[n].shape
    ]
    if missing or unexpected or mismatched:
        raise BundleError(
            f"{path / MODEL_FILE} does not fit the model: missing keys {missing}, "
            f"unexpected keys {unexpected}, shape mismatches {mismatched}"
        )
    with torch.no_grad():
        for name, tensor in state.items():
            targets[name].copy_(tensor)


def rng_states() -> tuple[dict, dict]:
    """This process's RNG states: (python's and numpy's, as JSON types; torch's, CPU and
    every CUDA device's once CUDA is in use). Each rank calls it for its own
    (``distributed.write_bundle``)."""
    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=False)
    as_json = {
        "python": [version, list(internal), gauss_next],
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": np_state["state"]["key"].tolist(),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
    }
    as_torch = {"torch_cpu": torch.get_rng_state()}
    # Only once CUDA is in use: reading the state would otherwise create a CUDA context.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        as_torch["torch_cuda"] = torch.cuda.get_rng_state_all()
    return as_json, as_torch


def _own(states: dict, rank: int) -> dict:
    """Rank ``rank``'s states of an RNG file: its entry of ``ranks``. A rank the bundle holds
    none for (a bundle of one rank, or a run resumed on more ranks than wrote it) takes the
    main rank's, as every rank of a new run starts from the same seeded states; the entries
    of ranks a smaller world no longer has are not read."""
    ranks = states.get("ranks")
    if ranks is None:
        return states
    return ranks[rank] if rank < len(ranks) else ranks[0]


def _restore_rng(path: Path, rank: int) -> None:
    states = _own(json.loads((path / RNG_JSON_FILE).read_text()), rank)
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = states["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_state["bit_generator"],
            "state": {"key": np.asarray(np_state["key"], dtype=np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    torch_states = _own(torch.load(path / RNG_TORCH_FILE, map_location="cpu", weights_only=True),
                        rank)
    torch.set_rng_state(torch_states["torch_cpu"])
    cuda_states = torch_states.get("torch_cuda")
    if cuda_states:
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if devices != len(cuda_states):
            warnings.warn(
                f"{path / RNG_TORCH_FILE}: saved {len(cuda_states)} CUDA RNG states, "
                f"{devices} CUDA devices now; restoring the first "
                f"{min(devices, len(cuda_states))}",
                RuntimeWarning,
                stacklevel=3,
            )
        for device, state in enumerate(cuda_states[:devices]):
            torch.cuda.set_rng_state(state, device)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def bundle_hash(path: str | os.PathLike) -> str:
    """sha256 of MANIFEST.json's canonical content: the bundle's content address."""
    manifest_path = Path(path) / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (OSError, ValueError) as exc:
        raise BundleError(f"{manifest_path}: cannot read the manifest ({exc})") from exc
    return canonical_hash(manifest)


def verify_bundle(path: str | os.PathLike) -> str:
    """Raise `BundleError` naming the bad file unless the bundle is complete and intact (COMPLETE
    present and equal to the manifest's hash, every file matching its sha256 and size, no file
    outside the manifest); return its content address (`bundle_hash`).

    `bundle_hash` alone reads only MANIFEST.json: use this where the address must stand for
    the files, e.g. re-checking an artifact before it is promoted."""
    path = Path(path)
    marker = path / COMPLETE_FILE
    if not marker.is_file():
        raise BundleError(f"{marker} is missing: the bundle was never finished")
    expected = marker.read_text().strip()
    actual = bundle_hash(path)
    if actual != expected:
        raise BundleError(
            f"{path / MANIFEST_FILE}: sha256 {actual} does not match the COMPLETE marker {expected}"
        )
    files = json.loads((path / MANIFEST_FILE).read_bytes()).get("files", {})
    for name, entry in sorted(files.items()):
        file = path / name
        if Path(name).name != name or name in (".", ".."):
            raise BundleError(f"{path / MANIFEST_FILE}: file name {name!r} is not a plain name")
        if not file.is_file():
            raise BundleError(f"{file} is listed in the manifest but missing")
        size = file.stat().st_size
        if size != entry["size"]:
            raise BundleError(f"{file}: size {size} bytes, the manifest says {entry['size']}")
        if _sha256_file(file) != entry["sha256"]:
            raise BundleError(f"{file}: sha256 differs from the manifest (corrupted)")
    unexpected = sorted(set(os.listdir(path)) - set(files) - {MANIFEST_FILE, COMPLETE_FILE})
    if unexpected:
        raise BundleError(f"{path}: files not in the manifest: {unexpected}")
    if META_FILE not in files:
        raise BundleError(f"{path / MANIFEST_FILE} does not list {META_FILE}")
    match = _STEP_DIR.match(path.name)
    if match:
        step = json.loads((path / META_FILE).read_text()).get("step")
        if step != int(match.group(1)):
            raise BundleError(f"{path / META_FILE}: step {step} does not match the folder name")
    return actual


def save_bundle(
    root: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    meta: dict[str, Any],
    trainable_only: bool = True,
    extra_writer: Callable[[Path], None] | None = None,
    rank_rngs: list[tuple[dict, dict]] | None = None,
) -> Path:
    """Write `root/step-{step:06d}/` atomically (see the module docstring) and return it.

    `rank_rngs`: every rank's `rng_states()` in rank order (`distributed.write_bundle`
    gathers them); None: this process's alone.

    `extra_writer(temp_folder)`, when given, runs after the standard files are written and
    may add plain files there (a training backend's own state, e.g. DeepSpeed's optimizer
    partitions of every rank); each is fsynced, listed in the manifest and verified like the
    others. It must leave the files already there alone and create no folders.

    Refuses to overwrite a complete, intact bundle of the same step; an incomplete or corrupt
    one is moved aside to `root/.broken-step-...`. On a full disk the temp folder is removed
    and `DiskFullError` ("no space left on ROOT ..., the last complete checkpoint is step N")
    is raised; earlier bundles are never touched.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    clashes = [k for k in RESERVED_META_KEYS if k in meta and not (k == "step" and meta[k] == step)]
    if clashes:
        raise ValueError(f"meta keys {clashes} are set by save_bundle; rename them")
    root = Path(root)
    name = f"step-{step:06d}"
    final = root / name
    if (final / COMPLETE_FILE).exists():
        try:
            verify_bundle(final)
        except BundleError as exc:
            warnings.warn(
                f"replacing corrupt checkpoint {final}: {exc}", RuntimeWarning, stacklevel=2
            )
        else:
            raise BundleError(
                f"checkpoint {final} already exists and is complete; refusing to "
                "overwrite it (delete it, or save under another step)"
            )

    tensors, aliases = _model_tensors(model, trainable_only)
    full_meta = {
        **meta,
        "format_version": FORMAT_VERSION,
        "step": step,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "trainable_only": trainable_only,
        "parameter_names": sorted(tensors),
        "parameter_aliases": aliases,
    }
    try:
        meta_bytes = json.dumps(full_meta, indent=2, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"meta must be JSON-serialisable (no NaN/inf): {exc}") from exc
    rng_json, rng_torch = rank_rngs[0] if rank_rngs else rng_states()
    if rank_rngs and len(rank_rngs) > 1:
        rng_json = {**rng_json, "ranks": [j for j, _ in rank_rngs]}
        rng_torch = {**rng_torch, "ranks": [t for _, t in rank_rngs]}

    created_root = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    if created_root:
        _fsync_dir(root.parent)
    tmp = root / f".tmp-{name}-{_host()}-{os.getpid()}"
    writes: list[tuple[str, Callable[[Path], None]]] = [
        (MODEL_FILE, lambda p: safetensors.torch.save_file(tensors, p, {"format": "pt"})),
        (RNG_JSON_FILE, _writer_bytes(json.dumps(rng_json).encode())),
        (RNG_TORCH_FILE, _writer_torch(rng_torch)),
        (META_FILE, _writer_bytes(meta_bytes)),
    ]
    if optimizer is not None:
        writes.append((OPTIMIZER_FILE, _writer_torch(optimizer.state_dict())))
    if scheduler is not None:
        writes.append((SCHEDULER_FILE, _writer_torch(scheduler.state_dict())))

    renamed = committed = False
    try:
        _discard(tmp)
        tmp.mkdir()
        files = {}
        for file_name, write in writes:
            _write_file(tmp / file_name, write)
            files[file_name] = {
                "sha256": _sha256_file(tmp / file_name),
                "size": (tmp / file_name).stat().st_size,
            }
        if extra_writer is not None:
            extra_writer(tmp)
            for file_name in sorted(set(os.listdir(tmp)) - set(files)):
                file = tmp / file_name
                plain = file.is_file() and not file.is_symlink()
                if file_name in (MANIFEST_FILE, COMPLETE_FILE) or not plain:
                    raise BundleError(f"extra_writer left {file}: only plain files other than "
                                      f"{MANIFEST_FILE} and {COMPLETE_FILE} can go into a bundle")
                _write_file(file, lambda _: None)  # written by extra_writer: only fsync it
                files[file_name] = {"sha256": _sha256_file(file), "size": file.stat().st_size}
        manifest_obj = {"format_version": FORMAT_VERSION, "files": files}
        manifest = canonical_json(manifest_obj).encode("utf-8")
        _write_file(tmp / MANIFEST_FILE, _writer_bytes(manifest))
        _fsync_dir(tmp)
        if final.exists():
            aside = _aside_path(root, name)
            os.rename(final, aside)
            warnings.warn(
                f"moved unfinished or corrupt checkpoint {final} aside to {aside}",
                RuntimeWarning,
                stacklevel=2,
            )
        os.rename(tmp, final)
        renamed = True
        _fsync_dir(root)
        _write_file(
            final / (COMPLETE_FILE + ".tmp"),
            _writer_bytes(canonical_hash(manifest_obj).encode()),
        )
        os.rename(final / (COMPLETE_FILE + ".tmp"), final / COMPLETE_FILE)
        committed = True
        _fsync_dir(final)
    except BaseException as exc:
        if not committed:
            _discard(final if renamed else tmp)
        if isinstance(exc, Exception) and is_disk_full(exc):
            raise no_space(final, root, exc) from exc
        raise
    return final


def latest_complete(root: str | os.PathLike) -> Path | None:
    """The highest-step bundle under `root` that has COMPLETE and verifies, else None.

    Folders without COMPLETE (partial) and hidden ones (`.tmp-*`, `.broken-*`) are ignored
    silently; complete but corrupt bundles are skipped with a warning.
    """
    for _, path in reversed(_step_dirs(Path(root))):
        if not (path / COMPLETE_FILE).exists():
            continue
        try:
            verify_bundle(path)
        except BundleError as exc:
            warnings.warn(f"skipping corrupt checkpoint: {exc}", RuntimeWarning, stacklevel=2)
            continue
        return path
    return None


def load_bundle(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    restore_rng: bool = True,
    rank: int = 0,
) -> dict[str, Any]:
    """Verify, then load parameters (by name), optimizer, scheduler and RNG states (``rank``'s
    own, where several ranks wrote the bundle; the main rank's for a rank it has none for).

    Returns the bundle's meta. Nothing is loaded when the bundle fails verification or its
    parameters do not fit the model (the error lists missing, unexpected and mis-shaped keys).
    """
    path = Path(path)
    verify_bundle(path)
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise BundleError(
            f"{path / META_FILE}: format_version {meta['format_version']} is "
            f"newer than this code reads ({FORMAT_VERSION}); upgrade agent_rl"
        )
    for obj, file_name in ((optimizer, OPTIMIZER_FILE), (scheduler, SCHEDULER_FILE)):
        if obj is not None and not (path / file_name).exists():
            raise BundleError(f"{path / file_name} is missing: the bundle was saved without it")
    _load_model_tensors(model, path, meta)
    if optimizer is not None:
        optimizer.load_state_dict(
            torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        )
    if scheduler is not None:
        scheduler.load_state_dict(
            torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=True)
        )
    if restore_rng:
        _restore_rng(path, rank)
    return meta


def resolve_bundle(path: str | os.PathLike) -> Path:
    """A bundle folder as given (it has COMPLETE), else the newest complete bundle under
    ``path/checkpoints`` (a run directory) or ``path`` (a checkpoints folder)."""
    path = Path(path)
    if not path.exists():
        raise BundleError(f"no checkpoint bundle or run directory at {path}")
    if (path / COMPLETE_FILE).exists():
        return path
    for root in (path / "checkpoints", path):
        found = latest_complete(root)
        if found is not None:
            return found
    raise BundleError(f"{path} holds no complete checkpoint bundle (a folder with a COMPLETE marker)")


def load_init(path: str | os.PathLike, model: torch.nn.Module,
              base: dict[str, Any] | None = None) -> dict[str, Any]:
    """Start ``model`` (plain, before any adapter) from the bundle at ``path`` (``resolve_bundle``):
    its full weights, verified, replace the model's; RNG states are left alone. ``base``: the
    ``models.model_fingerprint`` of the model the weights go into; a bundle whose meta names
    another base model (``base_model.model``: other weight or tokenizer files) is refused, as
    is one that holds only part of the weights (a LoRA training checkpoint: its adapters fit a
    peft model, not the base). Returns the bundle's meta, with ``bundle_hash`` added."""
    bundle = resolve_bundle(path)
    meta = json.loads((bundle / META_FILE).read_text()) if (bundle / META_FILE).is_file() else {}
    trained_from = (meta.get("base_model") or {}).get("model")
    if base is not None and trained_from is not None and any(
            trained_from.get(part) != base.get(part) for part in ("weights", "tokenizer")):
        raise BundleError(f"{bundle} was trained from {trained_from.get('id')!r}, whose weight or "
                          f"tokenizer files differ from those of {base.get('id')!r}: set model.id "
                          "to the model it was trained from")
    names = meta.get("parameter_names", [])
    if any("lora_" in n for n in names):
        raise BundleError(f"{bundle} holds LoRA adapters only (a training checkpoint under "
                          "model.adapter: lora); start from a bundle of full weights: "
                          "`agent-rl sft` writes one, or train with model.adapter: none")
    out = load_bundle(bundle, model, restore_rng=False)
    return {**out, "bundle_hash": bundle_hash(bundle), "bundle": str(bundle)}


def apply_retention(root: str | os.PathLike, keep: int) -> list[Path]:
    """Delete complete bundles older than the newest `keep` intact ones; return what went.

    The newest intact bundle is never deleted; corrupt bundles newer than the kept ones stay
    for inspection; partial folders are left alone. Stale `.tmp-*` folders of dead processes
    on this host are removed. Nothing is deleted when no bundle verifies (then it cannot tell
    which is newest).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the newest bundle is never deleted), got {keep}")
    root = Path(root)
    complete = [(s, p) for s, p in reversed(_step_dirs(root)) if (p / COMPLETE_FILE).exists()]
    kept: list[int] = []
    for step, path in complete:
        if len(kept) == keep:
            break
        try:
            verify_bundle(path)
        except BundleError as exc:
            warnings.warn(
                f"retention keeps corrupt checkpoint for inspection: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        kept.append(step)
    if not kept:
        if complete:
            warnings.warn(
                f"no checkpoint under {root} verifies; retention deletes nothing",
                RuntimeWarning,
                stacklevel=2,
            )
        return []

    deleted = []
    for step, path in complete:
        if step >= kept[-1]:
            continue
        # Renamed to a temp name first: a crash mid-delete leaves a .tmp-* folder, never a
        # half-deleted step folder. An interrupt (Ctrl-C, SIGTERM as KeyboardInterrupt)
        # arriving mid-delete finishes the delete before it goes on, leaving no .tmp-* folder.
        doomed = root / f".tmp-del-{path.name}-{_host()}-{os.getpid()}"
        try:
            os.rename(path, doomed)
            _fsync_dir(root)
            _discard(doomed)
        except FileNotFoundError:
            continue
        except BaseException:
            _discard(doomed)
            raise
        deleted.append(path)

    host = _host()
    for entry in os.scandir(root):
        if not entry.name.startswith(".tmp-") or not entry.is_dir():
            continue
        parts = entry.name.rsplit("-", 2)
        if len(parts) == 3 and parts[1] == host and parts[2].isdigit():
            if not _pid_alive(int(parts[2])):
                _discard(Path(entry.path))
    return deleted
