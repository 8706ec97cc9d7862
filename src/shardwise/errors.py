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
