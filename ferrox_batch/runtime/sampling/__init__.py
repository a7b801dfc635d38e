"""Choosing tokens from logits: the batched sampler, its per-request rows, filters, logit transforms, grammar
masks and log-probabilities."""
