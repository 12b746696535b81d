"""Checkpoint bundles: round trip, verification, retention, disk full, and SIGKILL mid-save."""

import errno
import io
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from agent_rl.run import checkpoint
from agent_rl.run.checkpoint import (
    BundleError,
    apply_retention,
    bundle_hash,
    latest_complete,
    load_bundle,
    save_bundle,
    verify_bundle,
)

META = {
    "tokens": {"generated": 1200, "trained": 800},
    "contract_hash": "c0ffee",
    "reference_id": "ref-v1",
    "verifier_id": "exact-v2",
    "data_cursor": 17,
    "sampler_position": [3, 5],
    "rollout_store_cursor": "episodes-000004.jsonl:120",
}


def _setup(seed: int = 0, width: int = 8):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler, x):
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()
    scheduler.step()


def _params(model):
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _save(root, step, model, optimizer=None, scheduler=None, **kwargs):
    return save_bundle(
        root, step, model=model, optimizer=optimizer, scheduler=scheduler, meta=dict(META), **kwargs
    )


def test_round_trip_restores_parameters_optimizer_scheduler_and_rng(tmp_path):
    x = torch.randn(16, 4)
    model, optimizer, scheduler = _setup()
    for _ in range(3):
        _train_step(model, optimizer, scheduler, x)
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    path = _save(tmp_path, 3, model, optimizer, scheduler)
    saved = _params(model)
    draws = (torch.rand(3), random.random(), np.random.rand())
    _train_step(model, optimizer, scheduler, x)
    after_one_more = _params(model)

    assert path == tmp_path / "step-000003"
    assert sorted(os.listdir(path)) == sorted(
        [
            "COMPLETE",
            "MANIFEST.json",
            "meta.json",
            "model.safetensors",
            "optimizer.pt",
            "rng.json",
            "rng.pt",
            "scheduler.pt",
        ]
    )
    assert (path / "COMPLETE").read_text() == bundle_hash(path)
    verify_bundle(path)
    assert latest_complete(tmp_path) == path

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    model2, optimizer2, scheduler2 = _setup(seed=1)
    meta = load_bundle(path, model2, optimizer2, scheduler2)
    _assert_same(_params(model2), saved)
    assert torch.equal(torch.rand(3), draws[0])
    assert random.random() == draws[1]
    assert np.random.rand() == draws[2]
    assert {k: meta[k] for k in META} == META
    assert meta["step"] == 3 and meta["format_version"] == checkpoint.FORMAT_VERSION
    assert meta["created"] and meta["trainable_only"] is True
    assert meta["parameter_names"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert scheduler2.last_epoch == 3 and scheduler2.get_last_lr() == [pytest.approx(1e-2 / 4)]
    # The optimizer's moments came back too: the next step lands on the same parameters.
    _train_step(model2, optimizer2, scheduler2, x)
    _assert_same(_params(model2), after_one_more)


def test_trainable_only_saves_and_loads_only_trainable_parameters(tmp_path):
    model, _, _ = _setup(seed=0)
    model[0].requires_grad_(False)
    path = _save(tmp_path, 0, model)
    stored = safetensors.torch.load_file(path / "model.safetensors")
    assert sorted(stored) == ["2.bias", "2.weight"]
    assert json.loads((path / "meta.json").read_text())["parameter_names"] == ["2.bias", "2.weight"]

    fresh, _, _ = _setup(seed=1)
    fresh[0].requires_grad_(False)
    frozen_before = fresh[0].weight.detach().clone()
    load_bundle(path, fresh, restore_rng=False)
    assert torch.equal(fresh[2].weight, model[2].weight)
    assert torch.equal(fresh[0].weight, frozen_before)  # frozen layer untouched


def test_full_model_includes_buffers_and_stores_tied_weights_once(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("scale", torch.tensor([2.0]))

    model = Tied()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="trainable_only=False"):
        _save(tmp_path, 0, model)
    path = _save(tmp_path, 0, model, trainable_only=False)
    assert sorted(safetensors.torch.load_file(path / "model.safetensors")) == [
        "embed.weight",
        "scale",
    ]
    assert json.loads((path / "meta.json").read_text())["parameter_aliases"] == {
        "head.weight": "embed.weight"
    }
    fresh = Tied()
    fresh.scale.fill_(0.0)
    load_bundle(path, fresh, restore_rng=False)
    assert torch.equal(fresh.head.weight, model.embed.weight) and fresh.scale.item() == 2.0


def test_load_names_missing_unexpected_and_mis_shaped_keys(tmp_path):
    model, _, _ = _setup()
    path = _save(tmp_path, 0, model)
    wider, _, _ = _setup(width=16)
    with pytest.raises(
        BundleError, match=r"shape mismatches \['0.bias: bundle \(8,\) vs model \(16,\)"
    ):
        load_bundle(path, wider)
    other = torch.nn.Sequential(torch.nn.Linear(4, 8))
    with pytest.raises(BundleError, match=r"unexpected keys \['2.bias', '2.weight'\]"):
        load_bundle(path, other)
    bigger = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2), torch.nn.Linear(2, 2)
    )
    with pytest.raises(BundleError, match=r"missing keys \['3.bias', '3.weight'\]"):
        load_bundle(path, bigger)
    with pytest.raises(BundleError, match="optimizer.pt is missing"):
        load_bundle(path, model, torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize(
    "name", ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng.json", "rng.pt", "meta.json"]
)
def test_a_flipped_byte_is_named_and_the_bundle_skipped(tmp_path, name):
    model, optimizer, scheduler = _setup()
    older = _save(tmp_path, 1, model, optimizer, scheduler)
    newer = _save(tmp_path, 2, model, optimizer, scheduler)
    data = bytearray((newer / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (newer / name).write_bytes(bytes(data))

    with pytest.raises(BundleError, match=rf"{name}: sha256 differs"):
        verify_bundle(newer)
    with pytest.raises(BundleError, match=name):
        load_bundle(newer, model)
    with pytest.warns(RuntimeWarning, match=f"skipping corrupt checkpoint.*{name}"):
        assert latest_complete(tmp_path) == older


def test_verify_bundle_returns_the_address_that_bundle_hash_alone_cannot_vouch_for(tmp_path):
    model, _, _ = _setup()
    path = _save(tmp_path, 3, model)
    address = verify_bundle(path)
    assert address == bundle_hash(path) == (path / "COMPLETE").read_text()
    weights = bytearray((path / "model.safetensors").read_bytes())
    weights[-1] ^= 0x01
    (path / "model.safetensors").write_bytes(bytes(weights))
    assert bundle_hash(path) == address  # it reads only MANIFEST.json
    with pytest.raises(BundleError, match=r"model\.safetensors: sha256 differs"):
        verify_bundle(path)


def test_marker_manifest_and_truncation_errors_name_the_file(tmp_path):
    model, _, _ = _setup()
    path = _save(tmp_path, 0, model)
    with open(path / "rng.pt", "ab") as f:
        f.write(b"x")
    with pytest.raises(BundleError, match=r"rng.pt: size \d+ bytes, the manifest says"):
        verify_bundle(path)

    path = _save(tmp_path, 1, model)
    manifest = json.loads((path / "MANIFEST.json").read_text())
    manifest["files"]["meta.json"]["size"] += 1
    (path / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="MANIFEST.json: sha256 .* does not match the COMPLETE"):
        verify_bundle(path)

    with pytest.warns(RuntimeWarning, match="skipping corrupt"):
        assert latest_complete(tmp_path) is None

    path = _save(tmp_path / "other", 2, model)
    (path / "COMPLETE").unlink()
    with pytest.raises(BundleError, match="COMPLETE is missing"):
        verify_bundle(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a partial bundle is skipped silently
        assert latest_complete(tmp_path / "other") is None


def test_resave_refuses_a_complete_step_and_moves_an_incomplete_one_aside(tmp_path):
    model, _, _ = _setup()
    path = _save(tmp_path, 4, model)
    address = bundle_hash(path)
    with pytest.raises(BundleError, match="already exists and is complete; refusing"):
        _save(tmp_path, 4, model)
    assert bundle_hash(path) == address
    verify_bundle(path)

    (path / "COMPLETE").unlink()  # as if killed between the rename and the marker
    with pytest.warns(RuntimeWarning, match="moved unfinished or corrupt checkpoint"):
        again = _save(tmp_path, 4, model)
    verify_bundle(again)
    with open(again / "rng.json", "ab") as f:  # complete but corrupt: also replaced, with warnings
        f.write(b" ")
    with pytest.warns(RuntimeWarning) as record:
        verify_bundle(_save(tmp_path, 4, model))
    assert [str(w.message).split(" checkpoint")[0] for w in record] == [
        "replacing corrupt",
        "moved unfinished or corrupt",
    ]
    broken = [p.name for p in tmp_path.iterdir() if p.name.startswith(".broken-step-000004-")]
    assert len(broken) == 2
    with pytest.raises(ValueError, match=r"\['created'\] are set by save_bundle"):
        save_bundle(tmp_path, 5, model=model, meta={"created": "yesterday"})
    with pytest.raises(TypeError, match="JSON-serialisable"):
        save_bundle(tmp_path, 5, model=model, meta={"tokens": float("nan")})


def test_extra_writer_files_join_the_manifest_and_are_verified(tmp_path):
    model, _, _ = _setup()

    def write_state(folder):
        (folder / "backend-state.bin").write_bytes(b"partition 0")
        (folder / "backend.json").write_text("{}")

    path = _save(tmp_path, 1, model, extra_writer=write_state)
    files = json.loads((path / "MANIFEST.json").read_text())["files"]
    assert {"backend-state.bin", "backend.json", "model.safetensors"} <= set(files)
    verify_bundle(path)
    with open(path / "backend-state.bin", "ab") as f:
        f.write(b"!")
    with pytest.raises(BundleError, match="backend-state.bin"):
        verify_bundle(path)


def test_extra_writer_may_not_add_folders_and_a_failure_leaves_nothing(tmp_path):
    model, _, _ = _setup()
    with pytest.raises(BundleError, match="only plain files"):
        _save(tmp_path, 1, model, extra_writer=lambda folder: (folder / "sub").mkdir())
    assert list(tmp_path.iterdir()) == []


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_an_interrupt_mid_retention_finishes_the_delete_first(tmp_path, monkeypatch):
    """SIGTERM reaches a run as KeyboardInterrupt, possibly while retention removes an old
    bundle (it did in CI: a `.tmp-del-step-000003-*` folder was left). The interrupted delete
    is completed before the interrupt goes on: no .tmp-* folder stays, the kept bundles
    verify, and the bundle not yet reached is untouched."""
    model, _, _ = _setup()
    for step in range(4):
        _save(tmp_path, step, model)
    discard = checkpoint._discard
    calls = []

    def interrupted(path):
        calls.append(path.name)
        if len(calls) == 1:  # half of the first doomed bundle gone, then the signal
            next(p for p in path.iterdir() if p.is_file()).unlink()
            raise KeyboardInterrupt("signal 15")
        discard(path)

    monkeypatch.setattr(checkpoint, "_discard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        apply_retention(tmp_path, keep=2)
    assert calls[0].startswith(".tmp-del-step-000001-") and calls[1] == calls[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000", "step-000002",
                                                          "step-000003"]
    for step in (0, 2, 3):
        verify_bundle(tmp_path / f"step-{step:06d}")


def test_retention_keeps_the_newest_and_cleans_stale_temp_folders(tmp_path):
    model, _, _ = _setup()
    for step in range(5):
        _save(tmp_path, step, model)
    partial = tmp_path / "step-000009"  # newer but never finished: not "newest"
    partial.mkdir()
    host = checkpoint._host()
    stale = tmp_path / f".tmp-step-000010-{host}-{_dead_pid()}"
    live = tmp_path / f".tmp-step-000011-{host}-{os.getpid()}"
    foreign = tmp_path / f".tmp-step-000012-otherhost-{_dead_pid()}"
    for folder in (stale, live, foreign):
        folder.mkdir()

    deleted = apply_retention(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["step-000002", "step-000001", "step-000000"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["step-000003", "step-000004", "step-000009", live.name, foreign.name]
    )
    assert latest_complete(tmp_path) == tmp_path / "step-000004"
    with pytest.raises(ValueError, match="keep must be >= 1"):
        apply_retention(tmp_path, keep=0)

    # The newest is corrupt: keep=1 keeps the newest intact one and leaves the corrupt one.
    with open(tmp_path / "step-000004" / "meta.json", "ab") as f:
        f.write(b" ")
    with pytest.warns(RuntimeWarning, match="keeps corrupt"):
        assert apply_retention(tmp_path, keep=1) == []
    with pytest.warns(RuntimeWarning, match="skipping corrupt"):
        assert latest_complete(tmp_path) == tmp_path / "step-000003"

    # Nothing verifies: it cannot tell which is newest, so nothing goes.
    with open(tmp_path / "step-000003" / "meta.json", "ab") as f:
        f.write(b" ")
    with pytest.warns(RuntimeWarning):
        assert apply_retention(tmp_path, keep=1) == []
    assert (tmp_path / "step-000003").exists() and (tmp_path / "step-000004").exists()


def _fail_on_second_file(real_write):
    calls = []

    def write(path, writer):
        calls.append(path.name)
        if len(calls) == 2:
            path.write_bytes(b"half a file")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, writer)

    return write


def _rust_writer_disk_full(tensors, path, metadata=None):
    # safetensors reports I/O errors as text in its own exception type, without an errno.
    raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("failure", ["oserror", "rust_text"])
def test_disk_full_removes_the_temp_folder_and_leaves_earlier_bundles(
    tmp_path, monkeypatch, failure
):
    model, optimizer, scheduler = _setup()
    first = _save(tmp_path, 0, model, optimizer, scheduler)
    address = bundle_hash(first)
    if failure == "oserror":
        monkeypatch.setattr(checkpoint, "_write_file", _fail_on_second_file(checkpoint._write_file))
    else:
        monkeypatch.setattr(checkpoint.safetensors.torch, "save_file", _rust_writer_disk_full)

    with pytest.raises(BundleError, match=r"no space left on .*step-000001 .*, the last complete "
                                          r"checkpoint is step 0"):
        _save(tmp_path, 1, model, optimizer, scheduler)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000"]
    verify_bundle(first)
    assert bundle_hash(first) == address
    assert latest_complete(tmp_path) == first


def test_other_errors_during_save_also_leave_nothing_behind(tmp_path, monkeypatch):
    model, _, _ = _setup()

    def boom(path, writer):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "_write_file", boom)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 0, model)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Crash test: SIGKILL a process that saves (resumes, trains, saves, prunes) in a loop.
# ---------------------------------------------------------------------------------------------

CRASH_ITERATIONS = 25
CRASH_KEEP = 2


def _big_setup():
    """~1.2M parameters (4.7 MB); with AdamW's moments a bundle is ~14 MB."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(768, 768), torch.nn.Tanh(), torch.nn.Linear(768, 768)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.99**s)
    return model, optimizer, scheduler


def _crash_worker(root: str, progress: str, ready) -> None:
    torch.set_num_threads(1)
    model, optimizer, scheduler = _big_setup()
    step = 0
    latest = latest_complete(root)
    if latest is not None:
        step = load_bundle(latest, model, optimizer, scheduler)["step"] + 1
    ready.set()
    x = torch.randn(8, 768)
    while True:
        _train_step(model, optimizer, scheduler, x)
        save_bundle(
            root,
            step,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            meta={"tokens": 100 * step},
        )
        fd = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{step}\n".encode())
        os.close(fd)
        apply_retention(root, keep=CRASH_KEEP)
        step += 1


@pytest.mark.slow
def test_sigkill_mid_save_never_leaves_a_bad_bundle(tmp_path):
    # A forkserver that has imported torch once forks each worker in milliseconds, and it never
    # ran a torch op itself, so the forked workers start with clean thread pools. torch._dynamo
    # is imported lazily by the first optimizer (~3 s); preloaded, it is paid once.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "torch._dynamo"])
    rng = random.Random(20240601)
    root, progress = tmp_path / "ckpt", tmp_path / "progress"
    newest_saved = -1
    interrupted = 0
    started = time.monotonic()
    for iteration in range(CRASH_ITERATIONS):
        ready = ctx.Event()
        proc = ctx.Process(
            target=_crash_worker, args=(str(root), str(progress), ready), daemon=True
        )
        proc.start()
        while not ready.wait(0.05):
            assert proc.is_alive(), f"worker died before it was ready (exit {proc.exitcode})"
        time.sleep(rng.uniform(0.0, 0.4))
        proc.kill()
        proc.join()
        assert proc.exitcode == -signal.SIGKILL, f"worker failed on its own (exit {proc.exitcode})"

        if progress.exists():
            newest_saved = max(map(int, progress.read_text().split()), default=-1)
        names = [p.name for p in root.iterdir()] if root.exists() else []
        complete = [n for n in names if n.startswith("step-") and (root / n / "COMPLETE").exists()]
        interrupted += any(n.startswith(".tmp-") for n in names) or len(complete) < sum(
            n.startswith("step-") for n in names
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a corrupt bundle would warn
            for name in complete:
                verify_bundle(root / name)  # a kill never leaves a torn bundle with COMPLETE
            latest = latest_complete(root)
        if newest_saved < 0:
            continue
        assert latest is not None, f"iteration {iteration}: no complete bundle after a save"
        assert latest.name == max(complete) and int(latest.name[5:]) >= newest_saved
        model, optimizer, scheduler = _big_setup()
        meta = load_bundle(latest, model, optimizer, scheduler, restore_rng=False)
        assert meta["tokens"] == 100 * meta["step"]

    assert newest_saved >= 3, "the workers never got far enough to test anything"
    assert interrupted >= 3, "no kill landed inside a save; make the model bigger"
    apply_retention(root, keep=CRASH_KEEP)  # the workers are dead: their temp folders go
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert sum((p / "COMPLETE").exists() for p in root.glob("step-*")) == CRASH_KEEP
    print(
        f"crash test: {CRASH_ITERATIONS} kills, {interrupted} mid-save, reached step "
        f"{newest_saved}, {time.monotonic() - started:.1f} s"
    )


class _FullDisk(io.BytesIO):
    """A file on a full disk: every write fails with ENOSPC."""

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_inside_a_backends_torch_save_names_the_last_complete_bundle(
        tmp_path, monkeypatch):
    """The torch backend's optimizer state goes through a Python file object
    (``checkpoint.save_torch``), so a full disk inside torch.save is the OSError ENOSPC it is
    (given a path, torch said "unexpected pos"): `write_bundle` raises `DiskFullError`
    naming the bundle and the last complete one, which stays intact; no partial folder."""
    from agent_rl.run.distributed import TorchBackend, write_bundle

    model, optimizer, _ = _setup()
    backend = TorchBackend(model, optimizer)
    first = write_bundle(backend, tmp_path, 1, meta={})
    opened = []

    def full_disk(path, mode="r", *args, **kwargs):  # files are read as they are
        if "w" not in mode:
            return open(path, mode, *args, **kwargs)
        opened.append(Path(path).name)
        return _FullDisk()

    monkeypatch.setattr(checkpoint, "open", full_disk, raising=False)
    with pytest.raises(checkpoint.DiskFullError, match=(
            rf"no space left on {tmp_path / 'step-000002'} \(No space left on device\), the last "
            rf"complete checkpoint is step 1 \({first}\)")):
        write_bundle(backend, tmp_path, 2, meta={})
    assert opened == [checkpoint.OPTIMIZER_FILE]  # the backend's state, first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]
    assert verify_bundle(first) and latest_complete(tmp_path) == first


def test_every_rank_saves_and_restores_its_own_rng_states(tmp_path):
    """A gloo world of 2 (torch's CPU generator standing in for the CUDA ones, which the same
    ``rng_states`` reads): the bundle holds each rank's own state, and each rank, loading it,
    draws what it drew right after saving."""
    from agent_rl.run import distributed

    worker = Path(__file__).with_name("_rng_worker.py")
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(distributed.free_port()),
         str(worker), str(tmp_path)], cwd=repo, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["saved"] != ranks[1]["saved"]  # two streams
    bundle = Path(ranks[0]["bundle"])
    states = torch.load(bundle / checkpoint.RNG_TORCH_FILE, weights_only=True)
    assert [s["torch_cpu"].tolist() for s in states["ranks"]] == [r["saved"] for r in ranks]
    assert states["torch_cpu"].tolist() == ranks[0]["saved"]  # the main rank's, as before
    assert len(json.loads((bundle / checkpoint.RNG_JSON_FILE).read_text())["ranks"]) == 2
    for r in ranks:
        assert r["after_load"] == r["after_save"]


def test_a_rank_the_bundle_has_no_rng_states_for_takes_the_main_ranks(tmp_path):
    """Resumed on more ranks than wrote the bundle (2 -> 4, 1 -> 2), a rank beyond them draws
    from the main rank's saved states, as every rank of a new run starts from the same seed;
    the ranks the bundle has states for draw from their own (2 -> 1: rank 0 its own)."""
    model = torch.nn.Linear(2, 2)
    draws, states = [], []
    for seed in (5, 6):  # two ranks, two streams
        torch.manual_seed(seed)
        states.append(checkpoint.rng_states())
        draws.append(torch.rand(2))
    path = checkpoint.save_bundle(tmp_path, 1, model=model, meta={}, rank_rngs=states)
    for rank, expected in ((0, draws[0]), (1, draws[1]), (2, draws[0]), (3, draws[0])):
        torch.manual_seed(99)  # moved on
        checkpoint.load_bundle(path, model, rank=rank)
        assert torch.equal(torch.rand(2), expected), rank
    single = checkpoint.save_bundle(tmp_path, 2, model=model, meta={})
    assert "ranks" not in torch.load(single / checkpoint.RNG_TORCH_FILE, weights_only=True)
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    checkpoint.save_bundle(tmp_path, 3, model=model, meta={})
    torch.manual_seed(6)
    checkpoint.load_bundle(tmp_path / "step-000003", model, rank=1)  # one set: everyone's
    assert torch.equal(torch.rand(2), expected)
