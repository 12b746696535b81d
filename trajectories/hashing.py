"""Canonical JSON and its sha256: the one way this project hashes structured data.

Canonical JSON is ``json.dumps`` with sorted keys, no whitespace (``","`` and ``":"``), UTF-8
text kept as is (``ensure_ascii=False``) and non-finite numbers refused (``allow_nan=False``),
so equal values always give equal bytes. Episodes, compression boundaries, checkpoint
manifests, canary state, sealed evaluation sets and the experiment contract are all hashed
with ``canonical_hash``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(obj: Any) -> str:
    """The canonical JSON text of ``obj``; ``ValueError`` on NaN or infinity."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def canonical_hash(obj: Any) -> str:
    """sha256 (hex) of the UTF-8 bytes of ``canonical_json(obj)``."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()
