"""The OpenAI-compatible HTTP server over a `ContinuousBatcher`.

* `create_app(batcher, model_name=...)`: the FastAPI app (`server.app`);
* `serve(model, batcher_config, host, port, ...)`: load, start, serve until
  stopped, then shut everything down (`server.run`; `ferrox-batch serve`).

Module map: `requests` parses and checks the engine's chat and completion
requests, `generation` serves the generation endpoints, `preparation` turns a
body into submitted requests and picks their answer shapes. Below them, `http`
is the layer every API shares (access checks, bodies, `streaming`, which
bridges a blocking `Ticket` to the event loop, `metrics`, `errors` and each
API's `error_shapes`); `openai` is OpenAI's surface (its wire shapes, the
Responses API, embeddings, tokenization).
"""

from __future__ import annotations

from ferrox_batch.server.app import create_app
from ferrox_batch.server.run import DEFAULT_HOST, DEFAULT_PORT, serve

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "create_app", "serve"]
