"""The training YAML's `export:` section (shardwise.train.config's TrainConfig.export): the dtype
and the largest safetensors file of the Hugging Face directory that `checkpointing.save_final`,
`shardwise export` and a LoRA run's merged model write (shardwise.train.export), the size parsed
as Hugging Face parses `max_shard_size`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from shardwise.train.config_base import Section as _Section

# `export.dtype: auto`: the dtype the run computes in (bf16-mixed trains in bf16, so its model is used in bf16).
EXPORT_DTYPE_OF_PRECISION = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp32": "fp32"}
SIZE_UNITS = "units TB, GB, MB, KB: powers of 1000, as Hugging Face's max_shard_size"


def shard_size_bytes(value: int | str) -> int:
    """`export.max_shard_size` in bytes: an int (bytes) or "5GB"/"500MB"/"2.5GB" parsed by
    huggingface_hub's parse_size_to_int, the parser transformers' save_pretrained uses."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        from huggingface_hub.serialization._base import parse_size_to_int

        try:
            n = parse_size_to_int(value)
        except (ValueError, OverflowError):  # "nanGB", "infGB"
            raise ValueError(f"expected bytes (an int) or a size like '5GB' or '500MB' ({SIZE_UNITS}), "
                             f"got {value!r}") from None
    else:
        raise ValueError(f"expected bytes (an int) or a size like '5GB' or '500MB' ({SIZE_UNITS}), "
                         f"got {value!r}")
    if n <= 0:
        raise ValueError(f"expected a size above 0 bytes, got {value!r} ({n} bytes)")
    return n


class ExportSection(_Section):
    """`export:` — the Hugging Face directory written by `checkpointing.save_final`, `shardwise export`
    and a LoRA run's merged model (shardwise.train.export.write_hf)."""

    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="dtype of the exported weights; auto = the run's compute dtype (precision "
        "bf16-mixed: bf16, fp16-mixed: fp16, fp32: fp32); the checkpoint keeps the fp32 master weights")
    max_shard_size: int | str = Field(
        "5GB", description="largest safetensors file: bytes, or a size like '5GB'/'500MB' (TB, GB, MB, KB: "
        "powers of 1000); more weights than this are split into model-0000i-of-0000N.safetensors with a "
        "model.safetensors.index.json; a tensor larger than it gets a file of its own")

    @field_validator("max_shard_size", mode="before")
    @classmethod
    def _size(cls, v: object) -> object:
        shard_size_bytes(v)  # type: ignore[arg-type]  # refuses anything but an int or a size string
        return v

    @property
    def max_shard_bytes(self) -> int:
        return shard_size_bytes(self.max_shard_size)
