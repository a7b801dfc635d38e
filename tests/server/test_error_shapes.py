"""`ErrorShapes`: the API a path belongs to picks the shape of its errors; OpenAI's everywhere else."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ferrox_batch.server.http.error_shapes import OPENAI_ERRORS, ErrorShapes, error_message, shaped_response


class Flat:
    """A shape that keeps the message alone, and answers a busy server with another status."""

    def translate(self, status: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return (529 if status == 503 else status), {"error": error_message(body)}


FLAT = Flat()
SHAPES = ErrorShapes((("/v1/messages", FLAT), ("/api", FLAT)))


def test_a_path_under_a_prefix_gets_that_api_s_shape():
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/api/chat", "/api", "/api/tags"):
        assert SHAPES.for_path(path) is FLAT, path
    for path in ("/v1/messagesx", "/apis", "/v1/chat/completions", "/", "/api2/chat", "/v1/models"):
        assert SHAPES.for_path(path) is OPENAI_ERRORS, path


@given(st.text(max_size=30))
def test_no_prefix_claims_a_path_that_does_not_start_with_it(path):
    shape = SHAPES.for_path(path)
    claimed = any(path == p or path.startswith(p + "/") for p in ("/v1/messages", "/api"))
    assert (shape is FLAT) == claimed


def test_a_response_is_the_shape_s_status_body_and_the_headers():
    body = {"error": {"type": "server_error", "code": "server_busy", "message": "busy; retry"}}
    response = shaped_response(FLAT, 503, body, {"Retry-After": "1"})
    assert response.status_code == 529 and response.headers["retry-after"] == "1"
    assert json.loads(response.body) == {"error": "busy; retry"}
    same = shaped_response(OPENAI_ERRORS, 503, body)
    assert same.status_code == 503 and json.loads(same.body) == body
