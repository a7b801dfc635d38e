"""Ollama's model endpoints: what is served (`/api/tags`, `/api/show`, `/api/ps`, `/api/version`), and the
model-management ones a fixed-model server refuses.

* `/api/tags` lists each served name, tagged (`name:latest`), with the weights' size in bytes, a digest,
  and `details` (`format: safetensors`, `quantization_level`: the precision the weights run in, e.g.
  `FP32`, `BF16`; `family` the architecture's family, `llama`, `qwen3`, ...; `parameter_size` empty: the
  server knows the weights' memory, packed copies included, not how many there are). The digest is the
  SHA-256 of the served name and what the server knows of the weights: it identifies this model on this
  server, not a blob Ollama could fetch. `modified_at` is when the server started.
* `/api/show` (`model`, or the older `name`) answers those details, `model_info` (`general.architecture`
  and, under its name as Ollama's keys are, the context length and the embedding length), `capabilities`
  (`completion`, `tools`, and `thinking` with a reasoning parser), `template` (the checkpoint's Jinja chat
  template: not a Go template), a `parameters` text of Ollama's sampling defaults as this server applies
  them (`options`), and a `modelfile` that says it is none; an unknown model is Ollama's 404.
* `/api/ps` lists the model as loaded, forever (`expires_at` far ahead: it is never unloaded), with its
  context length.
* `/api/version`: the Ollama API version these endpoints follow.
* `/api/pull`, `/api/push`, `/api/create`, `/api/copy`, `/api/delete`, `/api/blobs/...`: 403 in Ollama's
  error shape, saying this server serves a fixed model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.errors import DecodeError, InvalidRequest
from ferrox_batch.server.http.body import read_body
from ferrox_batch.server.http.errors import error_response
from ferrox_batch.server.http.generation_limits import Limits
from ferrox_batch.server.ollama.errors import OLLAMA_ERRORS, FixedModel
from ferrox_batch.server.ollama.names import served_name, tagged
from ferrox_batch.server.ollama.options import DEFAULTS
from ferrox_batch.server.requests import parse_json_object

#: The Ollama release whose API these endpoints follow (what `/api/version` answers).
OLLAMA_API_VERSION = "0.12.0"
#: `/api/ps`'s `expires_at` for a model that never unloads (what Ollama writes for `keep_alive: -1`).
NEVER = "2318-01-01T00:00:00Z"

#: The largest `/api/show` body read: it names a model, and is parsed on the event loop, so a big one must not
#: hold the loop (413 past it).
SHOW_MAX_BODY_BYTES = 64 * 1024


class OllamaModels:
    """The model endpoints of one app, over its batcher and served names."""

    def __init__(self, batcher: ContinuousBatcher, names: Sequence[str], limits: Limits, *, thinks: bool,
                 started: float) -> None:
        """`thinks`: answers' thinking is read apart (a reasoning parser or harmony); `started`: when the
        server started (epoch seconds)."""
        self._batcher = batcher
        self._names = tuple(names)
        self._limits = limits
        self._thinks = thinks
        self._modified = datetime.fromtimestamp(started, timezone.utc).isoformat().replace("+00:00", "Z")

    # ------------------------------------------------------------------ facts

    def _size(self) -> int:
        return int(self._batcher.model_stats.get("weight_bytes") or 0)

    def _details(self) -> dict[str, Any]:
        precision = str(self._batcher.model_stats.get("precision") or "")
        family = self._family()
        # No `parameter_size`: the server knows the weights' memory (packed copies included), not their count.
        return {"parent_model": "", "format": "safetensors", "family": family,
                "families": [family] if family else None, "parameter_size": "",
                "quantization_level": precision.upper()}

    def _family(self) -> str:
        """The model's family (its `model_type`: `llama`, `qwen3`, ...), where the KV store's config says."""
        config = getattr(self._batcher.store, "config", None)
        try:
            return str(config.family) if config is not None else ""
        except (AttributeError, KeyError, ValueError):  # an architecture no family claims: unnamed
            return ""

    def _digest(self, name: str) -> str:
        stats = self._batcher.model_stats
        seen = f"{name}\0{stats.get('precision')}\0{stats.get('weight_bytes')}\0{self._batcher.hidden_size}"
        return hashlib.sha256(seen.encode("utf-8")).hexdigest()

    def _entry(self, name: str) -> dict[str, Any]:
        return {"name": tagged(name), "model": tagged(name), "modified_at": self._modified, "size": self._size(),
                "digest": self._digest(name), "details": self._details()}

    # ------------------------------------------------------------------ endpoints

    async def tags(self) -> dict[str, Any]:
        return {"models": [self._entry(name) for name in self._names]}

    async def ps(self) -> dict[str, Any]:
        limit = self._batcher.ceiling.limit()
        return {"models": [{**self._entry(name), "expires_at": NEVER, "size_vram": 0, "context_length": limit}
                           for name in self._names]}

    async def version(self) -> dict[str, str]:
        return {"version": OLLAMA_API_VERSION}

    async def show(self, request: Request) -> Response:
        try:
            # Parsed on the event loop: a model name needs no more than `SHOW_MAX_BODY_BYTES`.
            body = parse_json_object(await read_body(request, min(SHOW_MAX_BODY_BYTES, self._limits.max_body_bytes),
                                                     self._limits.body_read_timeout))
            asked = body.get("model") or body.get("name")
            if not isinstance(asked, str) or not asked:
                raise InvalidRequest("model", asked, "is required")
            name = served_name(asked, self._names)
        except DecodeError as refusal:
            return error_response(refusal, OLLAMA_ERRORS)
        limit = self._batcher.ceiling.limit()
        tokenizer = self._batcher.tokenizer
        family = self._family()
        info: dict[str, Any] = {"general.architecture": family, "general.basename": name}
        if limit is not None:  # under the architecture's name, as Ollama's model info keys are
            info[f"{family}.context_length"] = limit
        if self._batcher.hidden_size is not None:
            info[f"{family}.embedding_length"] = self._batcher.hidden_size
        capabilities = ["completion", "tools"] + (["thinking"] if self._thinks else [])
        return JSONResponse({
            "modelfile": f"# ferrox-batch serves {name} as it was started: there is no Modelfile\nFROM {name}\n",
            "parameters": "\n".join(f"{key} {value}" for key, value in DEFAULTS.items()),
            "template": (tokenizer.chat_template if tokenizer is not None else None) or "",
            "details": self._details(), "model_info": info, "capabilities": capabilities,
            "modified_at": self._modified})

    async def fixed(self, request: Request) -> Response:
        """Model management: refused, whatever the body (it is never read)."""
        action = request.url.path.removeprefix("/api/").split("/", 1)[0]
        return error_response(FixedModel(f"/api/{action}"), OLLAMA_ERRORS)

    async def running(self, request: Request) -> Response:
        """`HEAD /`: what Ollama's clients probe for. `GET /` comes here only with the chat page off: a 404."""
        if request.method != "HEAD":
            raise StarletteHTTPException(404)
        return Response("Ollama is running", media_type="text/plain")

