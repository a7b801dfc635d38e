"""ferrox_batch: a thread-based continuous-batching LLM serving engine.

A Python port of the continuous-batching scheduler of the Rust server ferrox,
on a torch Llama-family runtime with a paged KV cache.
"""

__version__ = "0.1.0"
