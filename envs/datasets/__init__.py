"""Dataset-v0: your own question-answer tasks from a JSONL, CSV or ``datasets`` folder.

``env.py`` holds the environment and its description (formats, columns, rewards, bad data);
the rest, in the order a dataset meets it:

    files         the rows read from a .jsonl/.csv file or a datasets folder, bad ones named
    rewards       the built-in rewards (pure functions of reply and target) and their Verifier
    user_rewards  a "module:function" reward: loaded, its source pinned, its return read
    tasks         each row as a TaskSpec (prompt, target, metadata, id, reference reply)
    errors        DatasetError, RewardReturnError
    env           ``DatasetEnv``, registered as ``agent_rl/Dataset-v0``; ``from_dataset``
"""

from envs.datasets.env import DEFAULT_PATH, DatasetEnv, check_arguments, from_dataset
from envs.datasets.errors import DatasetError, RewardReturnError
from envs.datasets.rewards import (
    REWARDS,
    Verifier,
    built_in,
    choice_reward,
    contains_reward,
    exact_reward,
    normalize,
    read_choice,
    regex_reward,
)
from envs.datasets.user_rewards import (
    load_reward_function,
    reply_components,
    reward_source,
    user_components,
)
from envs.scoring import RewardFaultWarning, numeric_reward

__all__ = [
    "DEFAULT_PATH",
    "REWARDS",
    "DatasetEnv",
    "DatasetError",
    "RewardFaultWarning",
    "RewardReturnError",
    "Verifier",
    "built_in",
    "check_arguments",
    "choice_reward",
    "contains_reward",
    "exact_reward",
    "from_dataset",
    "load_reward_function",
    "normalize",
    "numeric_reward",
    "read_choice",
    "regex_reward",
    "reply_components",
    "reward_source",
    "user_components",
]
