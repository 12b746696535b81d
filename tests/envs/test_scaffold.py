"""envs.scaffold: a generated environment package installs, registers through the
``agent_rl.envs`` entry point, passes the contract checks and its own tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import pytest

from envs.scaffold import new_env_package, package_names


def _run(args: list[str], cwd, timeout: int = 60) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.slow
def test_scaffolded_package_installs_registers_and_passes(tmp_path):
    name = f"scaffold_{uuid.uuid4().hex[:6]}"  # unique: other test runs share the venv
    names = package_names(name)
    root = new_env_package(name, tmp_path)
    assert root == tmp_path / names["dist"]
    env_py = (root / names["pkg"] / "env.py").read_text()
    for section in ("Description", "Tools", "Observation", "Reward", "Episode end",
                    "Version history"):
        assert f"\n{section}\n" in env_py
    assert f'{name} = "{names["pkg"]}:register_envs"' in (root / "pyproject.toml").read_text()

    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(root)], tmp_path)
    try:
        script = textwrap.dedent(f"""
            import sys
            import envs
            from envs.checks import check_env_id

            ids = envs.list_envs()
            assert {names["env_id"]!r} in ids, ids
            assert {names["pkg"] + ".env"!r} not in sys.modules  # registered lazily
            report = check_env_id({names["env_id"]!r}, episodes=20)
            print(report)
            assert report.passed
        """)
        # cwd=tmp_path: the package is importable only through the install
        done = _run([sys.executable, "-c", script], tmp_path)
        assert "PASS" in done.stdout
        done = _run([sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider"], root)
        assert "2 passed" in done.stdout
    finally:
        subprocess.run([*pip, "uninstall", "-y", "-q", names["dist"]], capture_output=True,
                       timeout=60)


def test_refuses_to_overwrite(tmp_path):
    root = new_env_package("letters", tmp_path)
    with pytest.raises(FileExistsError, match="already exists"):
        new_env_package("letters", tmp_path)
    assert (root / "tests" / "test_env.py").exists()


@pytest.mark.parametrize("bad", ["", "Letters", "1abc", "my-env", "my env", "class", "a" * 41])
def test_rejects_bad_names(tmp_path, bad):
    with pytest.raises(ValueError, match="lowercase identifier"):
        new_env_package(bad, tmp_path)
    assert not any(tmp_path.iterdir())


def test_names():
    assert package_names("letter_count") == {
        "name": "letter_count", "Name": "LetterCount", "pkg": "agent_rl_env_letter_count",
        "dist": "agent-rl-env-letter-count", "env_id": "letter_count/LetterCount-v0"}
