"""Every JSON shardwise writes is strict: non-finite numbers become "NaN"/"Infinity"/"-Infinity"
strings at any depth (docs/training.md, "Strict JSON"), and nothing else changes."""

from __future__ import annotations

import json
import math

import pytest

from shardwise.strict_json import dumps


def _strict(text: str):
    def refuse(name: str):
        raise ValueError(f"bare {name}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_become_strings_at_any_depth():
    doc = {"loss": math.nan, "rows": [{"norm": math.inf}, (-math.inf, 1.5)], "n": 3, "s": "NaN", "none": None}
    assert _strict(dumps(doc, indent=2)) == {"loss": "NaN", "rows": [{"norm": "Infinity"}, ["-Infinity", 1.5]],
                                             "n": 3, "s": "NaN", "none": None}
    assert math.isnan(float(_strict(dumps(math.nan)))) and float(_strict(dumps([math.inf]))[0]) == math.inf


def test_finite_documents_are_written_as_json_writes_them():
    doc = {"a": [1, 2.5, True, None], "b": {"c": "x"}}
    assert dumps(doc, sort_keys=True) == json.dumps(doc, sort_keys=True)


def test_numpy_floats_are_encoded_and_anything_missed_raises_instead_of_writing_invalid_json():
    import numpy as np

    assert _strict(dumps({"x": np.float64("nan")})) == {"x": "NaN"}  # a float subclass
    with pytest.raises(ValueError, match="not JSON compliant"):
        dumps({"x": object()}, default=lambda o: math.nan)  # a NaN made after the encoding ran
