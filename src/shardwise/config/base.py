"""The two bases of every validated value: `Spec` (frozen, strict, raising ShardwiseError, not
pydantic's error type) and `Section` (a section of the training YAML: an unknown key is an error)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from shardwise.errors import user_error


class Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data):
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise user_error(e, type(self).__name__, model=type(self)) from None


class Section(BaseModel):
    # A typo must fail loudly, never silently fall back to a default.
    model_config = ConfigDict(extra="forbid")
