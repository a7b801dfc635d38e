"""`PrefixAffinityRouter`: Ray Serve's request-router extension point, placing each request by its prompt.

It runs in every process that holds a handle to the replicas (the ingress), one per handle. For a request
relayed with its body (`relay.RelayedRequest`) it ranks the replicas with `affinity.rank`: cheapest first,
where a replica costs the part of the prompt it was never sent plus a fixed price per request it has in
flight. Serve then probes the first rank's queue lengths and sends the request to
the least loaded replica that accepts it, falling back to the next rank when all of the first are full.
Once a request is placed, its prompt is recorded for that replica.

A request that names a replica in `relay.REPLICA_HEADER` goes to that replica while it is running: that is
how an operator reads one replica's `/stats` or `/metrics` through the ingress.

Load comes from Serve's cached queue lengths (requests in flight per replica), never a new probe: the
ranking adds no round trip.
"""

from __future__ import annotations

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

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        relayed = _relayed(pending_request)
        if relayed is None:
            return [candidate_replicas]
        pinned = relayed.header(REPLICA_HEADER)
        if pinned:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == pinned]
            if chosen:
                return [chosen]
        units = prompt_units(relayed.path, relayed.body)
        if units is None:
            return [candidate_replicas]
        matched = self.index.match(units)
        by_id = {r.replica_id: r for r in candidate_replicas}
        ranks = rank(list(by_id), {rid: matched.get(rid, 0) for rid in by_id},
                     {rid: self._load(rid) for rid in by_id}, len(units),
                     load_cost_units(units, self.load_cost_tokens))
        return [[by_id[rid] for rid in group] for group in ranks]

    def _load(self, replica_id: ReplicaID) -> int | None:
        return self.replica_queue_len_cache.get(replica_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        units = self._units(pending_request)
        if units is not None:
            self.index.record(units, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        running = {r.replica_id for r in replicas}
        for gone in self.index.replicas() - running:
            self.index.forget(gone)

    @staticmethod
    def _units(pending: PendingRequest) -> Units | None:
        relayed = _relayed(pending)
        return None if relayed is None else prompt_units(relayed.path, relayed.body)
