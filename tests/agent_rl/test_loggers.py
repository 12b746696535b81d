"""``log.to``: the contract's logger names, the missing-package check before any work, and
short real runs (the tiny model on tests/Digits-v0, SFT on Records-v0) read back from what each
logger wrote: TensorBoard's event file, the offline W&B run file, the MLflow SQLite store."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import pytest

from agent_rl import cli
from agent_rl.run import contract as contract_module
from agent_rl.run import loggers
from agent_rl.run.contract import ContractError, ExperimentContract, SFTContract
from agent_rl.training import sft, shared, train
from tests.agent_rl import toy_env

RUN = {
    "name": "logged",
    "env": {"id": toy_env.ENV_ID, "pool_size": 64},
    "eval": {"n": 2, "every": 0},
    "model": {"id": "tiny", "adapter": "none"},
    "rollout": {"group_size": 4, "tasks_per_step": 2, "max_response_tokens": 8,
                "truncation": "keep"},
    "optim": {"lr": 1e-3, "max_steps": 2},
    "checkpoint": {"every": 1, "keep": 1},
    "guards": {"max_truncated_frac": 1.01},
}
EVERY = ["jsonl", "tensorboard", "wandb", "mlflow"]


def needs_every_logger() -> None:
    """The W&B and MLflow tests need the extras `make venv` installs."""
    for package in ("wandb", "mlflow"):
        pytest.importorskip(package, reason=f"pip install 'agent-rl[{package}]'")


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, every file of it (settings, cache, runs) under this test's tmp folder."""
    for name in ("WANDB_API_KEY", "WANDB_DIR", "MLFLOW_TRACKING_URI", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / "wandb-home" / name.lower()))


@pytest.fixture(scope="module")
def digits_env():
    yield toy_env.register()
    toy_env.unregister()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- readers of what each logger wrote ----------------------------------------------------------


def tensorboard_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(s.step, s.value) for s in events.Scalars(tag)]


def tensorboard_text(folder: Path, tag: str) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return events.Tensors(f"{tag}/text_summary")[0].tensor_proto.string_val[0].decode()


def wandb_records(path: Path):
    """The records of a W&B run file (``run-ID.wandb``): a LevelDB-style log of 32 KiB
    blocks, a 7-byte file header (``:W&B``, magic, version), each chunk a 7-byte header
    (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and a piece of a protobuf
    ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_run(folder: Path) -> tuple[str, dict, list[dict]]:
    """(run id, config, history rows) of the one offline run in a W&B folder."""
    [path] = folder.glob("wandb/offline-run-*/run-*.wandb")
    run_id, config, rows = None, {}, []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        if kind == "config":
            config |= {u.key: json.loads(u.value_json) for u in record.config.update}
        if kind == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item})
    return run_id, config, rows


def mlflow_run(run_dir: Path):
    from mlflow.tracking import MlflowClient

    with warnings.catch_warnings():  # sqlalchemy's deprecation notice as mlflow opens a store
        warnings.simplefilter("ignore", DeprecationWarning)
        client = MlflowClient(f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
        [experiment] = [e for e in client.search_experiments() if e.name == "agent-rl"]
        [run] = client.search_runs([experiment.experiment_id])
    return client, run


# --- the contract ---------------------------------------------------------------------------------


def test_log_to_takes_the_known_loggers_and_always_writes_jsonl():
    assert ExperimentContract.from_dict({"log": {"to": ["wandb"]}}).log.to == ["jsonl", "wandb"]
    assert ExperimentContract.from_dict({"log": {"to": "mlflow"}}).log.loggers == ["jsonl", "mlflow"]
    assert SFTContract.from_dict({"log": {"to": []}}).log.loggers == ["jsonl"]
    with pytest.raises(ContractError, match=r"log\.to: unknown logger 'wandbb' \(did you mean "
                       r"wandb\?\); log\.to takes jsonl, tensorboard, wandb, mlflow"):
        ExperimentContract.from_dict({"log": {"to": ["tensorboard", "wandbb"]}})
    with pytest.raises(ContractError, match=r"log\.to: unknown logger 'comet'; log\.to takes"):
        SFTContract.from_dict({}, ["log.to=[comet]"])
    with pytest.raises(ContractError, match=r"log\.to: name each logger once"):
        ExperimentContract.from_dict({"log": {"to": ["wandb", "wandb"]}})
    with pytest.raises(ContractError, match=r"log\.projekt: unknown key"):
        ExperimentContract.from_dict({"log": {"projekt": "x"}})


def test_the_default_is_jsonl_and_tensorboard_when_it_is_installed(monkeypatch):
    """log.to: null is what a run wrote before the key existed."""
    default = ExperimentContract().log
    assert default.to is None
    monkeypatch.setattr(contract_module, "installed", lambda package: package != "tensorboard")
    assert default.loggers == ["jsonl"]
    default.check_installed()  # nothing named is missing
    monkeypatch.setattr(contract_module, "installed", lambda package: True)
    assert default.loggers == ["jsonl", "tensorboard"]


def test_the_log_section_is_not_hashed():
    """Where metrics are mirrored is no part of the experiment: a resumed run may add W&B."""
    base = ExperimentContract.from_dict({})
    logged = ExperimentContract.from_dict({"log": {"to": EVERY, "project": "p", "name": "n"}})
    assert logged.contract_hash() == base.contract_hash()
    assert "log" not in logged.hashed_fields() and logged.changes_from(base) == []
    assert SFTContract.from_dict({"log": {"to": ["mlflow"]}}).contract_hash() == \
        SFTContract.from_dict({}).contract_hash()


def test_a_missing_package_is_refused_before_the_model_loads(digits_env, tmp_path, monkeypatch,
                                                             capsys):
    monkeypatch.setattr(contract_module, "installed", lambda package: package != "wandb")
    monkeypatch.setattr(shared, "initial_model", lambda *a, **k: pytest.fail("the model loaded"))
    contract = ExperimentContract.from_dict({**RUN, "run_dir": str(tmp_path / "r")},
                                            ["log.to=[tensorboard,wandb]"])
    with pytest.raises(ContractError, match=r"log\.to: wandb is not installed: pip install "
                       r"'agent-rl\[wandb\]' \(or take it out of log\.to\)"):
        train.run(contract, progress=False)
    assert not (tmp_path / "r").exists()

    monkeypatch.setattr(contract_module, "installed", lambda package: False)
    config = tmp_path / "sft.yaml"
    config.write_text(f"model: {{id: tiny}}\nlog: {{to: [wandb, mlflow]}}\nrun_dir: {tmp_path}/s\n")
    assert cli.main(["sft", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "log.to: wandb and mlflow are not installed: pip install 'agent-rl[wandb,mlflow]'" in err
    assert not (tmp_path / "s").exists()


# --- the loggers on their own ---------------------------------------------------------------------


def test_loggers_open_at_the_first_record_and_keep_their_run_ids(tmp_path):
    """Nothing is written before a step is logged; W&B files go under the run directory when
    WANDB_DIR is not set; a second opening (a resumed run) continues the same runs."""
    needs_every_logger()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    contract = ExperimentContract.from_dict({"model": {"id": "tiny"}, "log": {
        "to": EVERY, "project": "agent-rl", "name": "mine"}, "run_dir": str(run_dir)})
    opened = loggers.open_loggers(contract, run_dir)
    opened.close()
    assert list(run_dir.iterdir()) == []
    opened.log({"step": 1, "reward/mean": 0.25, "skill a=b": 1, "flag": True, "none": None}, 1)
    opened.close()
    ids = json.loads((run_dir / "loggers.json").read_text())
    loggers.open_loggers(contract, run_dir).log({"step": 2, "reward/mean": 0.75}, 2)
    assert json.loads((run_dir / "loggers.json").read_text()) == ids

    assert read_jsonl(run_dir / "metrics.jsonl")[0]["none"] is None  # jsonl keeps the record
    runs = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 2 and all(p.name == f"run-{ids['wandb']['id']}.wandb" for p in runs)
    client, run = mlflow_run(run_dir)
    assert run.info.run_id == ids["mlflow"]["run_id"] and run.info.run_name == "mine"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward/mean")] \
        == [(1, 0.25), (2, 0.75)]
    assert run.data.metrics.keys() == {"reward/mean", "skill a_b"}  # numbers only; names MLflow takes


def test_flatten_writes_every_leaf_as_a_dotted_param():
    assert loggers.flatten({"env": {"id": "x", "kwargs": {}}, "eval": {"split": ["a", "b"]},
                            "reference": None, "optim": {"lr": 1e-3, "seed": 0}}) == {
        "env.id": "x", "env.kwargs": "{}", "eval.split": '["a", "b"]', "reference": "null",
        "optim.lr": "0.001", "optim.seed": "0"}


# --- real runs ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_training_run_writes_every_logger_and_resumes_into_the_same_runs(
        digits_env, tmp_path, monkeypatch):
    needs_every_logger()
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-runs"))
    run_dir = tmp_path / "run"
    contract = ExperimentContract.from_dict({**RUN, "run_dir": str(run_dir)},
                                            [f"log.to={EVERY}"])
    train.run(contract, progress=False)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    rewards = [(m["step"], m["reward/mean"]) for m in metrics]
    assert [step for step, _ in rewards] == [1, 2]

    # TensorBoard: the reward at each step, the contract as text
    assert tensorboard_scalars(run_dir / "tensorboard", "reward/mean") == \
        [(s, pytest.approx(r)) for s, r in rewards]
    assert "id: tiny" in tensorboard_text(run_dir / "tensorboard", "contract")

    # W&B (offline, under WANDB_DIR): the contract as the config, the reward against `step`
    run_id, config, rows = wandb_run(tmp_path / "wandb-runs")
    assert run_id == json.loads((run_dir / "loggers.json").read_text())["wandb"]["id"]
    assert config["model"]["id"] == "tiny" and config["env"]["id"] == toy_env.ENV_ID
    assert [(row["step"], row["reward/mean"]) for row in rows] == \
        [(s, pytest.approx(r)) for s, r in rewards]
    assert not (run_dir / "wandb").exists()

    # MLflow (run_dir/mlflow.db): the reward at each step, the contract as flat params
    client, run = mlflow_run(run_dir)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward/mean")] \
        == [(s, pytest.approx(r)) for s, r in rewards]
    assert run.data.params["model.id"] == "tiny" and run.data.params["rollout.group_size"] == "4"
    assert run.info.run_name == "run" and run.info.status == "FINISHED"

    # resumed one step further: the same W&B and MLflow runs continue
    longer = ExperimentContract.from_dict({**RUN, "run_dir": str(run_dir)},
                                          [f"log.to={EVERY}", "optim.max_steps=3"])
    train.run(longer, resume=True, progress=False)
    step3 = read_jsonl(run_dir / "metrics.jsonl")[-1]
    assert step3["step"] == 3
    client, again = mlflow_run(run_dir)
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1, 2, 3]
    files = sorted((tmp_path / "wandb-runs").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and {p.name for p in files} == {f"run-{run_id}.wandb"}
    assert [s for s, _ in tensorboard_scalars(run_dir / "tensorboard", "reward/mean")] == [1, 2, 3]


@pytest.mark.slow
def test_sft_logs_its_steps_to_the_loggers(tmp_path):
    needs_every_logger()
    contract = SFTContract.from_dict({
        "name": "t", "env": {"id": "agent_rl/Records-v0", "pool_size": 64},
        "eval": {"n": 2}, "model": {"id": "tiny", "adapter": "none"},
        "data": {"max_episodes": 4}, "optim": {"epochs": 1, "batch_sessions": 2,
                                               "micro_batch_tokens": 2048},
        "limits": {"max_prompt_tokens": 2048, "max_response_tokens": 8},
        "log": {"to": EVERY, "name": "warm"}, "run_dir": str(tmp_path / "sft")})
    result = sft.run(contract, progress=False)
    run_dir = result.run_dir
    losses = [(m["step"], m["loss/sft"]) for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert len(losses) == result.steps >= 2
    assert tensorboard_scalars(run_dir / "tensorboard", "loss/sft") == \
        [(s, pytest.approx(v)) for s, v in losses]
    _, config, rows = wandb_run(run_dir)
    assert config["data"]["source"] == "solver"
    assert [(row["step"], row["loss/sft"]) for row in rows] == [(s, pytest.approx(v)) for s, v in losses]
    client, run = mlflow_run(run_dir)
    assert run.info.run_name == "warm" and run.data.params["data.max_episodes"] == "4"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss/sft")] == \
        [(s, pytest.approx(v)) for s, v in losses]


@pytest.mark.slow
def test_only_rank_zero_logs_under_torchrun(digits_env, tmp_path):
    """Two ranks (DeepSpeed on gloo) train one step: one W&B run, one MLflow point per step,
    one TensorBoard event file, one metrics.jsonl line."""
    needs_every_logger()
    pytest.importorskip("deepspeed")
    from tests.agent_rl.test_train import DS, launch

    run_dir = launch(tmp_path / "run", *DS, "optim.max_steps=1", "eval.every=0",
                     f"log.to={EVERY}")
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1]
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert len(list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))) == 1
    client, run = mlflow_run(run_dir)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1]
