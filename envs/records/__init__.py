"""Records-v0 and LongRecords-v0: a tool agent over an in-memory record store."""

from envs.records.env import LongRecordsEnv, RecordsEnv, records_reward

__all__ = ["LongRecordsEnv", "RecordsEnv", "records_reward"]
