"""`POST /v1/embeddings`: each input's final hidden states, pooled, through the same batcher as generation.

Each input is a prompt that runs alone through its prefill (chunked like any other, batched with whatever
else is running) and never decodes: its rows' final hidden states (after the model's last norm) are
pooled on the worker (`GenerationParams.pooling`). The request, as OpenAI's and vLLM's:

* `input`: a string, a list of strings, a list of token ids, or a list of token-id lists (at most
  `choices.MAX_PROMPT_ROWS`), each one embedding, in order;
* `encoding_format`: `float` (a list of numbers) or `base64` (the little-endian float32 bytes, as OpenAI
  sends them);
* `dimensions`: keep the first k values (before normalising), at most the model's width;
* `normalize` (vLLM's, default true): scale each embedding to unit L2 length;
* `pooling` (ours, default `--pooling`'s): `last` (the last token's state, what a causal model's
  embedding usually is) or `mean` (over every position);
* `truncate_prompt_tokens` (vLLM's): keep each input's last k tokens; `user` is accepted.
"""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ferrox_batch.errors import InvalidRequest
from ferrox_batch.generation_types import POOLING, GenerationResult, SamplingParams
from ferrox_batch.server.choices import MAX_PROMPT_ROWS
from ferrox_batch.server.extra_fields import read_truncation
from ferrox_batch.server.fields import Fields
from ferrox_batch.server.http.json_body import json_pieces
from ferrox_batch.server.sampling_fields import SamplingOptions
from ferrox_batch.usage import Usage

ENCODINGS = ("float", "base64")
#: `--pooling`'s default: a causal model's embedding is its last token's state.
DEFAULT_POOLING = "last"


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """`POST /v1/embeddings`, in the shape the generation pipeline reads (one row per input, no decoding)."""

    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]
    options: SamplingOptions
    encoding_format: str = "float"
    dimensions: int | None = None
    normalize: bool = True
    truncate_prompt_tokens: int | None = None
    max_tokens: int = 0
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    best_of: int = 1
    echo: bool = False
    return_token_ids: bool = False
    prompt_logprobs: int | None = None


def parse_embedding_request(body: Mapping[str, Any], *, default_pooling: str = DEFAULT_POOLING,
                            hidden_size: int | None = None) -> EmbeddingRequest:
    from ferrox_batch.server.requests import read_prompts  # the same four forms as a completion's prompt

    fields = Fields(body)
    model = fields.raw("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model", model, "must be a string")
    user = fields.raw("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("user", user, "must be a string")
    encoding = fields.raw("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise InvalidRequest("encoding_format", encoding, f"must be one of {', '.join(ENCODINGS)}")
    dimensions = fields.integer("dimensions", None)
    if dimensions is not None and not 1 <= dimensions <= (hidden_size or dimensions):
        raise InvalidRequest("dimensions", dimensions, f"must be an integer in [1, {hidden_size}] (the model's width)")
    pooling = fields.raw("pooling")
    if pooling is None:
        pooling = default_pooling
    if pooling not in POOLING:
        raise InvalidRequest("pooling", pooling, f"must be one of {', '.join(POOLING)}")
    prompts = read_prompts(body.get("input"), "input")
    if len(prompts) > MAX_PROMPT_ROWS:
        raise InvalidRequest("input", len(prompts), f"may hold at most {MAX_PROMPT_ROWS} inputs")
    return EmbeddingRequest(model=model, prompts=prompts,
                            options=SamplingOptions(sampling=SamplingParams(), pooling=pooling),
                            encoding_format=encoding, dimensions=dimensions,
                            normalize=fields.boolean("normalize", True),
                            truncate_prompt_tokens=read_truncation(fields))


class EmbeddingFormat:
    """The answer of one embeddings request (whole only: embeddings do not stream)."""

    def __init__(self, model: str, request: EmbeddingRequest) -> None:
        self.model = model
        self.request = request
        self.id = f"embd-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def full(self, results: Sequence[GenerationResult], usages: Sequence[Usage] | None = None) -> Iterator[str]:
        prompt_tokens = sum(r.usage.prompt_tokens for r in results)
        body = {"id": self.id, "object": "list", "created": self.created, "model": self.model,
                "data": (self._item(i, r) for i, r in enumerate(results)),
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
        return json_pieces(body)

    def _item(self, index: int, result: GenerationResult) -> dict[str, Any]:
        vector = list(result.embedding or ())
        if self.request.dimensions is not None:
            vector = vector[:self.request.dimensions]
        if self.request.normalize:
            norm = math.sqrt(math.fsum(v * v for v in vector))
            if norm > 0:
                vector = [v / norm for v in vector]
        value: list[float] | str = vector
        if self.request.encoding_format == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        return {"object": "embedding", "index": index, "embedding": value}
