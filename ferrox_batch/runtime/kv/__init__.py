"""The paged KV store: one pool allocated whole, its block pool and prefix cache, the flat inputs a forward
reads from it, and the memory budget it is sized from."""
