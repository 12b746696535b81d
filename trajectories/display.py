"""Terminal rendering of episodes with rich (used by ``agent-rl inspect``).

``episode_tree`` draws one episode's session tree, one node per session: id, origin, what
crossed its boundary, turns, generated tokens, ``used_by_final``, credit and advantage. ``summary_table``
counts a batch of episodes. Text taken from episodes is never read as rich markup.

``escape_terminal`` is the one place that makes agent- or task-controlled text safe for a
terminal: every printer of the project (``agent-rl`` commands, progress lines, error messages,
warnings) passes such text through it, or through ``terminal_text`` when it goes to rich.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from functools import cache

from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from trajectories.assign import TurnCredit, assign, session_credit
from trajectories.models import Episode, Session

ORIGIN_STYLE = {"root": "bold cyan", "compression": "magenta", "branch": "yellow"}

# Characters a terminal acts on instead of showing: C0 controls, DEL and C1 controls (ESC
# starts colour, cursor, screen-clear and OSC 52 clipboard sequences; U+009B is a one-byte
# CSI), and the bidi overrides, isolates and marks that reorder what is shown.
_CONTROLS = (*range(0x20), 0x7F, *range(0x80, 0xA0))
_BIDI = (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_NAMED = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
_ESCAPES = {c: _NAMED.get(c) or (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}")
            for c in (*_CONTROLS, *_BIDI)}


@cache
def _escape_table(keep: str) -> dict[int, str]:
    return {c: escaped for c, escaped in _ESCAPES.items() if chr(c) not in keep}


def escape_terminal(text: str, keep: str = "\n\t") -> str:
    """``text`` with every character a terminal would act on written as its Python escape:
    C0 controls, DEL, C1 controls (``"\\x1b"``, ``"\\x9b"``, ``"\\r"``) and bidi controls
    (``"\\u202e"``), except those in ``keep`` (newline and tab: transcripts keep their layout).
    Backslashes stay as they are, so code stays readable and escaping twice changes nothing."""
    return text.translate(_escape_table(keep))


def terminal_text(text: str, style: str = "") -> Text:
    """Agent- or task-controlled ``text`` as a rich ``Text``: control characters escaped
    (``escape_terminal``) and never read as markup."""
    return Text(escape_terminal(text), style=style)


def _clip(text: str | None, width: int = 48) -> str:
    """One line of at most ``width`` characters of ``text``, before escaping."""
    text = " ".join((text or "").split())
    return escape_terminal(text if len(text) <= width else text[: width - 1] + "…")


def _boundary(session: Session) -> str:
    b = session.boundary
    if b is None:
        return ""
    if b.kind == "compression":
        before = escape_terminal((b.before_hash or "")[:8])
        return f'summary "{_clip(b.summary)}" before={before}'
    returned = "(not returned)" if b.returned is None else f'"{_clip(b.returned)}"'
    return f"parent_turn={b.parent_turn} returned {returned}"


def _session_label(session: Session, credit: Mapping[str, float] | None, final: str,
                   advantages: Mapping[str, float] | None = None) -> Text:
    label = Text()
    label.append(escape_terminal(session.session_id), style="bold")
    label.append(f" {session.origin}", style=ORIGIN_STYLE[session.origin])
    if session.session_id == final:
        label.append(" [final]", style="green")
    boundary = _boundary(session)
    if boundary:
        label.append(f" · {boundary}", style="dim")
    label.append(f" · {len(session.turns)} turns · {session.generated_tokens} gen tokens")
    label.append(f" · used_by_final={session.used_by_final}")
    if credit is not None:
        label.append(f" · credit {_number(credit[session.session_id], '.4g')}", style="bold green")
    if advantages is not None and session.session_id in advantages:
        label.append(f" · advantage {_number(advantages[session.session_id], '+.4g')}", style="bold")
    return label


def _number(value: float | TurnCredit, spec: str) -> str:
    """A session's credit or advantage: one number, or one per assistant turn in brackets."""
    if isinstance(value, tuple):
        return "[" + ", ".join(format(v, spec) for v in value) + "]"
    return format(value, spec)


def episode_tree(episode: Episode, credit: Mapping[str, float] | None = None,
                 advantages: Mapping[str, float] | None = None) -> Tree:
    """One episode as a rich Tree; ``credit`` (e.g. a ``Credit``) labels every session, and
    ``advantages`` (session id -> advantage) the sessions it names."""
    reward = episode.reward
    head = Text()
    head.append(f"episode {escape_terminal(episode.episode_id)}", style="bold")
    head.append(f" · {escape_terminal(episode.env_id)} v{episode.env_version}"
                f" · task {escape_terminal(episode.task_id)}")
    head.append(f" · reward {reward.total:.4g} ({reward.outcome.value})")
    method = getattr(credit, "method", None)
    if method is not None:
        head.append(f" · credit: {escape_terminal(method)} ({credit.unit})", style="green")
    root = Tree(head)
    tree = episode.tree
    final = episode.final_session.session_id

    def add(node: Tree, session: Session) -> None:
        child = node.add(_session_label(session, credit, final, advantages))
        for kid in tree.children(session.session_id):
            add(child, kid)

    add(root, tree.root)
    return root


def summary_table(episodes: Iterable[Episode], method: str = "broadcast",
                  params: Mapping[str, object] | None = None) -> Table:
    """Counts over ``episodes`` (read once): sessions, compressions, branches, tokens, rewards,
    credit under the assigner ``method`` with ``params``."""
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
        credit_sum += sum(map(session_credit, assign(ep, method, **(params or {})).values()))
    table = Table(title=terminal_text(f"{n} episodes · credit: {method}"))
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
