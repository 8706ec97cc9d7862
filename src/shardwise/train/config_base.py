"""The base of every section of the training YAML (shardwise.train.config)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # A typo must fail loudly, never silently fall back to a default.
    model_config = ConfigDict(extra="forbid")
