"""Base of every spec: frozen, strict, and raising ShardwiseError (not pydantic's error type)."""

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
