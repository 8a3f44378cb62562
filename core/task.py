"""What a run computes: generation, or one of the pooling tasks (`pooling_params.py` says what each returns). Pure
Python. The one place a task is told apart by its name: everything else asks the value (`task.pools`,
`task is Task.EMBED`).
"""

from __future__ import annotations

from enum import Enum


class Task(str, Enum):
    """A task; a str (its name) wherever it is written: the manifest, the summary's JSON, a message."""

    AUTO = "auto"  # a batch line's url, else what the checkpoint is for (`Run` resolves it before the run opens)
    GENERATE = "generate"
    EMBED = "embed"
    CLASSIFY = "classify"
    SCORE = "score"
    RERANK = "rerank"
    REWARD = "reward"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def pools(self) -> bool:
        """A pooling task: the model's hidden states pooled into a vector, a score or labels, no tokens generated."""
        return self not in (Task.AUTO, Task.GENERATE)

    @property
    def pairs(self) -> bool:
        """Its inputs are pairs of texts (a query and a document)."""
        return self in (Task.SCORE, Task.RERANK)

    @property
    def labels(self) -> bool:
        """It reads a classifier head's outputs (one per label; a reward model's single one)."""
        return self in (Task.CLASSIFY, Task.REWARD)


TASKS = tuple(task.value for task in Task)
POOLING_TASKS = tuple(task.value for task in Task if task.pools)
