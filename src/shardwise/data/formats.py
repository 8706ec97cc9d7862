"""Record formats (alpaca, chat, ShareGPT, plain text) and file loading with exact locations.

Parquet is read with pyarrow, a row group at a time, after its footer passed the bounds. JSON and JSONL are parsed with the standard
library on purpose: `datasets` 5.2 *segfaults* on a JSONL line that is `null` (found by the
property test; a crash cannot be turned into a user error), its Arrow schema inference
coerces types across records (5 -> 5.0, missing keys -> None) and its errors name no line.
Every record keeps a "file:line" (or "file:row N") location for later errors.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shardwise.config.data import ALL_FIELDS, FORMAT_FIELDS
from shardwise.errors import ShardwiseError, did_you_mean

Format = Literal["auto", "alpaca", "chat", "sharegpt", "text"]
OnError = Literal["raise", "skip"]

# The column whose presence identifies a format in "auto" mode, in priority order.
_MARKERS = (("chat", "messages"), ("sharegpt", "conversations"), ("alpaca", "instruction"), ("text", "text"))
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "model": "assistant"}  # fmt: skip
SUFFIXES = (".json", ".jsonl", ".parquet")
# Deepest container nesting a record may have. SFT records are 3 deep (record -> messages ->
# turn); the limit stops pathological input (a line nested 100k levels deep makes `json`
# raise RecursionError, and anything just under Python's recursion limit would crash the
# first recursive walk of a later stage) with an error naming file and line instead.
MAX_DEPTH = 32
# Half of a UTF-16 pair, which JSON's "\ud800" escapes can spell but no UTF-8 text holds.
_SURROGATE = re.compile("[\ud800-\udfff]")
# Bytes of one record: a JSONL line, a whole JSON array file (parsed whole), a Parquet value.
# A record is held a few times while it is parsed and templated (~4x, docs/data.md "Big
# records"), so 256 MiB keeps preflight near 1 GiB for it; the longest texts people train on
# (a book is ~1 MB, a whole code repository ~100 MB) fit. A longer line is refused after
# reading this much of it, never the whole line.
MAX_RECORD_BYTES = 256 << 20
# Bytes of a Parquet row group, as its footer declares them (uncompressed): pyarrow decodes a
# row group's columns whole. 2 GiB leaves room for the 1M-row groups pyarrow writes by default.
MAX_ROW_GROUP_BYTES = 2 << 30
# Leaf columns of a Parquet schema: an SFT table has a handful (alpaca: four).
MAX_PARQUET_COLUMNS = 4096


@dataclass(frozen=True)
class Example:
    """One validated record: a conversation (chat-like formats) or a text (pre-training)."""

    where: str  # "file:line" for errors
    format: str
    messages: tuple[dict[str, str], ...] = ()
    text: str | None = None

    @property
    def target_field(self) -> str:
        """The user-facing field that holds the targets, for 'no target tokens' errors."""
        return {"alpaca": "output", "chat": "messages", "sharegpt": "conversations"}.get(self.format, "text")


@dataclass
class LoadReport:
    records: int = 0
    skipped: int = 0
    skip_reasons: list[str] = field(default_factory=list)

    def skip(self, exc: ShardwiseError) -> None:
        self.skipped += 1
        if len(self.skip_reasons) < 5:  # keep a few examples for the report, not thousands
            self.skip_reasons.append(str(exc))


# ---------------------------------------------------------------- record validation


def _str(rec: dict[str, Any], col: str, where: str, *, required: bool, label: str | None = None) -> str | None:
    value = rec.get(col)
    label = label or col
    if value is None:
        if required:
            raise ShardwiseError(f"{where}: field '{label}': missing (expected a string).")
        return None
    if not isinstance(value, str):
        raise ShardwiseError(f"{where}: field '{label}': expected a string, got {type(value).__name__}.")
    if (bad := _SURROGATE.search(value)) is not None:  # "\ud800" in JSON: no UTF-8 (the tokenizer raised)
        raise ShardwiseError(f"{where}: field '{label}': a lone surrogate U+{ord(bad.group()):04X} at character "
                             f"{bad.start()} (not a Unicode character; expected UTF-8 text).")  # fmt: skip
    return value


def _turns(rec: dict[str, Any], fmt: str, cols: dict[str, str], where: str) -> tuple[dict[str, str], ...]:
    list_col, role_col, content_col = (cols[f] for f in FORMAT_FIELDS[fmt])
    turns = rec.get(list_col)
    if turns is None:
        raise ShardwiseError(f"{where}: field '{list_col}': missing (expected a list of turns).")
    if not isinstance(turns, list):
        raise ShardwiseError(f"{where}: field '{list_col}': expected a list of turns, got {type(turns).__name__}.")
    if not turns:
        raise ShardwiseError(f"{where}: field '{list_col}': empty conversation (expected at least one turn).")
    out = []
    for i, turn in enumerate(turns):
        label = f"{list_col}[{i}]"
        if not isinstance(turn, dict):
            raise ShardwiseError(f"{where}: field '{label}': expected an object, got {type(turn).__name__}.")
        role = _str(turn, role_col, where, required=True, label=f"{label}.{role_col}")
        if fmt == "sharegpt":
            if role not in SHAREGPT_ROLES:
                raise ShardwiseError(f"{where}: field '{label}.{role_col}': unknown role {role!r}. "
                                     + did_you_mean(str(role), list(SHAREGPT_ROLES)))
            role = SHAREGPT_ROLES[role]
        elif role not in ROLES:
            raise ShardwiseError(f"{where}: field '{label}.{role_col}': unknown role {role!r}. "
                                 + did_you_mean(str(role), list(ROLES)))
        content = _str(turn, content_col, where, required=True, label=f"{label}.{content_col}")
        if role == "assistant" and not content.strip():  # type: ignore[union-attr]
            raise ShardwiseError(f"{where}: field '{label}.{content_col}': empty assistant reply (nothing to learn).")
        out.append({"role": role, "content": content})
    return tuple(out)


def detect_format(rec: dict[str, Any], cols: dict[str, str], where: str) -> str:
    for fmt, marker in _MARKERS:
        if rec.get(cols[marker]) is not None:
            return fmt
    wanted = ", ".join(repr(cols[m]) for _, m in _MARKERS)
    raise ShardwiseError(f"{where}: cannot tell the record format: expected one of the fields {wanted} "
                         f"(got fields {sorted(rec)}); set data.format or data.fields.")


def too_deep(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether `obj` nests dicts/lists more than `limit` levels deep. Iterative on purpose: a
    recursive walk is exactly what a deeply nested record would crash."""
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        children = o.values() if isinstance(o, dict) else o
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def check_depth(rec: Any, where: str) -> None:
    """Refuse a record nested deeper than MAX_DEPTH, naming its top-level field when it has one."""
    if not isinstance(rec, (dict, list)) or not too_deep(rec):
        return
    field = next((k for k, v in rec.items() if isinstance(v, (dict, list)) and too_deep(v, MAX_DEPTH - 1)),
                 None) if isinstance(rec, dict) else None  # fmt: skip
    what = f"field '{field}': " if field is not None else ""
    raise ShardwiseError(f"{where}: {what}nested more than {MAX_DEPTH} levels deep (expected an SFT record: "
                         "strings, and lists of turns with role and content).")


def to_example(rec: Any, fmt: str, fields: dict[str, str], where: str) -> Example:
    """Validate one raw record into an :class:`Example`; raises ShardwiseError naming the field."""
    if not isinstance(rec, dict):
        raise ShardwiseError(f"{where}: expected a JSON object per record, got {type(rec).__name__}.")
    check_depth(rec, where)
    cols = {f: fields.get(f, f) for f in ALL_FIELDS}
    if fmt == "auto":
        fmt = detect_format(rec, cols, where)
    if fmt == "text":
        text = _str(rec, cols["text"], where, required=True)
        if not text.strip():  # type: ignore[union-attr]
            raise ShardwiseError(f"{where}: field '{cols['text']}': empty text (nothing to learn).")
        return Example(where, fmt, text=text)
    if fmt in ("chat", "sharegpt"):
        return Example(where, fmt, messages=_turns(rec, fmt, cols, where))
    instruction = _str(rec, cols["instruction"], where, required=True)
    extra = _str(rec, cols["input"], where, required=False)
    output = _str(rec, cols["output"], where, required=True)
    system = _str(rec, cols["system"], where, required=False)
    if not output.strip():  # type: ignore[union-attr]
        raise ShardwiseError(f"{where}: field '{cols['output']}': empty output (nothing to learn).")
    user = f"{instruction}\n\n{extra}" if extra else instruction
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}, {"role": "assistant", "content": output}]  # fmt: skip
    return Example(where, fmt, messages=tuple(messages))


# ---------------------------------------------------------------- files


def resolve_files(patterns: list[str], *, where: str) -> list[Path]:
    """Expand paths and globs (sorted, so the record order is reproducible)."""
    out: list[Path] = []
    for pattern in patterns:
        p = Path(pattern).expanduser()
        matches = sorted(Path(p.anchor or ".").glob(str(p.relative_to(p.anchor)))) if any(
            c in pattern for c in "*?[") else [p]  # fmt: skip
        if not matches or not all(m.is_file() for m in matches):
            raise ShardwiseError(f"{where}: file {pattern!r} not found (expected a JSON, JSONL or Parquet file).")
        for m in matches:
            if m.suffix.lower() not in SUFFIXES:
                raise ShardwiseError(f"{where}: file {str(m)!r}: unsupported suffix {m.suffix!r} "
                                     f"(expected one of {', '.join(SUFFIXES)}).")
        out.extend(matches)
    return out


class NotJSON(ValueError):
    """A non-standard constant (NaN, Infinity) in a JSON text."""


def _refuse_constant(name: str) -> Any:
    raise NotJSON(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


# The standard library's parser, made strict: NaN and Infinity are refused (NotJSON), not read
# as floats. `STRICT_JSON.decode(text)` is `json.loads(text)` otherwise.
STRICT_JSON = json.JSONDecoder(parse_constant=_refuse_constant)


def _parse_error(where: str, exc: Exception) -> ShardwiseError:
    """The error for a record the parser refused (`where` is "file:line")."""
    if isinstance(exc, json.JSONDecodeError):
        return ShardwiseError(f"{where}: malformed JSON: {exc.msg} at column {exc.colno} "
                              "(expected one JSON object per line, or a JSON array of objects).")
    if isinstance(exc, RecursionError):  # the stdlib parser recurses per level: a line 100k levels deep
        return _too_deep_error(where)
    what = str(exc) if isinstance(exc, NotJSON) else f"a number too long to read ({str(exc).split(':')[0]})"
    return ShardwiseError(f"{where}: malformed JSON: {what} (expected one JSON object per line, or a JSON "
                          "array of objects).")


def _not_utf8(path: Path, data: bytes, start: int, skipped: int = 0, first_line: int = 1) -> ShardwiseError:
    """The error for the undecodable byte `data[start]`: its line, column (1-based, in bytes)
    and offset in the file. `data` is what was decoded (the file after its BOM, or one line),
    `skipped` the bytes of the file before it, `first_line` the line it starts on."""
    line_start = data.rfind(b"\n", 0, start) + 1
    line = first_line + data.count(b"\n", 0, line_start)
    return ShardwiseError(f"{path}:{line}: not UTF-8 text (byte 0x{data[start]:02x} at column "
                          f"{start - line_start + 1}, offset {skipped + start} of the file); expected UTF-8 "
                          "encoded JSON or JSONL.")  # fmt: skip


def _parse_stdlib(path: Path, on_error: OnError, report: LoadReport) -> list[tuple[Any, int]]:
    """(record, line) pairs read with the standard library, with line-exact JSON errors.

    JSONL is read one line at a time: a line costs a few times its own size while it is parsed
    (the bytes, the text, the record), never the whole file's (docs/data.md "Big records")."""
    with path.open("rb") as f:
        head = f.read(1 << 16)
        bom = len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0  # tolerated
        while head and not head[bom:].lstrip():  # only whitespace so far: look further
            more = f.read(1 << 16)
            if not more:
                break
            head = head[:bom] + more
        f.seek(bom)
        if head[bom:].lstrip().startswith(b"["):
            size = path.stat().st_size
            if size > MAX_RECORD_BYTES:
                raise ShardwiseError(f"{path}: a JSON array file of {size} bytes, over the bound of "
                                     f"{MAX_RECORD_BYTES} (a JSON array is parsed whole); write the records "
                                     "as JSONL (one per line), read a line at a time, or split the file.")
            data = f.read()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _not_utf8(path, data, exc.start, bom) from None
            del data
            return _parse_array(path, text)
        return _parse_lines(path, f, bom, on_error, report)


def _parse_lines(path: Path, f: Any, offset: int, on_error: OnError, report: LoadReport) -> list[tuple[Any, int]]:
    """The records of a JSONL file open at `offset` (past any BOM), one line at a time."""
    out = []
    # split on b"\n" only, not splitlines(): JSON strings may hold raw U+2028 and friends.
    lineno = 0
    while raw := f.readline(MAX_RECORD_BYTES + 1):
        lineno += 1
        if len(raw) > MAX_RECORD_BYTES:
            raise ShardwiseError(f"{path}:{lineno}: a line of more than {MAX_RECORD_BYTES} bytes, over the "
                                 "bound on one record (docs/data.md \"Big records\"); split the text into "
                                 "several records.")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _not_utf8(path, raw, exc.start, offset, lineno) from None
        offset += len(raw)
        del raw
        if not line.strip():
            continue
        try:
            out.append((STRICT_JSON.decode(line), lineno))
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, NaN, a 5000-digit integer, 100k deep
            err = _parse_error(f"{path}:{lineno}", exc)
            if on_error == "raise":
                raise err from None
            report.skip(err)
        del line
    return out


def _too_deep_error(where: str) -> ShardwiseError:
    return ShardwiseError(f"{where}: JSON nested too deeply to parse (more than {MAX_DEPTH} levels are "
                          "refused; expected an SFT record: strings, and lists of turns with role and content).")


def _deep_line(text: str, limit: int = MAX_DEPTH) -> int:
    """1-based line where the bracket nesting of `text` first exceeds `limit` (strings skipped);
    only runs on the error path, after the parser gave up without a position."""
    depth = 0
    for m in re.finditer(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > limit:
                return text.count("\n", 0, m.start()) + 1
        elif c in "]}":
            depth -= 1
    return 1


def _parse_array(path: Path, text: str) -> list[tuple[Any, int]]:
    """Elements of a top-level JSON array with the line each one starts on."""
    dec = STRICT_JSON
    try:
        dec.decode(text)  # cheap full check first: the error position is exact
    except json.JSONDecodeError as exc:
        raise ShardwiseError(f"{path}:{exc.lineno}: malformed JSON: {exc.msg} at column {exc.colno}.") from exc
    except RecursionError:
        raise _too_deep_error(f"{path}:{_deep_line(text)}") from None
    except ValueError as exc:  # NaN, Infinity, a 5000-digit integer: no position
        raise _parse_error(str(path), exc) from None
    out, pos = [], text.index("[") + 1
    line, counted = 1, 0  # newlines counted incrementally: linear in the file size
    while True:
        while text[pos] in " \t\r\n,":
            pos += 1
        if text[pos] == "]":
            return out
        obj, end = dec.raw_decode(text, pos)
        line += text.count("\n", counted, pos)
        counted = pos
        out.append((obj, line))
        pos = end


class _Locator:
    """"file:line" (JSON) or "file:row N" (Parquet) of record i."""

    def __init__(self, path: Path, lines: list[int] | None = None):
        self.path, self._lines = path, lines

    def __call__(self, i: int) -> str:
        if self._lines is None:  # Parquet: rows, not lines
            return f"{self.path}:row {i + 1}"
        return f"{self.path}:{self._lines[i]}"


def read_file(path: Path, on_error: OnError, report: LoadReport) -> tuple[list[Any], _Locator]:
    """All raw records of one file, plus their locator."""
    if path.suffix.lower() != ".parquet":
        pairs = _parse_stdlib(path, on_error, report)
        return [rec for rec, _ in pairs], _Locator(path, [line for _, line in pairs])
    return read_parquet(path), _Locator(path)


def read_parquet(path: Path) -> list[Any]:
    """The rows of a Parquet file, one row group at a time, after its footer passed the bounds
    (MAX_PARQUET_COLUMNS, MAX_DEPTH, MAX_ROW_GROUP_BYTES); errors name the file (and row group).
    Read with pyarrow directly: `datasets` would write an Arrow copy into its cache first."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        meta, schema = pf.metadata, pf.schema_arrow
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ShardwiseError(f"{path}: cannot read Parquet: {exc} (expected a complete Parquet file).") from None
    if meta.num_columns > MAX_PARQUET_COLUMNS:
        raise ShardwiseError(f"{path}: a Parquet schema of {meta.num_columns} columns, over the bound of "
                             f"{MAX_PARQUET_COLUMNS} (an SFT table has a handful).")  # fmt: skip
    for fld in schema:
        if _type_depth(fld.type) > MAX_DEPTH:
            raise ShardwiseError(f"{path}: column {fld.name!r}: type nested more than {MAX_DEPTH} levels deep "
                                 "(expected an SFT record: strings, and lists of turns with role and content).")
    rows: list[Any] = []
    for g in range(meta.num_row_groups):
        size = meta.row_group(g).total_byte_size
        if size > MAX_ROW_GROUP_BYTES:
            raise ShardwiseError(f"{path}: row group {g} (rows {len(rows) + 1}-{len(rows) + meta.row_group(g).num_rows})"
                                 f" holds {size} bytes, over the bound of {MAX_ROW_GROUP_BYTES}; rewrite the file "
                                 "with smaller row groups (pyarrow.parquet.write_table(..., row_group_size=...)).")
        try:
            rows.extend(pf.read_row_group(g).to_pylist())
        except (pa.ArrowException, OSError, ValueError, MemoryError) as exc:
            raise ShardwiseError(f"{path}: row group {g} (from row {len(rows) + 1}): cannot read Parquet: "
                                 f"{exc} (expected a complete Parquet file).") from None  # fmt: skip
    return rows


def _type_depth(t: Any) -> int:
    """Nesting depth of an Arrow type (a string: 1; a list of structs of strings: 3)."""
    depth, stack = 0, [(t, 1)]
    while stack:
        t, d = stack.pop()
        depth = max(depth, d)
        stack.extend((t.field(i).type, d + 1) for i in range(getattr(t, "num_fields", 0)))
    return depth


def iter_examples(paths: list[Path], fmt: str, fields: dict[str, str], on_error: OnError,
                  report: LoadReport) -> Iterator[Example]:  # fmt: skip
    """Validated examples from all files in order; invalid ones raise or are counted as skipped."""
    for path in paths:
        records, locate = read_file(path, on_error, report)
        for i, rec in enumerate(records):
            report.records += 1
            try:
                yield to_example(rec, fmt, fields, locate(i))
            except ShardwiseError as exc:
                if on_error == "raise":
                    raise
                report.skip(exc)

