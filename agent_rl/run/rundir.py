"""The run directory: what a training run writes and reads back.

``contract.yaml`` + ``contract.sha256``, ``contract.pins.json`` (the content hashes of the
files the contract reads: ``input_pins``) and ``base_model.json`` (the content hashes of the
base model's files: pinned before the first rollout), ``metrics.jsonl`` (one namespaced
record per step, mirrored to the loggers of ``log.to``: ``loggers``, which keeps the ids of the
W&B and MLflow runs a resumed run continues in ``loggers.json``), ``eval.jsonl`` (held-out
summaries) and ``evals/<tag>.jsonl`` (one record per held-out episode), ``rollouts.jsonl``
(every episode), ``curriculum.jsonl`` (one record per difficulty-filter round, keyed by the
first step it trains), ``checkpoints/``, ``guard.json``, ``result.json``; ``run.lock`` while a
process runs there (``runlock``: one process per run directory); ``inputs/`` the rows a
script handed ``agent_rl.train(dataset=...)`` (``inputs_file``). ``agent-rl sft`` writes its
resume bundles to ``resume/`` and its final bundle to ``checkpoints/``.

What a user owns is never overwritten or dropped: ``check_run_dir`` refuses, writing
nothing, a folder that is no run of this contract and base model, or whose logs lost what
its checkpoint committed; only then are the pins written (``pin_run_dir``) and the logs cut
back to the checkpoint (``rewind_logs``: later lines move to ``<file>.rewound``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

from agent_rl.run import checkpoint
from agent_rl.run.contract import ExperimentContract, SFTContract, read_contract

LOG_FILES = ("rollouts.jsonl", "metrics.jsonl", "eval.jsonl", "curriculum.jsonl")
RUN_FILES = (*LOG_FILES, "checkpoints")
BASE_MODEL_FILE = "base_model.json"
PINS_FILE = "contract.pins.json"  # the content hashes of the files the contract reads
PIN_FILES = ("contract.yaml", "contract.sha256", PINS_FILE, BASE_MODEL_FILE)
LOCK_FILE = "run.lock"  # runlock.py: held while a process runs in the folder
INPUTS_DIR = "inputs"  # rows handed to agent_rl.train(dataset=...), by content: inputs_file



class RunDirError(ValueError):
    """The run directory cannot take the run asked for; nothing in it was changed."""


def check_run_dir(run_dir: Path, contract: ExperimentContract | SFTContract, contract_hash: str,
                  base_model: dict[str, Any], resume: bool,
                  checkpoints: Path | None = None) -> Path | None:
    """Check, writing nothing, that ``run_dir`` can take this run; return the checkpoint to
    resume from (None: start at step 0), the newest complete bundle of ``checkpoints``
    (``run_dir/checkpoints`` by default). Refused: a non-empty folder that is no agent-rl run
    (no ``contract.sha256``, readable ``contract.yaml`` or checkpoint), a run of another
    contract, a run without ``resume``; with ``resume``: a folder with nothing to resume, a
    changed base model (``base_model``: ``{role: models.model_fingerprint}``, pinned in
    ``base_model.json``) and logs that lost records the checkpoint committed (``split_log``).
    The lock file (``runlock``) is no content."""
    checkpoints = run_dir / "checkpoints" if checkpoints is None else checkpoints
    entries = sorted(p.name for p in run_dir.iterdir() if p.name not in (LOCK_FILE, INPUTS_DIR)
                     ) if run_dir.is_dir() else []
    if not entries:
        if resume:
            raise nothing_to_resume(run_dir)
        return None
    pinned = pinned_contract_hash(run_dir)
    latest = checkpoint.latest_complete(checkpoints) if resume or pinned is None else None
    meta = json.loads((latest / checkpoint.META_FILE).read_text()) if latest else {}
    pinned = pinned or meta.get("contract_hash")
    if pinned is None:
        raise RunDirError(f"{run_dir} is not an agent-rl run directory (no contract.sha256, "
                          f"readable contract.yaml or checkpoint) and holds {entries[:5]}: "
                          "choose a new or an empty run_dir")
    if pinned != contract_hash:
        try:
            old = read_contract(run_dir / "contract.yaml")
        except ValueError:  # the old contract.yaml is missing or no longer validates
            old = None
        changed = ([] if old is None else contract.changes_from(old)
                   if type(old) is type(contract) else [f"a run of another kind ({type(old).__name__})"])
        if (run_dir / PINS_FILE).is_file():  # files whose content changed under the same name
            changed += contract.pin_changes(json.loads((run_dir / PINS_FILE).read_text()))
        raise RunDirError(f"{run_dir} belongs to another contract ({pinned[:12]} != "
                          f"{contract_hash[:12]}; changed: {'; '.join(changed) or '?'}); "
                          "use a new run_dir or restore the old config")
    if not resume:
        if any((run_dir / name).exists() for name in RUN_FILES):
            raise RunDirError(f"{run_dir} already holds a run; pass --resume to continue it "
                              "or choose a new run_dir")
        return None
    pin = run_dir / BASE_MODEL_FILE
    pinned_model = json.loads(pin.read_text()) if pin.exists() else meta.get("base_model", {})
    changes = [f"{role} {now['id']}: {change}" for role, now in base_model.items()
               for change in fingerprint_changes(pinned_model.get(role, now), now)]
    if changes:
        raise RunDirError(f"cannot resume {run_dir}: its base model changed since the run "
                          f"started ({'; '.join(changes)}); restore those files or start a "
                          "new run_dir")
    for name in LOG_FILES:  # raises when a record the checkpoint committed is lost
        split_log(run_dir / name, meta.get("step", -1), meta.get("store_cursor", 0))
    return latest


def nothing_to_resume(run_dir: Path) -> RunDirError:
    """--resume of a folder that is empty or does not exist."""
    return RunDirError(f"--resume: {run_dir} {'is empty' if run_dir.is_dir() else 'does not exist'}"
                       ", so there is no run to resume; start it without --resume")


def pinned_contract_hash(run_dir: Path) -> str | None:
    """The contract hash a run directory was pinned to: ``contract.sha256``, else the hash of
    a ``contract.yaml`` that still validates, else None."""
    if (run_dir / "contract.sha256").is_file():
        return (run_dir / "contract.sha256").read_text().strip()
    try:
        return read_contract(run_dir / "contract.yaml").contract_hash()
    except ValueError:
        return None


def pinned_to(run_dir: Path, contract_hash: str) -> bool:
    """Whether ``run_dir`` holds a run pinned to this contract (one to resume, not refuse)."""
    return run_dir.is_dir() and pinned_contract_hash(run_dir) == contract_hash


def pin_run_dir(run_dir: Path, contract: ExperimentContract | SFTContract, contract_hash: str,
                base_model: dict[str, Any]) -> None:
    """Write what the run is pinned to, once ``check_run_dir`` and the checkpoint accepted it:
    ``contract.yaml``, ``contract.sha256``, ``contract.pins.json`` and ``base_model.json``
    (``PIN_FILES``). From here
    on the folder is this run's: a run killed before its first checkpoint resumes from step 0."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_file(run_dir / "contract.yaml", contract.to_yaml())
    write_file(run_dir / "contract.sha256", contract_hash + "\n")
    write_file(run_dir / PINS_FILE, json.dumps(contract.input_pins(), indent=2, sort_keys=True)
               + "\n")
    write_file(run_dir / BASE_MODEL_FILE, json.dumps(base_model, indent=2, sort_keys=True) + "\n")


def unpin_run_dir(run_dir: Path) -> None:
    """Take back ``pin_run_dir``'s files: a run that failed before writing anything else
    (an empty curriculum band) leaves the folder as it found it."""
    for name in PIN_FILES:
        (run_dir / name).unlink(missing_ok=True)


def split_log(path: Path, step: int, store_cursor: int) -> tuple[list[bytes], list[bytes], bytes]:
    """A log of the run cut at the checkpoint of ``step``: (lines kept, lines after it, torn
    last line). Kept: the first ``store_cursor`` records of ``rollouts.jsonl``, the records of
    steps <= ``step`` of ``metrics.jsonl`` and ``eval.jsonl``. Raises RunDirError naming the
    file and the line, record or step when a line before the last is no JSON record (with a
    step, but in the rollouts) or when a record the checkpoint committed is missing: a rollout
    record, or the metrics of a step <= ``step``. A crash cannot do that (both are fsynced
    before the checkpoint is written): the file was damaged, and nothing is cut."""
    if not path.exists():
        return [], [], b""
    *lines, torn = path.read_bytes().split(b"\n")  # torn: b"" when the file ends cleanly
    records = [_log_record(path, number, line) for number, line in enumerate(lines, start=1)]
    lost = ""
    if path.name == "rollouts.jsonl":
        kept, cut = lines[:store_cursor], lines[store_cursor:]
        if len(lines) < store_cursor:
            lost = (f"record {store_cursor}" if len(lines) + 1 == store_cursor
                    else f"records {len(lines) + 1}..{store_cursor}")
    else:
        steps = [_log_step(path, number, record) for number, record in enumerate(records, start=1)]
        kept = [line for line, s in zip(lines, steps, strict=True) if s <= step]
        cut = [line for line, s in zip(lines, steps, strict=True) if s > step]
        missing = sorted(set(range(1, step + 1)) - set(steps)) if path.name == "metrics.jsonl" else []
        if missing:
            lost = f"the metrics of step {', '.join(map(str, missing))}"
    if lost:
        torn_note = f"; its last line is torn ({len(torn)} bytes without a newline)" if torn else ""
        raise RunDirError(f"{path}: {lost}, which the checkpoint of step {step} committed, "
                          f"cannot be found{torn_note}. Restore {path.name}, or move that "
                          "checkpoint (and any later) out of checkpoints/ to resume from an "
                          "earlier one")
    return kept, cut, torn


def _log_record(path: Path, number: int, line: bytes) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        record = None
    if not isinstance(record, dict):
        raise RunDirError(f"{path}: line {number} is not a JSON record (the file is corrupt "
                          f"before its last line): restore {path.name}")
    return record


def _log_step(path: Path, number: int, record: dict[str, Any]) -> int:
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise RunDirError(f"{path}: line {number} has no step: not a record agent-rl wrote")
    return step


def rewind_logs(run_dir: Path, step: int, store_cursor: int) -> None:
    """Cut the run's logs back to a checkpoint (``split_log``): later records and a torn last
    line (work of a killed run after its last checkpoint, which the resumed run redoes) move
    to ``<file>.rewound``, a torn line with a warning naming it. So every step is logged
    once, and nothing is lost."""
    for name in LOG_FILES:
        path = run_dir / name
        kept, cut, torn = split_log(path, step, store_cursor)
        if torn:
            started = re.match(rb'\{"step": (\d+)', torn)
            warnings.warn(f"{path}: its last line ({f'of step {int(started[1])}, ' if started else ''}"
                          f"{len(torn)} bytes) was cut short by an interrupted write; moved to "
                          f"{name}.rewound", stacklevel=2)
        if cut or torn:
            with open(path.with_name(name + ".rewound"), "ab") as fh:
                fh.write(b"".join(line + b"\n" for line in [*cut, torn] if line))
            write_file(path, b"".join(line + b"\n" for line in kept))


def inputs_file(run_dir: Path, content: bytes, suffix: str) -> Path:
    """Write ``content`` to ``run_dir/inputs/<sha256 prefix><suffix>`` (once: named by its
    content, so a file there is never overwritten with other content) and return its path.
    ``inputs/`` is not run content: a folder holding only it is still a new run dir."""
    path = run_dir / INPUTS_DIR / f"{hashlib.sha256(content).hexdigest()[:16]}{suffix}"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, content)
    return path


EVAL_EPISODES = Path("evals") / "episodes"  # <tag>.jsonl: the episodes of one held-out evaluation


def recorded_episodes(run_dir: Path) -> Path | None:
    """The episodes a run directory recorded (what ``agent-rl inspect RUN`` reads): its
    training rollouts (``rollouts.jsonl``) when it holds any, else its last held-out
    evaluation's (``evals/episodes/after.jsonl``, else the newest written: a warm start's, or
    a run stopped before its first step); None when it recorded none."""
    store = run_dir / "rollouts.jsonl"
    if store.is_file() and store.stat().st_size:
        return store
    evals = sorted((run_dir / EVAL_EPISODES).glob("*.jsonl"), key=lambda p: p.stat().st_mtime)
    after = run_dir / EVAL_EPISODES / "after.jsonl"
    return after if after in evals else (evals[-1] if evals else None)


def write_file(path: Path, content: str | bytes) -> None:
    """Write ``content`` atomically (temp file, fsync, rename); a file that already holds it is
    left alone. The one way the run directory's files are replaced."""
    data = content.encode() if isinstance(content, str) else content
    if path.exists() and path.read_bytes() == data:
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def logged_eval(run_dir: Path, tag: str, step: int) -> dict[str, Any] | None:
    """The summary ``eval.jsonl`` holds for ``tag`` at ``step`` (the last one), else None."""
    path = run_dir / "eval.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    found = [r for r in records if r.get("tag") == tag and r.get("step") == step]
    return {k: v for k, v in found[-1].items() if k not in ("step", "tag")} if found else None


def json_safe(obj: Any) -> Any:
    """Non-finite floats as strings ("nan", "inf"), for strict JSON (checkpoint meta)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {key: json_safe(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(value) for value in obj]
    return obj


def log_json(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line, fsynced: a logged step survives a crash as its checkpoint does."""
    with open(path, "a") as fh:
        fh.write(json.dumps(record, default=float) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def fingerprint_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two ``model_fingerprint`` results, one line per part:
    ``weights: model.safetensors changed`` (or ``added``, ``removed``)."""
    out = []
    for part in ("weights", "tokenizer"):
        was, now = old.get(part, {}), new.get(part, {})
        files = [f"{name} {'added' if name not in was else 'removed' if name not in now else 'changed'}"
                 for name in sorted(was.keys() | now.keys()) if was.get(name) != now.get(name)]
        if files:
            out.append(f"{part}: {', '.join(files)}")
    return out
