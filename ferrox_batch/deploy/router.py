"""`PrefixAffinityRouter`: Ray Serve's request-router extension point, placing each request by its prompt.

It runs in every process that holds a handle to the replicas (the ingress), one per handle. For a request
relayed with its body (`relay.RelayedRequest`) it ranks the replicas with `affinity.rank`: cheapest first,
where a replica costs the part of the prompt it was never sent plus a fixed price per request it has in
flight. Serve then probes the first rank's queue lengths and
sends the request to the least loaded replica that accepts it, falling back to the next rank when all of
the first are full. Once a request is placed, its prompt is recorded for that replica.

A request that names a running replica in `relay.REPLICA_HEADER` goes to that replica: that is how an
operator reads one replica's `/stats` or `/metrics` through the ingress (the ingress refuses the answer
of any other replica, so a pin is never silently ignored).

Prompts are indexed per tenant (`relay.RelayedRequest.tenant`), as each replica caches them: a tenant's
request is never drawn to a replica by another tenant's prompt.

Loads are the requests this router has in flight on each replica, counted from Serve's routed and
completed hooks: exact for this router, never stale, and no probe per request. Each request's prompt is
read from its body once, however many times Serve asks to rank it.
"""

from __future__ import annotations

from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from ferrox_batch.deploy.affinity import (
    DEFAULT_CAPACITY,
    DEFAULT_LOAD_COST_TOKENS,
    PrefixIndex,
    Units,
    load_cost_units,
    prompt_units,
    rank,
)
from ferrox_batch.deploy.relay import REPLICA_HEADER, RelayedRequest

#: Prompts kept for requests being routed, and ids of requests that ended before their routed hook ran
#: (a request cancelled before it was placed leaves its entry behind; this bounds both).
_PENDING_PROMPTS = 4096


def _relayed(pending: PendingRequest | None) -> RelayedRequest | None:
    if pending is None:
        return None
    return next((a for a in (*pending.args, *pending.kwargs.values()) if isinstance(a, RelayedRequest)), None)


class PrefixAffinityRouter(RequestRouter):
    """Ranks replicas by the prompt prefix they were sent (see the module docstring)."""

    def initialize_state(self, load_cost_tokens: int = DEFAULT_LOAD_COST_TOKENS,
                         capacity: int = DEFAULT_CAPACITY) -> None:
        if isinstance(load_cost_tokens, bool) or not isinstance(load_cost_tokens, int) or load_cost_tokens < 0:
            raise ValueError(f"load_cost_tokens must be a non-negative integer, got {load_cost_tokens!r}")
        self.load_cost_tokens = load_cost_tokens
        self.index = PrefixIndex(capacity)
        self.in_flight: dict[ReplicaID, set[str]] = {}
        self._prompts: OrderedDict[str, tuple[Units, str | None] | None] = OrderedDict()
        self._finished_unrouted: OrderedDict[str, None] = OrderedDict()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        relayed = _relayed(pending_request)
        if relayed is None or pending_request is None:
            return [candidate_replicas]
        pinned = relayed.header(REPLICA_HEADER)
        if pinned:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == pinned]
            if chosen:
                return [chosen]
        prompt = self._prompt(pending_request)
        if prompt is None:
            return [candidate_replicas]
        units, tenant = prompt
        matched = self.index.match(units, tenant)
        by_id = {r.replica_id: r for r in candidate_replicas}
        ranks = rank(list(by_id), {rid: matched.get(rid, 0) for rid in by_id},
                     {rid: len(self.in_flight.get(rid, ())) for rid in by_id}, len(units),
                     load_cost_units(units, self.load_cost_tokens))
        return [[by_id[rid] for rid in group] for group in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        key = pending_request.metadata.internal_request_id
        if key in self._finished_unrouted:  # already over (see on_request_completed)
            del self._finished_unrouted[key]
        else:
            self.in_flight.setdefault(replica_id, set()).add(key)
        prompt = self._prompts.pop(key, None)
        if prompt is not None:
            units, tenant = prompt
            self.index.record(units, replica_id, tenant)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        held = self.in_flight.get(replica_id, set())
        if internal_request_id in held:
            held.discard(internal_request_id)
            return
        # Serve posts this to the router's loop, normally after the routed hook; should a request end
        # before that hook ran, remember it so the hook does not count it in flight for ever.
        self._finished_unrouted[internal_request_id] = None
        while len(self._finished_unrouted) > _PENDING_PROMPTS:
            self._finished_unrouted.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)
        self.in_flight.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        running = {r.replica_id for r in replicas}
        for gone in self.index.replicas() - running:
            self.index.forget(gone)
        for gone in set(self.in_flight) - running:
            del self.in_flight[gone]

    def _prompt(self, pending: PendingRequest) -> tuple[Units, str | None] | None:
        """The request's prompt and tenant, read from its body on the first ask and kept until it is placed."""
        key = pending.metadata.internal_request_id
        if key not in self._prompts:
            relayed = _relayed(pending)
            units = None if relayed is None else prompt_units(relayed.path, relayed.body)
            self._prompts[key] = None if relayed is None or units is None else (units, relayed.tenant)
            while len(self._prompts) > _PENDING_PROMPTS:
                self._prompts.popitem(last=False)
        return self._prompts[key]
