"""Contract keys from the outside: ``--set KEY=VALUE`` overrides by dotted path, pydantic's
errors as ``key: problem`` lines with the closest valid key of the section (did you mean),
and ``ContractError``, the error that names the key."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError


class ContractError(ValueError):
    """The experiment contract is broken; the message names the key."""


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply ``a.b.c=value`` (value parsed as YAML) to a nested dict in place."""
    if "=" not in item:
        raise ContractError(f"--set {item!r}: expected KEY=VALUE, e.g. optim.max_steps=4")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ContractError(f"--set {item!r}: the key has an empty part; expected KEY=VALUE, "
                            "e.g. optim.max_steps=4")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ContractError(f"--set {key}: value {raw!r} is not valid YAML: {exc}") from None
    set_key(data, key, value, "--set")


def set_key(data: dict[str, Any], key: str, value: Any, where: str = "override") -> None:
    """Set the dotted ``key`` (``optim.max_steps``) of a nested dict to ``value`` in place,
    making the sections on its way; ``where`` names the override in an error (``--set``)."""
    parts = key.strip().split(".")
    if not all(parts):
        raise ContractError(f"{where} {key!r}: the key has an empty part, e.g. optim.max_steps")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ContractError(f"{where} {key}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def format_errors(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """Pydantic's errors as ``key: problem; ...``; an unknown key of ``model`` (the contract
    validated) with the closest valid key of its section (``did_you_mean``)."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "value_error":  # our own message, without pydantic's "Value error, "
            msg = str(err["ctx"]["error"])
        elif err["type"] == "extra_forbidden":
            *section, key = (str(x) for x in err["loc"])
            keys = _section_keys(model, section) if model is not None else []
            msg = "unknown key" + did_you_mean(key, keys, prefix=".".join([*section, ""]))
        else:
            msg = err["msg"]
        parts.append(f"{loc}: {msg}" if loc else msg)  # a contract-level message names its keys
    return "; ".join(parts)


def did_you_mean(word: str, options: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean PREFIX+OPTION?)`` naming the option closest to ``word`` (``difflib``),
    or "" when none is close (a typo, not another word)."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _section_keys(model: type[BaseModel], path: Sequence[str]) -> list[str]:
    """The keys of the section at ``path`` below ``model`` (``["optim"]``: ``OptimSection``'s
    fields), or [] where ``path`` leads to no section (a free-form dict such as env.kwargs)."""
    for part in path:
        info = model.model_fields.get(part)
        kinds = () if info is None else (info.annotation, *get_args(info.annotation))
        section = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)),
                       None)
        if section is None:
            return []
        model = section
    return list(model.model_fields)
