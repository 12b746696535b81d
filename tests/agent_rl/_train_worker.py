"""Worker for test_train.py's multi-rank tests: `train.run` on a contract, as a launcher's
rank runs it (tests/Digits-v0 registered first, as the test process registers it).

    python -m torch.distributed.run --nproc-per-node 2 ... _train_worker.py CONTRACT.json [resume]
"""

from __future__ import annotations

import faulthandler
import json
import logging
import sys
import warnings
from pathlib import Path

from agent_rl.run.contract import ExperimentContract
from agent_rl.run.distributed import end_launched_rank
from agent_rl.training import train
from tests.agent_rl import toy_env

if __name__ == "__main__":
    faulthandler.enable()  # a rank that aborts prints where each thread was (test output)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed renames
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    toy_env.register()
    contract = ExperimentContract.from_dict(json.loads(Path(sys.argv[1]).read_text()))
    train.run(contract, resume=sys.argv[2:] == ["resume"], progress=False)
    end_launched_rank(0)  # as `agent-rl train` ends a launched rank
