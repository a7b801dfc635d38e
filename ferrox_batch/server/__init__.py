"""The OpenAI-compatible HTTP server over a `ContinuousBatcher`.

* `create_app(batcher, model_name=...)`: the FastAPI app (`server.app`);
* `serve(model, batcher_config, host, port, ...)`: load, start, serve until
  stopped, then shut everything down (`server.run`; `ferrox-batch serve`).

Module map: `requests` parses and checks bodies, `generation` serves the two
generation endpoints, `preparation` turns a body into submitted requests and
picks their answer shapes, `streaming` bridges a blocking `Ticket` to the
event loop and to server-sent events, `responses` holds OpenAI's wire shapes,
`metrics` the Prometheus registry, `errors` the HTTP-only refusals.
"""

from __future__ import annotations

from ferrox_batch.server.app import create_app
from ferrox_batch.server.run import DEFAULT_HOST, DEFAULT_PORT, serve

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "create_app", "serve"]
