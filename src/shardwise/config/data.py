"""The data section: where the SFT data is, what format it has and how it becomes training rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shardwise.config.fields import Finite, Int, Seed
from shardwise.errors import did_you_mean, user_error

# Canonical field names per format; DataConfig.fields maps them to the user's column names.
FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "alpaca": ("instruction", "input", "output", "system"),
    "chat": ("messages", "role", "content"),
    "sharegpt": ("conversations", "from", "value"),
    "text": ("text",),
}
ALL_FIELDS = tuple(sorted({f for fs in FORMAT_FIELDS.values() for f in fs}))
Truncation = Literal["keep_start", "cut_prompt", "drop", "raise"]

# Longest sample / packed row accepted (docs/data.md): 1M tokens, above every published context
# window; a typo such as 1e9 packs a whole dataset into one row that no rank can share.
MAX_LENGTH_CAP = 1 << 20


class DataConfig(BaseModel):
    """The `data:` section. Unknown keys are errors (a typo must not silently use a default)."""

    model_config = ConfigDict(extra="forbid")

    train_files: list[str] = Field(min_length=1, description="JSON/JSONL/Parquet paths or globs.")
    validation_files: list[str] = Field(default_factory=list, description="Validation split by file.")
    validation_fraction: Finite = Field(0.0, ge=0.0, lt=1.0, description="Or: split this fraction off train.")
    format: Literal["auto", "alpaca", "chat", "sharegpt", "text"] = "auto"
    fields: dict[str, str] = Field(default_factory=dict, description="Canonical field -> your column name.")
    max_length: Int = Field(2048, ge=8, le=MAX_LENGTH_CAP,
                            description=f"Tokens per sample and per packed row (8 to {MAX_LENGTH_CAP:,}).")
    truncation: Truncation = "keep_start"
    train_on_prompt: bool = False
    add_eos: bool = True
    packing: bool = True
    on_error: Literal["raise", "skip"] = "raise"
    chat_template: str | None = Field(None, description="Jinja template overriding the tokenizer's.")
    seed: Seed = 0

    @field_validator("fields")
    @classmethod
    def _known_fields(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if key not in ALL_FIELDS:
                raise ValueError(f"unknown canonical field {key!r}. {did_you_mean(key, ALL_FIELDS)}")
        return v

    @model_validator(mode="after")
    def _one_split_rule(self) -> DataConfig:
        if self.validation_files and self.validation_fraction > 0:
            raise ValueError("set validation_files or validation_fraction, not both")
        return self


def load_data_config(raw: Mapping[str, Any], *, source: str = "<data config>") -> DataConfig:
    """Validate a mapping into DataConfig; pydantic errors become ShardwiseError naming the field."""
    try:
        return DataConfig.model_validate(dict(raw))
    except ValidationError as exc:
        raise user_error(exc, source, model=DataConfig, prefix=("data",)) from None
