"""Terminal rendering of episodes with rich (used by ``agent-rl inspect``).

``episode_tree`` draws one episode's session tree, one node per session: id, origin, what
crossed its boundary, turns, generated tokens, ``used_by_final`` and credit. ``summary_table``
counts a batch of episodes. Text taken from episodes is never read as rich markup.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from trajectories.assign import assign
from trajectories.models import Episode, Session

ORIGIN_STYLE = {"root": "bold cyan", "compression": "magenta", "branch": "yellow"}


def _clip(text: str | None, width: int = 48) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _boundary(session: Session) -> str:
    b = session.boundary
    if b is None:
        return ""
    if b.kind == "compression":
        before = (b.before_hash or "")[:8]
        return f'summary "{_clip(b.summary)}" before={before}'
    returned = "(not returned)" if b.returned is None else f'"{_clip(b.returned)}"'
    return f"parent_turn={b.parent_turn} returned {returned}"


def _session_label(session: Session, credit: Mapping[str, float] | None, final: str) -> Text:
    label = Text()
    label.append(session.session_id, style="bold")
    label.append(f" {session.origin}", style=ORIGIN_STYLE[session.origin])
    if session.session_id == final:
        label.append(" [final]", style="green")
    boundary = _boundary(session)
    if boundary:
        label.append(f" · {boundary}", style="dim")
    label.append(f" · {len(session.turns)} turns · {session.generated_tokens} gen tokens")
    label.append(f" · used_by_final={session.used_by_final}")
    if credit is not None:
        label.append(f" · credit {credit[session.session_id]:.4g}", style="bold green")
    return label


def episode_tree(episode: Episode, credit: Mapping[str, float] | None = None) -> Tree:
    """One episode as a rich Tree; ``credit`` (e.g. a ``Credit``) labels every session."""
    reward = episode.reward
    head = Text()
    head.append(f"episode {episode.episode_id}", style="bold")
    head.append(f" · {episode.env_id} v{episode.env_version} · task {episode.task_id}")
    head.append(f" · reward {reward.total:.4g} ({reward.outcome.value})")
    method = getattr(credit, "method", None)
    if method is not None:
        head.append(f" · credit: {method} ({credit.unit})", style="green")
    root = Tree(head)
    tree = episode.tree
    final = episode.final_session.session_id

    def add(node: Tree, session: Session) -> None:
        child = node.add(_session_label(session, credit, final))
        for kid in tree.children(session.session_id):
            add(child, kid)

    add(root, tree.root)
    return root


def summary_table(episodes: Iterable[Episode], method: str = "broadcast") -> Table:
    """Counts over ``episodes`` (read once): sessions, compressions, branches, tokens, rewards."""
    n = sessions = tokens = 0
    reward_sum = credit_sum = 0.0
    origins: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    for ep in episodes:
        n += 1
        sessions += len(ep.sessions)
        origins.update(s.origin for s in ep.sessions)
        tokens += sum(s.generated_tokens for s in ep.sessions)
        reward_sum += ep.reward.total
        outcomes[ep.reward.outcome.value] += 1
        credit_sum += sum(assign(ep, method).values())
    table = Table(title=f"{n} episodes · credit: {method}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("episodes", str(n)),
        ("sessions", str(sessions)),
        ("compressions", str(origins["compression"])),
        ("branches", str(origins["branch"])),
        ("generated tokens", str(tokens)),
        ("mean reward", f"{reward_sum / n:.4g}" if n else "-"),
        ("mean credit / session", f"{credit_sum / sessions:.4g}" if sessions else "-"),
        ("outcomes", ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())) or "-"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table
