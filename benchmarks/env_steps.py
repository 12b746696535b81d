"""Environment overhead without a model: reset + scripted-solver steps for every registered env.

For each id in ``envs.list_envs()``, runs ``--episodes`` episodes (``reset(seed=k)``, then
``reference_action()`` until the episode ends, episode record included) and prints
microseconds per step and per episode. Environments without a scripted solver are listed as
skipped.

    .venv/bin/python -m benchmarks.env_steps --episodes 200
"""

from __future__ import annotations

import argparse
import time

from pydantic import BaseModel, Field
from rich.console import Console
from rich.table import Table

import envs


class BenchConfig(BaseModel):
    episodes: int = Field(200, ge=1, description="episodes per environment")
    max_steps: int = Field(500, ge=1, description="give up on an episode after this many steps")
    env_ids: list[str] | None = Field(None, description="ids to time; None: every registered id")


def time_env(env_id: str, episodes: int, max_steps: int) -> dict[str, float] | None:
    """Seconds spent in reset, in step, and steps taken, over `episodes` scripted episodes."""
    env = envs.make(env_id)
    reset_s = step_s = 0.0
    steps = solved = 0
    for seed in range(episodes):
        t0 = time.perf_counter()
        env.reset(seed=seed)
        reset_s += time.perf_counter() - t0
        for _ in range(max_steps):
            action = env.unwrapped.reference_action()
            if action is None:
                return None
            t0 = time.perf_counter()
            _, reward, terminated, truncated, _ = env.step(action)
            step_s += time.perf_counter() - t0
            steps += 1
            if terminated or truncated:
                solved += reward >= sum(env.unwrapped.reward_weights.values()) - 1e-9
                break
    return {"reset_s": reset_s, "step_s": step_s, "steps": steps, "solved": solved}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, field in BenchConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if name == "env_ids":
            parser.add_argument(flag, nargs="+", default=None, help=field.description)
        else:
            parser.add_argument(flag, type=int, default=field.default, help=field.description)
    config = BenchConfig(**vars(parser.parse_args(argv)))

    table = Table(title=f"env overhead, scripted solver, {config.episodes} episodes per env")
    for column in ("env", "steps/ep", "us/reset", "us/step", "us/ep", "solved"):
        table.add_column(column, justify="left" if column == "env" else "right",
                         no_wrap=column == "env")
    for env_id in config.env_ids or envs.list_envs():
        r = time_env(env_id, config.episodes, config.max_steps)
        if r is None:
            table.add_row(env_id, "-", "-", "-", "-", "no scripted solver")
            continue
        n = config.episodes
        table.add_row(env_id, f"{r['steps'] / n:.1f}", f"{1e6 * r['reset_s'] / n:.0f}",
                      f"{1e6 * r['step_s'] / r['steps']:.0f}",
                      f"{1e6 * (r['reset_s'] + r['step_s']) / n:.0f}", f"{r['solved']}/{n}")
    Console().print(table)


if __name__ == "__main__":
    main()
