"""The one error type users see.

Every user-facing mistake (bad YAML field, unknown model, impossible layout, a plan that
does not fit) raises :class:`ShardwiseError` with a message naming the file, line or
field, the value given and what was expected. ``assert`` is for programmer errors only.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """What `shardwise train` (launcher and every rank) exits with; documented in docs/training.md."""

    OK = 0
    FAILED = 1  # an unexpected error (traceback printed) or a rank that died
    USER_ERROR = 2  # bad config, data, model or a planned OOM: nothing ran
    NONFINITE = 3  # NaN/Inf loss or grad norm beyond run.nonfinite_patience: nothing exported
    HUNG = 4  # a rank made no progress within run.timeout_s (the watchdog names it)
    NO_SPACE = 74  # a save, the export or a log found the disk full; earlier checkpoints intact (EX_IOERR)
    # SIGTERM/SIGUSR1/SIGINT/SIGHUP: a checkpoint was saved, `--resume latest` continues; or the
    # signal came before any rank started: nothing ran, nothing was written (EX_TEMPFAIL)
    INTERRUPTED = 75


class NonFiniteError(RuntimeError):
    """NaN/Inf: a loss or gradient norm beyond `run.nonfinite_patience`, a run that ended on a
    skipped step, or weights that are not finite where a checkpoint or export would hold them.
    Exits ExitCode.NONFINITE; nothing non-finite is published."""


class OutOfSpaceError(RuntimeError):
    """A save that found the disk (or quota) full: exits ExitCode.NO_SPACE; what was saved before
    is intact and `summary.json` names the path, the bytes needed and the bytes free."""

    def __init__(self, message: str, *, path: str, need_bytes: int, free_bytes: int):
        super().__init__(message)
        self.path, self.need_bytes, self.free_bytes = path, need_bytes, free_bytes


class ShardwiseError(ValueError):
    """A user error: the message says what was wrong and what would be accepted."""


def did_you_mean(value: str, choices: list[str] | tuple[str, ...]) -> str:
    """'unknown X' helper: list the valid choices, closest first."""
    import difflib

    close = difflib.get_close_matches(value, choices, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"Valid choices: {', '.join(sorted(choices))}.{hint}"


def user_error(err: Exception, where: str, *, model: type | None = None, lines: dict[tuple, int] | None = None,
               prefix: tuple[str, ...] = (), header: str | None = None,
               overrides: dict[tuple, str] | None = None) -> ShardwiseError:
    """The one converter from a pydantic ValidationError to a ShardwiseError: one line per
    error naming `where` (with the YAML line when `lines` maps the key path), the dotted field
    (under `prefix`), the value given and what was expected; an unknown field lists the valid
    ones of `model`'s section, closest first. A ShardwiseError raised inside a validator
    already says all that and comes back unchanged. `overrides` maps the key paths a `--set`
    gave to that assignment: an error there (or in the check of a section an override is inside)
    names the override, not the file's line, and a list field says how to write a list."""
    errors = getattr(err, "errors", None)
    if errors is None:
        return ShardwiseError(f"{where}: {err}")
    out = []
    for e in errors():
        inner = (e.get("ctx") or {}).get("error")
        if isinstance(inner, ShardwiseError):
            return inner
        loc = tuple(p for p in e.get("loc", ()) if not (isinstance(p, str) and p.startswith("function-")))
        at, given = where, None
        # a section's own check (loc names the section) failing after a --set inside it names that --set
        inside = [a for k, a in (overrides or {}).items() if loc and len(k) > len(loc) and k[:len(loc)] == loc]
        for n in range(len(loc), 0, -1):
            if overrides and loc[:n] in overrides:
                at, given = f"--set {overrides[loc[:n]]}", overrides[loc[:n]]
                break
            if n == len(loc) and inside:
                at = ", ".join(f"--set {a}" for a in inside)
                break
            if lines and loc[:n] in lines:
                at = f"{where}:{lines[loc[:n]]}"
                break
        dotted = ".".join(str(p) for p in (*prefix, *loc)) or "(top level)"
        if e.get("type") == "extra_forbidden":
            section = _section(model, loc[:-1])
            allowed = [f for f in getattr(section, "model_fields", {}) if f != "source"]
            out.append(f"{at}: unknown field {dotted!r}. {did_you_mean(str(loc[-1]), allowed)}")
            continue
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if given is not None and e.get("type") == "list_type":
            key, _, value = given.partition("=")
            msg += f" (a list on the command line: --set {key}='[{value}]')"
        out.append(f"{at}: field {dotted!r} = {e.get('input')!r}: {msg}")
    if header:
        return ShardwiseError(f"{header}:\n  " + "\n  ".join(out))
    return ShardwiseError("; ".join(out))


def _section(model: type | None, loc: tuple) -> type | None:
    """The pydantic model class at `loc` under `model` (None past a non-model field)."""
    for p in loc:
        field = getattr(model, "model_fields", {}).get(str(p))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and hasattr(ann, "model_fields")):
            return None
        model = ann
    return model
