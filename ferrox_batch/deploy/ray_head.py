"""Where a local Ray head listens: on the address `serve --replicas` is bound to, loopback staying loopback.

`ray.init` starts a GCS, a raylet (node manager and object manager), Ray's agents and a worker per replica,
each with ports of its own that run whatever code is sent to them. Ray binds them from the node's IP: on
that address when it is a loopback one, on the node's IP (the agents) or every interface (the gRPC servers)
otherwise. So the head's node IP is `--host`'s address:

* a loopback `--host` (`127.0.0.1`, `::1`, `localhost`, any of 127/8): `127.0.0.1`, the loopback address
  Ray keeps its servers to, and nothing of Ray's is reachable from another machine. Ray rewrites a loopback
  node IP to the machine's routable one, for the nodes it expects to join; a local head that no node joins
  is started with that rewrite held off (only while `ray.init` runs, and for that address only).
* another address: that address (Ray's agents bind there; its gRPC servers bind every interface, which Ray
  has no setting for, and are guarded by Ray's token authentication).
* all interfaces (`0.0.0.0`, `::`) or a host name: Ray's own choice.

The dashboard stays off. Serve's HTTP proxy binds `--host` itself (`ray_serve.run_local`). Each Serve
replica also opens a gRPC server for calls between deployments, on every interface whatever the node's
address; a replica on a loopback node opens it on that loopback address instead (`replica_ports_on_node`,
called as the replica starts, before Serve opens it).
"""

from __future__ import annotations

import contextlib
import ipaddress
import threading
from collections.abc import Callable, Iterator
from typing import Any

import ray

#: The node IP of a head serving on a loopback address: the one Ray keeps all its servers to.
LOOPBACK_NODE = "127.0.0.1"
#: How gRPC names every interface in an address to bind.
ALL_INTERFACES = ("[::]", "0.0.0.0")


def head_address(host: str) -> str | None:
    """The node IP a local head serving on `host` takes (module docstring); None: Ray's choice."""
    name = host.strip().removeprefix("[").removesuffix("]")
    if name.lower() == "localhost":
        return LOOPBACK_NODE
    try:
        address = ipaddress.ip_address(name)
    except ValueError:  # a host name: it resolves to whatever the operator made it
        return None
    if address.is_loopback:
        return LOOPBACK_NODE
    return None if address.is_unspecified else str(address)


class _LoopbackKept:
    """Ray's rewrite of a loopback node IP held off for one address while a head starts (module docstring).

    Ray reads the rewrite from a module-level function of its own, so holding it off is a process-wide swap:
    one lock lets one head at a time swap it, so two heads started at once never restore each other's
    replacement, and it is restored whatever `ray.init` raised."""

    _lock = threading.Lock()

    @classmethod
    @contextlib.contextmanager
    def kept(cls, address: str) -> Iterator[None]:
        from ray._private import services

        if not ipaddress.ip_address(address).is_loopback:
            yield  # an address Ray never rewrites
            return
        with cls._lock:
            resolve = getattr(services, "resolve_ip_for_localhost", None)
            if resolve is None:
                yield  # a Ray that no longer rewrites it
                return

            def keep(host: str) -> str:
                return host if host == address else resolve(host)

            services.resolve_ip_for_localhost = keep
            try:
                yield
            finally:
                services.resolve_ip_for_localhost = resolve


def start_head(host: str, *, num_cpus: int | None) -> None:
    """Start a new local Ray instance with `num_cpus` logical CPUs (None: the machine's), its ports on
    `host`'s address."""
    address = head_address(host)
    if address is None:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
        return
    with _LoopbackKept.kept(address):
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address=address)


class _PortsOnNode:
    """Serve's `add_port_to_grpc_server`, as a replica's module calls it, with an all-interfaces address
    (the inter-deployment server's) moved to the node's loopback address; any other address is left as is."""

    __slots__ = ("add_port", "node")

    def __init__(self, add_port: Callable[[Any, str], int], node: str) -> None:
        self.add_port = add_port
        self.node = node

    def __call__(self, server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        return self.add_port(server, f"{_grpc_host(self.node)}:{port}" if host in ALL_INTERFACES else address)


def replica_ports_on_node() -> None:
    """In a Serve replica's process, before Serve starts the replica's own gRPC server: on a loopback node,
    that server listens on the node's loopback address rather than every interface (module docstring).

    Only the name Serve's replica module calls is replaced (Ray's own helper, and every other caller of it,
    stay as they are), and only once however many deployments of the process call this: the server starts
    after the replica's constructor returns, so the replacement lasts for the process, which is the
    replica's alone."""
    from ray.serve._private import replica as serve_replica

    add_port = getattr(serve_replica, "add_port_to_grpc_server", None)
    if add_port is None or isinstance(add_port, _PortsOnNode):
        return  # a Serve that opens no such server, or one already kept on the node
    node = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node).is_loopback:
        return  # a node others reach: the server binds as Serve says
    serve_replica.add_port_to_grpc_server = _PortsOnNode(add_port, node)


def _grpc_host(address: str) -> str:
    return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
