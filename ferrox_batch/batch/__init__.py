"""The continuous batcher: handle, worker, and the admission arithmetic it runs on."""
