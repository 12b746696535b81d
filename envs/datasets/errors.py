"""The two errors of Dataset-v0: a dataset or argument that cannot become tasks, and a user
reward function that returned something other than a score."""

from __future__ import annotations


class DatasetError(ValueError):
    """A dataset that cannot become tasks: the message names the file, row and column, or
    the keyword argument (``key``) that is wrong."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class RewardReturnError(TypeError):
    """A user reward function returned something that is not a score: a bug in the function,
    raised (never scored), the message naming the function and the value."""
