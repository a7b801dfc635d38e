"""`ClientPolicy`: what a server lets its clients choose in a request's fields, and where their cache lives.

Two fields of a generation request are the server's to bound, not the client's:

* **`priority`** orders admission. Any value a client may send, it sends: on a server shared by several
  clients, one that may send `-2**31` goes ahead of everyone. So the server names the inclusive range
  clients may use (`create_app(client_priorities=)`, `serve --client-priorities MIN:MAX`), by default only
  the default priority 0; a value outside is a 400 naming `priority` that says what this server allows.
* **`cache_salt`** names a prefix-cache namespace. A request that belongs to a tenant (an API key,
  `api_keys`) has its salt scoped to that tenant's namespace, so two tenants never share cached blocks,
  whatever salts they send.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.generation_types import PRIORITY_LIMIT
from ferrox_batch.server.sampling_fields import SamplingOptions

#: The priorities clients may use by default: only the default one.
DEFAULT_CLIENT_PRIORITIES = (0, 0)


def scoped_salt(namespace: str | None, salt: str | None) -> str | None:
    """The cache salt a request of tenant `namespace` runs with: its own `salt` inside the tenant's namespace.

    The namespace is a fixed-length hex digest, and every request of a keyed server has one, so no salt a
    client chooses can name another tenant's namespace (None: no tenant, the salt as sent)."""
    if namespace is None:
        return salt
    return f"tenant:{namespace}" if salt is None else f"tenant:{namespace}/{salt}"


@dataclass(frozen=True, slots=True)
class ClientPolicy:
    """The request fields one server bounds (see the module docstring)."""

    #: The inclusive range of `priority` a request may take.
    priorities: tuple[int, int] = DEFAULT_CLIENT_PRIORITIES

    def __post_init__(self) -> None:
        pair = self.priorities
        if not (isinstance(pair, tuple) and len(pair) == 2
                and all(isinstance(p, int) and not isinstance(p, bool) for p in pair)
                and -PRIORITY_LIMIT <= pair[0] <= pair[1] <= PRIORITY_LIMIT):
            raise ValueError(f"client_priorities must be a (min, max) pair of integers with min <= max, within "
                             f"[-{PRIORITY_LIMIT}, {PRIORITY_LIMIT}], got {pair!r}")

    def apply(self, options: SamplingOptions, namespace: str | None) -> SamplingOptions:
        """`options` as this server runs them: the priority checked, the cache salt scoped to the tenant."""
        low, high = self.priorities
        if not low <= options.priority <= high:
            allowed = f"only priority {low}" if low == high else f"priorities in [{low}, {high}]"
            raise InvalidRequest("priority", options.priority,
                                 f"is not one this server lets clients use: it takes {allowed} "
                                 f"(set by its operator with --client-priorities)")
        if namespace is None:
            return options
        return dataclasses.replace(options, cache_salt=scoped_salt(namespace, options.cache_salt))
