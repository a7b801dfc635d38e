"""The live-grammar budget: bytes of spec text the compiled grammars alive may have, in all and per client.

A request holds its compiled grammar from its submit to its answer, so the grammars alive are bounded by
pricing what requests hold. One pool for everyone let a few long requests of one client with big schemas
make every other client's schema a 503; so each client (`StructuredOutput.client`: an API key's tenant,
else the client's address) is priced against a share of its own. A client's bytes are the sizes of the
distinct specs its requests hold (the `n` choices of one request, or two requests with one schema, hold
it once), counted from the start of the first request's compile of a spec (so a client's builds in flight
are its share's too, not the pool's alone) to the last `HeldGrammar`'s release (its request answered, and
the handle dropped). `GrammarsBusy` (503, retry) refuses a spec past either bound.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

from ferrox_batch.errors import DecodeError
from ferrox_batch.structured import StructuredOutput


class GrammarsBusy(DecodeError):
    """The compiled grammars alive now hold the server's (or this client's) bytes of spec text: a new spec
    must wait for some of the requests holding theirs to finish (503: the request is fine, retry shortly)."""

    retry_after_secs = 1
    http_status = 503
    error_code = "server_busy"
    _fields = ("live_bytes", "limit_bytes", "whose")

    def __init__(self, live_bytes: int, limit_bytes: int, whose: str = "of requests in flight") -> None:
        self.live_bytes = live_bytes
        self.limit_bytes = limit_bytes
        self.whose = whose
        super().__init__(f"server is at capacity: the grammars {whose} hold {live_bytes} bytes "
                         f"of schema (limit {limit_bytes}); retry shortly")


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class HeldGrammar:
    """One request's hold on a compiled grammar, priced to its client until the request drops it."""

    compiled: Any  # `grammar.CompiledGrammar`

    @property
    def spec(self) -> StructuredOutput:
        return self.compiled.spec


class ClientShares:
    """Bytes of spec text each client's requests hold, against `share` each (thread-safe)."""

    def __init__(self, share: int) -> None:
        self.share = share
        self._lock = threading.Lock()
        self._held: dict[str, dict[StructuredOutput, int]] = {}  # client -> spec -> requests holding it
        self._bytes: dict[str, int] = {}

    def hold(self, client: str, compiled: Any) -> HeldGrammar:
        """A hold on `compiled` for a request of `client`; `GrammarsBusy` when a spec it does not hold yet
        would take it past its share."""
        self.take(client, compiled.spec, compiled.size)
        return self.handle(client, compiled)

    def take(self, client: str, spec: StructuredOutput, size: int) -> None:
        """Count `spec` to `client` (`GrammarsBusy` past its share), before its grammar is built: a client's
        builds in flight are its own share's, not only the pool's. `handle` gives the hold to a request;
        `release` gives it back unused (the build failed)."""
        with self._lock:
            specs = self._held.setdefault(client, {})
            if spec not in specs:
                held = self._bytes.get(client, 0)
                if held + size > self.share:
                    if not specs:
                        del self._held[client]
                    raise GrammarsBusy(held, self.share, "of this client's requests in flight")
                self._bytes[client] = held + size
            specs[spec] = specs.get(spec, 0) + 1

    def handle(self, client: str, compiled: Any) -> HeldGrammar:
        """The request's hold on `compiled`, taken by `take`: given back when the request drops it."""
        handle = HeldGrammar(compiled)
        weakref.finalize(handle, self.release, client, compiled.spec, compiled.size)
        return handle

    def release(self, client: str, spec: StructuredOutput, size: int) -> None:
        with self._lock:
            specs = self._held[client]
            specs[spec] -= 1
            if specs[spec]:
                return
            del specs[spec]
            self._bytes[client] -= size
            if not specs:
                del self._held[client], self._bytes[client]

    def held(self, client: str) -> int:
        """Bytes of spec text `client`'s requests hold now."""
        with self._lock:
            return self._bytes.get(client, 0)
