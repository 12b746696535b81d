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


# --- agent_rl.accel: entered through its package, and by the trainer through accel.step only --

ACCEL = ROOT / "agent_rl" / "accel"
TRAINERS = ("train.py", "sft.py")  # wherever the layout puts them under agent_rl/


def accel_submodules(folder: Path = ACCEL) -> set[str]:
    """The names of the modules and folders inside agent_rl/accel (its package surface aside)."""
    return {p.stem for p in folder.iterdir()
            if (p.suffix == ".py" or p.is_dir()) and not p.name.startswith("__")}


def accel_internal_imports(source: str, submodules: set[str]) -> list[int]:
    """Line numbers of the imports in ``source`` that reach inside agent_rl.accel: ``import
    agent_rl.accel.X``, ``from agent_rl.accel.X import ...``, ``from agent_rl.accel import X``
    for a submodule X, ``import_module("agent_rl.accel.X")``."""
    inside = "agent_rl.accel."
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            hit = any(alias.name.startswith(inside) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            hit = (node.module or "").startswith(inside) or (
                node.module == "agent_rl.accel" and any(a.name in submodules for a in node.names))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            hit = name in {"import_module", "__import__"} and str(node.args[0].value).startswith(inside)
        else:
            continue
        if hit:
            lines.append(node.lineno)
    return lines


def accel_names_used(source: str) -> set[str]:
    """What ``source`` names from the accelerator: ``accel.X`` attributes, names imported from
    any agent_rl.accel module, and accel modules imported whole."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "accel":
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("agent_rl.accel"):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("agent_rl.accel"))
    return names


def test_the_accelerator_is_imported_only_through_its_package():
    assert {"kernels", "attention", "patches", "head", "csrc"} <= accel_submodules()
    files = [p for p in package_files("agent_rl") if ACCEL not in p.parents]
    bad = [f"{p.relative_to(ROOT)}:{line}" for p in files
           for line in accel_internal_imports(p.read_text(), accel_submodules())]
    assert bad == []


def test_the_trainer_names_nothing_from_the_accelerator_but_its_entry_point():
    trainers = [p for p in package_files("agent_rl") if p.name in TRAINERS and ACCEL not in p.parents]
    assert sorted(p.name for p in trainers) == sorted(TRAINERS)
    for path in trainers:
        assert accel_names_used(path.read_text()) == {"step"}, path


def test_the_accel_checkers_catch_every_form():
    source = textwrap.dedent(
        """
        import agent_rl.accel.kernels
        from agent_rl.accel.head import HeadGrads
        from agent_rl.accel import kernels, step
        from agent_rl import accel

        def late():
            import importlib
            importlib.import_module("agent_rl.accel.patches")
            return accel.step, accel.blocked_attention
        """
    )
    assert accel_internal_imports(source, {"kernels", "head", "patches"}) == [2, 3, 4, 9]
    assert accel_names_used(source) == {"agent_rl.accel.kernels", "HeadGrads", "kernels", "step",
                                        "blocked_attention"}
    assert accel_names_used("from agent_rl import accel\nwith accel.step(b, m, d) as fast:\n    pass\n") == {"step"}
