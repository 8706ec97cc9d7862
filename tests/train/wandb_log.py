"""A reader of W&B's offline run file (`run-<id>.wandb`), for the tracker tests.

wandb 0.31 has no Python reader any more (`wandb.sdk.internal.datastore` went with the Python
backend), so this reads the file's documented container itself: LevelDB's log format
(https://github.com/google/leveldb/blob/main/doc/log_format.md: 32 KiB blocks of records with
a 7-byte header, checksum uint32, length uint16, type uint8: FULL, FIRST, MIDDLE, LAST),
preceded by W&B's 7-byte header (":W&B", magic 0xBEE1, version 0), each record a protobuf
`wandb_internal_pb2.Record` of wandb's own schema. The checksum (CRC-32 of the type byte and the
data, as wandb writes it) is verified: a damaged or misread file fails loudly.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    """Every protobuf Record of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, parts = HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # a block's trailer: too short for a header, zero-filled
            pos += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if (crc, length, kind) == (0, 0, 0):  # zero padding
            pos += room
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        assert len(chunk) == length, f"{path}: record cut at byte {pos}"
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"{path}: bad checksum at {pos}"
        pos += HEADER + length
        if kind == FULL:
            parts = chunk
        elif kind == FIRST:
            parts = chunk
            continue
        elif kind == MIDDLE:
            parts += chunk
            continue
        elif kind == LAST:
            parts += chunk
        else:
            raise AssertionError(f"{path}: record type {kind} at byte {pos}")
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(parts)
        yield rec


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def history(path: Path) -> dict[int, dict]:
    """The run's history rows by step (`_step`): the logged keys with their JSON values; W&B's
    own `_`-keys (step, runtime, timestamp) left out."""
    rows: dict[int, dict] = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") != "history":
            continue
        row = {_key(i): json.loads(i.value_json) for i in rec.history.item}
        step = int(row["_step"])
        assert step not in rows, f"step {step} written twice"
        rows[step] = {k: v for k, v in row.items() if not k.startswith("_")}
    return rows


def config(path: Path) -> dict:
    """The run's config (top-level keys, JSON values): the run record's, then each config
    record's updates in order."""
    out: dict = {}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind in ("run", "config"):
            for i in (rec.run.config if kind == "run" else rec.config).update:
                out[_key(i)] = json.loads(i.value_json)
    return out


def of_type(path: Path, kind: str) -> list:
    """The records of one type (`artifact`, `exit`, `run`, ...)."""
    return [getattr(r, kind) for r in records(path) if r.WhichOneof("record_type") == kind]
