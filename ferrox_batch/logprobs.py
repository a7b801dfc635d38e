"""`TokenLogprob`: what a request that asked for log-probabilities gets for each token it generated.

They are the model's own log-probabilities, `log_softmax` of the raw logits over the vocabulary, before
any sampling transform (penalties, temperature, top-k/top-p/min-p), as vLLM and llama.cpp's server report
them: a client scoring text wants the model's belief, not the sampler's. `top` holds the `k` most likely
tokens under that same distribution, most likely first (the sampled token may or may not be among them).

Shared vocabulary: the sampler makes them, the scheduler hands them on with the text, the server writes
them in OpenAI's shapes. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The most alternatives a request may ask for per token (OpenAI's `top_logprobs` limit, vLLM's default).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    #: 1 + how many tokens are strictly likelier than `token` (vLLM's `rank`); None where not computed.
    rank: int | None = None
