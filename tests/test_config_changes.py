"""config_differences: the dotted keys that differ between a saved config and a resume's, as JSON sees values."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verbatim.harness.config_changes import config_differences


@pytest.mark.parametrize("saved,now,expected", [
    ({}, {}, []),
    ({"lr": 1e-5}, {"lr": 1e-5}, []),
    ({"lr": 1e-5}, {"lr": 2e-5}, ["lr: 1e-05 -> 2e-05"]),
    ({"correction": {"token_tis_cap": 2.0}}, {"correction": {"token_tis_cap": None}},
     ["correction.token_tis_cap: 2.0 -> None"]),
    ({"lr": 1e-5, "correction": {"token_tis_cap": 2.0, "mode": "tis"}},
     {"lr": 2e-5, "correction": {"token_tis_cap": None, "mode": "tis"}},
     ["correction.token_tis_cap: 2.0 -> None", "lr: 1e-05 -> 2e-05"]),
    ({"seed": 1}, {}, ["seed: 1 -> (missing)"]),
    ({}, {"seed": 1}, ["seed: (missing) -> 1"]),
    ({"x": None}, {}, ["x: None -> (missing)"]),
    ({"model": "a"}, {"model": "b"}, ["model: 'a' -> 'b'"]),
    ({"model": "1"}, {"model": 1}, ["model: '1' -> 1"]),
    ({"flag": True}, {"flag": 1}, ["flag: True -> 1"]),
    ({"n": 1}, {"n": 1.0}, []),
    ({"nan": float("nan")}, {"nan": float("nan")}, []),
    ({"sizes": [1, 2]}, {"sizes": (1, 2)}, []),  # a saved config went through JSON: tuples come back as lists
    ({"sizes": [1, 2]}, {"sizes": [1, 3]}, ["sizes: [1, 2] -> [1, 3]"]),
    ({"a": {"b": 1}}, {"a": 2}, ["a: (missing) -> 2", "a.b: 1 -> (missing)"]),
    ({"a": {}}, {"a": {}}, []),
    ({"a": {}}, {}, ["a: {} -> (missing)"]),
    ({"a": {}}, {"a": {"b": 1}}, ["a.b: (missing) -> 1"]),  # not also "a: {} -> (missing)": a is there
    ({"a": {"b": 1}}, {"a": {}}, ["a.b: 1 -> (missing)"]),
    ({"a": {"b": {"c": 1, "d": 2}}}, {"a": {"b": {"c": 1, "d": 3}}}, ["a.b.d: 2 -> 3"]),
])
def test_config_differences(saved, now, expected):
    assert config_differences(saved, now) == expected


configs = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=3),
                       lambda inner: st.dictionaries(st.text("abc", min_size=1, max_size=2), inner, max_size=3),
                       max_leaves=8)
config_maps = st.dictionaries(st.text("abc", min_size=1, max_size=2), configs, max_size=4)


@settings(deadline=None)  # pure and fast, but a shared CPU can stall one example past 200 ms
@given(config_maps, config_maps)
def test_config_differences_is_symmetric_and_empty_only_for_equal_configs(a, b):
    forward, backward = config_differences(a, b), config_differences(b, a)
    assert config_differences(a, a) == []
    assert len(forward) == len(backward)
    assert [line.split(": ")[0] for line in forward] == [line.split(": ")[0] for line in backward]
    assert forward == sorted(forward, key=lambda line: line.split(": ")[0])
    assert (forward == []) == _same_config(a, b)


def _same_config(a, b) -> bool:
    """The equality config_differences means, written plainly: True is not 1, 1 is 1.0, dicts by their items."""
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_config(a[k], b[k]) for k in a)
    return a == b
