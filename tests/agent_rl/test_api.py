"""``agent_rl.train(contract | dict | path, **overrides)``: what it validates before a run
starts and what it hands the loop. The loop itself is stubbed (``api.run``): the real run of
``agent_rl.train`` is ``tests/test_examples.py::test_train_from_script``."""

from __future__ import annotations

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
