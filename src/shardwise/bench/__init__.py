"""Measurement side of shardwise: what engines actually hold, to check the planner against.

Everything here imports torch (and, in the worker, DeepSpeed); `import shardwise` and the
planner stay torch-free, so nothing is imported eagerly from this package.
"""

CATEGORIES: tuple[str, ...] = ("params", "grads", "master_params", "optimizer_states", "other")
"""Census categories in claim order: a storage is counted once, in the first that claims it."""

__all__ = ["CATEGORIES"]
