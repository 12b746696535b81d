"""``export(RUN_OR_BUNDLE, OUT)``: a trained policy as a standard Hugging Face folder.

What ``OUT`` holds::

    config.json, model.safetensors       the weights as the trainer holds them (the run's
    generation_config.json               model.dtype; the embedded GGUF model de-quantized),
                                         ``AutoModelForCausalLM.from_pretrained(OUT)`` and
                                         ``vllm serve OUT`` load them; the generation config
                                         stops on the tokens that ended a turn in training
    tokenizer files                      ``AutoTokenizer.from_pretrained(OUT)``, the chat
                                         template the run rendered with included
    README.md                            a model card: base model, assigner, the held-out
                                         results before/after with the paired difference and
                                         intervals (when the bundle is the one evaluated
                                         after training), the contract as YAML, versions

A LoRA run (``model.adapter: lora``): with ``merge_lora`` the adapter is merged into the base
weights (peft ``merge_and_unload``) and ``OUT`` is a full folder as above. Without it ``OUT``
is a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``, tokenizer,
card) whose ``base_model_name_or_path`` is the base model (its Hub id, or the absolute path of
its local folder): ``AutoPeftModelForCausalLM.from_pretrained(OUT)`` and ``vllm serve BASE
--enable-lora --lora-modules NAME=OUT`` load it. A base model that no ``from_pretrained`` can
load (the built-in ``smollm2-135m`` GGUF and ``tiny``) or that ``model.init`` replaced is
refused there: an adapter over it could not be applied anywhere, so ``merge_lora`` is the way.

``RUN_OR_BUNDLE`` is resolved as ``load_policy`` resolves it (a bundle folder, or a run
directory: its newest complete bundle, the final one after a finished run) and loaded with
``load.load_bundle_model``: a corrupt or incomplete bundle is refused naming the file. ``OUT``
is refused when it exists and is not empty (``force`` replaces it) and always when it is, or
holds, what is exported; files go to a temporary sibling folder first and are renamed into
place, so a failed export leaves no half-written ``OUT``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_rl.policies.load import (
    BundleModel,
    base_model_id,
    contract_of,
    holds_lora,
    load_bundle_model,
    resolve_bundle,
    run_dir_of,
)
from agent_rl.run import checkpoint

BUILTIN_MODELS = ("smollm2-135m", "tiny")  # ids no from_pretrained outside agent-rl loads
CARD_FILE = "README.md"


class ExportError(ValueError):
    """An export that cannot be done (``OUT`` taken, an adapter without a loadable base); the
    message says why and what to do. A bundle that cannot be loaded is a ``PolicyLoadError``."""


@dataclass(frozen=True)
class Exported:
    """What ``export`` wrote."""

    out: Path
    bundle: Path  # the checkpoint bundle exported
    step: int
    base_model: str  # model.id of the run (for an adapter folder: the base reference written)
    dtype: str  # of the weights written (for an adapter folder: of the adapter's tensors)
    adapter: bool  # True: a PEFT adapter folder over base_model; False: full weights
    merged: bool  # a LoRA adapter was merged into the base weights


def export(source: str | os.PathLike, out: str | os.PathLike, merge_lora: bool = False,
           force: bool = False, model_id: str | None = None) -> Exported:
    """Write the policy of ``source`` (a run directory or a checkpoint bundle) to ``out`` as a
    Hugging Face folder (the module docstring). ``model_id``: the base model of a bundle
    without its run's contract (default: the contract's ``model.id``)."""
    out = Path(out).expanduser()
    bundle = resolve_bundle(source)
    check_out(out, bundle, force)
    contract = contract_of(bundle)
    is_lora = holds_lora(bundle)
    adapter = is_lora and not merge_lora
    base = base_model_id(contract, model_id)
    if adapter:  # refused before the model is loaded when nothing could apply the adapter
        base = adapter_base(bundle, base, contract)
    loaded = load_bundle_model(bundle, model_id)
    step = json.loads((bundle / checkpoint.META_FILE).read_text())["step"]
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model = loaded.model
        if adapter:
            model.peft_config["default"].base_model_name_or_path = base
        elif is_lora:
            model = model.merge_and_unload()  # W + B A * scale, in place; a plain model back
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        set_stop_tokens(model, loaded.tokenizer)
        with quiet_progress():  # an adapter: no embedding copies (add_lora targets none), and
            # no Hub look-up of the base's vocabulary size ("auto" would query it): offline
            model.save_pretrained(tmp, **({"save_embedding_layers": False} if adapter else {}))
        if adapter:  # the generation config travels with the adapter, for a server to read
            model.get_base_model().generation_config.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        result = Exported(out, bundle, step, base, dtype, adapter, is_lora and merge_lora)
        (tmp / CARD_FILE).write_text(model_card(loaded, result))
        if out.exists():  # empty, or force: replaced only once the new folder is complete
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def check_out(out: Path, bundle: Path, force: bool) -> None:
    """Refuse, before anything is loaded, an ``out`` that is a file, that is or holds what is
    exported (the bundle, its run directory) or lies inside the bundle, or that exists and is
    not empty without ``force``."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder: choose another OUT")
    target, source = out.resolve(), bundle.resolve()
    run = run_dir_of(bundle)
    held = [source, *([run.resolve()] if run is not None else [])]
    if any(target == path or target in path.parents for path in held) or source in target.parents:
        raise ExportError(f"OUT {out} is, holds or lies inside the bundle exported ({bundle}): "
                          "choose another folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty: choose another OUT, or pass --force "
                          "to replace its contents")


def adapter_base(bundle: Path, model_id: str, contract: Any) -> str:
    """The base reference of a PEFT adapter folder: ``model_id`` when it is a Hub id, the
    absolute path of its folder when it is a local one; refused for a base that nothing
    outside agent-rl loads (``BUILTIN_MODELS``) or that the run's ``model.init`` replaced."""
    init = contract.model.init if contract is not None else None
    why = (f"the built-in model {model_id!r}, which from_pretrained cannot load"
           if model_id in BUILTIN_MODELS else
           f"the weights of model.init ({init}), not {model_id!r}" if init else None)
    if why:
        raise ExportError(f"{bundle} holds a LoRA adapter over {why}: an adapter folder "
                          "could not be applied. Pass --merge-lora to export the merged weights")
    return hub_id_of(model_id) or str(Path(model_id).expanduser().resolve())


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """No transformers progress bar ("Writing model shards") while a folder is written."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def set_stop_tokens(model: Any, tokenizer: Any) -> None:
    """The generation config stops where the policy stopped in training (the end-of-turn token
    and EOS: ``render.stop_token_ids``) and pads with the tokenizer's pad token."""
    from agent_rl.policies.render import stop_token_ids

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.generation_config
    config.eos_token_id = sorted(stop_token_ids(tokenizer))
    pad = tokenizer.pad_token_id
    config.pad_token_id = int(pad) if pad is not None else config.eos_token_id[0]


# ---------------------------------------------------------------------------------------------
# The model card
# ---------------------------------------------------------------------------------------------


def hub_id_of(model_id: str) -> str | None:
    """``model_id`` when it named a Hub model (a Hub id that is no local folder), else None."""
    from agent_rl.policies.models import is_hub_id

    local = model_id in BUILTIN_MODELS or Path(model_id).expanduser().exists()
    return model_id if not local and is_hub_id(model_id) else None


def agent_rl_version() -> str:
    try:
        return importlib.metadata.version("agent-rl")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed)"


def held_out(run_dir: Path | None, step: int) -> tuple[dict, dict, dict] | None:
    """``(before, after, comparison)`` of the run's ``result.json`` when its after-training
    evaluation was of this step (``eval.jsonl``), else None."""
    from agent_rl.run.rundir import logged_eval

    if run_dir is None or not (run_dir / "result.json").is_file():
        return None
    if logged_eval(run_dir, "after", step) is None:
        return None
    result = json.loads((run_dir / "result.json").read_text())
    if not all(result.get(key) for key in ("before", "after", "comparison")):
        return None
    return result["before"], result["after"], result["comparison"]


def _interval(lo: Any, hi: Any) -> str:
    return "-" if lo is None or hi is None else f"[{lo:.3f}, {hi:.3f}]"


def results_table(before: dict, after: dict, comparison: dict) -> list[str]:
    """Markdown rows: per split (all, then each held-out split), the mean reward before and
    after with 95% intervals, and the paired difference with its 95% bootstrap interval."""
    rows = ["| split | n | before | after | paired after - before |", "|---|---|---|---|---|"]
    named = [("all", before, after, comparison)] + [
        (name, before.get("splits", {}).get(name, {}), summary,
         comparison.get("splits", {}).get(name, {}))
        for name, summary in after.get("splits", {}).items()]
    for name, b, a, c in named:
        if not (b and a and c):
            continue
        rows.append(f"| {name} | {c['n']} "
                    f"| {b['reward_mean']:.3f} {_interval(b['reward_lo'], b['reward_hi'])} "
                    f"| {a['reward_mean']:.3f} {_interval(a['reward_lo'], a['reward_hi'])} "
                    f"| {c['reward_diff']:+.3f} {_interval(c['lo'], c['hi'])} |")
    return rows


def model_card(loaded: BundleModel, result: Exported) -> str:
    """README.md of an exported folder (the module docstring)."""
    contract, run_dir = loaded.contract, run_dir_of(loaded.bundle)
    credit = getattr(contract, "credit", None)
    assigner = (f"`{credit.assigner}`" + (f" with params `{json.dumps(credit.params)}`"
                                          if credit.params else "")
                if credit is not None else
                "none: supervised fine-tuning (`agent-rl sft`)" if contract is not None else
                "unknown (the bundle has no run contract beside it)")
    hub_base = hub_id_of(loaded.model_id)
    front = ["---", f"library_name: {'peft' if result.adapter else 'transformers'}",
             *([f"base_model: {hub_base}"] if hub_base else []),
             "tags: [agent-rl, reinforcement-learning, grpo]", "---"]
    what = ("a PEFT LoRA adapter over the base model below" if result.adapter else
            "full weights (the LoRA adapter merged into the base weights)" if result.merged else
            "full weights")
    lines = [*front, "", f"# {contract.name if contract else loaded.bundle.name}", "",
             f"Trained with agent-rl {agent_rl_version()} and exported from the checkpoint "
             f"bundle `{loaded.bundle.name}` (step {result.step}; content hash "
             f"`{checkpoint.bundle_hash(loaded.bundle)}`): {what}, {result.dtype}.", "",
             f"- base model: `{result.base_model}`",
             f"- environment: `{contract.env.id}`" if contract else "- environment: unknown",
             f"- credit assigner: {assigner}", ""]
    lines += ["## Held-out results", ""]
    results = held_out(run_dir, result.step)
    if results is None:
        lines += ["No held-out evaluation of this step was recorded (the run stopped early, or "
                  "this is not its final bundle): `agent-rl eval --policy RUN_OR_BUNDLE` "
                  "measures one.", ""]
    else:
        lines += ["Mean reward on the held-out tasks before and after training (greedy, "
                  "hint-free, the same tasks and seeds), with 95% intervals; the paired "
                  "difference with its 95% paired-bootstrap interval.", "",
                  *results_table(*results), ""]
    lines += ["## Loading", "", "```python"]
    if result.adapter:
        lines += ["from peft import AutoPeftModelForCausalLM",
                  "from transformers import AutoTokenizer", "",
                  'path = "PATH"  # this folder',
                  "model = AutoPeftModelForCausalLM.from_pretrained(path)",
                  "tokenizer = AutoTokenizer.from_pretrained(path)"]
    else:
        lines += ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                  'path = "PATH"  # this folder',
                  "model = AutoModelForCausalLM.from_pretrained(path)",
                  "tokenizer = AutoTokenizer.from_pretrained(path)"]
    lines += ["```", ""]
    if run_dir is not None:
        lines += ["## Experiment contract", "", "```yaml",
                  (run_dir / "contract.yaml").read_text().rstrip(), "```", ""]
    return "\n".join(lines)
