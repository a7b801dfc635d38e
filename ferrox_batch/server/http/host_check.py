"""Which `Host` a request may name: the guard against DNS rebinding.

A server on the user's own machine is reachable from any web page the user visits: the page's script
cannot read a cross-origin answer, but with DNS rebinding (its own name re-pointed at 127.0.0.1) the
browser treats the server as the page's own origin and lets it read everything. What such a request cannot
hide is its `Host` header, which names the attacker's domain. So a server bound to a loopback address
answers only requests that name it by a loopback name (`LOOPBACK_HOSTS`, any port).

A server bound to all interfaces (`0.0.0.0`, `::`) or to another address checks nothing by default: it
cannot know the names clients reach it by (a Service, an ingress, a load balancer), it is reachable
directly anyway, and its guard is the API key. `--allowed-hosts` lists names for either case; `*` allows
any, and `*.example.com` any subdomain of example.com.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

#: What a loopback-bound server answers to by default: the names a local client uses for it.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def default_allowed_hosts(bind_host: str) -> tuple[str, ...] | None:
    """The Host names a server bound to `bind_host` allows when told none: the loopback names when it is a
    loopback address (or `localhost`), else None (no check)."""
    host = bind_host.strip().lower().removeprefix("[").removesuffix("]")
    if host == "localhost":
        return LOOPBACK_HOSTS
    try:
        return LOOPBACK_HOSTS if ipaddress.ip_address(host).is_loopback else None
    except ValueError:  # a name other than localhost: it resolves to whatever the operator made it
        return None


def check_allowed_hosts(allowed: Sequence[str] | None) -> tuple[str, ...] | None:
    """`allowed` as a tuple of lower-case names, or a ValueError naming what is wrong with it."""
    if allowed is None:
        return None
    if isinstance(allowed, str) or not allowed:
        raise ValueError(f"allowed_hosts must be None or a non-empty sequence of host names, got {allowed!r}")
    names = []
    for name in allowed:
        if not isinstance(name, str) or not name.strip() or any(ch.isspace() or ch in "/@," for ch in name.strip()):
            raise ValueError(f"allowed_hosts: {name!r} is not a host name (e.g. api.example.com, [::1] or *)")
        names.append(name.strip().lower())
    return tuple(names)


def host_name(header: str) -> str:
    """The name a `Host` header gives, without its port, lower-case (`[::1]:8000` -> `[::1]`)."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        return header[:end + 1] if end > 0 else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def host_allowed(header: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a request naming `header` (None: no Host header) may pass a server that allows `allowed`."""
    if "*" in allowed:
        return True
    if not header:
        return False
    name = host_name(header)
    return any(name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:]) and
                                   len(name) > len(pattern) - 1)
               for pattern in allowed)
