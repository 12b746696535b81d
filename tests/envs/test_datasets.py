"""Dataset-v0 / ``envs.from_dataset``: rewards against hand-checked cases, the three formats,
column mapping and metadata, bad rows named by row and column, user reward functions,
determinism, the compositional splits of the example data, and a 2-step training smoke run."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

import envs
from envs.checks import check_env_id, hostile_actions
from envs.datasets import (
    DEFAULT_PATH,
    DatasetError,
    RewardFaultWarning,
    RewardReturnError,
    choice_reward,
    contains_reward,
    exact_reward,
    from_dataset,
    numeric_reward,
    read_choice,
    regex_reward,
)
from evals.splits import default_splits
from trajectories import Outcome

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "qa_sample.jsonl"
EXAMPLE_KWARGS = {"prompt": "question", "reward": "numeric", "task_id": "id",
                  "meta": {"skills": "skills", "entity_group": "topic", "length": "steps"}}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def answer_with(env, reply: str, task=None):
    """Score ``reply`` on ``task`` (default: the first row); the episode's RewardBreakdown."""
    env.reset(seed=0, options={"task": task or env.tasks[0]})
    *_, terminated, _, info = env.step(reply)
    assert terminated
    return info["episode"].reward


ROWS = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a, b in
        [(2, 3), (10, 4), (7, 8), (1, 1), (20, 22), (6, 9)]]


# --- rewards, by hand ------------------------------------------------------------------------


@pytest.mark.parametrize(("reply", "answer", "expected"), [
    ("Paris", "Paris", 1.0),
    ("  paris \n", "Paris", 1.0),  # trimmed, case-folded
    ("New   York", "new york", 1.0),  # whitespace runs are one space
    ("ＰＡＲＩＳ", "Paris", 1.0),  # NFKC: full-width letters
    ("Paris.", "Paris", 0.0),  # punctuation counts
    ("It is Paris", "Paris", 0.0),
    ("", "Paris", 0.0),
])
def test_exact(reply, answer, expected):
    assert exact_reward(reply, answer) == expected


@pytest.mark.parametrize(("reply", "answer", "tolerance", "expected"), [
    ("72", "72", 0, 1.0),
    ("The answer is 1,000.", "1000", 0, 1.0),
    ("12.0", "12", 0, 1.0),
    ("-3.5", "-3.5", 0, 1.0),
    ("First 72, then 73", "72", 0, 0.0),  # the last number counts
    ("73 or rather 72", "72", 0, 1.0),
    ("no number here", "72", 0, 0.0),
    ("3.14", "3.1416", 0.001, 1.0),  # |0.0016| <= 0.001 * 3.1416 (relative above 1)
    ("3.14", "3.1416", 0.0001, 0.0),  # > 0.0001 * 3.1416
    ("1010", "1000", 0.01, 1.0),  # 10 <= 0.01 * 1000
    ("1011", "1000", 0.01, 0.0),
    ("0.105", "0.1", 0.01, 1.0),  # |0.005| <= 0.01 * max(1, 0.1): absolute below 1
    ("0.12", "0.1", 0.01, 0.0),
    ("9" * 5000, "72", 0.5, 0.0),  # no overflow, no int-conversion limit
    ("9" * 1_100_000, "72", 0.5, 0.0),  # beyond the default Decimal exponent limit
])
def test_numeric(reply, answer, tolerance, expected):
    assert numeric_reward(reply, answer, tolerance) == expected


@pytest.mark.parametrize(("reply", "pattern", "expected"), [
    ("The answer is 42.", r"\b42\b", 1.0),  # re.search: anywhere
    ("1423", r"\b42\b", 0.0),
    ("forty-two", r"^\s*(42|forty[- ]two)\s*$", 1.0),
    ("it is forty-two", r"^\s*(42|forty[- ]two)\s*$", 0.0),  # anchored: the whole reply
    ("PARIS", r"(?i)paris", 1.0),
    ("PARIS", r"paris", 0.0),
])
def test_regex(reply, pattern, expected):
    assert regex_reward(reply, pattern) == expected


@pytest.mark.parametrize(("reply", "letter"), [
    ("B", "B"), ("(b)", "B"), (" B. ", "B"), ("[C]", "C"), ("D)", "D"),
    ("The answer is C.", "C"), ("Answer: (D)", "D"), ("I pick option A, final.", "A"),
    ("A. Because the sky is blue.", "A"), ("(A) is wrong, so (C)", "C"),
    ("The answer is C, not (A).", "C"),
    ("the answer is a dog", None), ("I think so", None), ("", None), ("answer is Apple", None),
])
def test_read_choice(reply, letter):
    assert read_choice(reply) == letter
    assert choice_reward(reply, "C") == float(letter == "C")


@pytest.mark.parametrize(("reply", "answer", "expected"), [
    ("The capital of France is Paris.", "paris", 1.0),
    ("PARIS", "Paris", 1.0),
    ("Par is", "Paris", 0.0),
    ("14", "4", 1.0),  # a plain substring, no word boundaries
])
def test_contains(reply, answer, expected):
    assert contains_reward(reply, answer) == expected


@pytest.mark.parametrize(("reward", "cell", "reply", "outcome", "total"), [
    ("exact", "Paris", "paris", Outcome.correct, 1.0),
    ("exact", "Paris", "Lyon", Outcome.wrong, 0.0),
    ("exact", "Paris", "   ", Outcome.format_error, 0.0),
    ("numeric", 72, "So 72.", Outcome.correct, 1.0),
    ("numeric", "1,000", "1000", Outcome.correct, 1.0),
    ("numeric", "72", "seventy-two", Outcome.format_error, 0.0),
    ("numeric", "72", "71", Outcome.wrong, 0.0),
    ("regex", r"\b4\d\b", "it is 47", Outcome.correct, 1.0),
    ("choice", "(B)", "The answer is B", Outcome.correct, 1.0),
    ("choice", "b", "A", Outcome.wrong, 0.0),
    ("choice", "B", "no idea", Outcome.format_error, 0.0),
    ("contains", "Paris", "It is Paris!", Outcome.correct, 1.0),
])
def test_each_kind_scores_through_the_env(tmp_path, reward, cell, reply, outcome, total):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "Q?", "answer": cell}])
    r = answer_with(from_dataset(path, reward=reward), reply)
    assert (r.outcome, r.total, r.components) == (outcome, total, {"accuracy": total})
    assert r.verifier == f"agent_rl/Dataset-v0@0/{reward}"


def test_tolerance_and_weights_pass_through(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "pi?", "answer": 3.1416}])
    env = from_dataset(path, reward="numeric", tolerance=0.001, weights={"accuracy": 2.0})
    assert answer_with(env, "about 3.14").total == 2.0
    assert answer_with(env, "about 3.1").total == 0.0


@pytest.mark.parametrize(("reward", "cells", "solution"), [
    ("exact", ["Paris", "New  York"], None),
    ("numeric", [72, "1,000", "-3.50", 0.25], None),
    ("choice", ["B", "(c)", "d."], None),
    ("contains", ["Paris", "x y"], None),
    ("regex", [r"^4\d$", r"(?i)paris"], ["42", "PARIS"]),
])
def test_reference_action_solves_every_row(tmp_path, reward, cells, solution):
    rows = [{"prompt": f"Question {i}?", "answer": c} for i, c in enumerate(cells)]
    for row, s in zip(rows, solution or [None] * len(rows), strict=True):
        if s is not None:
            row["solution"] = s
    env = from_dataset(write_jsonl(tmp_path / "t.jsonl", rows), reward=reward,
                       solution="solution" if solution else None)
    for task in env.task_pool(len(rows)):
        env.reset(seed=0, options={"task": task})
        *_, info = env.step(env.reference_action())
        assert info["episode"].reward.outcome == Outcome.correct, task


def test_regex_without_a_solution_column_has_no_scripted_solver(tmp_path):
    env = from_dataset(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "Q?", "answer": "^4"}]),
                       reward="regex")
    env.reset(seed=0)
    assert env.reference_action() is None


@pytest.mark.parametrize("reward", ["exact", "numeric", "regex", "choice", "contains"])
def test_hostile_replies_never_raise(tmp_path, reward):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "Q?", "answer": "B"
                                               if reward == "choice" else "42"}])
    env = from_dataset(path, reward=reward, tolerance=0.1)
    for reply in hostile_actions([]) + ["x" * 1_000_000, "9" * 1_000_000, "(" * 10_000]:
        assert env.score(env.tasks[0], reply, None).total in (0.0, 1.0)
        env.reset(seed=0)
        *_, terminated, truncated, info = env.step(reply)
        if not (terminated or truncated):  # a (malformed) tool call: a tool error, then answer
            *_, info = env.step("42")
        assert info["episode"].hash_ok()


# --- formats -----------------------------------------------------------------------------------


def test_jsonl_and_csv_give_the_same_tasks(tmp_path):
    jsonl = from_dataset(write_jsonl(tmp_path / "qa.jsonl", ROWS), reward="numeric")
    rows = [[r["prompt"], r["answer"]] for r in ROWS]
    table = from_dataset(write_csv(tmp_path / "qa.csv", ["prompt", "answer"], rows),
                         reward="numeric")
    strip = ("data",)  # the raw record differs (CSV cells are strings); the tasks do not
    assert [t.model_dump(exclude=set(strip)) for t in jsonl.tasks] == \
           [t.model_dump(exclude=set(strip)) for t in table.tasks]
    assert [t.task_id for t in jsonl.tasks] == [f"qa-{i}" for i in range(1, 7)]
    assert jsonl.data_hash != table.data_hash and len(jsonl.data_hash) == 64


def test_csv_with_bom_quotes_and_multiline_cells(tmp_path):
    path = tmp_path / "qa.csv"
    path.write_text('\ufeffprompt,answer\n"Line one,\nline two?",7\nplain?,8\n', encoding="utf-8")
    env = from_dataset(path)
    assert [t.prompt for t in env.tasks] == ["Line one,\nline two?", "plain?"]
    assert env.tasks[1].data["row"] == 2


def test_a_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    env = from_dataset(folder, reward="numeric")
    assert [t.prompt for t in env.tasks] == [r["prompt"] for r in ROWS]
    both = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2]),
                          "test": datasets.Dataset.from_list(ROWS[2:])}).save_to_disk(str(both))
    assert len(from_dataset(both).tasks) == 2  # "train" by default
    assert len(from_dataset(both, dataset_split="test").tasks) == 4
    with pytest.raises(DatasetError, match="dataset_split"):
        from_dataset(both, dataset_split="validation")


def test_a_datasets_folder_without_the_package_names_the_fix(tmp_path):
    try:
        import datasets  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("datasets is installed")
    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "state.json").write_text("{}")
    with pytest.raises(ImportError, match=r"pip install datasets.*to_json"):
        from_dataset(folder)


@pytest.mark.parametrize(("name", "content", "message"), [
    ("missing.jsonl", None, r"no such file or folder .*working directory"),
    ("t.json", "[]", r"unknown format '\.json'; use a \.jsonl file"),
    ("t.jsonl", "\n\n", "no rows"),
    ("t.csv", "", "no header row"),
    ("t.csv", "prompt,prompt\na,b\n", r"repeats column\(s\) \['prompt'\]"),
    ("folder", "/", "not one written by datasets"),
])
def test_bad_paths_say_the_fix(tmp_path, name, content, message):
    path = tmp_path / name
    if content == "/":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        from_dataset(path)


def test_an_edited_file_is_read_again(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS[:2])
    assert len(from_dataset(path).tasks) == 2
    write_jsonl(path, ROWS)
    os.utime(path, ns=(1, 1))  # a different mtime even on a coarse clock
    assert len(from_dataset(path).tasks) == 6


# --- column mapping and metadata ----------------------------------------------------------------


def test_column_mapping_meta_ids_and_system(tmp_path):
    path = write_csv(tmp_path / "quiz.csv",
                     ["qid", "question", "gold", "skills", "topic", "steps", "level", "source"],
                     [["a1", "What is 2+3*4?", "14", "mul>add", "math", "2", "1", "book"],
                      ["a2", "Capital of Peru?", "Lima", "recall", "geo", "1", "0", "web"]])
    env = from_dataset(path, prompt="question", answer="gold", task_id="qid",
                       system="Be brief.", meta={"skills": "skills", "entity_group": "topic",
                                                 "length": "steps", "difficulty": "level",
                                                 "origin": "source"})
    first, second = env.tasks
    assert (first.task_id, first.prompt, first.target) == ("a1", "What is 2+3*4?", "14")
    assert first.meta.model_dump() == {"skills": ["mul", "add"], "structure": "mul>add",
                                       "entity_group": "math", "length": 2, "difficulty": 1,
                                       "origin": "book"}  # an extra key is kept
    assert second.meta.skills == ["recall"] and second.meta.structure == "recall"
    assert first.data["record"]["source"] == "book" and first.data["row"] == 1
    obs, _ = env.reset(seed=0)
    assert obs[0] == {"role": "system", "content": "Be brief."}


def test_meta_none_reads_the_same_named_columns(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"prompt": "Q1?", "answer": "1", "skills": ["a", "b"], "entity_group": "g", "length": 2},
        {"prompt": "Q2?", "answer": "2", "skills": "a, c", "entity_group": "h", "length": 1}])
    first, second = from_dataset(path).tasks
    assert first.meta.skills == ["a", "b"] and first.meta.structure == "a>b"
    assert second.meta.skills == ["a", "c"] and second.meta.entity_group == "h"
    assert first.meta.difficulty == 0  # no column: TaskMeta's default
    bare = from_dataset(write_jsonl(tmp_path / "bare.jsonl", ROWS)).tasks[0].meta
    assert bare.model_dump() == {"skills": [], "structure": "", "entity_group": "", "length": 1,
                                 "difficulty": 0}


def test_skills_default_to_the_structure(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "Q?", "answer": "1", "s": "x>y>z"}])
    meta = from_dataset(path, meta={"structure": "s"}).tasks[0].meta
    assert meta.skills == ["x", "y", "z"] and meta.structure == "x>y>z"


def test_default_instructions_follow_the_reward(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "Q?", "answer": "B", "n": 3}])
    assert "final number" in from_dataset(path, reward="numeric", answer="n").instructions
    assert "letter" in from_dataset(path, reward="choice").instructions
    assert "final answer only" in from_dataset(path).instructions


# --- bad rows: errors naming the row and the column, at construction -------------------------


@pytest.mark.parametrize(("lines", "kwargs", "message"), [
    (['{"prompt": "a?", "answer": "1"}', '{"answer": "2"}'], {},
     r"row 2 \(line 2\): column 'prompt' \(prompt\) is missing; the row has columns \['answer'\]"),
    (['{"prompt": "a?", "answer": null}'], {}, r"row 1 \(line 1\): column 'answer' .* is null"),
    (['{"prompt": "a?", "answer": "1"}', "", "", '{"prompt": "  ", "answer": "2"}'], {},
     r"row 2 \(line 4\): column 'prompt' \(prompt\) is empty"),
    (['{"prompt": 12, "answer": "1"}'], {}, r"row 1 .*column 'prompt' \(prompt\) is int 12, not text"),
    (['{"prompt": "a?", "answer": ""}'], {}, r"row 1 .*column 'answer' \(answer\) is empty"),
    (['{"prompt": "a?", "answer": "1"}'] * 2 + ['{"prompt": "b?", "answer": "about 5"}'],
     {"reward": "numeric"}, r"row 3 \(line 3\): column 'answer' \(answer\) is 'about 5', not one number"),
    (['{"prompt": "a?", "answer": "1/2"}'], {"reward": "numeric"}, "row 1 .*not one number"),
    (['{"prompt": "a?", "answer": true}'], {"reward": "numeric"}, "row 1 .*is bool True"),
    (['{"prompt": "a?", "answer": "BC"}'], {"reward": "choice"}, "row 1 .*not one option letter"),
    (['{"prompt": "a?", "answer": "([a"}'], {"reward": "regex"},
     "row 1 .*not a valid regular expression"),
    (['{"prompt": "a?", "answer": "1", "length": "two"}'], {},
     r"row 1 .*column 'length' \(meta length\) is 'two', not an integer >= 1"),
    (['{"prompt": "a?", "answer": "1", "length": 0}'], {}, "not an integer >= 1"),
    (['{"prompt": "a?", "answer": "1", "skills": []}'], {},
     r"column 'skills' \(meta skills\) is empty"),
    (['{"prompt": "a?", "answer": "1", "skills": [1]}'], {}, "skills are a list of strings"),
    (['{"prompt": "a?", "answer": "1", "t": "g"}', '{"prompt": "b?", "answer": "2"}'],
     {"meta": {"entity_group": "t"}}, r"row 2 .*column 't' \(meta entity_group\) is missing"),
    (['{"prompt": "a?", "answer": "1", "id": "x"}', '{"prompt": "b?", "answer": "2", "id": "x"}'],
     {"task_id": "id"}, r"row 2 \(line 2\): task id 'x' repeats row 1 \(line 1\)"),
    (['{"prompt": "a?", "answer": "1"}', '{"prompt": "b?", "answer": 2'], {},
     r"row 2 \(line 2\): not valid JSON"),
    (['["a?", "1"]'], {}, r"row 1 \(line 1\): a JSON list, not an object"),
    (['{"prompt": "\\ud800", "answer": "1"}'], {}, "lone surrogate"),
])
def test_bad_jsonl_rows_name_the_row_and_column(tmp_path, lines, kwargs, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=message) as info:
        from_dataset(path, **kwargs)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(("text", "message"), [
    ("prompt,answer\na?,1\nb?\n", r"row 2 \(line 3\): fewer cells .*\['answer'\]"),
    ("prompt,answer\na?,1,extra\n", r"row 1 \(line 2\): 1 more cell\(s\) than the header"),
    ("prompt,answer\na?,1\n,2\n", r"row 2 \(line 3\): column 'prompt' \(prompt\) is empty"),
    ("question,answer\na?,1\n", r"row 1 \(line 2\): column 'prompt' \(prompt\) is missing"),
])
def test_bad_csv_rows_name_the_row_and_column(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DatasetError, match=message):
        from_dataset(path)


def test_bad_rows_fail_through_make_too(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a?"}\n')
    with pytest.raises(ValueError, match="row 1"):  # DatasetError is a ValueError
        envs.make("agent_rl/Dataset-v0", path=str(path))


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"reward": "fuzzy"}, DatasetError,
     r"reward 'fuzzy' is not one of \['exact', 'numeric', 'regex', 'choice', 'contains'\]"),
    ({"reward": "no_such_module_xyz:score"}, ImportError,
     r"reward 'no_such_module_xyz:score': cannot import module .*PYTHONPATH"),
    ({"reward": "json:no_such_function"}, ImportError, "json has no attribute 'no_such_function'"),
    ({"reward": "json:__doc__"}, DatasetError, "is str, not a function"),
    ({"reward": ":f"}, DatasetError, "'module:function'"),
    ({"reward": "missing/rewards.py:f"}, ImportError, "no file .*rewards.py"),
    ({"weights": {"accuracy": 1, "style": 1}}, DatasetError, "one component 'accuracy'"),
    ({"weights": {"accuracy": float("nan")}}, DatasetError, "finite numbers"),
    ({"tolerance": -1}, DatasetError, "tolerance must be"),
    ({"meta": {"skills": 3}}, DatasetError, "meta maps TaskMeta fields to column names"),
    ({"prompt": ""}, DatasetError, "prompt must name a column"),
    ({"dataset_split": "train"}, DatasetError, "dataset_split applies to a datasets folder"),
])
def test_bad_arguments_say_the_fix(tmp_path, kwargs, error, message):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(error, match=message):
        from_dataset(path, **kwargs)


# --- user reward functions ------------------------------------------------------------------


REWARDS_PY = '''
def length_match(answer, task):
    return float(len(answer.strip()) == len(str(task.target)))

def parts(answer, task):
    right = answer.strip() == str(task.target)
    return {"accuracy": float(right), "short": float(len(answer) < 10), "chars": len(answer)}

def says_yes(answer, task):
    return "yes"

def no_accuracy(answer, task):
    return {"style": 1.0}

def breaks_later(answer, task):
    if answer == "boom":
        raise ValueError("cannot read " + answer)
    return 1.0

def breaks_at_once(answer, task):
    raise KeyError("x")
'''


@pytest.fixture
def rewards_file(tmp_path) -> str:
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(REWARDS_PY))
    return str(tmp_path / "my_rewards.py")


def test_user_function_returning_a_float(tmp_path, rewards_file):
    env = from_dataset(write_jsonl(tmp_path / "t.jsonl", ROWS), reward=f"{rewards_file}:length_match")
    assert env.tasks[0].target == "5"  # the answer cell as it is
    assert answer_with(env, "9").outcome == Outcome.correct
    r = answer_with(env, "10")
    assert (r.outcome, r.total) == (Outcome.wrong, 0.0)
    assert answer_with(env, "").outcome == Outcome.format_error


def test_user_function_returning_components(tmp_path, rewards_file):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    env = from_dataset(path, reward=f"{rewards_file}:parts",
                       weights={"accuracy": 0.8, "short": 0.2})
    r = answer_with(env, "5")
    assert r.components == {"accuracy": 1.0, "short": 1.0, "chars": 1.0}  # chars: weight 0
    assert (r.total, r.outcome) == (pytest.approx(1.0), Outcome.correct)
    r = answer_with(env, "4")
    assert (r.total, r.outcome) == (pytest.approx(0.2), Outcome.wrong)
    # without weights the default {"accuracy": 1.0} applies: a dict holding accuracy is fine
    assert answer_with(from_dataset(path, reward=f"{rewards_file}:parts"), "5").total == 1.0


def test_user_function_from_an_importable_module(tmp_path, rewards_file, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    env = from_dataset(write_jsonl(tmp_path / "t.jsonl", ROWS), reward="my_rewards:length_match")
    assert answer_with(env, "1").total == 1.0
    assert envs.make("agent_rl/Dataset-v0", path=str(tmp_path / "t.jsonl"),
                     reward="my_rewards:length_match").unwrapped.verifier.name == \
        "my_rewards:length_match"


@pytest.mark.parametrize(("name", "kwargs", "message"), [
    ("says_yes", {}, r"reward function .*my_rewards.py:says_yes returned 'yes' \(str\); it "
                     "must return a finite float or a dict"),
    ("no_accuracy", {}, r"returned components \['style'\] without the weighted \['accuracy'\]; "
                        r".*weights=\{'style': 1.0\}"),
    ("length_match", {"weights": {"a": 1.0, "b": 1.0}}, "returned a float, but weights name"),
    ("breaks_at_once", {}, r"breaks_at_once raised KeyError: 'x' on t-1 .*checked at construction"),
])
def test_a_bad_user_function_fails_at_construction(tmp_path, rewards_file, name, kwargs,
                                                    message):
    with pytest.raises(DatasetError, match=message):
        from_dataset(write_jsonl(tmp_path / "t.jsonl", ROWS), reward=f"{rewards_file}:{name}",
                     **kwargs)


def test_a_user_function_failing_later_is_a_counted_verifier_fault(tmp_path, rewards_file):
    env = from_dataset(write_jsonl(tmp_path / "t.jsonl", ROWS),
                       reward=f"{rewards_file}:breaks_later")
    r = answer_with(env, "boom")
    assert r.outcome == Outcome.sandbox_error and r.is_infrastructure_fault and r.total == 0.0
    assert r.audit["reward_error"] == "ValueError: cannot read boom"


# --- determinism, pools, registry -------------------------------------------------------------


def test_task_pool_is_a_seeded_order_of_the_rows_capped_at_the_file(tmp_path):
    env = from_dataset(write_jsonl(tmp_path / "t.jsonl", ROWS))
    a, b = env.task_pool(4, seed=3), env.task_pool(4, seed=3)
    assert a == b and len(a) == 4
    assert from_dataset(tmp_path / "t.jsonl").task_pool(4, seed=3) == a
    assert [t.task_id for t in env.task_pool(6, seed=3)] != [t.task_id for t in env.task_pool(6, seed=4)]
    everything = env.task_pool(1000, seed=0)  # more than the file: every row once
    assert sorted(t.task_id for t in everything) == sorted(t.task_id for t in env.tasks)
    assert env.task_pool(0) == []
    first, second = envs.make("agent_rl/Dataset-v0"), envs.make("agent_rl/Dataset-v0")
    first.reset(seed=11)
    second.reset(seed=11)
    assert first.unwrapped.task == second.unwrapped.task


def test_the_registered_default_is_the_bundled_sample():
    env = envs.make("agent_rl/Dataset-v0").unwrapped
    assert env.path == DEFAULT_PATH and len(env.tasks) == 54
    assert "path" in envs.accepted_kwargs("agent_rl/Dataset-v0")
    assert envs.from_dataset is from_dataset


def test_check_env_id_on_the_example_data():
    report = check_env_id("agent_rl/Dataset-v0", episodes=5,
                          env_kwargs={"path": str(EXAMPLE), **EXAMPLE_KWARGS})
    assert report.passed, str(report)


# --- splits on the example data ------------------------------------------------------------


def test_default_splits_hold_out_structures_topics_and_length_of_the_example():
    env = from_dataset(EXAMPLE, **EXAMPLE_KWARGS)
    assert len(env.tasks) == 108
    splits = default_splits(env, pool_size=256, seed=0)
    assert splits.criteria["holdout_structures"] == ["div>sub"]
    assert splits.criteria["holdout_entity_groups"] == ["travel"]
    assert splits.criteria["min_holdout_length"] == 3
    counts = splits.counts()
    assert counts["dropped_duplicates"] == 0
    assert counts["train"] + len(splits.holdout) == 108 and counts["train"] == 64
    trained = {s for t in splits.train for s in t.meta.skills}
    assert {"add", "sub", "mul", "div"} <= trained
    assert all(t.meta.length < 3 and t.meta.entity_group != "travel"
               and t.meta.structure != "div>sub" for t in splits.train)
    assert default_splits("agent_rl/Dataset-v0", pool_size=256).holdout  # the bundled sample too


@pytest.mark.slow
def test_training_two_steps_on_the_example_contract(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "agent_rl.cli", "train", str(ROOT / "examples" / "dataset_qa.yaml"),
         "--set", "optim.max_steps=2", "--set", "eval.n=4", "--set", f"run_dir={run_dir}",
         "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    episode = json.loads((run_dir / "rollouts.jsonl").read_text().splitlines()[0])
    assert episode["env_id"] == "agent_rl/Dataset-v0"
    assert episode["reward"]["verifier"] == "agent_rl/Dataset-v0@0/numeric"


# --- scoring is bounded: agent text never hangs it ------------------------------------------


SLOW_PY = '''
import os, time

def sleeps_on_cue(answer, task):
    if answer == "sleep":
        time.sleep(3600)
    return float(answer.strip() == str(task.target))

def sleeps_always(answer, task):
    time.sleep(3600)

def exits_on_cue(answer, task):
    if answer == "exit":
        os._exit(3)
    return 1.0

def says_true_on_cue(answer, task):
    return True if answer == "yes" else 0.0

def says_true(answer, task):
    return answer == str(task.target)
'''


@pytest.fixture
def slow_rewards(tmp_path) -> str:
    (tmp_path / "slow_rewards.py").write_text(textwrap.dedent(SLOW_PY))
    return str(tmp_path / "slow_rewards.py")


def scored_quickly(env, reply: str, limit_s: float = 20.0):
    """The RewardBreakdown of ``reply`` on the first row, with its warnings; it must come back
    well within ``limit_s`` (the env's reward_timeout_s is far below it)."""
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reward = answer_with(env, reply)
    assert time.monotonic() - started < limit_s
    return reward, [str(w.message) for w in caught if w.category is RewardFaultWarning]


def assert_stopped(reward, said: list[str], timeout_s: float, task_id: str = "t-1") -> None:
    assert reward.outcome == Outcome.sandbox_error and reward.is_infrastructure_fault
    assert reward.total == 0.0 and reward.audit["task_id"] == task_id
    assert f"reward_timeout_s={timeout_s:g} s" in reward.audit["reward_error"]
    assert len(said) == 1 and f"task {task_id}" in said[0] and "sandbox_error" in said[0]


def test_a_catastrophic_regex_is_stopped_at_reward_timeout_s(tmp_path):
    """``^(a+)+$`` against 40 a's and a '!' backtracks for longer than the universe's age: the
    episode ends as a counted infrastructure fault after reward_timeout_s, and the next reply
    is scored as usual."""
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "Say a's.", "answer": "^(a+)+$"}])
    env = from_dataset(path, reward="regex", reward_timeout_s=0.5)
    reward, said = scored_quickly(env, "a" * 40 + "!")
    assert_stopped(reward, said, 0.5)
    assert answer_with(env, "aaaa").outcome == Outcome.correct
    assert answer_with(env, "aab").outcome == Outcome.wrong


def test_a_user_function_that_hangs_is_stopped_and_the_next_reply_is_scored(tmp_path, slow_rewards):
    env = from_dataset(write_jsonl(tmp_path / "t.jsonl", ROWS),
                       reward=f"{slow_rewards}:sleeps_on_cue", reward_timeout_s=0.5)
    reward, said = scored_quickly(env, "sleep")
    assert_stopped(reward, said, 0.5)
    assert "slow_rewards.py:sleeps_on_cue" in said[0]
    assert answer_with(env, "5").outcome == Outcome.correct  # a fresh worker after the kill


def test_a_user_function_that_exits_its_process_is_a_fault_not_an_exit(tmp_path, slow_rewards):
    env = from_dataset(write_jsonl(tmp_path / "t.jsonl", ROWS),
                       reward=f"{slow_rewards}:exits_on_cue")
    reward, said = scored_quickly(env, "exit")
    assert reward.outcome == Outcome.sandbox_error and len(said) == 1
    assert "WorkerDied" in reward.audit["reward_error"] and "exit code 3" in said[0]
    assert answer_with(env, "5").total == 1.0


def test_a_user_function_that_hangs_at_construction_names_reward_timeout_s(tmp_path, slow_rewards):
    started = time.monotonic()
    with pytest.raises(DatasetError, match=r"sleeps_always returned nothing within "
                                           r"reward_timeout_s=0.5 s on t-1 .*raise "
                                           "reward_timeout_s") as info:
        from_dataset(write_jsonl(tmp_path / "t.jsonl", ROWS),
                     reward=f"{slow_rewards}:sleeps_always", reward_timeout_s=0.5)
    assert info.value.key == "reward_timeout_s" and time.monotonic() - started < 20


def test_the_choice_reward_reads_long_whitespace_in_linear_time():
    """'answer' and 100000 spaces took minutes (three adjacent ``\\s*`` backtracking); one
    reading of each whitespace run is linear. The letter forms still read as before."""
    for reply in ["answer" + " " * 100_000 + "!", " " * 100_000 + "x!", "x" + " " * 100_000 + "!"]:
        started = time.monotonic()
        assert read_choice(reply) is None
        assert time.monotonic() - started < 2.0
    assert [read_choice(r) for r in ["The answer is: (C)", "answeris D", "Answer  :  E.",
                                     " ( b ) . ", "[c]:"]] == ["C", "D", "E", "B", "C"]


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), True, "10"])
def test_reward_timeout_s_is_a_finite_positive_number(tmp_path, value):
    with pytest.raises(DatasetError, match="reward_timeout_s must be a finite number of "
                                           "seconds > 0") as info:
        from_dataset(write_jsonl(tmp_path / "t.jsonl", ROWS), reward_timeout_s=value)
    assert info.value.key == "reward_timeout_s"


def test_stopped_rewards_are_masked_and_counted_by_the_trainer(tmp_path):
    """The trainer's rollout leaves a stopped reward out of its group and counts it
    (``reward/infra_error_rate``), with the task id and the reason on the episode."""
    from agent_rl.training.rollout import budget_report, filter_groups
    from envs.runner import Completion, run_episodes

    class Replies:
        def generate(self, batch, sampling):
            return [Completion("a" * 40 + "!" if i == 0 else "aaa", [1], [-0.1])
                    for i, _ in enumerate(batch)]

    rows = [{"prompt": "Say a's.", "answer": "^(a+)+$", "id": "hang"}]
    env = from_dataset(write_jsonl(tmp_path / "t.jsonl", rows), reward="regex", task_id="id",
                       reward_timeout_s=0.5)
    with pytest.warns(RewardFaultWarning, match="task hang"):
        episodes = run_episodes([env, from_dataset(tmp_path / "t.jsonl", reward="regex",
                                                   task_id="id", reward_timeout_s=0.5)],
                                env.tasks, Replies(), samples_per_task=2)
    assert [e.reward.outcome for e in episodes] == [Outcome.sandbox_error, Outcome.correct]
    assert episodes[0].task_id == "hang" and "DeadlineExceeded" in episodes[0].reward.audit[
        "reward_error"]
    decided, drops = filter_groups(episodes, dynamic_sampling=False)
    assert [e.filter["reason"] for e in decided] == ["infrastructure_fault", "kept"]
    assert budget_report(decided, drops, "mask")["infrastructure_faults"] == 1


# --- reward weights and return values -------------------------------------------------------


@pytest.mark.parametrize(("reward", "weights", "message"), [
    ("exact", {"accuracy": 0}, r"weights \{'accuracy': 0\} are all zero: every reply would"),
    ("exact", {"accuracy": -1.0}, r"weights \['accuracy'\] are negative"),
    ("exact", {"accuracy": float("inf")}, "finite numbers"),
    ("exact", {"accuracy": True}, "finite numbers"),
    ("parts", {"accuracy": 0.0, "short": 0.0}, "are all zero"),
    ("parts", {"accuracy": 1.0, "short": -0.5}, r"weights \['short'\] are negative"),
])
def test_degenerate_weights_are_refused_naming_weights(tmp_path, rewards_file, reward, weights,
                                                       message):
    spec = f"{rewards_file}:{reward}" if reward == "parts" else reward
    with pytest.raises(DatasetError, match=message) as info:
        from_dataset(write_jsonl(tmp_path / "t.jsonl", ROWS), reward=spec, weights=weights)
    assert info.value.key == "weights"


def test_a_zero_weight_beside_a_positive_one_is_recorded_not_scored(tmp_path, rewards_file):
    env = from_dataset(write_jsonl(tmp_path / "t.jsonl", ROWS), reward=f"{rewards_file}:parts",
                       weights={"accuracy": 1.0, "short": 0.0})
    r = answer_with(env, "4")  # wrong but short: 1 x 0 + 0 x 1
    assert (r.total, r.outcome) == (0.0, Outcome.wrong)


def test_a_user_function_returning_a_bool_fails_at_construction(tmp_path, slow_rewards):
    with pytest.raises(DatasetError, match=r"slow_rewards.py:says_true returned True \(bool\); "
                                           r"a score is a float: return float\(...\)"):
        from_dataset(write_jsonl(tmp_path / "t.jsonl", ROWS), reward=f"{slow_rewards}:says_true")


def test_a_user_function_returning_a_bool_later_is_a_loud_error(tmp_path, slow_rewards):
    env = from_dataset(write_jsonl(tmp_path / "t.jsonl", ROWS),
                       reward=f"{slow_rewards}:says_true_on_cue")
    assert answer_with(env, "no").outcome == Outcome.wrong
    with pytest.raises(RewardReturnError, match=r"says_true_on_cue returned True \(bool\)"):
        answer_with(env, "yes")


# --- rows Python cannot read are named like any bad row -------------------------------------


GOOD = b'{"prompt": "a?", "answer": "1"}\n'


@pytest.mark.parametrize(("name", "content", "message"), [
    ("bad.jsonl", GOOD + b'{"prompt": "caf\xff?", "answer": "1"}\n',
     r"row 2 \(line 2\): byte 16 of the line \(0xff\) is not UTF-8; save the file as UTF-8"),
    ("bad.jsonl", GOOD + b"\n" + b'{"prompt": "a?", "answer": ' + b"7" * 5000 + b"}\n",
     r"row 2 \(line 3\): holds an integer of 5000 digits \(Python reads at most 4300\); "
     r'write it as a string: "777777777777..."'),
    ("bad.jsonl", GOOD + b'{"prompt": "a?", "answer": "1", "x": ' + b"[" * 100_000
     + b"]" * 100_000 + b"}\n", r"row 2 \(line 2\): nested deeper than JSON can be read here"),
    ("bad.jsonl", GOOD + b'{"prompt": "a?", "answer": "1", "x": ' + b"[" * 500 + b"]" * 500
     + b"}\n", r"row 2 \(line 2\): nested 501 levels deep; a row nests at most 100 levels"),
    ("bad.csv", b"prompt,answer\na?,1\ncaf\xff?,1\n",
     r"row 2 \(line 3\): column 'prompt' holds byte 0xff at character 4, not UTF-8"),
    ("bad.csv", b"prompt,\xe9nswer\na?,1\n", r"line 1 \(the header\): column name .* holds byte "
                                             r"0xe9, not UTF-8"),
    ("bad.csv", b'prompt,answer\na?,1\n"' + b"x" * 200_000 + b'",1\nb?,2\n',
     r"row 2 \(line 3\): not readable as CSV \(field larger than field limit \(131072\)\); a "
     r"\.csv cell holds at most 131072 characters: put longer ones in a \.jsonl file"),
], ids=["jsonl-not-utf8", "jsonl-5000-digits", "jsonl-100000-deep", "jsonl-500-deep",
        "csv-not-utf8", "csv-header-not-utf8", "csv-200k-cell"])
def test_rows_python_cannot_read_are_named_with_file_row_and_line(tmp_path, name, content,
                                                                  message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DatasetError, match=message) as info:
        from_dataset(path)
    assert str(info.value).startswith(f"{path}: ")


def test_a_long_integer_answer_in_a_csv_cell_is_read_as_text(tmp_path):
    path = write_csv(tmp_path / "t.csv", ["prompt", "answer"], [["Big?", "7" * 5000]])
    env = from_dataset(path, reward="numeric")
    assert answer_with(env, "It is " + "7" * 5000).outcome == Outcome.correct


def test_a_function_passed_from_python_is_scored_in_the_worker_by_value(tmp_path):
    """A closure (or a script's function) cannot be imported by a scoring worker: it is sent
    there pickled by value, and named in the env's verifier id by its qualified name."""
    from trajectories.functions import PASSED

    bonus = 0.25

    def near(answer, task):  # reads a variable of the enclosing test: a real closure
        miss = abs(int(answer) - int(task.target)) if answer.strip().isdigit() else 99
        return {"accuracy": float(miss == 0), "near": bonus * (miss == 1)}

    env = from_dataset(write_jsonl(tmp_path / "t.jsonl", ROWS), reward=near,
                       weights={"accuracy": 1.0, "near": 1.0})
    spec = ("tests.envs.test_datasets:"
            "test_a_function_passed_from_python_is_scored_in_the_worker_by_value.<locals>.near")
    assert PASSED[spec] is near and env.verifier.name == spec
    assert answer_with(env, "5").total == 1.0  # the first task: 2 + 3
    off = answer_with(env, "4")
    assert (off.components, off.total, off.outcome) == (
        {"accuracy": 0.0, "near": 0.25}, 0.25, Outcome.wrong)
    assert answer_with(env, "3").total == 0.0
    lam = from_dataset(write_jsonl(tmp_path / "t.jsonl", ROWS), reward=lambda a, t: 0.5)
    assert answer_with(lam, "anything").total == 0.5
