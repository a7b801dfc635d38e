"""The prefix-affinity router reads Ollama's requests as the requests they amount to.

Pins: `/api/chat` messages are the chat endpoint's units, a templated `/api/generate` the chat of its
`system` and `prompt`, a raw one the completion of its prompt; a load request (no prompt) carries none.
"""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from ferrox_batch.deploy.affinity import prompt_units

TEXT = st.text(min_size=1, max_size=40)


def units(path: str, body: dict) -> object:
    return prompt_units(path, json.dumps(body).encode())


@given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), TEXT), min_size=1, max_size=4))
def test_an_ollama_chat_is_the_chat_endpoints_units(turns):
    messages = [{"role": role, "content": text} for role, text in turns]
    assert units("/api/chat", {"messages": messages}) == units("/v1/chat/completions", {"messages": messages})


@given(TEXT, st.one_of(st.none(), TEXT))
def test_a_generate_is_its_chat_or_with_raw_its_completion(prompt, system):
    said = [{"role": "system", "content": system}] if system else []
    chat = units("/v1/chat/completions", {"messages": [*said, {"role": "user", "content": prompt}]})
    assert units("/api/generate", {"prompt": prompt, "system": system}) == chat
    assert units("/api/generate", {"prompt": prompt, "raw": True}) == units("/v1/completions", {"prompt": prompt})
    assert units("/api/generate", {"system": system}) is None and units("/api/tags", {"prompt": prompt}) is None
