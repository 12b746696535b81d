"""ExperimentContract: every input of a run, pinned and hashed before the first rollout.

YAML in (``ExperimentContract.from_yaml``), overrides by dotted path (``--set optim.lr=1e-4``),
validated (unknown keys, wrong types, booleans where a number goes, non-finite numbers, splits
that do not exist, env kwargs the env's constructor does not take and impossible combinations
are errors that name the key), hashed (``contract_hash``: sha256 of the canonical JSON of the
resolved contract). The key names are the YAML contract of DESIGN section 7.

What the hash leaves out (``UNHASHED``): keys that say where a run stops, where its numbers go
and where its memory lives, never what a step computes.
- ``optim.max_steps``: where the run stops. The learning-rate schedule is constant and nothing
  else reads the horizon, so the first j steps of a K-step run are exactly a j-step run; this
  is what lets ``--resume --set optim.max_steps=K`` extend a finished or killed run. A
  schedule that depends on the horizon (warm-up or decay) must put it back in the hash.
- ``log``: where the step metrics are mirrored (``agent_rl.run.loggers``): a run resumed with
  ``--set log.to=[jsonl,wandb]`` is the same experiment, watched in one more place.
- ``run.peak_flops``: what ``perf/mfu`` is divided by.
- Memory, so that a run that ran out of it resumes with another setting:
  ``rollout.gpu_memory_utilization`` and ``rollout.vllm_sleep`` (where the engine's memory
  lives), ``model.device_memory`` (how much the device has), ``optim.micro_batch_tokens`` (the
  same gradient accumulated in another order: equal up to float rounding) and
  ``rollout.vllm_lora`` (the adapter merged into the engine's weights, W + s B A rounded once,
  or applied beside them, x W^T + s (x A^T) B^T: the same model up to float rounding; measured
  in float32, greedy tokens identical and log-probs within 1e-4).
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Self, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from agent_rl.run.env_checks import check_env_kwargs, check_split_names
from agent_rl.run.overrides import (
    ContractError,
    apply_override,
    did_you_mean,
    format_errors,
    set_key,
)
from agent_rl.run.pins import (
    content_hash,
    env_pins,
    function_pin,
    init_bundle_hash,
    pin_text,
)
from trajectories.hashing import canonical_hash

if TYPE_CHECKING:
    from evals.splits import Splits


def _auto_size(value: Any) -> int | str:
    if value == "auto" or (type(value) is int and value >= 1):
        return value
    raise ValueError(f"a positive integer or auto, got {value!r}")


# a positive number, or "auto": sized from the device (agent_rl.run.sizing)
AutoSize = Annotated[int | Literal["auto"], PlainValidator(_auto_size)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_only_for_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads true as 1 for an int or float field (`optim.max_steps=true` ran 1 step)
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and annotation is not bool and bool not in get_args(annotation):
            raise ValueError(f"got the boolean {str(value).lower()}; this key is not a boolean")
        return value


class HoldoutSection(_Section):
    """What the trainer holds out of the task pool, in place of the automatic choice
    (``evals.splits.choose_holdouts``). Names are checked against the pool when a run starts."""

    structures: list[str] = Field(default_factory=list, description="meta.structure values held out whole (split holdout_structure); each must occur in the pool")
    entity_groups: list[str] = Field(default_factory=list, description="meta.entity_group values held out whole (split holdout_entity); each must occur in the pool")
    min_length: int | None = Field(None, ge=1, description="tasks with meta.length >= this are held out (split holdout_length); some task must reach it")
    task_ids_file: str | None = Field(None, description="a text file of task_ids (one a line; blank lines and # comments ignored; relative to the working directory) held out as unseen tasks (split holdout_iid); its content is part of the contract hash")

    @model_validator(mode="after")
    def _names_something(self) -> HoldoutSection:
        if not (self.structures or self.entity_groups or self.min_length is not None
                or self.task_ids_file is not None):
            raise ValueError("names nothing to hold out: give structures, entity_groups, "
                             "min_length or task_ids_file (or env.holdout: null for the "
                             "automatic choice)")
        return self

    def fills(self, split: str, iid_fraction: float) -> bool:
        """Whether these holdouts (and ``env.iid_fraction``) can put tasks in ``split``."""
        compositional = bool(self.structures or self.entity_groups or self.min_length is not None)
        return {"holdout_structure": bool(self.structures),
                "holdout_entity": bool(self.entity_groups),
                "holdout_length": self.min_length is not None, "holdout": compositional,
                "holdout_iid": self.task_ids_file is not None or iid_fraction > 0}.get(split, True)

    def split_kwargs(self) -> dict[str, Any]:
        """The ``holdouts`` of ``evals.splits.default_splits`` (reads ``task_ids_file``)."""
        task_ids: list[str] = []
        if self.task_ids_file is not None:
            try:
                lines = Path(self.task_ids_file).read_text().splitlines()
            except OSError as exc:
                raise ValueError(f"env.holdout.task_ids_file: cannot read {self.task_ids_file} "
                                 f"({exc.strerror or exc})") from None
            task_ids = [t for t in (line.split("#", 1)[0].strip() for line in lines) if t]
            if not task_ids:
                raise ValueError(f"env.holdout.task_ids_file: {self.task_ids_file} lists no "
                                 "task id (one a line)")
        return {"holdout_structures": self.structures, "holdout_entity_groups": self.entity_groups,
                "min_holdout_length": self.min_length, "holdout_task_ids": task_ids}


_HOLDOUT_KEYS = {"structure": "structures", "entity_group": "entity_groups",
                 "length": "min_length", "task_id": "task_ids_file"}  # UnknownHoldout.what -> key


class EnvSection(_Section):
    id: str = Field("agent_rl/Arithmetic-v0", description="registered environment id")
    split: str = Field("train", description="which compositional split the trainer draws from")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to envs.make")
    pool_size: int = Field(256, ge=1, description="tasks generated before splitting")
    pool_seed: int = Field(0, description="seed of the task pool")
    iid_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="share of the train split held out as `holdout_iid` (unseen tasks of trained structures); when nothing compositional can be held out and env.holdout is null, this share (0.25 when 0) of the tasks is, with a notice")
    holdout: HoldoutSection | None = Field(None, description="what to hold out: {structures, entity_groups, min_length, task_ids_file}; null: chosen from the pool's metadata (evals.splits.choose_holdouts)")

    def splits(self, env: Any, require: list[str] | tuple[str, ...] = ()) -> Splits:
        """``evals.splits.default_splits`` of this section's pool (``env`` built from it), with
        ``holdout`` in place of the automatic choice; ``require``: splits that must hold tasks.
        A held-out name the pool does not have is a ``ValueError`` naming the key."""
        from evals.splits import HoldoutError, default_splits

        try:
            return default_splits(env, self.pool_size, self.pool_seed,
                                  holdouts=self.holdout.split_kwargs() if self.holdout else None,
                                  iid_fraction=self.iid_fraction, require=require)
        except HoldoutError as exc:
            raise ValueError("; ".join(f"env.holdout.{_HOLDOUT_KEYS[p.what]}: {p.message}"
                                       for p in exc.problems)
                             + f" (a pool of {self.pool_size} tasks, env.pool_seed "
                             f"{self.pool_seed})") from None


class EvalSection(_Section):
    split: str | list[str] = Field("holdout", description="held-out split(s) evaluated during/after training, e.g. [holdout_iid, holdout]; always hint-free")
    n: int = Field(64, ge=1, description="held-out tasks per evaluation")
    every: int = Field(5, ge=0, description="evaluate every N steps (0: only before and after)")
    seed: int = Field(1234, description="sampling seed, the same for every evaluated policy")
    temperature: float = Field(0.0, ge=0.0, description="0: greedy")

    @property
    def splits(self) -> list[str]:
        return [self.split] if isinstance(self.split, str) else list(self.split)


class ModelSection(_Section):
    id: str = Field("smollm2-135m", description="smollm2-135m | tiny | a local HF folder | a Hugging Face Hub id (org/name) already in the local HF cache (read offline, content-hashed)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="bfloat16: forward passes under bf16 autocast, fp32 master weights and optimizer state")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N (auto: cuda when available); policy, trainer, reference and evaluation run there")
    adapter: Literal["none", "lora"] = Field("lora", description="full fine-tune or LoRA (peft)")
    lora_rank: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    tf32: bool = Field(True, description="float32 matrix products on CUDA in TensorFloat-32 (torch.backends.cuda.matmul.allow_tf32, set_float32_matmul_precision('high')): inputs rounded to 10 mantissa bits, float32 accumulation, several times faster on Ampere and later; false: full float32. The CPU is never affected")
    device_memory: float | None = Field(None, gt=0.0, description="GiB of memory on the device a rank runs on, for the resource plan (agent_rl.run.plan): `agent-rl train` refuses a contract whose plan needs more, before writing anything; null = a CUDA device's total memory, and on the CPU no limit; not hashed")
    init: str | None = Field(None, description="start from a bundle written by `agent-rl sft` (or any checkpoint of full weights): the bundle folder, or a run dir (its newest complete bundle); loaded onto model.id's weights, which must be the ones the bundle was trained from, before any adapter; its content hash is part of the contract hash")

    @field_validator("device")
    @classmethod
    def _device_spec(cls, value: str) -> str:
        from agent_rl.run.devices import check_device_spec

        return check_device_spec(value)

    @field_validator("id")
    @classmethod
    def _not_an_endpoint(cls, value: str) -> str:
        if value.startswith("openai:"):
            raise ValueError(f"{value!r} is an OpenAI-compatible endpoint, which is evaluation "
                             "only: it reports no prompt token ids, so there is nothing exact "
                             "to train on; evaluate it with `agent-rl eval --policy "
                             f"{value}` and train a local model (smollm2-135m, tiny, a "
                             "folder, a Hub id)")
        return value


class RolloutSection(_Section):
    backend: Literal["hf", "vllm"] = "hf"
    group_size: int = Field(8, ge=1, description="G samples per task form a group")
    tasks_per_step: int = Field(4, ge=1)
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_prompt_tokens: int = Field(512, ge=8, description="a longer prompt is not generated for: the episode ends truncated (an env's context_budget must be below it)")
    max_response_tokens: int = Field(128, ge=1)
    truncation: Literal["mask", "penalize", "keep"] = "mask"
    truncation_penalty: float = Field(0.0, description="reward given to overlong responses under penalize")
    dynamic_sampling: bool = Field(True, description="drop groups with zero reward contrast")
    max_policy_lag: int = Field(0, ge=0, description="0: synchronous; k > 0: the next steps' rollouts run while this step trains, on a weight copy synced after every update; sessions sampled more than k updates ago are dropped and counted")
    correction: Literal["none", "tis", "mask"] = Field("none", description="rollout/trainer mismatch: none (ratio against the rollout's log-probs), tis (truncated importance weight), mask (drop tokens whose ratio leaves [1/cap, cap])")
    correction_cap: float = Field(2.0, gt=1.0, description="the cap C of rollout.correction")
    decode_batch: AutoSize = Field("auto", description="conversations the hf backend decodes at once (HFPolicy.batch_size; more are decoded in chunks of this many): auto is 32 on the CPU, and on CUDA sized from the GPU memory free once the weights are placed and the KV cache a row needs (agent_rl.run.sizing); a row's samples do not depend on it")
    dtype: Literal["float32", "bfloat16"] | None = Field(None, description="the weights rollouts sample with: null = the trained model's (HF: shared, or a float32 copy with LoRA merged under adapter lora; vLLM: model.dtype); float32 | bfloat16 = a copy in that dtype (LoRA merged), given the weights after every update; the mismatch is measured (rollout/logprob_diff_*)")
    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0, description="vLLM on CUDA: the share of the GPU's memory the engine takes (weights, activations, KV cache), all free at engine start; null = computed then from the free memory, less the trainer's headroom (agent_rl.policies.vllm_policy.engine_memory_fraction); refused where vllm runs on the CPU; not hashed")
    vllm_sleep: Literal["auto"] | bool = Field("auto", description="vLLM on CUDA: the engine sleeps (level 1: weights to host memory, KV cache dropped) while the trainer updates, and wakes at the next weight push; auto = on for CUDA with max_policy_lag 0; true is refused on the CPU and with max_policy_lag > 0; not hashed")
    vllm_lora: Literal["auto"] | bool = Field("auto", description="vLLM with model.adapter lora: push the adapter alone after every update (a LoRA request per revision, the engine's base weights never written) instead of merging it into every adapted layer; auto = where the engine can apply the adapter (agent_rl.policies.engine_weights.lora_blockers), true = the same or an error naming what blocks it, false = the merged push; not hashed (the same model, up to float rounding)")

    @model_validator(mode="after")
    def _vllm_only(self) -> RolloutSection:
        given = ("gpu_memory_utilization" if self.gpu_memory_utilization is not None
                 else "vllm_sleep" if self.vllm_sleep is True
                 else "vllm_lora" if self.vllm_lora is True else None)
        if given and self.backend != "vllm":
            raise ValueError(f"rollout.{given} applies to rollout.backend: vllm; the backend is "
                             f"{self.backend}: remove the key")
        if self.vllm_sleep is True and self.max_policy_lag:
            raise ValueError("rollout.vllm_sleep: true with rollout.max_policy_lag > 0: the engine "
                             "generates while the trainer updates, so it cannot sleep; use auto or "
                             "false")
        return self


class RewardShapingSection(_Section):
    length: float = Field(0.0, ge=0.0, description="weight of Kimi k1.5's length reward, added to every training episode's reward as the component `length` (agent_rl.training.rollout, step 4); 0 or null: off. Held-out evaluation is never shaped")

    @field_validator("length", mode="before")
    @classmethod
    def _null_is_off(cls, value: Any) -> Any:
        return 0.0 if value is None else value  # null and 0 are one contract (one hash)


class HintsSection(_Section):
    """Task hints on a decaying share of the training episodes (``agent_rl.training.rollout``, step 0:
    the formulas, the rounding, the seeded choice); held-out evaluation never shows any. In
    place of ``env.kwargs.hints``, which may not be given with it."""

    schedule: Literal["constant", "linear", "step"] = Field(..., description="the share of step s (from 1), t = min(s - 1, over_steps) / over_steps: constant: start; linear: (1 - t) * start + t * end; step: start while s <= over_steps, then end")
    start: float = Field(1.0, ge=0.0, le=1.0, description="share of step 1's episodes shown a hint")
    end: float = Field(0.0, ge=0.0, le=1.0, description="share from step over_steps + 1 on (unused by constant)")
    over_steps: int = Field(100, ge=1, description="steps from start to end (unused by constant)")


class CurriculumSection(_Section):
    """Kimi k1.5's difficulty filter (``agent_rl.training.curriculum``: the pool, the pass rule, the
    rounds, resume): train only on tasks whose estimated pass rate is in [min, max]."""

    filter: Literal["pass_rate"] = Field(..., description="pass_rate: k samples of each pool task at the rollout's settings; a sample passes when its outcome is `correct`")
    k: int = Field(4, ge=1, description="samples per task of the estimate")
    min: float = Field(0.1, ge=0.0, le=1.0, description="lowest pass rate kept (inclusive)")
    max: float = Field(0.9, ge=0.0, le=1.0, description="highest pass rate kept (inclusive)")
    every: int = Field(0, ge=0, description="re-estimate (with the current policy, on a new pool) before step r * every + 1; 0: once, before step 1")
    pool: int = Field(64, ge=1, description="train tasks estimated per round, at most: a seeded draw (optim.seed, round); only kept pool tasks are trained on")

    @field_validator("filter", mode="before")
    @classmethod
    def _known_filter(cls, value: Any) -> Any:
        if value in ("none", None):
            raise ValueError("filter none takes no other curriculum key: give curriculum: "
                             "{filter: none} alone (or curriculum: null)")
        if value != "pass_rate":
            raise ValueError(f"unknown filter {value!r}: use pass_rate (or curriculum: null)")
        return value

    @model_validator(mode="after")
    def _band(self) -> CurriculumSection:
        if self.min > self.max:
            raise ValueError(f"curriculum.min ({self.min}) > curriculum.max ({self.max}): the "
                             "band keeps no pass rate; make min <= max")
        return self


class CreditSection(_Section):
    assigner: str = Field("broadcast", description="a registered assigner (trajectories.ASSIGNERS: broadcast, terminal_only, uniform_split, discounted, usage_weighted, or one added with @register_assigner) or your function fn(episode, **params) -> {session_id: credit} as 'module:function' or 'path/to/file.py:function' (its source file is part of the contract hash)")
    params: dict[str, Any] = Field(default_factory=dict)
    session_weighting: Literal["per_episode", "per_session"] = "per_episode"


class AdvantageSection(_Section):
    std: Literal["population", "sample", "none"] = "population"
    scale: Literal["group", "batch"] = "group"
    eps: float = Field(1e-6, gt=0.0)


class KLSection(_Section):
    beta: float = Field(0.0, ge=0.0)
    estimator: Literal["k1", "k2", "k3"] = "k3"


class LossSection(_Section):
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    clip_low: float = Field(0.2, ge=0.0, le=1.0, description="lower clip bound 1 - clip_low (1.0: none, as MiniMax-M1's CISPO)")
    clip_high: float = Field(0.28, ge=0.0, description="upper clip bound 1 + clip_high")
    ratio: Literal["token", "sequence"] = Field("token", description="token: r_t = pi/pi_old per token (PPO/GRPO); sequence: GSPO's length-normalised sequence ratio s_b, one clip decision per sequence (GSPO clips at about 3e-4 / 4e-4, not 0.2 / 0.28)")
    objective: Literal["ppo_clip", "cispo"] = Field("ppo_clip", description="with q the loss.ratio: ppo_clip: -min(q A, clip(q) A); cispo (MiniMax-M1): -sg[clip(q)] A logp, a clipped IS weight that never drops a token's gradient (agent_rl.training.grpo)")
    kl: KLSection = Field(default_factory=KLSection)


class OptimSection(_Section):
    lr: float = Field(1e-5, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    updates_per_batch: int = Field(1, ge=1)
    micro_batch_tokens: AutoSize = Field("auto", description="tokens per trainer micro-batch, padding included: the activations one forward keeps for backward; auto is 512 on the CPU, and on CUDA sized from the GPU memory free once the weights are placed (agent_rl.run.sizing). A longer row (a shared prompt with its samples, never split) is a micro-batch of its own and recomputes ceil(L (1 - B / T)) of its L decoder layers in backward (training.update.recompute_layers), so it keeps as much as B tokens would in float32 (under bf16 autocast a token keeps less: B / update.HALF_ACTIVATIONS tokens there, more where the CPU accelerator's kernels run)")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the backward pass instead of keeping them (transformers' gradient checkpointing, non-reentrant): the same losses and gradients, less memory per micro-batch, ~30-60% more training time (without it, only rows longer than micro_batch_tokens recompute, and only as many layers as that bound needs)")
    max_steps: int = Field(20, ge=0)
    seed: int = 0


class BackendSection(_Section):
    name: Literal["torch", "deepspeed"] = "torch"
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage (deepspeed only)")
    offload: Literal["none", "cpu"] = Field("none", description="DeepSpeed ZeRO optimizer offload (deepspeed only)")


class RunSection(_Section):
    """How the run's process computes, beside what it computes."""

    deterministic: bool = Field(False, description="bit-exact reruns and resumes on a GPU: torch.use_deterministic_algorithms(True) (an op without a deterministic kernel is an error naming it), CUBLAS_WORKSPACE_CONFIG=:4096:8 set before CUDA starts, cuDNN deterministic and without autotuning; slower (docs/scale-out.md says what stays inexact without it)")


class TrainRunSection(RunSection):
    """``RunSection`` with what training alone reports against."""

    peak_flops: float | None = Field(None, gt=0.0, description="the device's peak FLOP/s that perf/mfu is taken against (e.g. what `python benchmarks/limits.py` measures on a CPU); null: NVIDIA's spec-sheet bf16 figure on a listed GPU under model.dtype bfloat16, else MFU not reported (perf/flops still is)")


class CheckpointSection(_Section):
    every: int = Field(5, ge=0, description="0: only at the end")
    keep: int = Field(3, ge=1, description="complete bundles kept (the newest is never deleted)")


class GuardSection(_Section):
    max_nonfinite_steps: int = Field(2, ge=1)
    min_entropy: float = Field(0.05, ge=0.0)
    max_kl: float = Field(1.0, gt=0.0)
    max_policy_lag: int = Field(2, ge=0)
    max_verifier_error_rate: float = Field(0.1, ge=0.0, le=1.0)
    holdout_patience: int = Field(5, ge=1)
    max_truncated_frac: float = Field(0.9, gt=0.0, description="pause when this fraction of responses hits the length limit two steps running (> 1 disables)")


LOGGERS = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""``log.to`` names -> the package each needs, installed by the pip extra of the same name
(``agent_rl.run.loggers`` writes them; jsonl needs none)."""


class LogSection(_Section):
    """Where each step's metrics go (``agent_rl.run.loggers``). ``metrics.jsonl`` is always
    written: resume, ``agent-rl report`` and ``inspect`` read it."""

    to: list[str] | None = Field(None, description="jsonl (metrics.jsonl, always written), tensorboard (run_dir/tensorboard), wandb (WANDB_MODE respected; files under run_dir/wandb unless WANDB_DIR), mlflow (run_dir/mlflow.db unless MLFLOW_TRACKING_URI); null: jsonl, and tensorboard when it is installed")
    project: str | None = Field(None, description="the W&B project and the MLflow experiment (null: agent-rl)")
    name: str | None = Field(None, description="the W&B and MLflow run name (null: the run directory's name)")

    @field_validator("to", mode="before")
    @classmethod
    def _known_loggers(cls, value: Any) -> Any:
        if value is None:
            return None
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"expected a list of logger names ({', '.join(LOGGERS)}), got "
                             f"{value!r}")
        for name in names:
            if name not in LOGGERS:
                close = difflib.get_close_matches(name, LOGGERS, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ValueError(f"unknown logger {name!r}{hint}; log.to takes "
                                 f"{', '.join(LOGGERS)}")
        if len(set(names)) != len(names):
            raise ValueError(f"name each logger once, got {names}")
        return ["jsonl", *(n for n in names if n != "jsonl")]  # jsonl is always written

    @property
    def loggers(self) -> list[str]:
        """The loggers this run writes: ``to``, or for null jsonl and (when installed)
        tensorboard."""
        if self.to is not None:
            return list(self.to)
        return ["jsonl", *(["tensorboard"] if installed("tensorboard") else [])]

    def check_installed(self) -> None:
        """Every logger ``to`` names has its package, else a ``ContractError`` naming the pip
        extra (a check of this machine, not of the contract: ``_Contract.check_run_dir``)."""
        missing = [n for n in self.loggers if LOGGERS[n] and not installed(LOGGERS[n])]
        if missing:
            extras = ",".join(missing)
            raise ContractError(
                f"log.to: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                f"installed: pip install 'agent-rl[{extras}]' (or take "
                f"{'it' if len(missing) == 1 else 'them'} out of log.to)")


def installed(package: str) -> bool:
    """Whether ``package`` can be imported here (found, not imported)."""
    import importlib.util

    return importlib.util.find_spec(package) is not None


class AcceptanceSection(_Section):
    holdout_min: float | None = None
    max_error_rate: float = Field(0.05, ge=0.0, le=1.0)
    critical_slices: list[str] = Field(default_factory=list)


class _Contract(_Section):
    """What every contract kind shares: YAML in with ``--set`` overrides, the run directory, and
    the hash over the resolved contract, less the ``UNHASHED`` keys, with the content of every
    file the contract makes the run read (``input_pins``: data, held-out ids, a user reward
    function's source, the ``model.init`` bundle) in place of its name, so an edited file is a
    changed contract."""

    UNHASHED: ClassVar[tuple[str, ...]] = ()
    # keys added after contracts were first hashed, and the value at which they are left out of
    # the hash: a contract that leaves them there hashes as it did before they existed
    LATER_KEYS: ClassVar[dict[str, Any]] = {"model.tf32": True, "rollout.decode_batch": "auto",
                                            "run": {"deterministic": False}}

    # --- I/O -------------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None,
                  values: Mapping[str, Any] | None = None) -> Self:
        """The contract in the YAML file ``path``, with ``overrides`` (``--set`` items:
        ``KEY=VALUE``, the value YAML text) and then ``values`` (dotted key -> Python value)
        applied before it is validated."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            raise ContractError(f"config file not found: {path}") from None
        except yaml.YAMLError as exc:
            raise ContractError(f"{path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ContractError(f"{path}: the top level must be a mapping of keys")
        return cls.from_dict(data, overrides, source=str(path), values=values)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], overrides: list[str] | None = None,
                  source: str = "contract", values: Mapping[str, Any] | None = None) -> Self:
        data = json.loads(json.dumps(data))  # deep copy, plain types
        for item in overrides or []:
            apply_override(data, item)
        for key, value in (values or {}).items():
            set_key(data, key, json.loads(json.dumps(value, default=str)), "override")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ContractError(f"{source}: {format_errors(exc, cls)}") from None

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir.replace("${name}", self.name))

    def check_run_dir(self) -> Path:
        """``resolved_run_dir``, refused when it or a folder above it is a file, or when a
        logger ``log.to`` names is not installed (``LogSection.check_installed``): checks of
        this machine, so they are not part of validation (a contract read back from a bundle
        is valid wherever it is read); every run calls this before its model loads."""
        self.log.check_installed()
        run_dir = self.resolved_run_dir
        blocked = next((p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()),
                       None)
        if blocked is not None:
            raise ContractError(f"run_dir: {blocked} is a file, not a directory ({self.run_dir!r})")
        return run_dir

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def input_pins(self) -> dict[str, dict[str, Any]]:
        """Every file the contract makes the run read, pinned by its content: dotted key ->
        what the hash holds in place of the key's value (the one place that decides this).
        ``model.init``: ``{path, bundle}`` (``checkpoint.bundle_hash``); the env's files
        (``env_pins``); a ``module:function`` ``credit.assigner``: ``{function, sha256}``. A file that cannot be read is a ``ContractError`` naming its key."""
        pins = env_pins(self.env)
        assigner = getattr(getattr(self, "credit", None), "assigner", "")
        if ":" in assigner:  # your own function: its code is part of the objective
            pins["credit.assigner"] = function_pin(assigner, "assigner", "credit.assigner")
        if self.model.init is not None:
            pins["model.init"] = {"path": self.model.init,
                                  "bundle": init_bundle_hash(self.model.init)}
        return pins

    def hashed_fields(self) -> dict[str, Any]:
        """The resolved contract as plain JSON types, less the ``UNHASHED`` keys, with every
        ``input_pins`` key holding its pin; a null ``model.init`` is left out (a contract
        without a warm start hashes as before the key existed, as do the ``LATER_KEYS`` at their
        defaults; the ``UNHASHED`` keys go first, so one inside a ``LATER_KEYS`` section, as
        ``run.peak_flops``, leaves it as it was)."""
        data = self.model_dump(mode="json")
        if self.model.init is None:
            del data["model"]["init"]
        for dotted in self.UNHASHED:
            *sections, key = dotted.split(".")
            node = data
            for section in sections:
                node = node[section]
            del node[key]
        for dotted, default in self.LATER_KEYS.items():
            *sections, key = dotted.split(".")
            node = data
            for section in sections:
                node = node.get(section, {})
            if key in node and node[key] == default:
                del node[key]
        for dotted, pin in self.input_pins().items():
            *sections, key = dotted.split(".")
            node = data
            for section in sections:
                node = node[section]
            node[key] = pin
        return data

    def contract_hash(self) -> str:
        return canonical_hash(self.hashed_fields())

    def changes_from(self, other: _Contract) -> list[str]:
        """``key: other's value -> this value`` for every hashed key that differs (dotted)."""
        mine, theirs = _leaves(self), _leaves(other)
        return [f"{key}: {theirs[key]!r} -> {mine[key]!r}"
                for key in mine if not self.unhashed(key) and mine[key] != theirs[key]]

    def unhashed(self, key: str) -> bool:
        """Whether the dotted ``key`` is one of ``UNHASHED`` or inside one (``log.to``)."""
        return any(key == k or key.startswith(k + ".") for k in self.UNHASHED)

    def pin_changes(self, pinned: dict[str, Any]) -> list[str]:
        """``key: content changed (...)`` for every input pin that differs from ``pinned`` (the
        ``input_pins`` a run directory recorded): what ``changes_from`` cannot see, since the
        key's value is the same and the file's content is not."""
        mine = self.input_pins()
        return [f"{key}: content changed ({pin_text(pinned.get(key))} -> "
                f"{pin_text(mine.get(key))})"
                for key in sorted(set(mine) | set(pinned)) if mine.get(key) != pinned.get(key)]



class ExperimentContract(_Contract):
    """One training run, fully specified."""

    UNHASHED: ClassVar[tuple[str, ...]] = (  # the module docstring
        "optim.max_steps", "log", "optim.micro_batch_tokens", "rollout.gpu_memory_utilization",
        "rollout.vllm_sleep", "rollout.vllm_lora", "run.peak_flops", "model.device_memory")

    name: str = "run"
    env: EnvSection = Field(default_factory=EnvSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    model: ModelSection = Field(default_factory=ModelSection)
    reference: str | None = Field(None, description="fixed KL reference model id; required when loss.kl.beta > 0")
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    reward_shaping: RewardShapingSection = Field(default_factory=RewardShapingSection)
    credit: CreditSection = Field(default_factory=CreditSection)
    advantage: AdvantageSection = Field(default_factory=AdvantageSection)
    loss: LossSection = Field(default_factory=LossSection)
    curriculum: CurriculumSection | None = Field(None, description="difficulty filter {filter: pass_rate, k, min, max, every, pool}; null (or {filter: none}): every train task is drawn")
    hints: HintsSection | None = Field(None, description="annealed training hints {schedule, start, end, over_steps}; null (or {schedule: none}): env.kwargs decide, as built")
    optim: OptimSection = Field(default_factory=OptimSection)
    backend: BackendSection = Field(default_factory=BackendSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    run: TrainRunSection = Field(default_factory=TrainRunSection)
    log: LogSection = Field(default_factory=LogSection)
    guards: GuardSection = Field(default_factory=GuardSection)
    acceptance: AcceptanceSection = Field(default_factory=AcceptanceSection)
    run_dir: str = "runs/${name}"

    @field_validator("hints", mode="before")
    @classmethod
    def _schedule_none_is_null(cls, value: Any) -> Any:
        return None if value == {"schedule": "none"} else value  # one contract, one hash

    @field_validator("curriculum", mode="before")
    @classmethod
    def _filter_none_is_null(cls, value: Any) -> Any:
        return None if value in ({"filter": "none"}, {"filter": None}) else value  # one hash

    @model_validator(mode="after")
    def _check_combinations(self) -> ExperimentContract:
        # Named in DESIGN, not built yet: refuse them rather than silently run something else.
        if self.backend.name == "torch" and (self.backend.zero_stage or self.backend.offload != "none"):
            raise ValueError("backend.zero_stage / backend.offload need backend.name: deepspeed")
        if self.backend.offload != "none" and self.backend.zero_stage == 0:
            raise ValueError("backend.offload: cpu needs backend.zero_stage >= 1")
        if self.rollout.backend == "vllm" and self.rollout.top_p < 1.0:
            raise ValueError("rollout.top_p < 1 with rollout.backend vllm: vLLM reports log-probs "
                             "renormalised over the nucleus, not the full softmax the trainer "
                             "recomputes; use top_p 1.0 or rollout.backend hf")
        if self.rollout.vllm_lora is True and self.model.adapter != "lora":
            raise ValueError("rollout.vllm_lora: true needs model.adapter: lora (there is no "
                             f"adapter to push alone; model.adapter is {self.model.adapter}): "
                             "remove the key")
        if self.loss.kl.beta > 0 and self.reference is None:
            raise ValueError("loss.kl.beta > 0 needs `reference` (a fixed model id); got reference: null")
        if self.reference is not None and self.reference in ("rollout", "policy"):
            raise ValueError("reference: the KL reference must be a fixed model, never the rollout policy")
        if self.reference is not None and self.reference == self.model.id and self.model.adapter == "none":
            raise ValueError(
                f"reference: {self.reference!r} is the model being trained; with full fine-tuning "
                "the rollout policy would be its own reference (use a separate frozen copy's path)")
        check_split_names(self.env, self.eval)
        if not self.eval.splits or len(set(self.eval.splits)) != len(self.eval.splits):
            raise ValueError(f"eval.split: name each split once, got {self.eval.split!r}")
        held = self.env.holdout  # explicit holdouts: the splits they leave empty are known now
        empty = [n for n in self.eval.splits
                 if held is not None and not held.fills(n, self.env.iid_fraction)]
        if "holdout_iid" in empty:
            raise ValueError("eval.split holdout_iid needs env.iid_fraction > 0 or "
                             "env.holdout.task_ids_file")
        if empty:
            raise ValueError(f"eval.split {empty[0]!r} is empty: env.holdout holds out none of "
                             "it; name it there (structures, entity_groups, min_length) or "
                             "evaluate on holdout_iid")
        if self.env.split in self.eval.splits:
            raise ValueError(f"eval.split {self.env.split!r} is the training split (env.split): "
                             "held-out evaluation must use tasks the trainer never sees")
        for key, free in (("env.kwargs", self.env.kwargs), ("credit.params", self.credit.params)):
            bad = next(_nonfinite(free, key), None)
            if bad is not None:
                raise ValueError(f"{bad}: not a finite number")
        check_env_kwargs(self.env.id, self.env.kwargs)
        if self.hints is not None and "hints" in self.env.kwargs:
            raise ValueError("hints: the hints section decides which training episodes show a "
                             "hint, so env.kwargs.hints would be ignored; drop env.kwargs.hints "
                             "(hints: {schedule: constant, start: 1.0} shows them on every one)")
        budget = self.env.kwargs.get("context_budget")
        if isinstance(budget, int) and budget >= self.rollout.max_prompt_tokens:
            raise ValueError(
                f"env.kwargs.context_budget ({budget}) must be below rollout.max_prompt_tokens "
                f"({self.rollout.max_prompt_tokens}): compression has to happen before the "
                "prompt limit ends the episode")
        if self.rollout.max_policy_lag > self.guards.max_policy_lag:
            raise ValueError(
                f"rollout.max_policy_lag ({self.rollout.max_policy_lag}) exceeds "
                f"guards.max_policy_lag ({self.guards.max_policy_lag})")
        if self.curriculum is not None and self.curriculum.every and self.rollout.max_policy_lag:
            raise ValueError("curriculum.every > 0 with rollout.max_policy_lag > 0: rollouts run "
                             "ahead of the re-estimated band; use curriculum.every: 0 (once, "
                             "before step 1) or rollout.max_policy_lag: 0")
        if self.loss.aggregation == "seq_mean_token_sum_norm" and self.rollout.max_response_tokens < 1:
            raise ValueError("loss.aggregation seq_mean_token_sum_norm needs rollout.max_response_tokens")
        if self.rollout.dynamic_sampling and self.rollout.group_size < 2:
            raise ValueError("rollout.dynamic_sampling needs rollout.group_size >= 2 (a group of one has no contrast)")
        from trajectories.assign import ASSIGNERS, check_params, find_assigner
        from trajectories.functions import PASSED, is_passed

        if is_passed(self.credit.assigner) and self.credit.assigner not in PASSED:
            return self  # a script's function, not passed to this process: the hash says so
        try:  # a registered name, or your function as "module:function"
            find_assigner(self.credit.assigner)
        except ValueError as exc:
            hint = ("" if ":" in self.credit.assigner
                    else did_you_mean(self.credit.assigner, ASSIGNERS))
            raise ValueError(f"credit.assigner: {exc}{hint}") from None
        try:
            check_params(self.credit.assigner, self.credit.params)
        except ValueError as exc:
            raise ValueError(f"credit.params: {exc}") from None
        return self

def _nonfinite(value: Any, key: str):
    """Dotted keys of the NaN or infinite floats inside a free-form value (dicts and lists)."""
    if isinstance(value, float) and not math.isfinite(value):
        yield key
    elif isinstance(value, dict | list):
        for k, v in value.items() if isinstance(value, dict) else enumerate(value):
            yield from _nonfinite(v, f"{key}.{k}")


UNHASHED = ExperimentContract.UNHASHED


class SFTDataSection(_Section):
    """The episodes ``agent-rl sft`` trains on (``agent_rl.training.sft``)."""

    source: Literal["solver", "store"] = Field("solver", description="solver: the env's scripted solver (reference_action) on the env.split tasks; store: the episodes of a RolloutStore file")
    episodes_per_task: int = Field(1, ge=1, description="solver: episodes per train task (seeded env resets)")
    store: str | None = Field(None, description="store: the rollouts.jsonl (a RolloutStore) to read; its content hash is part of the contract hash")
    min_reward: float | None = Field(None, description="keep episodes whose reward total is at least this (null: all); the rest are counted, not trained on")
    max_episodes: int | None = Field(None, ge=1, description="at most this many episodes, in order (null: all)")

    @model_validator(mode="after")
    def _store_named(self) -> SFTDataSection:
        if self.source == "store" and not self.store:
            raise ValueError("data.source store needs data.store: the path of a rollouts.jsonl")
        if self.source == "solver" and self.store:
            raise ValueError("data.store is read only with data.source: store")
        return self


class SFTOptimSection(_Section):
    lr: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    epochs: int = Field(2, ge=0, description="passes over the episodes' sessions, each in a seeded order (0: evaluate only)")
    batch_sessions: int = Field(8, ge=1, description="sessions per optimizer step; the loss is the mean over their trained tokens")
    micro_batch_tokens: AutoSize = Field("auto", description="tokens per micro-batch, padding included; auto: 512 on the CPU, sized from the GPU memory on CUDA (agent_rl.run.sizing)")
    seed: int = 0


class SFTLimits(_Section):
    max_prompt_tokens: int = Field(512, ge=8, description="evaluation: a longer prompt is not generated for; training: a longer session is refused")
    max_response_tokens: int = Field(128, ge=1, description="evaluation: tokens per reply")


class SFTContract(_Contract):
    """One supervised warm start (``agent-rl sft``): episodes in, a bundle out, held-out reward
    before and after. The loss is the mean negative log-likelihood of the tokens RL would
    train (``render``'s loss mask: assistant tokens the policy generates, in every session)."""

    UNHASHED: ClassVar[tuple[str, ...]] = ("log", "optim.micro_batch_tokens",  # as training's
                                           "model.device_memory")

    name: str = "sft"
    env: EnvSection = Field(default_factory=EnvSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    model: ModelSection = Field(default_factory=ModelSection)
    data: SFTDataSection = Field(default_factory=SFTDataSection)
    optim: SFTOptimSection = Field(default_factory=SFTOptimSection)
    limits: SFTLimits = Field(default_factory=SFTLimits)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection, description="resume points every N optimizer steps (run_dir/resume/step-N: `agent-rl sft --resume` continues from the newest); the final bundle is checkpoints/step-N")
    run: RunSection = Field(default_factory=RunSection)
    log: LogSection = Field(default_factory=LogSection)
    run_dir: str = "runs/${name}"

    @model_validator(mode="after")
    def _check(self) -> SFTContract:
        check_split_names(self.env, self.eval)
        if self.env.split in self.eval.splits:
            raise ValueError(f"eval.split {self.env.split!r} is the training split (env.split)")
        bad = next(_nonfinite(self.env.kwargs, "env.kwargs"), None)
        if bad is not None:
            raise ValueError(f"{bad}: not a finite number")
        check_env_kwargs(self.env.id, self.env.kwargs)
        return self

    def input_pins(self) -> dict[str, dict[str, Any]]:
        """As every contract's, with ``data.store`` as ``{path, sha256}`` of the file's bytes."""
        pins = super().input_pins()
        if self.data.store:
            pins["data.store"] = {"path": self.data.store,
                                  "sha256": content_hash(self.data.store, "data.store")}
        return pins


def read_contract(path: str | Path, overrides: list[str] | None = None) -> ExperimentContract | SFTContract:
    """A run directory's ``contract.yaml`` (or any contract file) as the kind it is: an
    ``SFTContract`` when it has a ``data`` section, else an ``ExperimentContract``."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError):
        data = {}
    kind = SFTContract if isinstance(data, dict) and "data" in data else ExperimentContract
    return kind.from_yaml(path, overrides)


def _leaves(section: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value down through the sections (a free-form dict such as env.kwargs is
    one value, and so is a section that may be null, such as env.holdout: both contracts then
    have the same keys), in field order."""
    out: dict[str, Any] = {}
    for name, info in type(section).model_fields.items():
        value = getattr(section, name)
        if isinstance(value, BaseModel) and info.default is not None:  # always present
            out.update(_leaves(value, f"{prefix}{name}."))
        elif isinstance(value, BaseModel):
            out[f"{prefix}{name}"] = value.model_dump(mode="json", exclude_defaults=True)
        else:
            out[f"{prefix}{name}"] = value
    return out


