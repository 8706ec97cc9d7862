"""The number types of the configs users write (the training YAML and its `--set` overrides,
the data section): what a field of each type accepts, refused while the config is validated,
before any rank starts.

- `Int`: an integer and nothing that converts to one (`true`, `2.0`, `'5'` are refused), within
  ±MAX_COUNT; the field's own bounds (`gt=0`, `le=...`) apply on top.
- `Finite`: a finite number (no NaN or ±Inf, no boolean); YAML 1.1 reads `1e-4` as a string,
  so a numeric string is read as the number it spells.
- `Seed`: an integer in SEED_RANGE.
- `NonBlank`: a string that is not empty or only spaces (a path field set to '' would mean
  the working directory).
- `bounded(...)`: a bound on a number with the reason in the error message.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, Strict

from shardwise.errors import ShardwiseError

# Bytes per element of the dtypes a run computes in, keeps its weights in or reduces gradients in.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# JSON numbers (metrics.jsonl, summary.json, the trackers) hold integers exactly up to 2**53;
# no count of steps, samples or bytes a run uses comes near it.
MAX_COUNT = 2**53
# numpy.random.seed's range: each rank seeds Python's random, torch and numpy with run.seed and
# the data order with the data seed (numpy's SeedSequence refuses a negative one).
SEED_RANGE = (0, 2**32 - 1)


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
    return value


def _count_range(value: int) -> int:
    if abs(value) > MAX_COUNT:
        raise ValueError(f"expected an integer of at most 2**53 = {MAX_COUNT} in size (the largest JSON holds "
                         "exactly; far above any run)")
    return value


def _seed_range(value: int) -> int:
    lo, hi = SEED_RANGE
    if not lo <= value <= hi:
        raise ValueError(f"expected a seed from {lo} to {hi} (2**32 - 1, numpy's seed range; every rank seeds "
                         "torch, numpy and the data order with it)")
    return value


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("expected a non-empty string (an empty path would mean the working directory; "
                         "write '.' for that)")
    return value


Int = Annotated[int, Strict(), AfterValidator(_count_range)]
Finite = Annotated[float, BeforeValidator(_not_bool), Field(allow_inf_nan=False)]
Seed = Annotated[int, Strict(), AfterValidator(_seed_range)]
NonBlank = Annotated[str, AfterValidator(_not_blank)]


def bounded(*, gt: float | None = None, ge: float | None = None, lt: float | None = None,
            le: float | None = None, why: str) -> AfterValidator:
    """A check of a number's bounds whose error states the interval and `why` (the reason)."""
    lo = f"above {gt:g}" if gt is not None else f"at least {ge:g}" if ge is not None else ""
    hi = f"below {lt:g}" if lt is not None else f"at most {le:g}" if le is not None else ""

    def check(value: float) -> float:
        ok = not math.isnan(value) and (gt is None or value > gt) and (ge is None or value >= ge) and (
            lt is None or value < lt) and (le is None or value <= le)
        if not ok:
            raise ValueError(f"expected a number {' and '.join(x for x in (lo, hi) if x)} ({why})")
        return value

    return AfterValidator(check)


# --- a command-line flag's number (the flag named in the error)


def check_number(flag: str, value, *, low: float = 0.0, high: float | None = None, unit: str = "",
                 hint: str = "") -> float:
    """`value` of command-line `flag` if it is a finite number in (low, high]; else the
    ShardwiseError naming the flag, the value and the expected range."""
    rng = f"> {low:g}" + (f" and at most {high:g}" if high is not None else "")
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > low
    if not ok or (high is not None and value > high):
        shown = f"{value:g}" if isinstance(value, float) else repr(value)
        raise ShardwiseError(f"{flag} {shown}: expected a finite number{unit} {rng}{hint}")
    return value


def check_count(flag: str, value, *, high: int | None = None, hint: str = "") -> int:
    """`value` of `flag` if it is a whole number in 1..high; else the ShardwiseError naming the flag."""
    ok = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())
    if not ok or value < 1 or (high is not None and value > high):
        rng = f"1..{high:,}" if high is not None else "at least 1"
        raise ShardwiseError(f"{flag} {value!r}: expected a whole number {rng}{hint}")
    return int(value)
