"""The prefix-affinity index and ranking: which replica holds the longest prefix, within bounded memory."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ferrox_batch.deploy.affinity import (
    IDS_CHUNK,
    TEXT_CHUNK,
    PrefixIndex,
    chain,
    chunk_size,
    load_cost_units,
    prompt_units,
    rank,
)

texts = st.text(alphabet="ab", max_size=6 * TEXT_CHUNK)
ids = st.lists(st.integers(0, 3), max_size=6 * IDS_CHUNK).map(tuple)
prompts = st.one_of(texts, ids)


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_prompts_are_read_as_the_server_reads_them():
    assert prompt_units("/v1/completions", body(prompt="Hello")) == "Hello"
    assert prompt_units("/v1/completions", body(prompt=[1, 2, 3])) == (1, 2, 3)
    assert prompt_units("/v1/completions", body(prompt=["first", "second"])) == "first"
    assert prompt_units("/v1/completions", body(prompt=[[4, 5], [6]])) == (4, 5)
    chat = prompt_units("/v1/chat/completions", body(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]))
    assert chat == "system\x1fBe brief.\x1euser\x1fHi\x1e"
    for path, raw in (("/v1/models", body(prompt="x")), ("/v1/completions", b"{not json"),
                      ("/v1/completions", b"[1]"), ("/v1/completions", body(prompt=True)),
                      ("/v1/chat/completions", body(messages="hi")), ("/tokenize", body(prompt="x"))):
        assert prompt_units(path, raw) is None, (path, raw)


def test_a_conversations_next_turn_extends_its_previous_one():
    turn = [{"role": "system", "content": "s" * 100}, {"role": "user", "content": "u" * 50}]
    first = prompt_units("/v1/chat/completions", body(messages=turn))
    second = prompt_units("/v1/chat/completions", body(messages=[*turn, {"role": "assistant", "content": "a"},
                                                                   {"role": "user", "content": "more"}]))
    assert isinstance(first, str) and isinstance(second, str) and second.startswith(first)


@given(prompts, st.one_of(texts, ids))
def test_a_prompts_chain_is_a_prefix_of_any_extension_of_it(prompt, tail):
    if type(tail) is not type(prompt):
        return
    whole = chain(prompt)
    assert len(whole) == len(prompt) // chunk_size(prompt)
    assert chain(prompt + tail)[:len(whole)] == whole


def test_text_and_ids_never_share_links():
    assert not set(chain("a" * TEXT_CHUNK)) & set(chain((0,) * IDS_CHUNK))


def _common_chunks(a, b) -> int:
    size, n = chunk_size(a), 0
    while (n + 1) * size <= min(len(a), len(b)) and a[n * size:(n + 1) * size] == b[n * size:(n + 1) * size]:
        n += 1
    return n


@given(st.lists(st.tuples(prompts, st.sampled_from("xyz")), max_size=12), prompts)
def test_a_match_is_the_longest_whole_chunk_prefix_each_replica_was_sent(history, query):
    index = PrefixIndex(capacity=10_000)
    for prompt, replica in history:
        index.record(prompt, replica)
    expected = {}
    for prompt, replica in history:
        if type(prompt) is type(query):
            n = _common_chunks(prompt, query)
            if n:
                expected[replica] = max(expected.get(replica, 0), n * chunk_size(query))
    assert index.match(query) == expected


@given(st.lists(st.tuples(prompts, st.sampled_from("xyz")), max_size=20), st.integers(1, 12))
def test_memory_stays_within_capacity_and_the_newest_prompt_is_kept(history, capacity):
    index = PrefixIndex(capacity=capacity)
    for prompt, replica in history:
        index.record(prompt, replica)
        assert len(index) <= capacity
    if history:
        prompt, replica = history[-1]
        links = len(chain(prompt))
        if 0 < links <= capacity:
            assert index.match(prompt).get(replica) == links * chunk_size(prompt)


@given(st.lists(st.tuples(prompts, st.sampled_from("xyz")), max_size=12), prompts)
def test_a_forgotten_replica_matches_nothing(history, query):
    index = PrefixIndex()
    for prompt, replica in history:
        index.record(prompt, replica)
    index.forget("x")
    assert "x" not in index.match(query) and "x" not in index.replicas()


def test_capacity_must_be_positive():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            PrefixIndex(capacity=bad)


replicas = st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True)


@given(replicas, st.data(), st.integers(1, 400), st.integers(0, 100))
def test_ranks_hold_every_candidate_once_cheapest_first(candidates, data, length, load_cost):
    matched = {c: data.draw(st.integers(0, length), label=f"match {c}") for c in candidates}
    loads = {c: data.draw(st.one_of(st.none(), st.integers(0, 30)), label=f"load {c}") for c in candidates}
    ranks = rank(candidates, matched, loads, length, load_cost)
    assert sorted(c for group in ranks for c in group) == sorted(candidates)
    if max(matched.values()) == 0:
        assert ranks == [list(candidates)]
        return
    cost = {c: length - matched[c] + load_cost * (loads[c] or 0) for c in candidates}
    assert {cost[c] for c in ranks[0]} == {min(cost.values())}
    assert all(cost[c] > min(cost.values()) for group in ranks[1:] for c in group)


def test_a_held_conversation_stays_unless_its_replica_is_much_busier():
    # 400 units, 380 held by "a": "a" wins until it has (380 / 64 =) 5.9 more requests in flight than "b".
    for extra, winner in ((0, "a"), (5, "a"), (6, "b")):
        assert rank(["a", "b"], {"a": 380, "b": 0}, {"a": extra, "b": 0}, 400, 64)[0] == [winner]
    assert load_cost_units("text") == 4 * load_cost_units((1, 2))


def test_no_candidates_no_ranks():
    assert rank([], {}, {}, 10, 64) == []


def test_tenants_never_share_links():
    # A replica holding one tenant's prompt draws no other tenant's request for it: where a request is
    # routed (and the replica header its answer carries) must not tell one tenant what another sent.
    index = PrefixIndex()
    prompt = "s" * (3 * TEXT_CHUNK)
    index.record(prompt, "r1", namespace="tenant-a")
    assert index.match(prompt, namespace="tenant-a") == {"r1": 3 * TEXT_CHUNK}
    assert index.match(prompt, namespace="tenant-b") == {}
    assert index.match(prompt) == {}  # no tenant (an open server) is a namespace of its own
    assert not set(chain(prompt, "tenant-a")) & set(chain(prompt, "tenant-b"))
    assert chain(prompt, None) == chain(prompt)
