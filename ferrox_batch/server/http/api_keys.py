"""`ApiKeys`: the bearer keys a server takes, one tenant each, its name and its prefix-cache namespace.

Why tenants get their own namespace: the prefix cache lets a request adopt the KV blocks of any earlier
prompt that shares its beginning, and `usage.prompt_tokens_details.cached_tokens` says how many it adopted.
Shared between clients, that count tells one client whether another recently sent a given prefix (a system
prompt, a document), one guess at a time. So by default each key's requests use a namespace of their own,
which `server.client_policy` combines with the request's own `cache_salt`: two keys never share a cached
block, and a salt is a namespace inside its tenant's. `shared_prefix_cache=True` turns this off for
operators whose keys all belong to one party and who want the hits across them. The tenant keeps its name
(`tenant_of`) either way: budgets shared per client (the live grammars') are still one share per key.

What it promises:

* **A key is checked in constant time** with respect to its content (`hmac.compare_digest` against every
  key, without stopping at the first match), so timing tells neither a key's bytes nor which key matched.
* **The namespace is never the key.** It is an HMAC-SHA256 of the key under a secret drawn at random when
  the server starts: it names a tenant inside this process (the prefix cache lives no longer) and reveals
  nothing about the key if it is ever seen.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

#: Hex digits of the HMAC that name a tenant's namespace: 128 bits, as the cache's own block keys.
NAMESPACE_HEX = 32


class ApiKeys:
    """The keys this server takes; each is a tenant."""

    __slots__ = ("_keys", "_namespaces")

    def __init__(self, keys: Sequence[str], *, shared_prefix_cache: bool = False) -> None:
        if isinstance(keys, str) or not keys:
            raise ValueError(f"api keys must be a non-empty sequence of strings, got {keys!r}")
        for key in keys:
            if not isinstance(key, str) or not key or key != key.strip():
                raise ValueError(f"an api key must be a non-empty string without surrounding spaces, got {key!r}")
        if len(set(keys)) != len(keys):
            raise ValueError("the api keys must be distinct: a key names one tenant")
        secret = secrets.token_bytes(32)
        self._keys = tuple(key.encode("utf-8") for key in keys)
        self._namespaces = tuple(
            None if shared_prefix_cache
            else hmac.new(secret, key, hashlib.sha256).hexdigest()[:NAMESPACE_HEX] for key in self._keys)

    @classmethod
    def of(cls, api_key: str | Sequence[str] | None, *, shared_prefix_cache: bool = False) -> ApiKeys | None:
        """`create_app`'s `api_key`: None or an empty sequence (an open API), one key, or several."""
        if api_key is None or (not isinstance(api_key, str) and len(api_key) == 0):
            return None
        return cls([api_key] if isinstance(api_key, str) else list(api_key), shared_prefix_cache=shared_prefix_cache)

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, token: str) -> int | None:
        """The index of the key `token` is, or None; every key is compared, whatever matched."""
        given = token.encode("utf-8")
        found = None
        for index, key in enumerate(self._keys):
            if hmac.compare_digest(given, key):
                found = index
        return found

    def namespace(self, token: str) -> str | None:
        """The prefix-cache namespace of the tenant whose key `token` is (None: an unknown key, or a shared
        cache)."""
        index = self.match(token)
        return None if index is None else self._namespaces[index]

    def namespace_of(self, index: int) -> str | None:
        return self._namespaces[index]

    def tenant_of(self, index: int) -> str:
        """The name of key `index`'s tenant, whether or not tenants share the cache: what its share of a
        per-client budget is kept under. Its index among the keys, never anything of the key."""
        if not 0 <= index < len(self._keys):
            raise IndexError(f"there is no key {index}")
        return f"key{index}"
