"""ferrox_batch: a thread-based continuous-batching LLM serving engine.

A Python port of the continuous-batching scheduler of the Rust server ferrox,
on a torch Llama-family runtime with a paged KV cache.
"""

__version__ = "0.1.0"

# Lazy exports (PEP 562): the admission arithmetic must import without torch, so the
# package itself imports nothing heavy until one of these names is used.
_EXPORTS = {
    "BatcherConfig": "ferrox_batch.admission.config",
    "BatcherEvent": "ferrox_batch.replies",
    "CancelToken": "ferrox_batch.cancel",
    "ContinuousBatcher": "ferrox_batch.engine.handle",
    "DecodeError": "ferrox_batch.errors",
    "DecodeFn": "ferrox_batch.scheduler.request",
    "FinishReason": "ferrox_batch.generation_types",
    "GenerationParams": "ferrox_batch.generation_types",
    "GenerationResult": "ferrox_batch.generation_types",
    "SamplingParams": "ferrox_batch.generation_types",
    "load_model": "ferrox_batch.runtime.loading.loader",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ferrox_batch' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
