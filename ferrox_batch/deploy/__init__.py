"""Running ferrox-batch as more than one replica.

* `affinity`: which replica most likely holds a prompt's prefix (pure Python, no Ray);
* `relay`: one HTTP request carried to a replica and run through its own app (pure ASGI, no Ray);
* `router`, `ray_serve`: the Ray Serve application built from those two (need `ferrox-batch[ray]`);
* `ray_head`: the local Ray head `serve --replicas` starts, its ports on `--host`'s address (needs Ray).

Nothing here is imported by the engine or `ferrox-batch serve` unless asked for, so Ray stays optional.
"""

#: How replicas are chosen: by prompt prefix (`router.PrefixAffinityRouter`), or Serve's default
#: power-of-two choices.
ROUTERS = ("affinity", "default")
