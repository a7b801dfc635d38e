"""Each API key is priced against its own share of the live-grammar budget, whether or not keys share the
prefix cache; a client without a key is known by its address, an IPv6 one by its /64.

Pins: with `shared_prefix_cache=True` (no cache namespace per key), one key's requests in flight holding
its whole grammar share make that key's next new schema a 503, while another key's schema is still
served; `client_identity` names a keyed request by its key's tenant and an unkeyed one by its address,
every address of one IPv6 /64 being one client.
"""

from __future__ import annotations

import concurrent.futures

import httpx
from server_helpers import DEADLINE, MODEL_NAME, poll, served
from worker_helpers import Gate

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.engine.wiring import config_ceiling
from ferrox_batch.grammar_limits import GrammarLimits
from ferrox_batch.runtime.sampling.grammar import Grammars
from ferrox_batch.server.http.access import client_identity
from ferrox_batch.structured import StructuredOutput

ALICE, BOB = "sk-alice-1", "sk-bob-2"


def schema(field: str) -> dict:
    return {"type": "object", "properties": {field: {"type": "integer"}}, "required": [field]}


def ask(base_url: str, key: str, field: str) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/chat/completions", timeout=DEADLINE, headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "A number?"}],
                            "max_tokens": 4, "temperature": 0,
                            "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "x", "schema": schema(field)}}})


def gated_grammar_batcher(model, gate: Gate, limits: GrammarLimits) -> ContinuousBatcher:
    """`model` served with its grammar engine under `limits`, its worker's detokenizing through `gate`."""
    config = BatcherConfig(kv_block_size=16, kv_blocks=64)
    tokenizer = model.tokenizer
    grammars = Grammars(tokenizer.inner.to_str(), model.config.vocab_size, sorted(tokenizer.stop_tokens.ids),
                        limits=limits)
    batcher = ContinuousBatcher.spawn_with_ceiling(model.decoder, gate, config, config_ceiling(model.decoder, config),
                                                   grammars=grammars)
    batcher.tokenizer = tokenizer
    return batcher


def test_each_key_has_its_own_grammar_share_when_the_cache_is_shared(tiny_batch_model):
    first, second = (StructuredOutput.json_schema(schema(f)).size for f in ("first", "other"))
    share = max(first, second) + min(first, second) // 2  # one schema fits a client's share, two do not
    gate = Gate(tiny_batch_model.tokenizer.decode, permits=None)
    batcher = gated_grammar_batcher(tiny_batch_model, gate, GrammarLimits(client_live_bytes=share))
    with served(batcher, api_key=[ALICE, BOB], shared_prefix_cache=True) as (base_url, app), \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        gate.hold()
        try:
            held = pool.submit(ask, base_url, ALICE, "first")
            gate.wait_calls(1)  # ALICE's request is in flight, holding its schema
            refused = ask(base_url, ALICE, "other")
            assert refused.status_code == 503, refused.text  # ALICE's share is full
            served_too = pool.submit(ask, base_url, BOB, "other")
            in_flight = app.state.ferrox.generations.in_flight
            poll(lambda: served_too.done() or len(in_flight) == 2, "BOB's request to be priced")
            gate.open()
            assert served_too.result(DEADLINE).status_code == 200, "BOB's share is his own"
            assert held.result(DEADLINE).status_code == 200
        finally:
            gate.open()


class Connection:
    """What `client_identity` reads of an exchange: its scope's state and its client address."""

    def __init__(self, host: str | None, state: dict | None = None) -> None:
        self.scope = {"state": state or {}}
        self.client = None if host is None else type("Address", (), {"host": host})()


def test_a_client_is_its_tenant_else_its_address_an_ipv6_one_by_its_64():
    assert client_identity(Connection("10.0.0.1", {"tenant": "key0"})) == "tenant:key0"
    assert client_identity(Connection("10.0.0.1")) == "address:10.0.0.1"
    assert client_identity(Connection("10.0.0.1")) != client_identity(Connection("10.0.0.2"))
    one = client_identity(Connection("2001:db8:1:2::1"))
    assert one == client_identity(Connection("2001:db8:1:2:ffff:1:2:3")) == "address:2001:db8:1:2::/64"
    assert one != client_identity(Connection("2001:db8:1:3::1"))
    assert client_identity(Connection("::ffff:10.0.0.1")) == "address:10.0.0.1"  # IPv4 mapped: the IPv4 client
    assert client_identity(Connection(None)) == "address:unknown"
    assert client_identity(Connection("testclient")) == "address:testclient"  # not an IP: as it is
