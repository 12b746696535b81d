"""Gymnasium-style tool environments that emit session trees (`trajectories.Episode`).

Imports only `trajectories`. Built-in environments register on import.
"""

from envs.core import TaskMeta, TaskSpec, ToolEnv, tool
from envs.datasets import from_dataset
from envs.registry import accepted_kwargs, list_envs, make, register
from envs.sessions import (
    Return,
    SessionRecorder,
    Spawn,
    Summary,
    approx_token_count,
    used_by_data_flow,
)
from envs.spaces import ChatSpace, TextSpace
from envs.tools import (
    HermesParser,
    ParseError,
    PermissionDenied,
    ToolCall,
    ToolCallParser,
    ToolError,
)

register("agent_rl/Arithmetic-v0", "envs.arithmetic:ArithmeticEnv")
register("agent_rl/Records-v0", "envs.records.env:RecordsEnv")
register("agent_rl/LongRecords-v0", "envs.records.env:LongRecordsEnv")
register("agent_rl/PIIMask-v0", "envs.piimask:PIIMaskEnv")
register("agent_rl/Relay-v0", "envs.relay:RelayEnv")
register("agent_rl/CodeTests-v0", "envs.codetests.env:CodeTestsEnv")
register("agent_rl/Dataset-v0", "envs.datasets.env:DatasetEnv")
register("agent_rl/Agent-v0", "envs.agent_env:AgentEnv")
register("agent_rl/Candidates-v0", "envs.candidates:CandidatesEnv")

__all__ = [
    "accepted_kwargs",
    "ChatSpace",
    "HermesParser",
    "ParseError",
    "PermissionDenied",
    "Return",
    "SessionRecorder",
    "Spawn",
    "Summary",
    "TaskMeta",
    "TaskSpec",
    "TextSpace",
    "ToolCall",
    "ToolCallParser",
    "ToolEnv",
    "ToolError",
    "approx_token_count",
    "from_dataset",
    "list_envs",
    "make",
    "register",
    "tool",
    "used_by_data_flow",
]
