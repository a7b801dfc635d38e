"""Everything that touches a device: model config, paged KV store, decoder, tokenizer, loading and fetching."""
