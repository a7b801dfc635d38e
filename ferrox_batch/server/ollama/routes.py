"""The Ollama API's routes on an app: one short call from `create_app`.

Generation and embeddings go through the app's `Generations.serve`, under the same admission (open-request
cap, body limits, the batcher's refusals) as the OpenAI endpoints, with errors in Ollama's shape. `HEAD /`
answers what Ollama's clients probe for ("Ollama is running"); `GET /` stays the chat page (or a 404 with
the page off): clients that check for a server use `HEAD /`, `/api/version` or `/api/tags`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from ferrox_batch.server.generation import Generations
from ferrox_batch.server.ollama.models import OllamaModels
from ferrox_batch.server.ollama.surface import OllamaSurface
from ferrox_batch.server.ollama.translation import OLLAMA_CHAT, OLLAMA_EMBED, OLLAMA_EMBEDDINGS, OLLAMA_GENERATE

#: The path prefix every Ollama route shares (its error shape's, `error_shapes`).
PREFIX = "/api"
#: Model management: refused on a fixed-model server (path, methods).
MANAGEMENT = (("/api/pull", ["POST"]), ("/api/push", ["POST"]), ("/api/create", ["POST"]),
              ("/api/copy", ["POST"]), ("/api/delete", ["DELETE"]),
              ("/api/blobs/{digest}", ["HEAD", "POST"]))


def add_ollama_routes(app: FastAPI, generations: Generations, models: OllamaModels, *, ui: bool) -> None:
    """`ui`: the chat page is on `GET /` (without it, `GET /` is still a 404: only `HEAD /` answers)."""
    def serving(endpoint: str) -> Any:
        surface = OllamaSurface(endpoint)

        async def serve(request: Request) -> Response:
            return await generations.serve(request, surface=surface)

        return serve

    for path, endpoint in (("/api/chat", OLLAMA_CHAT), ("/api/generate", OLLAMA_GENERATE),
                           ("/api/embed", OLLAMA_EMBED), ("/api/embeddings", OLLAMA_EMBEDDINGS)):
        app.add_api_route(path, serving(endpoint), methods=["POST"])
    app.add_api_route("/api/tags", models.tags, methods=["GET"])
    app.add_api_route("/api/ps", models.ps, methods=["GET"])
    app.add_api_route("/api/version", models.version, methods=["GET"])
    app.add_api_route("/api/show", models.show, methods=["POST"])
    for path, methods in MANAGEMENT:
        app.add_api_route(path, models.fixed, methods=methods)
    # With the page off, GET is routed here too, for its 404 (a HEAD-only route would make it a 405).
    app.add_api_route("/", models.running, methods=["HEAD"] if ui else ["HEAD", "GET"])
