"""The import-layer rule (DESIGN section 1), checked on the source with ``ast``.

    trajectories  imports none of envs, evals, agent_rl
    envs          imports only trajectories (of the four)
    evals         imports envs and trajectories, not agent_rl
    agent_rl      may import all three

and, inside agent_rl (DESIGN section 2), between its subpackages:

    run/          the ground floor: imports no other agent_rl subpackage
    policies/     imports run/ (and accel/)
    training/     imports policies/ and run/ (and accel/); never the reverse
    cli/          imports run/, policies/, training/; imported by none of them
    accel/        the optional CPU accelerator: entered only through ``agent_rl.accel``
                  itself (no ``agent_rl.accel.<module>`` from outside it), by policies/
                  and training/

Every import counts, including imports inside functions and ``importlib.import_module`` /
``__import__`` calls with a literal module name.
"""

from __future__ import annotations

import ast
import json
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
            from agent_rl.training.train import train
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


# --- inside agent_rl: its subpackages ------------------------------------------------------

AGENT_RL = ROOT / "agent_rl"
# each subpackage -> the agent_rl subpackages it may import
SUBPACKAGE_IMPORTS = {
    "run": set(),
    "accel": {"run"},
    "policies": {"run", "accel"},
    "training": {"run", "policies", "accel"},
    "cli": {"run", "policies", "training"},
}
TOP_LEVEL_IMPORTS = {"run", "policies", "training"}  # agent_rl/__init__.py: the public API


def agent_rl_imports(source: str, root: Path, filename: str = "<src>") -> list[tuple[str, int]]:
    """The agent_rl modules ``source`` imports, as dotted paths, with their line numbers:
    ``from agent_rl.x import y`` is ``agent_rl.x.y`` where ``y`` is a module or package under
    ``root`` (the agent_rl folder), else ``agent_rl.x``."""
    found = []

    def add(module: str, line: int) -> None:
        if module == "agent_rl" or module.startswith("agent_rl."):
            found.append((module, line))

    def is_module(dotted: str) -> bool:
        path = root.joinpath(*dotted.split(".")[1:])
        return path.is_dir() or path.with_suffix(".py").is_file()

    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                add(dotted if is_module(dotted) else node.module, node.lineno)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0]
            if name in {"import_module", "__import__"} and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str):
                add(arg.value, node.lineno)
    return found


def room_of(parts: tuple[str, ...]) -> str | None:
    """The subpackage a module path below agent_rl/ belongs to, None for a top-level module
    (agent_rl/__init__.py)."""
    return parts[0] if len(parts) > 1 else None


def subpackage_violations(files: list[Path], root: Path = AGENT_RL) -> list[str]:
    out = []
    for path in files:
        here = room_of(path.relative_to(root).parts)
        allowed = TOP_LEVEL_IMPORTS if here is None else SUBPACKAGE_IMPORTS[here]
        for module, line in agent_rl_imports(path.read_text(), root, str(path)):
            parts = tuple(module.split(".")[1:])
            if not parts:
                continue  # `import agent_rl`: the public API
            there = parts[0]
            where = f"{path.relative_to(root.parent)}:{line} imports {module}"
            if there == here:
                continue
            if there not in allowed:
                may = f"only {', '.join(sorted(allowed))}" if allowed else "no other subpackage"
                out.append(f"{where}: {here or 'agent_rl/__init__.py'} may import {may}")
            elif there == "accel" and parts[0] == "accel" and len(parts) > 1:
                out.append(f"{where}: enter the accelerator through agent_rl.accel only")
    return sorted(out)


def test_agent_rl_subpackages_import_in_one_direction():
    files = sorted(AGENT_RL.rglob("*.py"))
    assert {room_of(p.relative_to(AGENT_RL).parts) for p in files} >= {
        "run", "policies", "training", "cli"}
    assert subpackage_violations(files) == []


def test_every_agent_rl_module_sits_in_a_subpackage():
    flat = {p.stem for p in AGENT_RL.glob("*.py")} - {"__init__"}
    assert not flat, f"agent_rl/{sorted(flat)}: put it in a subpackage"
    folders = {p.name for p in AGENT_RL.iterdir() if (p / "__init__.py").is_file()}
    assert folders <= set(SUBPACKAGE_IMPORTS), f"{sorted(folders - set(SUBPACKAGE_IMPORTS))}: " \
                                                "add it to SUBPACKAGE_IMPORTS and docs/layout.md"


def test_subpackage_checker_catches_each_rule(tmp_path):
    root = tmp_path / "agent_rl"
    for folder in ("run", "policies", "training", "cli", "accel"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "accel" / "kernels.py").write_text("")
    sources = {
        "run/bad.py": "from agent_rl.policies import hf\nimport agent_rl.training.train\n",
        "policies/bad.py": ("from agent_rl.training.grpo import policy_loss\n"
                            "from agent_rl import accel\nfrom agent_rl.accel import step\n"
                            "from agent_rl.accel import kernels\n"),
        "training/bad.py": ("import agent_rl.cli\nfrom agent_rl.run import checkpoint\n"
                            "from agent_rl.policies.hf import HFPolicy\n"
                            "import importlib\nimportlib.import_module('agent_rl.accel.kernels')\n"),
        "cli/bad.py": "from agent_rl import accel\nfrom agent_rl.training import train\n",
        "__init__.py": "import importlib\nimportlib.import_module('agent_rl.cli')\n",
    }
    for name, source in sources.items():
        (root / name).write_text(source)
    files = [root / name for name in sources]
    assert subpackage_violations(files, root) == [
        "agent_rl/__init__.py:2 imports agent_rl.cli: agent_rl/__init__.py may import only "
        "policies, run, training",
        "agent_rl/cli/bad.py:1 imports agent_rl.accel: cli may import only policies, run, training",
        "agent_rl/policies/bad.py:1 imports agent_rl.training.grpo: policies may import only "
        "accel, run",
        "agent_rl/policies/bad.py:4 imports agent_rl.accel.kernels: enter the accelerator "
        "through agent_rl.accel only",
        "agent_rl/run/bad.py:1 imports agent_rl.policies: run may import no other subpackage",
        "agent_rl/run/bad.py:2 imports agent_rl.training.train: run may import no other "
        "subpackage",
        "agent_rl/training/bad.py:1 imports agent_rl.cli: training may import only accel, "
        "policies, run",
        "agent_rl/training/bad.py:5 imports agent_rl.accel.kernels: enter the accelerator "
        "through agent_rl.accel only",
    ]


def test_import_agent_rl_is_light_and_its_public_names_resolve():
    code = (
        "import json, sys, agent_rl\n"
        "light = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "where = {name: getattr(agent_rl, name).__module__ for name in agent_rl.__all__}\n"
        "print(json.dumps([light, where, 'agent_rl.cli' in sys.modules]))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    light, where, cli_imported = json.loads(result.stdout)
    assert light == []  # before any public name is used
    assert where == {
        "ContractError": "agent_rl.run.overrides", "ExperimentContract": "agent_rl.run.contract",
        "HFPolicy": "agent_rl.policies.hf", "OpenAIPolicy": "agent_rl.policies.openai_policy",
        "RunResult": "agent_rl.training.train", "VLLMPolicy": "agent_rl.policies.vllm_policy",
        "export": "agent_rl.policies.export",
        "group_advantages": "agent_rl.training.grpo", "load_policy": "agent_rl.policies.load",
        "policy_loss": "agent_rl.training.grpo", "read_contract": "agent_rl.run.contract",
        "session_advantages": "agent_rl.training.rollout", "train": "agent_rl.training.api",
    }
    assert not cli_imported


# --- agent_rl.accel: entered through its package, and by the trainer through accel.step only --

ACCEL = ROOT / "agent_rl" / "accel"
# under agent_rl/: the loop, and the trainers whose passes enter the accelerator (one step each)
LOOP, TRAINERS = "training/train.py", ("training/update.py", "training/sft.py")


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
    trainers = [ROOT / "agent_rl" / name for name in TRAINERS]
    assert all(p.is_file() for p in trainers)
    for path in trainers:
        assert accel_names_used(path.read_text()) == {"step"}, path
    assert accel_names_used((ROOT / "agent_rl" / LOOP).read_text()) <= {"step", "disabled"}


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
