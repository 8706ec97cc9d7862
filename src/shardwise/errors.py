"""The one error type users see.

Every user-facing mistake (bad YAML field, unknown model, impossible layout, a plan that
does not fit) raises :class:`ShardwiseError` with a message naming the file, line or
field, the value given and what was expected. ``assert`` is for programmer errors only.
"""

from __future__ import annotations


class ShardwiseError(ValueError):
    """A user error: the message says what was wrong and what would be accepted."""


def did_you_mean(value: str, choices: list[str] | tuple[str, ...]) -> str:
    """'unknown X' helper: list the valid choices, closest first."""
    import difflib

    close = difflib.get_close_matches(value, choices, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"Valid choices: {', '.join(sorted(choices))}.{hint}"


def user_error(err: Exception, where: str) -> ShardwiseError:
    """Turn a pydantic ValidationError into a ShardwiseError naming each field, the value given
    and what was expected; a ShardwiseError raised inside a validator comes back unchanged."""
    errors = getattr(err, "errors", None)
    if errors is None:
        return ShardwiseError(f"{where}: {err}")
    lines = []
    for e in errors():
        inner = (e.get("ctx") or {}).get("error")
        if isinstance(inner, ShardwiseError):
            return inner
        field = ".".join(str(p) for p in e.get("loc", ())) or "(root)"
        msg = e.get("msg", "invalid")
        if e.get("type") == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{field}: {msg} (got {e.get('input')!r})")
    return ShardwiseError(f"{where}: " + "; ".join(lines))
