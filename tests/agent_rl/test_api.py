"""``agent_rl.train(contract | dict | path, **overrides)``: what it validates before a run
starts and what it hands the loop. The loop itself is stubbed (``api.run``): the real run of
``agent_rl.train`` is ``tests/test_examples.py::test_train_from_script``."""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from pathlib import Path

import pytest
import yaml

import agent_rl
from agent_rl import ContractError, ExperimentContract
from agent_rl.training import api

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"


@pytest.fixture
def ran(monkeypatch):
    """The (contract, resume, progress) each call of the stubbed loop got."""
    calls = []
    monkeypatch.setattr(api, "run", lambda contract, resume, progress:
                        calls.append((contract, resume, progress)) or "result")
    return calls


def test_train_is_the_function_at_the_top():
    assert agent_rl.train is api.train


def test_overrides_by_double_underscore_or_dotted_key_give_the_same_contract(ran, tmp_path):
    run_dir = str(tmp_path / "run")
    assert agent_rl.train(TINY, optim__max_steps=4, rollout__group_size=4, run_dir=run_dir) == "result"
    agent_rl.train(TINY, **{"optim.max_steps": 4, "rollout.group_size": 4, "run_dir": run_dir})
    (first, resume, progress), (second, _, _) = ran
    assert (first.optim.max_steps, first.rollout.group_size, first.run_dir) == (4, 4, run_dir)
    assert first.contract_hash() == second.contract_hash()
    assert (resume, progress) == (False, True)
    # the file's other keys are kept: only the overridden ones differ
    plain = ExperimentContract.from_yaml(TINY)
    assert plain.optim.max_steps == 2 and first.optim.lr == plain.optim.lr


def test_a_dict_a_contract_and_a_path_are_the_same_run(ran, tmp_path):
    data = yaml.safe_load(TINY.read_text())
    contract = ExperimentContract.from_yaml(TINY)
    agent_rl.train(data, optim__max_steps=3, resume=True, progress=False)
    agent_rl.train(contract, optim__max_steps=3)
    agent_rl.train(str(TINY), optim__max_steps=3)
    hashes = {c.contract_hash() for c, _, _ in ran}
    assert len(hashes) == 1 and ran[0][1:] == (True, False)
    agent_rl.train(contract)  # no override: the very object
    assert ran[-1][0] is contract


def test_python_values_are_not_yaml_text(ran):
    agent_rl.train(TINY, env__kwargs={"max_operand": 9}, run_dir=Path("runs/x"), name="yes")
    contract = ran[0][0]
    assert contract.env.kwargs == {"max_operand": 9}
    assert contract.run_dir == "runs/x" and contract.name == "yes"  # "yes" stays a string


@pytest.mark.parametrize("overrides, message", [
    ({"optim__max_stepz": 4}, "optim.max_stepz: unknown key"),
    ({"optim__max_steps": -1}, "optim.max_steps"),
    ({"optim__max_steps__x": 1}, "override optim.max_steps.x: 'max_steps' is not a section"),
    ({"optim.": 1}, "override 'optim.': the key has an empty part"),
])
def test_a_broken_override_is_a_contract_error_naming_the_key_before_anything_runs(
        ran, overrides, message):
    with pytest.raises(ContractError, match=message.replace(".", r"\.")):
        agent_rl.train(TINY, **overrides)
    assert ran == []


def test_a_missing_file_and_a_blocked_run_dir_are_refused_before_anything_runs(ran, tmp_path):
    with pytest.raises(ContractError, match="config file not found"):
        agent_rl.train(tmp_path / "nope.yaml")
    (tmp_path / "file").write_text("")
    with pytest.raises(ContractError, match="run_dir: .*file is a file, not a directory"):
        agent_rl.train(TINY, run_dir=str(tmp_path / "file" / "run"))
    assert ran == []


# --- typed arguments: reward, dataset, assigner, peft_config ---------------------------------

ROWS = [{"prompt": f"{a} + 1 =", "answer": str(a + 1)} for a in range(8)]
ON_ROWS = {"eval": {"split": "holdout_iid"}, "env": {"iid_fraction": 0.25}}


def test_python_objects_become_contract_keys(ran, tmp_path):
    from peft import LoraConfig

    def my_reward(reply, task):  # a closure: kept in this process, named by its qualname
        return float(reply.strip() == task.target)

    def my_credit(episode):
        return {s.session_id: episode.reward.total for s in episode.sessions}

    agent_rl.train(ON_ROWS, reward=my_reward, dataset=ROWS, assigner=my_credit,
                   peft_config=LoraConfig(r=4, lora_alpha=12, task_type="CAUSAL_LM"),
                   run_dir=str(tmp_path / "run"))
    (contract, _, _), = ran
    here = "tests.agent_rl.test_api:test_python_objects_become_contract_keys.<locals>"
    assert contract.env.id == "agent_rl/Dataset-v0"
    assert contract.env.kwargs["reward"] == f"{here}.my_reward"
    assert contract.credit.assigner == f"{here}.my_credit"
    assert (contract.model.adapter, contract.model.lora_rank, contract.model.lora_alpha) == (
        "lora", 4, 12)
    # the rows: one JSONL file in the run dir's inputs/, named by its content
    path = Path(contract.env.kwargs["path"])
    assert path.parent == tmp_path / "run" / "inputs"
    assert [json.loads(line) for line in path.read_text().splitlines()] == ROWS
    assert path.name == hashlib.sha256(path.read_bytes()).hexdigest()[:16] + ".jsonl"
    # the pins hold the functions' own source, so editing them is a new contract
    pins = contract.input_pins()
    assert pins["env.kwargs.reward"]["sha256"] == hashlib.sha256(
        inspect.getsource(my_reward).encode()).hexdigest()
    assert set(pins) == {"env.kwargs.path", "env.kwargs.reward", "credit.assigner"}


def test_an_importable_function_is_named_as_yaml_would(ran, tmp_path):
    from envs.scoring import numeric_reward
    from tests.trajectories.custom_assigners import depth_share

    agent_rl.train(ON_ROWS, reward=numeric_reward, dataset=ROWS, assigner=depth_share,
                   run_dir=str(tmp_path / "run"))
    contract = ran[0][0]
    assert contract.env.kwargs["reward"] == "envs.scoring:numeric_reward"
    assert contract.credit.assigner == "tests.trajectories.custom_assigners:depth_share"


def test_a_datasets_dataset_is_rows_too(ran, tmp_path):
    datasets = pytest.importorskip("datasets")
    agent_rl.train(ON_ROWS, dataset=datasets.Dataset.from_list(ROWS), run_dir=str(tmp_path / "r"))
    path = Path(ran[0][0].env.kwargs["path"])
    assert [json.loads(line) for line in path.read_text().splitlines()] == ROWS


class Rows:
    """What a ``datasets.Dataset`` offers the API: iteration over dict rows."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def test_any_iterable_of_dicts_is_rows_and_a_path_is_passed_through(ran, tmp_path):
    agent_rl.train(ON_ROWS, dataset=Rows(ROWS), run_dir=str(tmp_path / "a"))
    agent_rl.train(ON_ROWS, dataset=ROWS, run_dir=str(tmp_path / "b"))
    first, second = (Path(c.env.kwargs["path"]) for c, _, _ in ran)
    assert first.read_bytes() == second.read_bytes()
    agent_rl.train(ON_ROWS, dataset=first, run_dir=str(tmp_path / "c"))
    assert ran[-1][0].env.kwargs["path"] == str(first)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dataset": {"train": ROWS}}, "dataset: a mapping (splits or columns ['train'])"),
    ({"dataset": [ROWS[0], "text"]}, "dataset row 2: a str, not a dict"),
    ({"dataset": [{"prompt": "a", "answer": object()}]}, "dataset row 1: not JSON"),
    ({"dataset": [{"prompt": "a", "answer": float("nan")}]}, "dataset row 1: not JSON"),
    ({"dataset": []}, "dataset: no rows"),
    ({"dataset": 3}, "dataset: int is not a list of dicts"),
    ({"reward": 3}, "reward: reward must be a function, got int"),
    ({"assigner": "nope"}, "credit.assigner: unknown assigner 'nope'"),
    ({"reward": "exact", "env__id": "agent_rl/Relay-v0"},
     "env.id: reward= and dataset= are the arguments of agent_rl/Dataset-v0, but the contract "
     "trains on agent_rl/Relay-v0"),
])
def test_bad_typed_arguments_are_named_before_anything_is_written(ran, tmp_path, kwargs, message):
    with pytest.raises(ContractError, match=re.escape(message)):
        agent_rl.train(ON_ROWS, run_dir=str(tmp_path / "run"), **kwargs)
    assert ran == [] and not (tmp_path / "run").exists()


def test_a_lora_config_the_trainer_would_not_honour_is_refused_naming_the_fields(ran):
    from peft import LoraConfig

    config = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    with pytest.raises(ContractError, match=re.escape(
            "this LoraConfig also sets target_modules=['q_proj', 'v_proj'], lora_dropout=0.1: "
            "drop those fields")):
        agent_rl.train(TINY, peft_config=config)
    with pytest.raises(ContractError, match="peft_config: a peft.LoraConfig, got dict"):
        agent_rl.train(TINY, peft_config={"r": 8})
    assert ran == []
