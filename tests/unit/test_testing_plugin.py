"""onceflow.testing's comparison: multisets, with duplicates and missing records named by key."""

from __future__ import annotations

import pytest

from onceflow.testing import DeadLetter, assert_published, multiset

A = {"key": "a", "window_start": 0, "clicks": 2}
B = {"key": "b", "window_start": 0, "clicks": 1}


def test_equal_multisets_pass_whatever_the_order():
    assert_published([B, A], [A, B])
    assert multiset([{"x": 1, "y": 2}]) == multiset([{"y": 2, "x": 1}])


def test_a_record_published_twice_fails_naming_its_key():
    with pytest.raises(AssertionError) as failed:
        assert_published([A, A, B], [A, B])
    assert "key 'a': published 1 more time(s) than expected" in str(failed.value)
    assert "3 published, 2 expected" in str(failed.value)


def test_missing_and_unexpected_records_are_named_by_key():
    wrong = {**B, "clicks": 3}
    with pytest.raises(AssertionError) as failed:
        assert_published([A, wrong], [A, B])
    message = str(failed.value)
    assert "key 'b': not expected:" in message and '"clicks": 3' in message
    assert "key 'b': missing (1 of 1):" in message and '"clicks": 1' in message


def test_a_key_function_and_byte_values_and_dead_letters():
    with pytest.raises(AssertionError, match="key 'w0'"):
        assert_published([A], [B], key=lambda r: f"w{r['window_start']}")
    assert_published([b"\x00\x01"], [b"\x00\x01"])
    letter = DeadLetter(b"{x", "value is not valid JSON", "in/0/3")
    assert_published([letter], [DeadLetter(b"{x", "value is not valid JSON", "in/0/3")])
