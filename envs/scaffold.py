"""Scaffold an installable agent-rl environment package.

``new_env_package("letter_count", "plugins/")`` writes ``plugins/agent-rl-env-letter-count/``::

    pyproject.toml                      entry point: [project.entry-points."agent_rl.envs"]
                                        letter_count = "agent_rl_env_letter_count:register_envs"
    README.md                           the commands of ``next_steps``, from install to a run
    train.yaml                          an experiment contract that trains the id out of the box
                                        (the tiny model, 2 steps, evaluated on holdout_iid)
    agent_rl_env_letter_count/
        __init__.py                     register_envs(): envs.register(
                                            "letter_count/LetterCount-v0", ...)
        env.py                          a small working ToolEnv: one @tool, deterministic task_pool,
                                        a pure reward function, a scripted reference_action()
    tests/test_env.py                   envs.checks.check_env_id on the id, plus a reward unit test

Once ``pip install -e`` installed it, ``envs.list_envs()`` shows the id without an import.
``next_steps(name, root)`` are the commands from there to a trained run (``agent-rl envs new``
prints them). Command line: ``python -m envs.scaffold NAME [DEST]``.
"""

from __future__ import annotations

import keyword
import re
import shlex
import sys
from pathlib import Path
from string import Template

_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "${dist}"
version = "0.1.0"
description = "agent-rl environment ${env_id}"
requires-python = ">=3.10"
dependencies = ["agent-rl"]

[project.entry-points."agent_rl.envs"]
${name} = "${pkg}:register_envs"

[tool.setuptools.packages.find]
include = ["${pkg}*"]

[tool.pytest.ini_options]
testpaths = ["tests"]
"""

README = """\
# ${dist}

The agent-rl environment `${env_id}` (see `${pkg}/env.py`). From this folder:

    pip install -e .                  # registers the id (entry-point group agent_rl.envs)
    agent-rl envs check ${env_id}
    python -m pytest tests            # the same contract checks and the reward unit tests
    agent-rl train train.yaml         # 2 steps of the tiny model -> runs/${name}/

`train.yaml` is the experiment contract of that run. Its tasks all share one structure, entity
group and length, so there is no compositional holdout (split `holdout`): a quarter of the
tasks are held out as unseen tasks (`env.iid_fraction: 0.25`, split `holdout_iid`) and
evaluated before and after training. Once `task_pool` varies `meta.structure`,
`meta.entity_group` or `meta.length`, held-out compositions are chosen automatically
(`eval.split: [holdout_iid, holdout]`), or name them in `env.holdout`:
`{structures: [...], entity_groups: [...], min_length: N, task_ids_file: held_out.txt}`.
For a real run, edit `train.yaml` as its comments say (a real model, longer replies, more steps).
"""

TRAIN = """\
# A first training run of ${env_id}: the tiny random Llama, 2 steps, seconds on CPU.
#   agent-rl train train.yaml          # writes runs/${name}/ under the working directory
# It proves the package trains end to end (the random model never answers). For a real run:
#   model: {id: smollm2-135m, adapter: lora}, rollout: {group_size: 8, max_response_tokens: 128,
#   dynamic_sampling: true}, optim: {lr: 1.0e-5, max_steps: 50}; delete guards.
# The scaffold's tasks share one structure, entity group and length: nothing compositional can
# be held out, so a quarter of them are held out as unseen tasks (split holdout_iid). To name
# holdouts instead: env.holdout: {structures: [...], entity_groups: [...], min_length: N,
# task_ids_file: held_out.txt}
name: ${name}
env: {id: ${env_id}, split: train, iid_fraction: 0.25}
eval: {split: holdout_iid, n: 4, every: 0}
model: {id: tiny, adapter: none}
# the random tiny model never answers, so its groups have no reward contrast and always hit the
# length limit: dynamic sampling off and max_truncated_frac > 1 keep every step running
rollout: {group_size: 2, tasks_per_step: 2, max_response_tokens: 8, truncation: keep,
          dynamic_sampling: false}
optim: {lr: 1.0e-4, max_steps: 2}
checkpoint: {every: 0, keep: 2}
guards: {max_truncated_frac: 1.5}
run_dir: runs/$${name}
"""

INIT = '''\
"""agent-rl environment package: registers ``${env_id}``.

Installed, it is found through the entry-point group ``agent_rl.envs`` (see pyproject.toml):
``envs.list_envs()`` lists its ids and ``envs.make`` builds them without an explicit import.
Registration is lazy: ``env.py`` is imported only when the environment is built.
"""

ENV_IDS = ("${env_id}",)


def register_envs() -> None:
    from envs import register

    register("${env_id}", "${pkg}.env:${Name}Env")
'''

ENV = '''\
"""${Name}-v0: count a letter in a word with the ``count`` tool, then answer with the number.

Description
    Each task names a word and one of its letters. The agent calls ``count`` to count that
    letter in the word, then replies with just the number.

Tools
    ``count(text, letter)``: how many times ``letter`` (one character) occurs in ``text``.

Observation
    ``[system, user]`` at the start (instructions with the tool list, and the task), then the
    agent's turns and the ``tool`` results.

Reward
    ``accuracy`` (weight 1.0): 1 when the last number in the final reply equals the count
    (``envs.scoring.numeric_answer``: ``3.0`` is 3, ``1,000`` is 1000, no exponents).

Episode end
    The first reply without a tool call is the answer and ends the episode (outcome
    ``correct``, ``wrong``, or ``format_error`` when it holds no number); ``max_turns``
    replies end it ``truncated``.

Version history
    v0: generated by ``envs.scaffold``.
"""

from __future__ import annotations

import json

import numpy as np
from envs import TaskMeta, TaskSpec, ToolEnv, ToolError, tool
from envs.scoring import numeric_answer, numeric_components
from trajectories import RewardBreakdown

WORDS = ("banana", "mississippi", "session", "reward", "rollout", "summary", "agent", "letter")
WEIGHTS = {"accuracy": 1.0}


def count_reward(reply: str, count: int) -> dict[str, float]:
    """The reward components of a final reply (a pure function: evaluation reuses it)."""
    return numeric_components(reply, count, list(WEIGHTS))


class ${Name}Env(ToolEnv):
    env_id = "${env_id}"
    version = 0
    instructions = "Use the tools to solve the task, then reply with just the final number."
    reward_weights = WEIGHTS

    @tool
    def count(self, text: str, letter: str) -> int:
        """Count how many times `letter` (one character) occurs in `text`."""
        if len(letter) != 1:
            raise ToolError("letter must be exactly one character")
        return text.count(letter)

    def task_pool(self, n: int, seed: int = 0) -> list[TaskSpec]:
        rng = np.random.default_rng(seed)
        tasks = []
        for i in range(n):
            word = str(rng.choice(WORDS))
            letter = str(rng.choice(sorted(set(word))))
            tasks.append(TaskSpec(
                task_id=f"${name}-{seed}-{i}",
                prompt=f"How many times does the letter {letter!r} occur in {word!r}?",
                meta=TaskMeta(skills=["count"], structure="count", entity_group="words", length=2),
                target=word.count(letter),
                data={"word": word, "letter": letter},
            ))
        return tasks

    def score(self, task: TaskSpec, answer: str, state: None) -> RewardBreakdown:
        return numeric_answer(answer, task.target, WEIGHTS, f"{self.env_id}@{self.version}")

    def reference_action(self) -> str | None:
        """The scripted solver: call ``count`` once, then answer with its result."""
        if self.task is None:
            return None
        if not any(m["role"] == "tool" for m in self.active_messages):
            args = {"text": self.task.data["word"], "letter": self.task.data["letter"]}
            return f"<tool_call>{json.dumps({'name': 'count', 'arguments': args})}</tool_call>"
        return str(self.task.target)
'''

TEST = '''\
"""Contract checks and reward unit tests for ${env_id}."""

import envs
from envs.checks import check_env_id

from ${pkg} import register_envs
from ${pkg}.env import count_reward

ENV_ID = "${env_id}"


def setup_module():
    if ENV_ID not in envs.list_envs():  # a source checkout, not installed: register by hand
        register_envs()


def test_contract_checks():
    report = check_env_id(ENV_ID, episodes=20)
    assert report.passed, str(report)


def test_reward_by_hand():
    assert count_reward("3", 3) == {"accuracy": 1.0}
    assert count_reward("there are 3", 3) == {"accuracy": 1.0}
    assert count_reward("4", 3) == {"accuracy": 0.0}
    assert count_reward("no idea", 3) == {"accuracy": 0.0}
'''


def package_names(name: str) -> dict[str, str]:
    """The names derived from an environment name (``letter_count``)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or keyword.iskeyword(name):
        raise ValueError(
            f"environment name {name!r} must be a lowercase identifier of at most 40 characters: "
            "a letter, then letters, digits or underscores (e.g. 'letter_count')"
        )
    camel = "".join(part.capitalize() for part in name.split("_"))
    return {"name": name, "Name": camel, "pkg": f"agent_rl_env_{name}",
            "dist": f"agent-rl-env-{name.replace('_', '-')}", "env_id": f"{name}/{camel}-v0"}


def new_env_package(name: str, dest_dir: str | Path) -> Path:
    """Write an installable environment package for ``name`` under ``dest_dir``; returns its
    folder. Refuses to overwrite an existing folder."""
    names = package_names(name)
    root = Path(dest_dir) / names["dist"]
    if root.exists():
        raise FileExistsError(f"{root} already exists; remove it or choose another name")
    files = {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        "train.yaml": TRAIN,
        f"{names['pkg']}/__init__.py": INIT,
        f"{names['pkg']}/env.py": ENV,
        "tests/test_env.py": TEST,
    }
    for rel, template in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(Template(template).substitute(names))
    return root


def next_steps(name: str, root: str | Path) -> list[str]:
    """The shell commands, run from the folder ``root`` is relative to, that take the package
    ``new_env_package(name, ...)`` wrote at ``root`` to a trained run: install, the contract
    checks, the package's tests, then its ``train.yaml`` (2 steps of the tiny model, written to
    ``runs/NAME/``)."""
    env_id = package_names(name)["env_id"]
    folder = Path(root).as_posix()
    if not (Path(root).is_absolute() or folder.startswith(".")):
        folder = f"./{folder}"  # pip reads a bare name as a package to download
    return [f"pip install -e {shlex.quote(folder)}",
            f"agent-rl envs check {env_id}",
            f"python -m pytest {shlex.quote(folder + '/tests')}",
            f"agent-rl train {shlex.quote(folder + '/train.yaml')}"]


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m envs.scaffold NAME [DEST_DIR]")
    print(new_env_package(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else "."))
