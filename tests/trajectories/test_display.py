"""Terminal safety of what ``trajectories.display`` draws: agent text never acts on the terminal."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from trajectories.display import episode_tree, escape_terminal, summary_table, terminal_text
from trajectories.testing import episode, session


def rendered(renderable) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(renderable)
    return out.getvalue()


@pytest.mark.parametrize("raw, shown", [
    ("plain text, [brackets] and a \\ backslash", "plain text, [brackets] and a \\ backslash"),
    ("\x1b]52;c;SGVsbG8=\x07", "\\x1b]52;c;SGVsbG8=\\x07"),  # OSC 52: a clipboard write
    ("\x1b[2J\x1b[H", "\\x1b[2J\\x1b[H"),  # clear the screen, cursor home
    ("\x1b[32mPASSED\x1b[0m", "\\x1b[32mPASSED\\x1b[0m"),  # a fake green verdict
    ("\x9b31mred", "\\x9b31mred"),  # C1 CSI, one character
    ("\x85\x9f\x80", "\\x85\\x9f\\x80"),  # C1: NEL, the last and the first
    ("a\rb\x00c\x08d\x7f", "a\\rb\\x00c\\x08d\\x7f"),  # carriage return, NUL, backspace, DEL
    ("evil\u202etxt.exe\u202c", "evil\\u202etxt.exe\\u202c"),  # right-to-left override, pop
    ("\u2066\u2067\u2068\u2069", "\\u2066\\u2067\\u2068\\u2069"),  # isolates
    ("\u200e\u200f\u061c\u202a\u202b\u202d", "\\u200e\\u200f\\u061c\\u202a\\u202b\\u202d"),
    ("line one\n\tline two", "line one\n\tline two"),  # newline and tab kept: layout
    ("café 東京 ✓ 🙂", "café 東京 ✓ 🙂"),  # printable non-ASCII untouched
])
def test_escape_terminal_by_hand(raw, shown):
    assert escape_terminal(raw) == shown


def test_escape_terminal_keep_narrows_what_passes():
    assert escape_terminal("a\nb\tc", keep="") == "a\\nb\\tc"
    assert escape_terminal("a\nb\tc", keep="\n") == "a\nb\\tc"


def test_escape_terminal_escapes_exactly_the_controls_and_is_idempotent():
    controls = {*range(0x20), *range(0x7F, 0xA0), 0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F),
                *range(0x2066, 0x206A)}
    for code in range(0x3000):
        char = chr(code)
        once = escape_terminal(char, keep="")
        if code in controls:
            assert once.isascii() and once.isprintable() and once[0] == "\\", hex(code)
        else:
            assert once == char, hex(code)
        assert escape_terminal(once, keep="") == once


def test_terminal_text_is_never_markup():
    text = terminal_text("[bold red]x[/] \x1b[1m", "green")
    assert text.plain == "[bold red]x[/] \\x1b[1m" and str(text.style) == "green"
    assert rendered(text) == "[bold red]x[/] \\x1b[1m\n"


def test_episode_tree_and_summary_escape_ids_and_boundaries():
    eid, sid = "ep\x1b[2J", "r\u202e"
    ep = episode([session(sid, episode_id=eid), session("c1", sid, "compression", episode_id=eid)],
                 episode_id=eid, task_id="t\x9b1m", env_id="agent_rl/X\x07-v0")
    out = rendered(episode_tree(ep)) + rendered(summary_table([ep], "broadcast"))
    for raw in ("\x1b", "\u202e", "\x9b", "\x07"):
        assert raw not in out
    for shown in ("episode ep\\x1b[2J", "task t\\x9b1m", "agent_rl/X\\x07-v0", "r\\u202e root",
                  'summary "summary of r\\u202e"'):
        assert shown in out
