"""Fuzz of the training YAML's validation (shardwise.config.schema): every field of the schema
given generated values (numbers of every size and sign, NaN, ±Inf, booleans, strings, lists,
mappings, null), and generated `--set` assignments. Each either validates, or is one
ShardwiseError naming the field (or the `--set`); never another exception. Hypothesis with a
fixed seed (derandomize=True)."""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from shardwise.config.load import load_config, validate
from shardwise.config.schema import TrainConfig
from shardwise.errors import ShardwiseError

# a fixed seed (derandomize), no example database: every CI run tries the same cases
FUZZ = settings(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "fsdp-synthetic-cpu.yaml"


def leaves(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Key paths of every field of the schema that is not a section."""
    out = []
    for name, f in model.model_fields.items():
        if name == "source":
            continue
        ann = f.annotation
        args = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)
        sub = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        out += leaves(sub[0], (*prefix, name)) if sub else [(*prefix, name)]
    return out


FIELDS = leaves(TrainConfig)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, 1, -1, 2**53, 2**53 + 1, 2**64, 1e-9, 1e300]),
    st.text(max_size=12), st.sampled_from(["", " ", "1e-4", "nan", "inf", "auto", "true", "0x10", "1_000"]),
)  # fmt: skip
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=6)  # fmt: skip


def nest(path: tuple[str, ...], value) -> dict:
    raw: dict = {}
    node = raw
    for p in path[:-1]:
        node = node.setdefault(p, {})
    node[path[-1]] = value
    return raw


@settings(FUZZ, max_examples=400)
@given(field=st.sampled_from(FIELDS), value=VALUES)
def test_any_value_of_any_field_validates_or_names_the_field(field, value):
    """400 cases in CI (fixed seed): a field of the schema and a generated value."""
    try:
        cfg = validate(nest(field, value), "fuzz.yaml")
    except ShardwiseError as e:
        msg = str(e)
        # the field, or the section whose own check it failed (model: a name or a path)
        assert any(f"'{'.'.join(field[:n])}" in msg for n in range(1, len(field) + 1)) or "unknown field" in msg, msg
        return
    # what was accepted is what the ranks may use: numbers finite, counts integers
    got = cfg
    for p in field:
        got = getattr(got, p)
    for x in (got if isinstance(got, tuple | list) else [got]):
        assert not (isinstance(x, float) and not math.isfinite(x)), (field, value, got)


ASSIGNMENT = st.one_of(
    st.text(alphabet="run.stepsd=[]{}'\" 1e-9.,:#&*!|>-", max_size=24),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from([".".join(f) for f in FIELDS] + ["run..steps", ".run", "run.",
                                                                                        "", "run.steps.x"]),
              st.text(max_size=10)),
)  # fmt: skip


@settings(FUZZ, max_examples=300)
@given(assignment=ASSIGNMENT)
def test_any_set_assignment_loads_or_is_one_error_naming_it(assignment):
    """300 cases in CI (fixed seed): generated `--set` strings (keys of the schema, empty parts,
    YAML punctuation in values) over the shipped example."""
    try:
        load_config(CONFIG, [assignment])
    except ShardwiseError as e:
        assert "--set" in str(e) or "placeholder" in str(e), str(e)
