"""What a client sends reaches the server's log lines escaped: one request, one line, nothing forged.

Pins: a refused request whose path carries a percent-encoded newline (or other control characters, or a
terminal escape) logs one line with them escaped; a refused Host is logged through the same escaping.
"""

from __future__ import annotations

import logging

import httpx
from server_helpers import DEADLINE, served, tiny_batcher

from ferrox_batch.server.http.log_text import loggable

KEY = "sk-log-1"


def test_loggable_escapes_control_characters_and_keeps_the_rest():
    assert loggable("/v1/completions") == "/v1/completions"
    assert loggable("/v1/x\nFAKE\r\t\x1b[31m\x00\x7f\u2028") == "/v1/x\\nFAKE\\r\\t\\x1b[31m\\x00\\x7f\\u2028"
    assert loggable("caf\u00e9 \u6f22") == "caf\u00e9 \u6f22"
    assert loggable("x" * 10_000).endswith("...") and len(loggable("x" * 10_000)) < 600


def test_a_refused_path_with_a_newline_logs_one_line(tiny_batch_model, caplog):
    caplog.set_level(logging.INFO, logger="ferrox_batch.server")
    with served(tiny_batcher(tiny_batch_model), api_key=KEY, allowed_hosts=("localhost",)) as (base_url, _app):
        port = base_url.rsplit(":", 1)[1]
        for path in ("/v1/x%0aFAKE%20request%20ok", "/v1/x%0d%0aFAKE", "/v1/%1b%5b2J"):
            response = httpx.get(base_url + path, headers={"Authorization": "Bearer wrong", "Host": f"localhost:{port}"},
                                 timeout=DEADLINE)
            assert response.status_code == 401
        refused = httpx.get(base_url + "/v1/models", headers={"Host": "évil.example".encode("latin-1")}, timeout=DEADLINE)
        assert refused.status_code == 400
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("ferrox_batch.server") and " on GET " in r.getMessage()]
    assert len(lines) == 4, lines
    for line in lines:
        assert not any(ch < " " or ch == "\x7f" for ch in line), line
    assert "/v1/x\\nFAKE request ok" in lines[0] and "\\r\\n" in lines[1] and "\\x1b[2J" in lines[2]
    assert "évil.example" in lines[3]
