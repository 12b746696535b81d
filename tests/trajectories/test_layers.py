"""The import-layer rule (DESIGN section 1), checked on the source with ``ast``.

    trajectories  imports none of envs, evals, agent_rl
    envs          imports only trajectories (of the four)
    evals         imports envs and trajectories, not agent_rl
    agent_rl      may import all three

Every import counts, including imports inside functions and ``importlib.import_module`` /
``__import__`` calls with a literal module name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trajectories", "envs", "evals", "agent_rl")
FORBIDDEN = {
    "trajectories": {"envs", "evals", "agent_rl"},
    "envs": {"evals", "agent_rl"},
    "evals": {"agent_rl"},
    "agent_rl": set(),
}


def imported_packages(source: str, filename: str = "<src>") -> dict[str, int]:
    """Top-level names of the absolute imports in ``source`` -> first line number."""
    found: dict[str, int] = {}

    def add(module: str | None, line: int) -> None:
        if module:
            found.setdefault(module.split(".")[0], line)

    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            add(node.module, node.lineno)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0]
            if name in {"import_module", "__import__"} and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str):
                add(arg.value, node.lineno)
    return found


def violations(package: str, files: list[Path], base: Path = ROOT) -> list[str]:
    out = []
    for path in files:
        for name, line in imported_packages(path.read_text(), str(path)).items():
            if name in FORBIDDEN[package]:
                out.append(f"{path.relative_to(base)}:{line} imports {name}")
    return sorted(out)


def package_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_package_respects_import_layers(package):
    files = package_files(package)
    assert files, f"no python files found in {package}/"
    assert violations(package, files) == []


def test_trajectories_sources_are_all_seen():
    names = {p.name for p in package_files("trajectories")}
    assert {"__init__.py", "models.py", "tree.py", "store.py", "assign.py"} <= names


def test_checker_catches_every_import_form(tmp_path):
    source = textwrap.dedent(
        """
        import os
        import envs.core as core
        from evals import stats
        from . import sibling
        from .models import Episode

        def late():
            from agent_rl.train import train
            import importlib
            importlib.import_module("agent_rl.cli")
            return __import__("numpy")
        """
    )
    assert imported_packages(source) == {
        "os": 2, "envs": 3, "evals": 4, "agent_rl": 9, "importlib": 10, "numpy": 12,
    }
    bad = tmp_path / "bad.py"
    bad.write_text(source)
    assert violations("trajectories", [bad], tmp_path) == [
        "bad.py:3 imports envs", "bad.py:4 imports evals", "bad.py:9 imports agent_rl",
    ]
    assert violations("envs", [bad], tmp_path) == ["bad.py:4 imports evals", "bad.py:9 imports agent_rl"]
    assert violations("evals", [bad], tmp_path) == ["bad.py:9 imports agent_rl"]
    assert violations("agent_rl", [bad], tmp_path) == []


def test_import_trajectories_pulls_no_upper_layer_or_torch():
    code = (
        "import sys, trajectories, trajectories.display, trajectories.testing\n"
        "print(sorted(m for m in ('envs', 'evals', 'agent_rl', 'torch') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
