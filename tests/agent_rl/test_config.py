"""ExperimentContract: YAML in and out, --set overrides, errors that name the key, the hash."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from agent_rl.run.contract import UNHASHED, ContractError, ExperimentContract, SFTContract

# The example of DESIGN section 7, verbatim: its key names are part of the contract.
DESIGN_YAML = """\
name: smollm2-pii
env: {id: agent_rl/PIIMask-v0, split: train, kwargs: {}}
eval: {split: holdout, n: 64, every: 5, seed: 1234}
model: {id: smollm2-135m, dtype: float32, adapter: lora, lora_rank: 16}  # id: smollm2-135m | tiny | a local HF folder
reference: null                 # a model id; required when loss.kl.beta > 0, never the rollout policy
rollout: {backend: hf, group_size: 8, tasks_per_step: 4, temperature: 1.0, top_p: 1.0,
          max_prompt_tokens: 512, max_response_tokens: 128, truncation: mask,
          dynamic_sampling: true, max_policy_lag: 0}
credit: {assigner: broadcast, params: {}, session_weighting: per_episode}
advantage: {std: population, scale: group, eps: 1.0e-6}
loss: {aggregation: token_mean, clip_low: 0.2, clip_high: 0.28, ratio: token, objective: ppo_clip,
       kl: {beta: 0.0, estimator: k3}}
optim: {lr: 1.0e-5, weight_decay: 0.0, grad_clip: 1.0, updates_per_batch: 1, max_steps: 20, seed: 0}
backend: {name: torch}          # or {name: deepspeed, zero_stage: 2}
checkpoint: {every: 5, keep: 3}
guards: {max_nonfinite_steps: 2, min_entropy: 0.05, max_kl: 1.0, max_policy_lag: 2,
         max_verifier_error_rate: 0.1, holdout_patience: 5}
acceptance: {holdout_min: null, max_error_rate: 0.05, critical_slices: []}
run_dir: runs/${name}
"""


@pytest.fixture
def design_file(tmp_path):
    path = tmp_path / "contract.yaml"
    path.write_text(DESIGN_YAML)
    return path


def contract_error(data=None, overrides=None) -> str:
    with pytest.raises(ContractError) as info:
        ExperimentContract.from_dict(data or {}, overrides)
    return str(info.value)


# --- YAML -------------------------------------------------------------------------------------


def test_design_example_loads_and_round_trips(design_file, tmp_path):
    contract = ExperimentContract.from_yaml(design_file)
    assert contract.env.id == "agent_rl/PIIMask-v0" and contract.reference is None
    assert contract.loss.clip_high == 0.28 and contract.advantage.eps == 1e-6
    assert contract.resolved_run_dir.as_posix() == "runs/smollm2-pii"

    copy = tmp_path / "copy.yaml"
    copy.write_text(contract.to_yaml())
    again = ExperimentContract.from_yaml(copy)
    assert again == contract
    assert again.contract_hash() == contract.contract_hash()
    assert again.to_yaml() == contract.to_yaml()


def test_empty_yaml_gives_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set\n")
    assert ExperimentContract.from_yaml(path) == ExperimentContract()


def test_broken_yaml_is_a_contract_error(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("optim: {lr: 1e-3\nname: [unclosed\n")
    with pytest.raises(ContractError, match=r"broken\.yaml is not valid YAML"):
        ExperimentContract.from_yaml(path)
    path.write_text("- just\n- a list\n")
    with pytest.raises(ContractError, match="top level must be a mapping"):
        ExperimentContract.from_yaml(path)


def test_missing_file_is_a_contract_error(tmp_path):
    with pytest.raises(ContractError, match=r"config file not found: .*nope\.yaml"):
        ExperimentContract.from_yaml(tmp_path / "nope.yaml")


# --- overrides ----------------------------------------------------------------------------------


def test_overrides_by_dotted_path_parse_values_as_yaml(design_file):
    contract = ExperimentContract.from_yaml(design_file, [
        "optim.max_steps=4",
        "optim.lr=3e-4",  # YAML 1.1 reads this as a string; the float field converts it
        "rollout.temperature=0.7",
        "rollout.dynamic_sampling=false",
        "env.kwargs={max_turns: 3, hints: true}",
        "loss.kl.beta=0.05",
        "reference=/models/frozen-base",
        "run_dir=/tmp/r",
        "name=a=b",  # only the first '=' separates key and value
    ])
    assert contract.optim.max_steps == 4 and isinstance(contract.optim.max_steps, int)
    assert contract.optim.lr == 3e-4 and isinstance(contract.optim.lr, float)
    assert contract.rollout.temperature == 0.7
    assert contract.rollout.dynamic_sampling is False
    assert contract.env.kwargs == {"max_turns": 3, "hints": True}
    assert contract.loss.kl.beta == 0.05 and contract.loss.kl.estimator == "k3"  # sibling kept
    assert contract.reference == "/models/frozen-base"
    assert contract.resolved_run_dir.as_posix() == "/tmp/r"
    assert contract.name == "a=b"
    assert contract.optim.seed == 0 and contract.loss.clip_high == 0.28  # the rest untouched


def test_overrides_create_missing_sections():
    contract = ExperimentContract.from_dict({}, ["guards.min_entropy=0.5", "reference=null"])
    assert contract.guards.min_entropy == 0.5 and contract.reference is None


def test_from_dict_does_not_mutate_its_input():
    data = {"optim": {"lr": 1e-3}}
    ExperimentContract.from_dict(data, ["optim.lr=2e-3", "rollout.group_size=2"])
    assert data == {"optim": {"lr": 1e-3}}


@pytest.mark.parametrize("item, message", [
    ("optim.max_steps", "expected KEY=VALUE"),
    ("optim.lr=[1", r"--set optim\.lr: value '\[1' is not valid YAML"),
    ("name.x=1", "'name' is not a section"),
    ("=1", r"--set '=1': the key has an empty part"),  # was "(top level): unknown key"
    ("optim..lr=1", r"--set 'optim\.\.lr=1': the key has an empty part"),
])
def test_malformed_overrides_are_named(item, message):
    with pytest.raises(ContractError, match=message):
        ExperimentContract.from_dict({"name": "run"}, [item])


# --- validation ---------------------------------------------------------------------------------


def test_unknown_key_error_names_the_key(design_file):
    with pytest.raises(ContractError, match=r"optim\.lrr: unknown key"):
        ExperimentContract.from_yaml(design_file, ["optim.lrr=1e-4"])
    assert "loss.kl.betta: unknown key" in contract_error({"loss": {"kl": {"betta": 0.1}}})
    assert "learning_rate: unknown key" in contract_error({"learning_rate": 0.1})


def test_loss_recipes_are_contract_keys():
    """loss.ratio (GSPO's sequence ratio) and loss.objective (CISPO): defaults, values, errors."""
    default = ExperimentContract()
    assert default.loss.ratio == "token" and default.loss.objective == "ppo_clip"
    gspo = ExperimentContract.from_dict({}, ["loss.ratio=sequence", "loss.objective=cispo"])
    assert gspo.loss.ratio == "sequence" and gspo.loss.objective == "cispo"
    assert "loss.ratio: Input should be 'token' or 'sequence'" in contract_error(
        overrides=["loss.ratio=gspo"])
    assert "loss.objective: Input should be 'ppo_clip' or 'cispo'" in contract_error(
        overrides=["loss.objective=cisp"])
    # clip_low 1.0 puts the lower bound at 0 (MiniMax-M1's CISPO clips only above); above 1 is refused
    assert ExperimentContract.from_dict({}, ["loss.clip_low=1.0"]).loss.clip_low == 1.0
    assert "loss.clip_low: Input should be less than or equal to 1" in contract_error(
        overrides=["loss.clip_low=1.5"])


def test_wrong_types_and_ranges_name_the_key():
    assert "rollout.group_size" in contract_error(overrides=["rollout.group_size=zero"])
    assert "optim.lr: Input should be greater than 0" in contract_error(overrides=["optim.lr=-1"])
    assert "rollout.truncation" in contract_error(overrides=["rollout.truncation=drop"])
    message = contract_error(overrides=["optim.lr=0", "rollout.top_p=2"])
    assert "optim.lr" in message and "rollout.top_p" in message  # every error, not the first


@pytest.mark.parametrize("override", [
    "rollout.truncation_penalty=.nan", "optim.lr=.inf", "optim.lr=inf", "optim.lr=.nan",
    "guards.max_kl=.nan", "acceptance.holdout_min=-.inf", "eval.temperature=.inf",
])
def test_non_finite_numbers_are_refused(override):
    key = override.split("=", 1)[0]
    assert f"{key}: Input should be a finite number" in contract_error(overrides=[override])


@pytest.mark.parametrize("override, key", [
    ("env.kwargs={max_ops: .nan}", "env.kwargs.max_ops"),
    ("env.kwargs={nested: {deep: [1, .inf]}}", "env.kwargs.nested.deep.1"),
    ("credit.params={gamma: .nan}", "credit.params.gamma"),
])
def test_non_finite_numbers_are_refused_inside_free_form_sections(override, key):
    message = contract_error(overrides=[override, "credit.assigner=discounted"])
    assert f"{key}: not a finite number" in message


@pytest.mark.parametrize("override", [
    "optim.max_steps=true", "rollout.group_size=false", "optim.lr=true",
    "acceptance.holdout_min=true", "name=true",
])
def test_booleans_are_not_numbers(override):
    """pydantic reads true as 1: `optim.max_steps=true` ran one step."""
    key = override.split("=", 1)[0]
    assert f"{key}: got the boolean" in contract_error(overrides=[override])
    assert ExperimentContract.from_dict({}, ["rollout.dynamic_sampling=false"]).rollout \
        .dynamic_sampling is False  # a boolean key still takes one


def test_env_kwargs_are_checked_against_the_constructor():
    message = contract_error(overrides=["env.kwargs={bogus: 1}"])
    assert message.startswith("contract: env.kwargs.bogus: agent_rl/Arithmetic-v0 takes no such")
    assert "max_ops" in message and "max_turns" in message  # its own and its base class's
    records = ExperimentContract.from_dict({}, [
        "env.id=agent_rl/Records-v0", "env.kwargs={context_budget: 400, max_turns: 3, hints: true}"])
    assert records.env.kwargs["max_turns"] == 3
    assert "env.kwargs.max_ops" in contract_error(
        overrides=["env.id=agent_rl/Records-v0", "env.kwargs={max_ops: 2}"])
    unknown = contract_error(overrides=["env.id=agent_rl/Recrds-v0"])
    assert "env.id: No environment 'agent_rl/Recrds-v0'" in unknown and "Records-v0" in unknown


def test_run_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "taken").write_text("someone's file")
    for run_dir in ("taken", "taken/sub"):
        contract = ExperimentContract.from_dict({"run_dir": str(tmp_path / run_dir)})
        with pytest.raises(ContractError, match=r"run_dir: .*taken is a file, not a directory"):
            contract.check_run_dir()
    free = ExperimentContract.from_dict({"run_dir": str(tmp_path / "new" / "${name}")})
    assert free.check_run_dir() == tmp_path / "new" / "run"


def test_kl_needs_a_fixed_reference():
    message = contract_error(overrides=["loss.kl.beta=0.1"])
    assert "loss.kl.beta > 0 needs `reference`" in message
    assert "never the rollout policy" in contract_error(
        overrides=["loss.kl.beta=0.1", "reference=policy"])
    ok = ExperimentContract.from_dict({}, ["loss.kl.beta=0.1", "reference=/models/base"])
    assert ok.reference == "/models/base"


def test_reference_cannot_be_the_model_under_full_fine_tuning():
    message = contract_error(overrides=["model.adapter=none", "reference=smollm2-135m",
                                        "model.id=smollm2-135m"])
    assert "is the model being trained" in message
    # with LoRA the base weights (adapter disabled) are a fixed reference
    lora = ExperimentContract.from_dict({}, ["model.adapter=lora", "reference=smollm2-135m",
                                             "loss.kl.beta=0.1"])
    assert lora.reference == lora.model.id


def test_other_impossible_combinations():
    assert "exceeds guards.max_policy_lag" in contract_error(
        overrides=["rollout.max_policy_lag=3", "guards.max_policy_lag=2"])
    assert "group_size >= 2" in contract_error(overrides=["rollout.group_size=1"])
    assert ExperimentContract.from_dict({}, ["rollout.group_size=1",
                                             "rollout.dynamic_sampling=false"]).rollout.group_size == 1
    assert "credit.assigner: unknown assigner 'nope'" in contract_error(overrides=["credit.assigner=nope"])
    # with explicit holdouts an empty holdout_iid is known before the run (without, it depends
    # on the pool: test_holdout_iid_without_iid_fraction_is_decided_by_the_pool)
    assert "needs env.iid_fraction > 0" in contract_error(
        overrides=["eval.split=holdout_iid", "env.holdout={min_length: 3}"])
    assert ExperimentContract.from_dict({}, ["eval.split=holdout_iid",
                                             "env.iid_fraction=0.2"]).env.iid_fraction == 0.2


def test_credit_params_are_checked_against_the_assigner():
    assert "credit.params" in contract_error(overrides=["credit.params={gama: 0.5}",
                                                        "credit.assigner=discounted"])
    message = contract_error(overrides=["credit.params={gama: 0.5}", "credit.assigner=discounted"])
    assert "gama" in message and "gamma" in message  # what it got and what it takes
    assert "gamma must be in [0, 1]" in contract_error(
        overrides=["credit.assigner=discounted", "credit.params={gamma: 2}"])
    assert "no parameters" in contract_error(overrides=["credit.params={unused_value: 0}"])
    ok = ExperimentContract.from_dict({}, ["credit.assigner=usage_weighted",
                                           "credit.params={unused_value: -0.5}"])
    assert ok.credit.params == {"unused_value": -0.5}


def test_splits_are_checked_by_name_and_held_out_from_training():
    assert "eval.split: no split 'holdot'" in contract_error(overrides=["eval.split=holdot"])
    assert "env.split: no split 'trian'" in contract_error(overrides=["env.split=trian"])
    assert "eval.split: no split 'bogus'" in contract_error(overrides=["eval.split=bogus"])
    # Splits has this key (the dropped duplicates), but it is no split to train on
    assert "env.split: no split 'dropped_duplicates'" in contract_error(
        overrides=["env.split=dropped_duplicates"])
    assert "eval.split: no split 'dropped_duplicates'" in contract_error(
        overrides=["eval.split=[holdout, dropped_duplicates]"])
    assert "is the training split" in contract_error(
        overrides=["env.split=holdout", "eval.split=holdout"])
    assert "name each split once" in contract_error(overrides=["eval.split=[holdout, holdout]"])
    both = ExperimentContract.from_dict({}, ["eval.split=[holdout_iid, holdout]",
                                             "env.iid_fraction=0.2"])
    assert both.eval.splits == ["holdout_iid", "holdout"]
    assert ExperimentContract().eval.splits == ["holdout"]


def test_a_context_budget_must_fit_the_prompt_limit():
    message = contract_error(overrides=["env.kwargs={context_budget: 600}",
                                        "rollout.max_prompt_tokens=512"])
    assert "context_budget (600) must be below rollout.max_prompt_tokens (512)" in message
    assert ExperimentContract.from_dict({}, ["env.kwargs={context_budget: 400}"]).env.kwargs


def test_backend_keys_are_checked_together():
    ok = ExperimentContract.from_dict({}, ["backend.name=deepspeed", "backend.zero_stage=2",
                                           "backend.offload=cpu"])
    assert ok.backend.zero_stage == 2
    assert "need backend.name: deepspeed" in contract_error(overrides=["backend.zero_stage=2"])
    assert "offload: cpu needs backend.zero_stage >= 1" in contract_error(
        overrides=["backend.name=deepspeed", "backend.offload=cpu"])
    zero3 = ExperimentContract.from_dict({}, ["backend.name=deepspeed", "backend.zero_stage=3"])
    assert zero3.backend.zero_stage == 3


def test_vllm_rollouts_need_the_full_softmax():
    assert "rollout.top_p < 1 with rollout.backend vllm" in contract_error(
        overrides=["rollout.backend=vllm", "rollout.top_p=0.9"])
    assert ExperimentContract.from_dict({}, ["rollout.backend=vllm"]).rollout.backend == "vllm"


def test_device_and_correction_keys():
    contract = ExperimentContract.from_dict({}, ["model.device=cuda:1", "rollout.correction=tis"])
    assert contract.model.device == "cuda:1" and contract.rollout.correction_cap == 2.0
    assert "not a device" in contract_error(overrides=["model.device=tpu"])
    assert "rollout.correction_cap" in contract_error(overrides=["rollout.correction_cap=1.0"])


# --- the hash -----------------------------------------------------------------------------------


def test_contract_hash_is_stable_and_canonical(design_file):
    a = ExperimentContract.from_yaml(design_file)
    b = ExperimentContract.from_yaml(design_file)
    assert a.contract_hash() == b.contract_hash()
    assert len(a.contract_hash()) == 64 and int(a.contract_hash(), 16) >= 0
    # key order and spelling of the same values do not matter
    reordered = ExperimentContract.from_dict(
        {"run_dir": "runs/${name}", "optim": {"seed": 0, "lr": 0.00001}}, [])
    default_order = ExperimentContract.from_dict({"optim": {"lr": 1e-5}}, [])
    assert reordered.contract_hash() == default_order.contract_hash()
    # a default spelled out is the same contract as a default left out
    assert ExperimentContract.from_dict({"optim": {"seed": 0}}).contract_hash() == \
        ExperimentContract().contract_hash()


@pytest.mark.parametrize("override", [
    "optim.lr=2e-5", "optim.seed=1", "rollout.group_size=4", "loss.clip_high=0.2",
    "env.kwargs={hints: true}", "model.id=tiny", "eval.n=8", "guards.min_entropy=0.1",
    "name=other", "checkpoint.every=1", "loss.ratio=sequence", "loss.objective=cispo",
])
def test_contract_hash_changes_with_any_hashed_field(design_file, override):
    base = ExperimentContract.from_yaml(design_file)
    changed = ExperimentContract.from_yaml(design_file, [override])
    assert changed.contract_hash() != base.contract_hash()
    key = override.split("=", 1)[0]
    assert [c.split(":", 1)[0] for c in changed.changes_from(base)] == [key]


def test_max_steps_is_left_out_of_the_hash(design_file):
    """max_steps says where to stop, not how a step is computed: extending a run by resuming
    with a larger max_steps is the same experiment (config.py's docstring)."""
    assert UNHASHED == ("optim.max_steps", "log", "optim.micro_batch_tokens",
                        "rollout.gpu_memory_utilization", "rollout.vllm_sleep",
                        "rollout.vllm_lora", "run.peak_flops", "model.device_memory")
    # log: where metrics go (test_loggers.py); the engine's memory: test_vllm_colocation.py;
    # the adapter merged or beside the weights: test_vllm_lora.py; the device's memory:
    # test_plan.py; micro-batches: the same gradient accumulated in another order (below);
    # the peak MFU is divided by (below)
    base = ExperimentContract.from_yaml(design_file)
    # run.peak_flops sits in a section (run) hashed only off its defaults: the hash stays the
    # one of a contract without the key, with it set or not
    assert ExperimentContract.from_yaml(design_file, ["run.peak_flops=7e11"]).contract_hash() == \
        base.contract_hash()
    assert "run" not in base.hashed_fields()
    with pytest.raises(ContractError, match="run.peak_flops"):
        ExperimentContract.from_yaml(design_file, ["run.peak_flops=0"])
    for memory in ("optim.micro_batch_tokens=256", "optim.micro_batch_tokens=auto"):
        assert ExperimentContract.from_yaml(design_file, [memory]).contract_hash() == \
            base.contract_hash()
    longer = ExperimentContract.from_yaml(design_file, ["optim.max_steps=200"])
    assert longer.contract_hash() == base.contract_hash()
    assert longer.changes_from(base) == []
    assert "max_steps" not in longer.hashed_fields()["optim"]
    assert longer.model_dump()["optim"]["max_steps"] == 200  # still in the contract itself


def test_changes_from_says_what_changed(design_file):
    base = ExperimentContract.from_yaml(design_file)
    changed = ExperimentContract.from_yaml(design_file, ["optim.lr=2e-5", "env.kwargs={max_turns: 3}"])
    assert changed.changes_from(base) == ["env.kwargs: {} -> {'max_turns': 3}",
                                          "optim.lr: 1e-05 -> 2e-05"]


def test_reward_shaping_length_is_a_contract_key(design_file):
    """reward_shaping.length: the weight of Kimi's length reward; 0 (the default) or null: off."""
    base = ExperimentContract.from_yaml(design_file)
    assert base.reward_shaping.length == 0.0
    assert ExperimentContract.from_yaml(design_file, ["reward_shaping.length=null"]) == base
    assert ExperimentContract.from_yaml(
        design_file, ["reward_shaping.length=null"]).contract_hash() == base.contract_hash()
    on = ExperimentContract.from_yaml(design_file, ["reward_shaping.length=0.1"])
    assert on.reward_shaping.length == 0.1
    assert on.contract_hash() != base.contract_hash()
    assert on.changes_from(base) == ["reward_shaping.length: 0.0 -> 0.1"]
    assert ExperimentContract.from_dict({"reward_shaping": {"length": 0.25}}).reward_shaping.length == 0.25
    assert "reward_shaping.length: Input should be greater than or equal to 0" in contract_error(
        overrides=["reward_shaping.length=-0.1"])
    assert "reward_shaping.length: got the boolean" in contract_error(
        overrides=["reward_shaping.length=true"])
    assert "reward_shaping.length: Input should be a finite number" in contract_error(
        overrides=["reward_shaping.length=.inf"])
    assert "reward_shaping.lenght: unknown key" in contract_error(
        overrides=["reward_shaping.lenght=0.1"])


# --- env.holdout: what the trainer holds out ----------------------------------------------------


def test_env_holdout_is_a_contract_key(design_file, tmp_path, monkeypatch):
    from agent_rl.run.contract import HoldoutSection

    monkeypatch.chdir(tmp_path)  # task_ids_file is read from the working directory
    (tmp_path / "ids.txt").write_text("t-1\n")
    digest = hashlib.sha256(b"t-1\n").hexdigest()
    base = ExperimentContract.from_yaml(design_file)
    assert base.env.holdout is None  # null: chosen from the pool's metadata
    held = ExperimentContract.from_yaml(
        design_file, ["env.holdout={structures: [a>b], min_length: 3, task_ids_file: ids.txt}"])
    assert held.env.holdout == HoldoutSection(structures=["a>b"], min_length=3,
                                              task_ids_file="ids.txt")
    assert held.contract_hash() != base.contract_hash()
    assert held.hashed_fields()["env"]["holdout"] == {  # the file pinned by its content
        "structures": ["a>b"], "entity_groups": [], "min_length": 3,
        "task_ids_file": {"path": "ids.txt", "sha256": digest}}
    assert held.changes_from(base) == [
        "env.holdout: None -> {'structures': ['a>b'], 'min_length': 3, 'task_ids_file': 'ids.txt'}"]
    assert base.changes_from(held)[0].endswith("-> None")
    copy = tmp_path / "copy.yaml"
    copy.write_text(held.to_yaml())
    assert ExperimentContract.from_yaml(copy).contract_hash() == held.contract_hash()
    assert all(f.description for f in HoldoutSection.model_fields.values())
    assert "env.holdout.strucs: unknown key" in contract_error(overrides=["env.holdout.strucs=[a]"])
    assert "env.holdout: names nothing to hold out" in contract_error(overrides=["env.holdout={}"])
    assert "env.holdout.min_length: Input should be greater than or equal to 1" in contract_error(
        overrides=["env.holdout={min_length: 0}"])
    assert "env.holdout.min_length: got the boolean" in contract_error(
        overrides=["env.holdout={min_length: true}"])


def test_explicit_holdouts_decide_which_eval_splits_exist():
    only_ids = "env.holdout={task_ids_file: ids.txt}"
    assert "eval.split 'holdout' is empty: env.holdout holds out none of it" in contract_error(
        overrides=[only_ids, "eval.split=holdout"])
    assert ExperimentContract.from_dict({}, [only_ids, "eval.split=holdout_iid"])
    assert "eval.split 'holdout_structure' is empty" in contract_error(
        overrides=["env.holdout={entity_groups: [g]}", "eval.split=[holdout, holdout_structure]"])
    assert ExperimentContract.from_dict({}, ["env.holdout={min_length: 3}",
                                             "eval.split=[holdout_length, holdout]"])


def test_holdout_iid_without_iid_fraction_is_decided_by_the_pool():
    """With env.holdout null, holdout_iid holds tasks when the pool has no compositional axis
    (the unseen-task fallback), so the contract cannot refuse it; the run checks it."""
    contract = ExperimentContract.from_dict({}, ["eval.split=holdout_iid"])
    assert contract.env.iid_fraction == 0.0 and contract.env.holdout is None


class _PoolEnv:
    spec = None

    def __init__(self, tasks):
        self.tasks, self.unwrapped = tasks, self

    def task_pool(self, n, seed=0):
        return self.tasks[:n]


def _pool():
    from envs import TaskMeta, TaskSpec

    def task(tid, structure, group, length):
        return TaskSpec(task_id=tid, prompt=f"Task {tid}.", meta=TaskMeta(
            skills=structure.split(">"), structure=structure, entity_group=group, length=length))

    return [task("s1", "a>b", "g1", 2), task("e1", "a", "g2", 1), task("l1", "b", "g1", 5),
            task("i1", "a", "g1", 1), task("i2", "b", "g1", 2),
            *(task(f"t{i}", "ab"[i % 2], "g1", 1 + i % 2) for i in range(5))]


def test_env_holdout_splits_the_pool_by_name(tmp_path):
    from agent_rl.run.contract import EnvSection, HoldoutSection

    ids = tmp_path / "held_out.txt"
    ids.write_text("# held-out tasks\ni1\n\n  i2   # and this one\n")
    section = EnvSection(holdout=HoldoutSection(
        structures=["a>b"], entity_groups=["g2"], min_length=5, task_ids_file=str(ids)))
    splits = section.splits(_PoolEnv(_pool()), require=["train", "holdout", "holdout_iid"])
    got = {name: sorted(t.task_id for t in splits[name]) for name in
           ("holdout_structure", "holdout_entity", "holdout_length", "holdout_iid", "train")}
    assert got == {"holdout_structure": ["s1"], "holdout_entity": ["e1"], "holdout_length": ["l1"],
                   "holdout_iid": ["i1", "i2"], "train": [f"t{i}" for i in range(5)]}

    unknown = EnvSection(holdout=HoldoutSection(structures=["a>c", "a>b"], entity_groups=["g7"]))
    with pytest.raises(ValueError) as info:
        unknown.splits(_PoolEnv(_pool()))
    message = str(info.value)
    assert "env.holdout.structures: held-out structure ['a>c'] appears in no task" in message
    assert "env.holdout.entity_groups: held-out entity_group ['g7'] appears in no task" in message
    assert "known: ['g1', 'g2']" in message

    ids.write_text("i1\nnope\n")
    with pytest.raises(ValueError, match=r"env.holdout.task_ids_file: held-out task_id \['nope'\]"):
        EnvSection(holdout=HoldoutSection(task_ids_file=str(ids))).splits(_PoolEnv(_pool()))
    ids.write_text("# nothing\n")
    with pytest.raises(ValueError, match="env.holdout.task_ids_file: .* lists no task id"):
        EnvSection(holdout=HoldoutSection(task_ids_file=str(ids))).splits(_PoolEnv(_pool()))
    with pytest.raises(ValueError, match="env.holdout.task_ids_file: cannot read"):
        EnvSection(holdout=HoldoutSection(task_ids_file=str(tmp_path / "missing.txt"))).splits(
            _PoolEnv(_pool()))


# --- hints: annealed training hints -------------------------------------------------------------


def test_hints_is_a_contract_key(design_file):
    default = ExperimentContract.from_yaml(design_file)
    assert default.hints is None  # off: env.kwargs decide, as before the section existed
    off = ExperimentContract.from_yaml(design_file, ["hints={schedule: none}"])  # DESIGN's spelling
    assert off.hints is None and off.contract_hash() == default.contract_hash()
    on = ExperimentContract.from_yaml(design_file, [
        "hints.schedule=linear", "hints.start=1.0", "hints.end=0.0", "hints.over_steps=2"])
    assert on.hints.model_dump() == {"schedule": "linear", "start": 1.0, "end": 0.0,
                                     "over_steps": 2}
    assert on.contract_hash() != default.contract_hash()
    assert ExperimentContract.from_yaml(design_file, ["hints.schedule=step"]).hints.over_steps == 100


@pytest.mark.parametrize("overrides, message", [
    (["hints.schedule=cosine"], "hints.schedule: Input should be 'constant', 'linear' or 'step'"),
    (["hints={start: 0.5}"], "hints.schedule: Field required"),
    (["hints.schedule=linear", "hints.start=1.5"], "hints.start: Input should be less than or equal to 1"),
    (["hints.schedule=linear", "hints.end=-0.1"], "hints.end: Input should be greater than or equal to 0"),
    (["hints.schedule=step", "hints.over_steps=0"], "hints.over_steps: Input should be greater than or equal to 1"),
    (["hints.schedule=linear", "hints.gamma=2"], "hints.gamma: unknown key"),
    (["hints=true"], "hints: got the boolean true"),
    (["hints.schedule=linear", "env.kwargs={hints: true}"], "drop env.kwargs.hints"),
])
def test_hints_errors_name_the_key(overrides, message):
    assert message in contract_error(overrides=overrides)


# --- curriculum: the difficulty filter -----------------------------------------------------------


def test_curriculum_is_a_contract_key(design_file):
    default = ExperimentContract.from_yaml(design_file)
    assert default.curriculum is None  # off: every train task is drawn
    for spelling in ("curriculum={filter: none}", "curriculum={filter: null}"):  # DESIGN's spelling
        off = ExperimentContract.from_yaml(design_file, [spelling])
        assert off.curriculum is None and off.contract_hash() == default.contract_hash()
    design = ExperimentContract.from_yaml(  # DESIGN section 7's example
        design_file, ["curriculum={filter: pass_rate, k: 4, min: 0.1, max: 0.9, every: 10}"])
    assert design.curriculum.model_dump() == {"filter": "pass_rate", "k": 4, "min": 0.1,
                                              "max": 0.9, "every": 10, "pool": 64}
    assert design.contract_hash() != default.contract_hash()
    on = ExperimentContract.from_yaml(design_file, ["curriculum.filter=pass_rate"])
    assert (on.curriculum.k, on.curriculum.min, on.curriculum.max, on.curriculum.every,
            on.curriculum.pool) == (4, 0.1, 0.9, 0, 64)
    edge = ExperimentContract.from_yaml(design_file, [
        "curriculum.filter=pass_rate", "curriculum.min=0.5", "curriculum.max=0.5"])
    assert edge.curriculum.min == edge.curriculum.max == 0.5  # a one-point band is allowed
    lagged = ExperimentContract.from_dict({}, ["curriculum.filter=pass_rate",
                                               "rollout.max_policy_lag=1"])
    assert lagged.curriculum.every == 0  # estimated once, before the pipeline starts


@pytest.mark.parametrize("overrides, message", [
    (["curriculum.filter=pass_rate", "curriculum.min=0.9", "curriculum.max=0.1"],
     "curriculum: curriculum.min (0.9) > curriculum.max (0.1)"),
    (["curriculum.filter=pass_rate", "curriculum.k=0"],
     "curriculum.k: Input should be greater than or equal to 1"),
    (["curriculum.filter=best_of_k"], "curriculum.filter: unknown filter 'best_of_k'"),
    (["curriculum={filter: none, k: 2}"], "curriculum.filter: filter none takes no other"),
    (["curriculum.k=2"], "curriculum.filter: Field required"),
    (["curriculum.filter=pass_rate", "curriculum.max=1.5"],
     "curriculum.max: Input should be less than or equal to 1"),
    (["curriculum.filter=pass_rate", "curriculum.min=-0.1"],
     "curriculum.min: Input should be greater than or equal to 0"),
    (["curriculum.filter=pass_rate", "curriculum.pool=0"],
     "curriculum.pool: Input should be greater than or equal to 1"),
    (["curriculum.filter=pass_rate", "curriculum.every=-1"],
     "curriculum.every: Input should be greater than or equal to 0"),
    (["curriculum.filter=pass_rate", "curriculum.k=true"], "curriculum.k: got the boolean true"),
    (["curriculum.filter=pass_rate", "curriculum.kk=2"], "curriculum.kk: unknown key"),
    (["curriculum.filter=pass_rate", "curriculum.every=3", "rollout.max_policy_lag=1"],
     "curriculum.every > 0 with rollout.max_policy_lag > 0"),
])
def test_curriculum_errors_name_the_key(overrides, message):
    assert message in contract_error(overrides=overrides)


# --- Dataset-v0: the files it reads are pinned, its arguments checked ---------------------------


REWARD_V1 = "def score(answer, task):\n    return float(answer.strip() == task.target)\n"
REWARD_V2 = "def score(answer, task):\n    return float(task.target in answer)\n"


def dataset_contract(reward: str, **kwargs) -> ExperimentContract:
    return ExperimentContract.from_dict({
        "env": {"id": "agent_rl/Dataset-v0", "iid_fraction": 0.5,
                "kwargs": {"path": "qa.jsonl", "reward": reward, **kwargs}},
        "eval": {"split": "holdout_iid"}})


@pytest.fixture
def dataset_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the contract's paths are read from the working directory
    (tmp_path / "qa.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    (tmp_path / "rewards.py").write_text(REWARD_V1)
    return tmp_path


def test_a_reward_function_file_is_pinned_by_its_content(dataset_dir):
    contract = dataset_contract("rewards.py:score")
    before, pins = contract.contract_hash(), contract.input_pins()
    assert contract.hashed_fields()["env"]["kwargs"]["reward"] == {
        "function": "rewards.py:score", "sha256": hashlib.sha256(REWARD_V1.encode()).hexdigest()}
    assert contract.pin_changes(pins) == []
    (dataset_dir / "rewards.py").write_text(REWARD_V2)  # the same name, another body
    assert contract.contract_hash() != before
    assert contract.changes_from(contract) == []  # no key changed ...
    (change,) = contract.pin_changes(pins)  # ... the content of one file did, and it is named
    assert change == (f"env.kwargs.reward: content changed (rewards.py:score sha256 "
                      f"{hashlib.sha256(REWARD_V1.encode()).hexdigest()[:12]} -> rewards.py:score "
                      f"sha256 {hashlib.sha256(REWARD_V2.encode()).hexdigest()[:12]})")
    (dataset_dir / "rewards.py").write_text(REWARD_V1)
    assert contract.contract_hash() == before


def test_a_reward_function_module_is_pinned_by_its_source_file(dataset_dir, monkeypatch):
    (dataset_dir / "pinned_reward_mod.py").write_text(REWARD_V1)
    monkeypatch.syspath_prepend(str(dataset_dir))
    contract = dataset_contract("pinned_reward_mod:score")
    before = contract.contract_hash()
    (dataset_dir / "pinned_reward_mod.py").write_text(REWARD_V2)
    assert contract.contract_hash() != before
    assert [c.split(":")[0] for c in contract.pin_changes({})] == ["env.kwargs.path",
                                                                   "env.kwargs.reward"]


def test_built_in_rewards_and_other_envs_pin_no_code(dataset_dir):
    assert set(dataset_contract("numeric").input_pins()) == {"env.kwargs.path"}
    assert ExperimentContract().input_pins() == {}


@pytest.mark.parametrize(("reward", "message"), [
    ("missing.py:score", r"env.kwargs.reward: cannot read .*missing.py"),
    ("no_such_module_xyz:score", "env.kwargs.reward: reward 'no_such_module_xyz:score': no module"),
])
def test_a_reward_function_that_cannot_be_pinned_names_the_key(dataset_dir, reward, message):
    with pytest.raises(ContractError, match=message):
        dataset_contract(reward).contract_hash()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"weights": {"accuracy": 0}}, r"env.kwargs.weights: weights \{'accuracy': 0\} are all zero"),
    ({"weights": {"accuracy": -1}}, r"env.kwargs.weights: weights \['accuracy'\] are negative"),
    ({"reward_timeout_s": 0}, "env.kwargs.reward_timeout_s: reward_timeout_s must be a finite"),
    ({"reward": "fuzzy"}, "env.kwargs.reward: reward 'fuzzy' is not one of"),
    ({"reward": ":f"}, "env.kwargs.reward: reward ':f': a user reward is 'module:function'"),
    ({"tolerance": -1}, "env.kwargs.tolerance: tolerance must be"),
])
def test_dataset_arguments_are_contract_errors_naming_the_key(kwargs, message):
    overrides = [f"env.kwargs.{k}={v!r}" if not isinstance(v, dict) else f"env.kwargs.{k}={v}"
                 for k, v in kwargs.items()]
    assert re.search(message, contract_error(
        {"env": {"id": "agent_rl/Dataset-v0"}, "eval": {"split": "holdout_iid"}}, overrides))


def test_an_env_registered_from_outside_agent_rl_is_pinned_by_its_source(tmp_path, monkeypatch):
    """A scaffolded or plugin env scores with its own code: editing it is a new contract."""
    import envs
    from envs import registry

    package = tmp_path / "pinned_env_pkg"
    package.mkdir()
    source = (Path(envs.__file__).parent / "arithmetic.py").read_text()
    (package / "__init__.py").write_text("")
    (package / "env.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    envs.register("tests/PinnedArithmetic-v0", "pinned_env_pkg.env:ArithmeticEnv")
    try:
        contract = ExperimentContract.from_dict({"env": {"id": "tests/PinnedArithmetic-v0"}})
        pins = contract.input_pins()
        assert pins == {"env.id": {"id": "tests/PinnedArithmetic-v0",
                                   "sha256": hashlib.sha256(source.encode()).hexdigest()}}
        before = contract.contract_hash()
        (package / "env.py").write_text(source + "\n# edited\n")
        assert contract.contract_hash() != before
        assert [c.split(":")[0] for c in contract.pin_changes(pins)] == ["env.id"]
    finally:
        registry._REGISTERED.pop("tests/PinnedArithmetic-v0", None)
        import gymnasium
        gymnasium.registry.pop("tests/PinnedArithmetic-v0", None)


# --- credit.assigner as "module:function" ------------------------------------------------------


def test_an_assigner_function_named_in_yaml_is_validated_and_pinned_by_its_source(tmp_path):
    source = tmp_path / "my_credit.py"
    source.write_text("def half(episode, share=0.5):\n"
                      "    return {s.session_id: share * episode.reward.total for s in episode.sessions}\n")
    contract = ExperimentContract.from_dict(
        {}, [f"credit.assigner={source}:half", "credit.params={share: 0.25}"])
    pins = contract.input_pins()
    assert pins == {"credit.assigner": {"function": f"{source}:half",
                                        "sha256": hashlib.sha256(source.read_bytes()).hexdigest()}}
    before = contract.contract_hash()
    source.write_text(source.read_text() + "# edited\n")
    assert contract.contract_hash() != before  # its code is part of the objective
    assert [c.split(":")[0] for c in contract.pin_changes(pins)] == ["credit.assigner"]
    plain = ExperimentContract.from_dict({}, ["credit.assigner=tests.trajectories.custom_assigners:depth_share"])
    assert plain.credit.assigner == "tests.trajectories.custom_assigners:depth_share"


@pytest.mark.parametrize(("overrides", "message"), [
    (["credit.assigner=no_such_module_xyz:fn"],
     r"credit.assigner: assigner 'no_such_module_xyz:fn': cannot import module"),
    (["credit.assigner=tests.trajectories.custom_assigners:missing"],
     "credit.assigner: .*has no attribute 'missing'"),
    (["credit.assigner=tests.trajectories.custom_assigners:takes_nothing"],
     r"credit.params: assigner .*takes_nothing' cannot take \[\]"),
    (["credit.assigner=tests.trajectories.custom_assigners:depth_share", "credit.params={gamma: 1}"],
     r"credit.params: .*cannot take \['gamma'\].*it takes \['scale'\]"),
])
def test_a_bad_assigner_function_is_a_contract_error_naming_the_key(overrides, message):
    assert re.search(message, contract_error(overrides=overrides))


def test_a_script_assigner_not_passed_here_reads_but_cannot_run():
    """contract.yaml of a run whose assigner was a script's function: readable (report,
    inspect), but its hash, taken before any training, says to pass the function again."""
    contract = ExperimentContract.from_dict({}, ["credit.assigner=__main__:my_credit"])
    with pytest.raises(ContractError, match=r"credit.assigner: assigner '__main__:my_credit' is a "
                                            r"function that was passed from Python.*assigner=my_credit"):
        contract.contract_hash()


# --- did you mean -------------------------------------------------------------------------------


def test_an_unknown_key_names_the_closest_valid_key_of_its_section(tmp_path):
    with pytest.raises(ContractError, match=r"optim\.max_step: unknown key \(did you mean "
                                            r"optim\.max_steps\?\)"):
        ExperimentContract.from_dict({}, ["optim.max_step=4"])  # a --set override
    config = tmp_path / "c.yaml"
    config.write_text("optim: {max_step: 4}\nguards: {max_truncated: 1.5}\n")
    message = str(pytest.raises(ContractError, ExperimentContract.from_yaml, config).value)
    assert "optim.max_step: unknown key (did you mean optim.max_steps?)" in message
    assert "guards.max_truncated: unknown key (did you mean guards.max_truncated_frac?)" in message
    assert "optimm: unknown key (did you mean optim?)" in contract_error({"optimm": {"lr": 1}})
    assert ("env.holdout.structurs: unknown key (did you mean env.holdout.structures?)"
            in contract_error(overrides=["env.holdout.structurs=[a]"]))
    # nothing close: no guess
    assert contract_error({"learning_rate": 0.1}).endswith("learning_rate: unknown key")


def test_unknown_names_of_splits_assigners_env_kwargs_and_envs_get_a_suggestion():
    assert "did you mean holdout?" in contract_error(overrides=["eval.split=holdot"])
    assert "did you mean terminal_only?" in contract_error(
        overrides=["credit.assigner=terminl_only"])
    assert "env.kwargs.hintz: agent_rl/Arithmetic-v0 takes no such argument (did you mean " \
           "env.kwargs.hints?)" in contract_error(overrides=["env.kwargs.hintz=true"])
    assert "Did you mean ['agent_rl/Arithmetic-v0'" in contract_error(
        overrides=["env.id=agent_rl/Arithmetc-v0"])


def test_gpu_keys_validate_and_name_themselves():
    c = ExperimentContract.from_dict({}, overrides=[
        "optim.micro_batch_tokens=2048", "rollout.decode_batch=64", "model.tf32=false",
        "run.deterministic=true"])
    assert (c.optim.micro_batch_tokens, c.rollout.decode_batch, c.model.tf32,
            c.run.deterministic) == (2048, 64, False, True)
    for override, message in (("optim.micro_batch_tokens=0", "optim.micro_batch_tokens: a positive integer or auto, got 0"),
                              ("rollout.decode_batch=lots", "rollout.decode_batch: a positive integer or auto, got 'lots'"),
                              ("rollout.decode_batch=true", "rollout.decode_batch: got the boolean true")):
        with pytest.raises(ContractError, match=message):
            ExperimentContract.from_dict({}, overrides=[override])


def test_keys_added_later_leave_the_hash_alone_at_their_defaults():
    c = ExperimentContract()
    fields = c.hashed_fields()
    assert "run" not in fields and "tf32" not in fields["model"]
    assert "decode_batch" not in fields["rollout"]
    assert "run" not in SFTContract().hashed_fields()
    for override in ("model.tf32=false", "rollout.decode_batch=8", "run.deterministic=true"):
        assert ExperimentContract.from_dict({}, overrides=[override]).contract_hash() != c.contract_hash()
