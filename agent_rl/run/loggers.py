"""Where a run's step metrics go: the contract's ``log.to`` (``LogSection.loggers``).

    jsonl        run_dir/metrics.jsonl, one JSON record per step, fsynced; always written
                 (resume, ``agent-rl report`` and ``inspect`` read it)
    tensorboard  run_dir/tensorboard (``torch.utils.tensorboard``): every number of the
                 record as a scalar at its step; the contract as the text ``contract``
    wandb        a W&B run (``WANDB_MODE``, ``WANDB_API_KEY`` and the other ``WANDB_*``
                 variables respected; files under run_dir/wandb unless ``WANDB_DIR``): the
                 numbers against the metric ``step``, the contract as the run config
    mlflow       an MLflow run in run_dir/mlflow.db (a local SQLite store; ``mlflow ui
                 --backend-store-uri sqlite:///RUN/mlflow.db``) unless ``MLFLOW_TRACKING_URI``:
                 the numbers at their step, the contract flattened to params (``env.id``: ...)

W&B project and MLflow experiment: ``log.project`` (default ``agent-rl``); run name: ``log.name``
(default the run directory's name). A resumed run continues the same W&B and MLflow runs: their
ids are kept in run_dir/loggers.json. Steps a killed run logged after its last checkpoint are
logged again when redone (metrics.jsonl sets them aside, ``rundir.rewind_logs``; the mirrors
cannot take a point back): W&B plots against ``step``, so the redone points lie on the same x.
MLflow params are written when its run is created; a resumed run keeps them.

Nothing opens before the first record (a finished run resumed logs nothing and opens nothing),
and only the process that logs opens anything: under torchrun the trainer logs on rank 0 only.
Whether each package is installed is checked before the model loads
(``LogSection.check_installed``).
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agent_rl.run.contract import ExperimentContract, SFTContract
from agent_rl.run.rundir import log_json, write_file

IDS_FILE = "loggers.json"  # the W&B and MLflow run ids a resumed run continues
DEFAULT_PROJECT = "agent-rl"


class Logger(Protocol):
    """One destination of step metrics."""

    def log(self, record: dict[str, Any], step: int) -> None:
        """``record``: a step's metrics as ``metrics.jsonl`` holds them (``step`` included)."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class RunInfo:
    """What a logger is told about the run when it opens."""

    run_dir: Path
    config: dict[str, Any]  # the contract, as plain JSON types
    project: str
    name: str

    @property
    def contract_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.config, sort_keys=False)


class Loggers:
    """The run's loggers (``open_loggers``), opened at the first record."""

    def __init__(self, names: list[str], info: RunInfo):
        unknown = [n for n in names if n not in OPENERS]
        if unknown:
            raise ValueError(f"log.to: unknown logger {unknown[0]!r}; known: {list(OPENERS)}")
        self.names, self.info = list(names), info
        self.opened: list[Logger] | None = None

    def log(self, record: dict[str, Any], step: int) -> None:
        if self.opened is None:
            self.opened = []  # a logger that fails to open leaves the ones before it to close
            for name in self.names:
                self.opened.append(OPENERS[name](self.info))
        for logger in self.opened:
            logger.log(record, step)

    def close(self) -> None:
        """Flush and close every opened logger (a run's end); a later record opens them anew."""
        for logger in self.opened or []:
            logger.close()
        self.opened = None


def open_loggers(contract: ExperimentContract | SFTContract, run_dir: Path,
                 names: list[str] | None = None) -> Loggers:
    """The loggers of ``contract.log`` (``names``: others in their place) writing for
    ``run_dir``; nothing is opened before the first ``log``."""
    info = RunInfo(run_dir=run_dir, config=contract.model_dump(mode="json"),
                   project=contract.log.project or DEFAULT_PROJECT,
                   name=contract.log.name or run_dir.resolve().name)
    return Loggers(contract.log.loggers if names is None else names, info)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a step record (no ``step``, no booleans, no None or text)."""
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)}


# --- the loggers ------------------------------------------------------------------------------


class JsonlLog:
    """run_dir/metrics.jsonl (``rundir.log_json``: appended, fsynced)."""

    def __init__(self, info: RunInfo):
        self.path = info.run_dir / "metrics.jsonl"

    def log(self, record: dict[str, Any], step: int) -> None:
        log_json(self.path, record)

    def close(self) -> None:
        pass


class TensorBoardLog:
    """run_dir/tensorboard: scalars at their step, the contract as text."""

    def __init__(self, info: RunInfo):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(info.run_dir / "tensorboard"))
        self.writer.add_text("contract", "```\n" + info.contract_yaml + "```")

    def log(self, record: dict[str, Any], step: int) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()  # stops its background thread


class WandbLog:
    """A W&B run, continued on resume (its id in loggers.json)."""

    def __init__(self, info: RunInfo):
        import wandb
        from wandb.sdk.lib.runid import generate_id

        run_id = read_ids(info.run_dir).get("wandb", {}).get("id") or generate_id()
        save_id(info.run_dir, "wandb", {"id": run_id})
        where = Path(os.environ.get("WANDB_DIR") or info.run_dir)
        where.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=info.project, name=info.name, id=run_id, resume="allow",
                              dir=str(where), reinit="create_new",
                              settings=wandb.Settings(console="off"))
        self.run.config.update(info.config, allow_val_change=True)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log({**scalars(record), "step": step})

    def close(self) -> None:
        self.run.finish()


class MlflowLog:
    """An MLflow run, continued on resume (its id in loggers.json, for its tracking URI)."""

    def __init__(self, info: RunInfo):
        with warnings.catch_warnings():  # sqlalchemy's and mlflow's deprecation notices
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            from mlflow.entities import Param, RunStatus
            from mlflow.tracking import MlflowClient

            store = info.run_dir / "mlflow.db"
            uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{store.resolve()}"
            self.client = MlflowClient(uri)
            held = read_ids(info.run_dir).get("mlflow", {})
            if held.get("tracking_uri") == uri:
                self.run_id = held["run_id"]
                self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
                return
            experiment = self.client.get_experiment_by_name(info.project)
            experiment_id = (experiment.experiment_id if experiment is not None else
                             self.client.create_experiment(info.project, artifact_location=(
                                 None if "MLFLOW_TRACKING_URI" in os.environ
                                 else (info.run_dir / "mlartifacts").resolve().as_uri())))
            self.run_id = self.client.create_run(experiment_id, run_name=info.name).info.run_id
            save_id(info.run_dir, "mlflow", {"tracking_uri": uri, "run_id": self.run_id})
            params = [Param(key, value) for key, value in flatten(info.config).items()]
            for start in range(0, len(params), 100):  # log_batch takes 100 params a call
                self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, record: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(mlflow_key(key), value, now, step) for key, value in scalars(record).items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


OPENERS: dict[str, Callable[[RunInfo], Logger]] = {
    "jsonl": JsonlLog, "tensorboard": TensorBoardLog, "wandb": WandbLog, "mlflow": MlflowLog}


# --- helpers ----------------------------------------------------------------------------------


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted key -> text for every leaf of a nested dict (``{"env": {"id": "x"}}`` ->
    ``{"env.id": "x"}``); lists and empty dicts as JSON, null as ``null``."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out |= flatten(value, f"{prefix}{key}.")
        elif isinstance(value, str):
            out[prefix + key] = value
        else:
            out[prefix + key] = json.dumps(value)
    return out


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts: characters other than letters, digits, ``_-./ :`` as
    ``_``."""
    return re.sub(r"[^\w\-./ :]", "_", key)


def read_ids(run_dir: Path) -> dict[str, dict[str, Any]]:
    path = run_dir / IDS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def save_id(run_dir: Path, logger: str, ids: dict[str, Any]) -> None:
    """Keep a logger's run ids in loggers.json, for the resumed run."""
    held = read_ids(run_dir) | {logger: ids}
    write_file(run_dir / IDS_FILE, json.dumps(held, indent=2, sort_keys=True) + "\n")
