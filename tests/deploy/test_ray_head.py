"""A local Ray head listens where `serve --host` says: loopback stays loopback.

`ray.init` is replaced by a recorder here (a real head takes seconds; `test_serve_replicas` starts one and
checks its sockets), which also asks Ray, while the head starts, what it would make of a loopback node
address: Ray rewrites one to the machine's routable address, which would open the GCS, the raylet and every
worker to the network.
"""

from __future__ import annotations

import contextlib
import threading

import pytest

ray = pytest.importorskip("ray", reason="needs the test extra (ray[serve])")
import ray._private.services as ray_services  # noqa: E402

from worker_helpers import DEADLINE  # noqa: E402

from ferrox_batch.deploy.ray_head import head_address, start_head  # noqa: E402


@pytest.fixture
def started(monkeypatch) -> list[dict]:
    calls: list[dict] = []

    def init(**options):
        node = options.get("_node_ip_address")
        calls.append({**options, "resolved": None if node is None else ray_services.resolve_ip_for_localhost(node)})

    monkeypatch.setattr(ray, "init", init)
    return calls


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "LocalHost", "::1", "[::1]", "127.0.0.2"])
def test_a_loopback_host_keeps_every_ray_port_on_loopback(started, host):
    node = "127.0.0.1"
    resolve = ray_services.resolve_ip_for_localhost
    start_head(host, num_cpus=3)
    [options] = started
    assert options["address"] == "local" and options["num_cpus"] == 3
    assert options["_node_ip_address"] == node and options["resolved"] == node, "Ray moved the node off loopback"
    assert options["include_dashboard"] is False
    assert ray_services.resolve_ip_for_localhost is resolve, "Ray's own resolution is back once the head is up"


def test_a_specific_address_is_the_nodes_and_all_interfaces_are_rays_choice(started):
    start_head("10.1.2.3", num_cpus=1)
    start_head("0.0.0.0", num_cpus=1)
    start_head("::", num_cpus=1)
    specific, *anywhere = started
    assert specific["_node_ip_address"] == specific["resolved"] == "10.1.2.3"
    assert all("_node_ip_address" not in options and options["include_dashboard"] is False for options in anywhere)


def test_the_head_address_of_each_kind_of_host():
    assert [head_address(h) for h in ("127.0.0.1", "localhost", "[::1]", "192.168.1.5", "0.0.0.0", "::",
                                      "server.example")] == ["127.0.0.1", "127.0.0.1", "127.0.0.1", "192.168.1.5",
                                                             None, None, None]


def test_a_failed_start_puts_rays_resolution_back(monkeypatch):
    resolve = ray_services.resolve_ip_for_localhost

    def init(**options):
        raise RuntimeError("no room")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(RuntimeError, match="no room"):
        start_head("127.0.0.1", num_cpus=1)
    assert ray_services.resolve_ip_for_localhost is resolve


def test_heads_started_at_once_never_leave_a_replacement_behind(monkeypatch):
    """Two heads started together: the second waits for the first to put Ray's resolution back, so neither
    restores the other's replacement (which would keep loopback addresses unrewritten for the process)."""
    resolve = ray_services.resolve_ip_for_localhost
    first_inside, first_done = threading.Event(), threading.Event()
    # How long the first start gives the second to reach `ray.init` beside it: it never does, so the test
    # spends this much once; it only has to exceed a thread's start.
    together = threading.Barrier(2, timeout=0.5)
    seen: list[str] = []

    def init(**options):
        seen.append(ray_services.resolve_ip_for_localhost(options["_node_ip_address"]))
        if not first_inside.is_set():
            first_inside.set()
            with contextlib.suppress(threading.BrokenBarrierError):
                together.wait()
            return
        with contextlib.suppress(threading.BrokenBarrierError):
            together.wait()
        assert first_done.wait(DEADLINE)  # the first start ends (and restores) before this one

    def first() -> None:
        try:
            start_head("127.0.0.1", num_cpus=1)
        finally:
            first_done.set()

    monkeypatch.setattr(ray, "init", init)
    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert first_inside.wait(DEADLINE)
    threads.append(threading.Thread(target=start_head, args=("::1",), kwargs={"num_cpus": 1}))
    threads[1].start()
    for thread in threads:
        thread.join(DEADLINE)
    assert seen == ["127.0.0.1", "127.0.0.1"]
    assert ray_services.resolve_ip_for_localhost is resolve, "a start restored the other's replacement"


def test_serve_replicas_start_the_head_and_the_http_proxy_on_the_host(started, monkeypatch):
    import threading

    from ray import serve

    from ferrox_batch.deploy.ray_serve import run_local

    proxies: list[dict] = []
    monkeypatch.setattr(serve, "start", lambda **options: proxies.append(options))
    for name in ("run", "shutdown"):
        monkeypatch.setattr(serve, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    stop = threading.Event()
    stop.set()
    run_local(object(), host="127.0.0.1", port=8123, stop=stop, num_cpus=2)
    [options] = started
    assert options["_node_ip_address"] == options["resolved"] == "127.0.0.1" and options["num_cpus"] == 2
    assert proxies == [{"http_options": {"host": "127.0.0.1", "port": 8123}}]


@pytest.mark.parametrize(("node", "bound"), [("127.0.0.1", "127.0.0.1:0"), ("::1", "[::1]:0"),
                                             ("10.1.2.3", "[::]:0")])
def test_a_replica_on_a_loopback_node_opens_its_grpc_server_there(monkeypatch, node, bound):
    from ray.serve._private import replica as serve_replica

    from ferrox_batch.deploy.ray_head import replica_ports_on_node

    opened: list[str] = []
    monkeypatch.setattr(serve_replica, "add_port_to_grpc_server", lambda server, address: opened.append(address))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: node)
    replica_ports_on_node()
    replica_ports_on_node()  # a second deployment in the same process wraps nothing twice
    serve_replica.add_port_to_grpc_server(None, "[::]:0")  # what Serve asks for as a replica starts
    serve_replica.add_port_to_grpc_server(None, "10.9.9.9:7000")  # an address of its own choosing stays
    assert opened == [bound, "10.9.9.9:7000"]


def test_the_replica_patch_replaces_only_the_replica_modules_name(monkeypatch):
    from ray._common import tls_utils
    from ray.serve._private import replica as serve_replica

    from ferrox_batch.deploy.ray_head import replica_ports_on_node

    helper = tls_utils.add_port_to_grpc_server
    monkeypatch.setattr(serve_replica, "add_port_to_grpc_server", serve_replica.add_port_to_grpc_server)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    replica_ports_on_node()
    patched = serve_replica.add_port_to_grpc_server
    replica_ports_on_node()
    assert serve_replica.add_port_to_grpc_server is patched and patched.add_port is helper  # wrapped once
    assert tls_utils.add_port_to_grpc_server is helper  # Ray's own helper, for every other caller, is untouched
