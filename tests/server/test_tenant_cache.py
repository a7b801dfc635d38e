"""With several API keys, each key is a tenant with its own prefix-cache namespace.

Pins: a tenant's repeated prompt is served from the cache, but another tenant sending the same prompt
computes it (`cached_tokens` 0), so `usage.prompt_tokens_details.cached_tokens` never tells one tenant
what another sent, even when both send the same `cache_salt`; `shared_prefix_cache=True` shares the
cache across keys as before; the namespace is a keyed hash, never the key. Every key is accepted, one key
still works exactly as a single `api_key` did, and the keys come from a repeatable, comma-separated
`--api-key` or `$FERROX_API_KEY`.
"""

from __future__ import annotations

import httpx
import pytest
from server_helpers import DEADLINE, served, tiny_batcher

from ferrox_batch.cli import build_parser
from ferrox_batch.cli.common import CliError
from ferrox_batch.cli.serve import api_keys
from ferrox_batch.server.http.api_keys import ApiKeys

ALICE, BOB = "sk-alice-1", "sk-bob-2"
PROMPT = list(range(5, 45))  # 40 token ids: two full 16-position blocks can be adopted


def cached(base_url: str, key: str, **extra) -> int:
    response = httpx.post(f"{base_url}/v1/completions", timeout=DEADLINE, headers={"Authorization": f"Bearer {key}"},
                          json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True, **extra})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenants_do_not_see_each_others_cached_prompts(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model, prefix_cache=True), api_key=[ALICE, BOB]) as (base_url, _app):
        assert cached(base_url, ALICE) == 0
        assert cached(base_url, ALICE) == 32  # the same tenant's second request is cached
        assert cached(base_url, BOB) == 0  # the other tenant learns nothing from it
        assert cached(base_url, BOB) == 32
        assert cached(base_url, ALICE, cache_salt="team") == 0  # a salt is a namespace within the tenant's
        assert cached(base_url, ALICE, cache_salt="team") == 32
        assert cached(base_url, BOB, cache_salt="team") == 0  # the same salt does not cross tenants
        unkeyed = httpx.post(f"{base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=DEADLINE)
        assert unkeyed.status_code == 401


def test_a_shared_prefix_cache_is_shared_across_keys(tiny_batch_model):
    with served(tiny_batcher(tiny_batch_model, prefix_cache=True), api_key=(ALICE, BOB),
                shared_prefix_cache=True) as (base_url, _app):
        assert cached(base_url, ALICE) == 0
        assert cached(base_url, BOB) == 32


def test_the_namespace_is_a_keyed_hash_of_the_key():
    keys = ApiKeys([ALICE, BOB])
    alice, bob = keys.namespace(ALICE), keys.namespace(BOB)
    assert alice is not None and bob is not None and alice != bob
    assert ALICE not in alice and keys.namespace(ALICE) == alice  # stable for the server's life
    assert ApiKeys([ALICE, BOB]).namespace(ALICE) != alice  # keyed with a secret of this server's own
    assert keys.namespace("sk-unknown") is None
    assert ApiKeys([ALICE], shared_prefix_cache=True).namespace(ALICE) is None
    for bad in ([], [""], ["a", "a"], [" padded "], "", [3]):
        with pytest.raises(ValueError):
            ApiKeys(bad)


def test_the_cli_reads_several_keys():
    def keys(*flags: str, env: dict[str, str] | None = None) -> tuple[str, ...]:
        return api_keys(build_parser().parse_args(["serve", *flags]), env or {})

    assert keys() == ()
    assert keys("--api-key", ALICE) == (ALICE,)
    assert keys("--api-key", ALICE, "--api-key", BOB) == (ALICE, BOB)
    assert keys("--api-key", f"{ALICE}, {BOB}") == (ALICE, BOB)
    assert keys(env={"FERROX_API_KEY": f"{ALICE},{BOB}"}) == (ALICE, BOB)
    assert keys("--api-key", ALICE, env={"FERROX_API_KEY": BOB}) == (ALICE,)  # the flag wins
    for bad in (("--api-key", " "), ("--api-key", f"{ALICE},,{BOB}"), ("--api-key", ALICE, "--api-key", ALICE)):
        with pytest.raises(CliError):
            keys(*bad)
    with pytest.raises(CliError):
        keys(env={"FERROX_API_KEY": ""})
    assert build_parser().parse_args(["serve", "--shared-prefix-cache"]).shared_prefix_cache is True
