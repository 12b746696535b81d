"""The Gymnasium spaces of a ``ToolEnv``: observations are chat messages (``ChatSpace``),
actions are the policy's text (``TextSpace``). Both ``contains`` and ``sample`` work, so
``gymnasium.utils.env_checker.check_env`` runs on every environment."""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np

__all__ = ["ChatSpace", "TextSpace"]

_ROLES = ("system", "user", "assistant", "tool")
_WORDS = ("search", "record", "answer", "summary", "tool", "value", "the", "of", "42", "{", "}")


class ChatSpace(gymnasium.Space):
    """Observations: a list of chat messages ``{"role": ..., "content": str, ...}``; an
    assistant message the policy sampled also carries its ``"token_ids"``."""

    def __init__(self, max_messages: int = 10_000, seed: int | None = None):
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_messages = max_messages

    def contains(self, x: Any) -> bool:
        return (
            isinstance(x, list)
            and 0 < len(x) <= self.max_messages
            and all(
                isinstance(m, dict) and m.get("role") in _ROLES and isinstance(m.get("content"), str)
                for m in x
            )
        )

    def sample(self, mask: Any = None, probability: Any = None) -> list[dict[str, str]]:
        n = int(self.np_random.integers(1, 6))
        return [
            {"role": str(self.np_random.choice(_ROLES)), "content": _random_text(self.np_random)}
            for _ in range(n)
        ]

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "ChatSpace()"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ChatSpace) and other.max_messages == self.max_messages


class TextSpace(gymnasium.Space):
    """Actions: any string (the policy's raw text)."""

    def __init__(self, max_length: int = 1 << 20, seed: int | None = None):
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_length = max_length

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        return _random_text(self.np_random)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"TextSpace(max_length={self.max_length})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, TextSpace) and other.max_length == self.max_length


def _random_text(rng: np.random.Generator) -> str:
    return " ".join(str(rng.choice(_WORDS)) for _ in range(int(rng.integers(1, 12))))
