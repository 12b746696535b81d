"""What a vLLM engine is loaded with, by Hugging Face tensor name, and what is read back out
of it: the ``save_pretrained`` folder an engine starts from (``save_for_engine``), the names a
full push must carry (``checkpoint_names``, ``push_names_checked``), the LoRA adapter an
adapter-only push sends and the checks that decide it (``lora_blockers``,
``pushes_adapter_only``, ``adapter_tensors``, ``write_adapter``), and the functions run inside
the engine's worker that re-prepare its embeddings after a reload and read its weights back
(``prepare_embeddings``, ``read_engine_weights``), hashed as the trainer's are
(``tensors_hash``).

``agent_rl.policies.vllm_policy`` holds the engine that uses them (``VLLMPolicy``) and, in its
docstring, why a push and an adapter request work as they do. Importing this module needs no
vllm: the functions that read vLLM's registry or modules import it when called.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch

from agent_rl.policies.models import named_weights_for_push

# ---------------------------------------------------------------------------------------------
# Full pushes: the folder an engine starts from, the names a push carries, the hash
# ---------------------------------------------------------------------------------------------


def tensors_hash(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in name order: equal exactly
    when the same names hold bit-identical tensors."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_for_engine(model: Any, tokenizer: Any, folder: str | Path, merge: bool = True) -> Path:
    """Write ``model`` (LoRA merged; ``merge=False``: its base weights alone) and ``tokenizer``
    as a ``save_pretrained`` folder that vLLM loads: ``config.json``, ``model.safetensors``,
    the tokenizer files."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.save_pretrained(folder)
    tensors = {name: t.to("cpu").contiguous() for name, t in named_weights_for_push(model, merge)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    return folder


def checkpoint_names(folder: str | Path) -> frozenset[str] | None:
    """The tensor names of a ``save_pretrained`` folder's safetensors files (None: it has none)."""
    from safetensors import safe_open

    names: set[str] = set()
    files = sorted(Path(folder).glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return frozenset(names) if files else None


def push_names_checked(named_tensors: Iterable[tuple[str, torch.Tensor]], expected: frozenset[str],
                       optional: frozenset[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_tensors`` passed on while their names are the engine's: an unknown name (not
    in ``expected`` or ``optional``) raises before its tensor is passed on, a name of
    ``expected`` never seen raises once the stream ends."""
    seen: set[str] = set()

    def refuse(missing: list[str], unknown: list[str]) -> NoReturn:
        raise ValueError(
            f"load_weights: a push must carry exactly the engine's {len(expected)} weights (HF "
            f"names); missing {missing[:4]}{'...' if len(missing) > 4 else ''}, unknown "
            f"{unknown[:4]}{'...' if len(unknown) > 4 else ''}. Fix: push "
            "named_weights_for_push(model) (LoRA merged), not only the trainable tensors")

    for name, tensor in named_tensors:
        if name not in expected and name not in optional:
            refuse([], [name])
        seen.add(name)
        yield name, tensor
    if expected - seen:
        refuse(sorted(expected - seen), [])


# ---------------------------------------------------------------------------------------------
# Adapter-only pushes (``vllm_policy``'s docstring)
# ---------------------------------------------------------------------------------------------


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks


def lora_rank_slot(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of ``rank``: the smallest value it allows that
    holds it."""
    for slot in VLLM_LORA_RANKS:
        if rank <= slot:
            return slot
    raise ValueError(f"LoRA rank {rank}: vLLM holds ranks up to {VLLM_LORA_RANKS[-1]}; "
                     "use a smaller model.lora_rank or rollout.vllm_lora: false")


def active_lora_config(model: Any) -> Any | None:
    """The peft ``LoraConfig`` of ``model``'s active adapter (None: not a peft LoRA model)."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    config = configs[model.active_adapter]
    return config if getattr(config, "peft_type", None) == "LORA" else None


def lora_blockers(model: Any) -> list[str]:
    """Why the installed vLLM cannot apply ``model``'s adapter itself ([]: it can): what vLLM
    0.32's ``PEFTHelper.validate_legal`` refuses (DoRA, modules_to_save, an adapter bias, a
    rank over 512) and an architecture without vLLM LoRA support."""
    from vllm.model_executor.models import ModelRegistry, supports_lora

    config = active_lora_config(model)
    if config is None:
        return ["the model has no peft LoRA adapter (model.adapter: none)"]
    if len(model.peft_config) > 1:
        return [f"the model holds {len(model.peft_config)} adapters; one is pushed"]
    blockers = []
    if config.use_dora:
        blockers.append("DoRA (vLLM does not apply it)")
    if config.modules_to_save:
        blockers.append(f"modules_to_save {sorted(config.modules_to_save)}")
    if config.bias != "none":
        blockers.append(f"an adapter bias ({config.bias})")
    ranks = [config.r, *config.rank_pattern.values()]
    if max(ranks) > VLLM_LORA_RANKS[-1]:
        blockers.append(f"rank {max(ranks)} (vLLM holds up to {VLLM_LORA_RANKS[-1]})")
    base = model.get_base_model()
    for arch in getattr(base.config, "architectures", None) or [type(base).__name__]:
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is None or not supports_lora(cls):
            blockers.append(f"architecture {arch} (no vLLM LoRA support)")
    return blockers


def pushes_adapter_only(setting: str | bool, model: Any) -> bool:
    """Whether a vLLM engine for ``model`` takes the adapter alone after every update
    (``rollout.vllm_lora``): ``auto`` when ``model`` is a peft LoRA model whose adapter the
    engine can apply (``lora_blockers``), ``True`` the same or an error naming what stands in
    the way, ``False`` never (the adapter merged into every adapted layer)."""
    if setting is False:
        return False
    blockers = lora_blockers(model)
    if blockers and setting is True:
        raise ValueError("rollout.vllm_lora: true, but vLLM cannot apply this adapter itself: "
                         + "; ".join(blockers) + ". Use rollout.vllm_lora: auto or false (the "
                         "adapter merged into the pushed weights)")
    return not blockers


def adapter_tensors(model: Any, within: Callable[[str], bool] | None = None,
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The active adapter's tensors with the names peft's ``save_pretrained`` writes
    (``base_model.model.<module>.lora_A.weight``, ...), detached: what an adapter-only push
    sends; ``within``: those whose names it accepts only."""
    from peft.utils import get_peft_model_state_dict

    named = {name: t for name, t in model.state_dict().items() if within is None or within(name)}
    state = get_peft_model_state_dict(model, state_dict=named, adapter_name=model.active_adapter)
    for name, tensor in state.items():
        yield name, tensor.detach()


def write_adapter(config: Any, named_tensors: Iterable[tuple[str, torch.Tensor]],
                  folder: Path) -> Path:
    """``folder`` as peft's ``save_pretrained`` of the adapter alone writes it (what vLLM's
    ``LoRARequest`` loads): ``adapter_config.json`` and ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(folder))
    tensors = {name: t.to("cpu").contiguous() for name, t in named_tensors}
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


# ---------------------------------------------------------------------------------------------
# Functions run inside the engine's worker (``LLM.apply_model``: they get the vLLM model)
# ---------------------------------------------------------------------------------------------


def prepare_embeddings(model: torch.nn.Module) -> None:
    """Redo the kernel preparation of every embedding-like layer from its current weight (on
    CPU: the prepacked matrix a tied lm_head computes logits with). Idempotent."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            module.quant_method.process_weights_after_loading(module)


@torch.inference_mode()
def read_engine_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights the engine computes with, read back, with HF names (on CPU). Under LoRA
    (``enable_lora``) vLLM wraps each layer as ``<name>.base_layer``: the base weights, read
    under the layer's own name (the adapter is not in them)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    embeddings: dict[int, tuple[str, torch.Tensor]] = {}

    def probe(module: torch.nn.Module, in_features: int) -> torch.Tensor:
        eye = torch.eye(in_features, dtype=module.params_dtype, device=module.weight.device)
        return module.quant_method.apply(module, eye).t()  # [N, K] = (I @ W^T)^T

    for wrapped_name, module in model.named_modules():
        name = hf_name(wrapped_name)
        if isinstance(module, ParallelLMHead):
            weight = probe(module, module.embedding_dim)[: module.num_embeddings]  # [V, H]
            tied = embeddings.get(id(module.weight))
            done.add(name)
            if tied is not None and torch.equal(weight, tied[1]):
                continue  # the tied head computes with exactly the embedding: no HF tensor of its own
            out[f"{name}.weight"] = weight.cpu()
        elif isinstance(module, VocabParallelEmbedding):
            weight = module.weight[: module.num_embeddings]  # [V, H], padding rows dropped
            embeddings[id(module.weight)] = (name, weight)
            out[f"{name}.weight"] = weight.cpu().clone()
            done.add(name)
        elif isinstance(module, LinearBase):
            parts = {"weight": probe(module, module.input_size_per_partition)}  # [N, K]
            if getattr(module, "bias", None) is not None:
                parts["bias"] = module.bias
            parent, _, leaf = name.rpartition(".")
            subs = packed.get(leaf)
            sizes = getattr(module, "output_sizes", None)
            for kind, tensor in parts.items():
                if subs and sizes and len(subs) == len(sizes):
                    for sub, piece in zip(subs, tensor.split(list(sizes), dim=0), strict=True):
                        out[f"{parent}.{sub}.{kind}"] = piece.cpu().clone()
                else:
                    out[f"{name}.{kind}"] = tensor.cpu().clone()
            done.add(name)
    for wrapped_name, param in model.named_parameters():
        name = hf_name(wrapped_name)
        if name.rpartition(".")[0] not in done:
            out[name] = param.detach().cpu().clone()
    return out


def hf_name(name: str) -> str:
    """A vLLM module or parameter name less the ``.base_layer`` its LoRA wrappers add."""
    return name.replace(".base_layer", "")
