"""Small builders for hand-made episodes (tests, examples, benchmarks)."""

from __future__ import annotations

from trajectories.models import Boundary, Episode, Outcome, RewardBreakdown, Session, Turn


def assistant(text: str, token_ids: list[int] | None = None, logprob: float = -0.5) -> Turn:
    ids = token_ids if token_ids is not None else list(range(1, len(text.split()) + 2))
    return Turn(role="assistant", content=text, token_ids=ids, logprobs=[logprob] * len(ids),
                finish_reason="stop")


def session(
    session_id: str,
    parent_id: str | None = None,
    origin: str = "root",
    episode_id: str = "ep-0",
    used_by_final: bool | None = True,
    usage: float | None = None,
    text: str = "working on it",
) -> Session:
    boundary = None
    if origin == "compression":
        before = [{"role": "user", "content": f"context of {parent_id}"}]
        boundary = Boundary.compression(before, [{"role": "user", "content": "task + summary"}],
                                        summary=f"summary of {parent_id}")
    elif origin == "branch":
        boundary = Boundary(kind="branch", parent_turn=1,
                            after=[{"role": "user", "content": "sub-task"}], returned="done")
    return Session(
        session_id=session_id,
        parent_id=parent_id,
        episode_id=episode_id,
        origin=origin,
        boundary=boundary,
        turns=[Turn(role="user", content="task"), assistant(text)],
        used_by_final=used_by_final,
        metrics={} if usage is None else {"usage": usage},
    )


def episode(
    sessions: list[Session],
    reward: float = 1.0,
    episode_id: str = "ep-0",
    final_session_id: str | None = None,
    **fields,
) -> Episode:
    outcome = Outcome.correct if reward >= 1.0 else Outcome.wrong
    return Episode(
        episode_id=episode_id,
        env_id=fields.pop("env_id", "agent_rl/Hand-v0"),
        env_version=fields.pop("env_version", 0),
        task_id=fields.pop("task_id", "task-0"),
        group_id=fields.pop("group_id", "group-0"),
        sessions=sessions,
        final_session_id=final_session_id,
        reward=RewardBreakdown.from_components({"accuracy": reward}, {"accuracy": 1.0}, outcome,
                                               "hand@1"),
        **fields,
    )
