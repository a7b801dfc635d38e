"""The stop limits: too many stop strings, a too-long one, too many characters over all of them, or too many
stop token ids is an `InvalidRequest` naming the field when `GenerationParams` is built (the caller's thread),
for a library caller as for the server, and the limits themselves are accepted."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.generation_types import GenerationParams
from ferrox_batch.stop_limits import (
    DEFAULT_MAX_STOP_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOPS,
    check_stop_chars,
)


def refused(**fields: object) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        GenerationParams(max_tokens=4, **fields)  # type: ignore[arg-type]
    return caught.value


def test_a_stop_list_of_100000_strings_is_refused_naming_stop() -> None:
    error = refused(stop=[f"s{i}" for i in range(100_000)])
    assert error.param == "stop" and error.http_status == 400
    assert f"at most {MAX_STOPS}" in str(error) and "100000" in str(error)


def test_one_stop_past_the_count_is_refused_and_the_count_itself_is_not() -> None:
    assert refused(stop=["x"] * (MAX_STOPS + 1)).param == "stop"
    assert len(GenerationParams(max_tokens=4, stop=["x"] * MAX_STOPS).stop) == MAX_STOPS


def test_a_stop_string_past_the_length_is_refused_and_the_length_itself_is_not() -> None:
    error = refused(stop=["ok", "y" * (MAX_STOP_STRING_CHARS + 1)])
    assert error.param == "stop" and f"at most {MAX_STOP_STRING_CHARS} characters" in str(error)
    assert len(str(error)) < 400, "the message quotes the string shortened"
    # A bare string is one stop, held to the same length.
    assert refused(stop="z" * 100_000).param == "stop"
    # Characters, not bytes: a stop of multibyte characters is measured as the matcher sees it.
    assert GenerationParams(max_tokens=4, stop="あ" * MAX_STOP_STRING_CHARS).stop == ("あ" * MAX_STOP_STRING_CHARS,)


def test_stop_token_ids_past_the_count_are_refused_naming_them() -> None:
    error = refused(stop_token_ids=range(MAX_STOP_TOKEN_IDS + 1))
    assert error.param == "stop_token_ids" and f"at most {MAX_STOP_TOKEN_IDS}" in str(error)
    assert len(GenerationParams(max_tokens=4, stop_token_ids=range(MAX_STOP_TOKEN_IDS)).stop_token_ids) == (
        MAX_STOP_TOKEN_IDS
    )


def test_the_token_id_limit_leaves_room_for_every_stop_string_to_be_one_token() -> None:
    """`text_params` adds one id per stop string that is a single token to the caller's own."""
    assert MAX_STOP_TOKEN_IDS >= 2 * MAX_STOPS


def test_entry_types_are_still_checked_first() -> None:
    assert refused(stop=["a", 3]).reason == "entries must be strings"
    assert refused(stop_token_ids=[1, -1]).reason == "entries must be integers >= 0"


@settings(max_examples=200, deadline=None)
@given(count=st.integers(0, MAX_STOPS + 2), length=st.integers(1, MAX_STOP_STRING_CHARS + 2),
       limit=st.none() | st.integers(1, 3 * DEFAULT_MAX_STOP_CHARS))
def test_a_stop_list_is_accepted_exactly_within_its_count_length_and_total(count, length, limit) -> None:
    """Over counts x lengths (and the total the caller sets, or the library's default): refused naming
    `stop` exactly when one limit is passed, so no accepted list exceeds the total its builder is held to."""
    stop = ["s" * length] * count
    total = limit if limit is not None else DEFAULT_MAX_STOP_CHARS
    fits = count <= MAX_STOPS and (count == 0 or length <= MAX_STOP_STRING_CHARS) and count * length <= total
    bound = {} if limit is None else {"max_stop_chars": limit}
    if fits:
        assert GenerationParams(max_tokens=4, stop=stop, **bound).stop == tuple(stop)
    else:
        error = refused(stop=stop, **bound)
        assert error.param == "stop" and error.http_status == 400


def test_the_library_default_bounds_the_worst_case_the_per_string_limits_allow() -> None:
    worst = ["".join(chr(0x4E00 + i * MAX_STOP_STRING_CHARS + j) for j in range(MAX_STOP_STRING_CHARS))
             for i in range(MAX_STOPS)]  # no two share a prefix: the largest matcher
    error = refused(stop=worst)
    assert error.param == "stop" and f"{DEFAULT_MAX_STOP_CHARS:,} characters in all" in str(error)
    assert error.value == MAX_STOPS * MAX_STOP_STRING_CHARS


def test_the_total_is_one_check_whoever_calls_it() -> None:
    """The server's cap (`RequestCaps.check_body`) calls this same check with its flag's value."""
    with pytest.raises(InvalidRequest) as caught:
        check_stop_chars(["ab", "cd"], 3, "--max-stop-chars")
    assert caught.value.param == "stop" and "at most 3 characters in all" in str(caught.value)
    assert "--max-stop-chars" in str(caught.value)
    check_stop_chars(["ab", "c"], 3)
    assert refused(max_stop_chars=0).param == "max_stop_chars"
