"""Finding the agent's code in its reply, on the trusted side: parsed (``ast``), never executed.

The code is the last fenced block (```python, ```py or a bare ```; an unclosed last fence runs
to the end) of the last 20 that defines the function at top level, else the last fenced block,
else the whole reply.
"""

from __future__ import annotations

import ast
import threading

MAX_CODE_CHARS = 20_000
_CODE_LANGS = frozenset({"", "python", "python3", "py"})
_MAX_BLOCKS = 20  # the last fenced blocks that are looked at


def fenced_blocks(reply: str) -> list[str]:
    """The Python (or untagged) fenced blocks of ``reply``, in order; an unclosed last fence
    runs to the end, and a closing fence may end a code line (``return x```)."""
    blocks: list[tuple[str, list[str]]] = []
    lang: str | None = None  # the open fence's language; None: outside a fence
    for line in reply.split("\n"):
        stripped = line.strip()
        if lang is None:
            if stripped.startswith("```"):
                lang = stripped[3:].strip().lower()
                blocks.append((lang, []))
            continue
        if stripped.startswith("```"):
            lang = None
        elif stripped.endswith("```"):
            blocks[-1][1].append(line.rstrip()[:-3])
            lang = None
        else:
            blocks[-1][1].append(line)
    return ["\n".join(lines).strip("\n") + "\n" for lang, lines in blocks if lang in _CODE_LANGS]


AST_LOCK = threading.RLock()
"""Held around every ``ast`` parse: CPython 3.11 keeps the AST constructor's recursion depth in
interpreter-wide state, so two threads parsing at once (a thread switch inside one parse, e.g.
at a garbage collection running a finalizer: concurrent env steps) can fail with
``SystemError: AST constructor recursion depth mismatch``."""


def defines(code: str, name: str) -> bool:
    """Does ``code`` parse and bind ``name`` at top level (``def``, an assignment, an import)?"""
    try:
        with AST_LOCK:
            tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return True
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name
                                                    for a in node.names):
            return True
    return False


def extract_code(reply: str, name: str) -> str:
    """The last fenced block that defines ``name``, else the last fenced block, else all."""
    blocks = fenced_blocks(reply)[-_MAX_BLOCKS:]
    if not blocks:
        return reply
    return next((b for b in reversed(blocks) if len(b) <= MAX_CODE_CHARS and defines(b, name)),
                blocks[-1])

