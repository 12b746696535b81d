"""trajectories.hashing: one canonical JSON, one hash, used by every place that hashes data."""

from __future__ import annotations

import hashlib
import json
import math

import pytest

from trajectories import testing
from trajectories.hashing import canonical_hash, canonical_json


def test_canonical_json_by_hand():
    assert canonical_json({"b": [1, 2.5], "a": "é"}) == '{"a":"é","b":[1,2.5]}'
    assert canonical_hash({"b": 1, "a": 2}) == canonical_hash({"a": 2, "b": 1})
    assert canonical_hash({"a": 1}) == hashlib.sha256(b'{"a":1}').hexdigest()
    with pytest.raises(ValueError):
        canonical_json({"x": math.nan})


def test_every_hashed_record_uses_it(tmp_path):
    import torch

    from agent_rl.run import checkpoint
    from agent_rl.run.contract import ExperimentContract
    from envs.core import TaskSpec
    from evals.splits import sealed_eval_set
    from trajectories import messages_hash

    episode = testing.episode([testing.session("r")])
    assert episode.content_hash == canonical_hash(episode.model_dump(mode="json",
                                                                     exclude={"content_hash"}))
    messages = [{"role": "user", "content": "ü"}]
    assert messages_hash(messages) == canonical_hash(messages)
    contract = ExperimentContract()
    assert contract.contract_hash() == canonical_hash(contract.hashed_fields())
    sealed = sealed_eval_set([TaskSpec(task_id="t", prompt="p")])
    assert sealed.manifest_hash == canonical_hash(sorted(sealed.manifest.items()))
    assert sealed.manifest["t"]["spec"] == canonical_hash(sealed.tasks[0].model_dump(mode="json"))
    # (the canary's live-store hash is checked against canonical_hash in tests/evals/test_canary.py)
    model = torch.nn.Linear(2, 2)
    bundle = checkpoint.save_bundle(tmp_path, 1, model=model, meta={"step": 1})
    manifest = json.loads((bundle / "MANIFEST.json").read_text())
    assert checkpoint.bundle_hash(bundle) == canonical_hash(manifest)
    assert (bundle / "COMPLETE").read_text().strip() == canonical_hash(manifest)
