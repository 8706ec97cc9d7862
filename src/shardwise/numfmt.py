"""Numbers as the CLI prints them: rates with significant digits, so a slow rate never reads "0"."""

from __future__ import annotations


def rate(x: float) -> str:
    """A throughput (tokens/s, params/s): thousands grouped from 100 up (`3,204`), three
    significant digits below (`42.5`, `0.0123`), so a CPU's rate is never printed as `0`."""
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    if abs(x) >= 99.95:
        return f"{x:,.0f}"
    return f"{x:.3g}"
