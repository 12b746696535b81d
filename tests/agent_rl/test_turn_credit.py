"""Turn-level credit (``turn_discount``) from the group baseline to the loss: advantages per
assistant turn by hand, each generated token carrying its turn's, and the ``[B, T]`` tensor
that reaches ``grpo.policy_loss``; session-level credit keeps its ``[B]`` path unchanged."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from agent_rl.policies.models import tiny_model
from agent_rl.policies.render import micro_batches, pack, share_prefixes
from agent_rl.run.contract import ContractError, ExperimentContract
from agent_rl.training import grpo, update
from agent_rl.training.rollout import build_sequences, session_advantages
from agent_rl.training.shared import device_batch
from agent_rl.training.update import advantage_rows, micro_batch_loss
from tests.agent_rl.test_rollout import sampled
from trajectories import Boundary, Episode, Outcome, RewardBreakdown, Session, Turn

EPS = 1e-6
TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"
TURN = {"assigner": "turn_discount", "assigner_params": {"gamma": 0.5},
        "session_weighting": "per_episode", "std": "population", "scale": "group", "eps": EPS}
TEXTS = ("The answer is 4", "no, 42.", "It is 42.")  # the episode's 3 assistant turns in order


def episode(tok, episode_id: str, reward: float) -> Episode:
    """2 sessions, 3 assistant turns along the path: the root's two, then the compression's one."""
    root = Session(session_id=f"{episode_id}/root", episode_id=episode_id, origin="root",
                   turns=[Turn(role="user", content="What is 12 + 30?"), sampled(tok, TEXTS[0]),
                          Turn(role="user", content="Check it."), sampled(tok, TEXTS[1])])
    boundary = Boundary.compression(root.messages(), [{"role": "user", "content": "task\n42"}], "42")
    follow = Session(session_id=f"{episode_id}/next", episode_id=episode_id, origin="compression",
                     parent_id=root.session_id, boundary=boundary,
                     turns=[Turn(role="user", content="task\n42"), sampled(tok, TEXTS[2])])
    outcome = Outcome.correct if reward >= 1.0 else Outcome.wrong
    return Episode(episode_id=episode_id, env_id="agent_rl/Hand-v0", env_version=0, task_id="t",
                   group_id="g", sessions=[root, follow], final_session_id=follow.session_id,
                   reward=RewardBreakdown.from_components({"accuracy": reward}, {"accuracy": 1.0}, outcome,
                                                          "hand@1"), filter={"kept": True})


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(seed=0)


def test_group_advantages_per_turn_by_hand(tiny):
    _, tok = tiny
    values = session_advantages([episode(tok, "a", 1.0), episode(tok, "b", 0.0)], "turn_discount",
                                {"gamma": 0.5}, eps=EPS)
    # credits: a (0.25, 0.5) and (1.0,); b all 0. Baseline over the 2 episode rewards [1, 0]:
    # mean 0.5, population std 0.5, so A = (credit - 0.5) / (0.5 + eps).
    s = 0.5 + EPS
    assert values["a", "a/root"] == pytest.approx((-0.25 / s, 0.0), abs=1e-12)
    assert values["a", "a/next"] == pytest.approx((0.5 / s,), abs=1e-12)
    assert values["b", "b/root"] == pytest.approx((-0.5 / s, -0.5 / s), abs=1e-12)
    assert values["b", "b/next"] == pytest.approx((-0.5 / s,), abs=1e-12)


def test_a_zero_contrast_group_gives_zero_to_every_turn(tiny):
    _, tok = tiny
    values = session_advantages([episode(tok, "a", 1.0), episode(tok, "b", 1.0)], "turn_discount",
                                {"gamma": 0.5}, eps=EPS)
    assert values["a", "a/root"] == (0.0, 0.0) and values["b", "b/next"] == (0.0,)


def hand_rows(tok, advantages: dict[str, tuple[float, ...]], order: list[str], width: int) -> torch.Tensor:
    """[B, width]: each session's turn values repeated over its generated tokens, zero padded."""
    lengths = {"root": [len(sampled(tok, TEXTS[0]).token_ids), len(sampled(tok, TEXTS[1]).token_ids)],
               "next": [len(sampled(tok, TEXTS[2]).token_ids)]}
    rows = torch.zeros(len(order), width)
    for b, sid in enumerate(order):
        values = [v for v, n in zip(advantages[sid], lengths[sid.split("/")[1]], strict=True)
                  for _ in range(n)]
        rows[b, :len(values)] = torch.tensor(values)
    return rows


def test_every_generated_token_takes_its_turns_advantage(tiny):
    _, tok = tiny
    sequences, _ = build_sequences(tok, [episode(tok, "a", 1.0), episode(tok, "b", 0.0)], **TURN)
    s = 0.5 + EPS
    expected = {"a/root": (-0.25 / s, 0.0), "a/next": (0.5 / s,),
                "b/root": (-0.5 / s, -0.5 / s), "b/next": (-0.5 / s,)}
    order = [q.session_id for q in sequences]
    width = max(q.rendered.num_trained for q in sequences)
    rows = hand_rows(tok, expected, order, width)
    for b, q in enumerate(sequences):
        assert q.advantage.shape == (q.rendered.num_trained,)
        assert torch.allclose(q.advantage, rows[b, :q.rendered.num_trained])
    assert torch.allclose(advantage_rows([q.advantage for q in sequences], width), rows)


def test_session_credit_keeps_one_float_and_the_same_batch_tensor(tiny):
    _, tok = tiny
    sequences, _ = build_sequences(tok, [episode(tok, "a", 1.0), episode(tok, "b", 0.0)],
                                   **{**TURN, "assigner": "broadcast", "assigner_params": {}})
    advantages = [q.advantage for q in sequences]
    assert all(type(a) is float for a in advantages)
    s = 0.5 + EPS
    assert advantages == pytest.approx([0.5 / s, 0.5 / s, -0.5 / s, -0.5 / s], abs=1e-12)
    rows = advantage_rows(advantages, width=7)
    old = torch.tensor(advantages)  # what update.py batched before per-turn credit
    assert rows.shape == (4,) and rows.dtype == old.dtype and torch.equal(rows, old)


def test_the_per_token_advantages_reach_the_loss(tiny, monkeypatch):
    model, tok = tiny
    sequences, _ = build_sequences(tok, [episode(tok, "a", 1.0), episode(tok, "b", 0.0)], **TURN)
    contract = ExperimentContract.from_yaml(TINY, ["credit.assigner=turn_discount",
                                                   "credit.params={gamma: 0.5}"])
    rendered = [q.rendered for q in sequences]
    micro = micro_batches(pack(share_prefixes(rendered)), 10 ** 6)
    assert len(micro) == 1
    members = [k for rows in micro[0] for row in rows for k in row.members]
    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return grpo.policy_loss(*args, **kwargs)

    monkeypatch.setattr(update, "policy_loss", spy)
    batch = device_batch(micro[0], rendered, tok.pad_token_id, torch.device("cpu"))
    loss, _ = micro_batch_loss(model, None, sequences, batch, members, 0, {}, contract)
    (logprobs, old, advantages, mask), kwargs = calls[0]
    s = 0.5 + EPS
    expected = {"a/root": (-0.25 / s, 0.0), "a/next": (0.5 / s,),
                "b/root": (-0.5 / s, -0.5 / s), "b/next": (-0.5 / s,)}
    rows = hand_rows(tok, expected, [sequences[k].session_id for k in members], logprobs.shape[1])
    assert advantages.shape == logprobs.shape and torch.allclose(advantages, rows)
    by_hand, _ = grpo.policy_loss(logprobs, old, rows, mask, **kwargs)
    assert torch.isfinite(loss) and torch.allclose(loss, by_hand)
    # at ratio 1 each token's gradient is its own advantage's, not its row's mean
    per_session = advantages.sum(1) / mask.sum(1)  # [B] the mean over each row's tokens
    lp = logprobs.detach().requires_grad_()

    def gradient(a: torch.Tensor) -> torch.Tensor:
        loss = grpo.policy_loss(lp, lp.detach(), a, mask, **kwargs)[0]
        return torch.autograd.grad(loss, lp)[0]  # [B, T]

    assert not torch.allclose(gradient(rows), gradient(per_session), atol=0.0)


def test_the_contract_takes_turn_discount_and_names_a_bad_gamma():
    contract = ExperimentContract.from_yaml(TINY, ["credit.assigner=turn_discount",
                                                   "credit.params={gamma: 0.5}"])
    assert (contract.credit.assigner, contract.credit.params) == ("turn_discount", {"gamma": 0.5})
    with pytest.raises(ContractError, match=r"credit\.params: assigner 'turn_discount' refuses "
                                            r"\{'gamma': 0\}: .*gamma must be in \(0, 1\]"):
        ExperimentContract.from_yaml(TINY, ["credit.assigner=turn_discount", "credit.params={gamma: 0}"])


@pytest.mark.slow
def test_a_tiny_run_trains_with_turn_discount(tmp_path):
    from tests.agent_rl.test_cli import train_tiny

    run_dir = tmp_path / "turn"
    result = train_tiny(run_dir, "credit.assigner=turn_discount", "credit.params={gamma: 0.5}")
    assert result.returncode == 0, result.stderr
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["train/tokens"] > 0 and math.isfinite(m["loss/policy"]) for m in steps)


def test_a_mixed_micro_batch_lays_out_one_row_per_sequence():
    rows = advantage_rows([0.5, torch.tensor([1.0, -1.0]), 2], width=3)
    assert rows.tolist() == [[0.5, 0.5, 0.5], [1.0, -1.0, 0.0], [2.0, 2.0, 2.0]]
