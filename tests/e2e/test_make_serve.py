"""`make serve`, as a newcomer runs it: the server starts on the default model, prints the chat page's address,
serves the page there, and answers a chat request.

The suite runs after `make test` installed everything and fetched the model, so
here `make serve` only checks its stamps, confirms the model, and starts the
server. The process group (make, and the server it started) is stopped however
the test ends, and the port must be free again afterwards.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from process_helpers import free_port, server_process, wait_healthy, wait_port_free

REPO = Path(__file__).resolve().parents[2]
#: Loading the default model takes seconds here; a cold CI machine gets far more room.
STARTUP_SECS = 180.0

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(400)]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_serve_starts_the_default_model_and_answers_a_chat(real_model_dir: Path) -> None:
    port = free_port()
    # A make that runs this suite (`make test`) passes its jobserver and level down; the server's make
    # is a separate, top-level run.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    with server_process(["make", "--no-print-directory", "serve", f"PORT={port}"], cwd=REPO, env=env) as server:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, server, timeout=STARTUP_SECS)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=32, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        answer = reply.choices[0].message.content
        assert answer and answer.strip(), reply
        assert reply.model == "smollm2-135m-instruct"
        assert f"chat page: {base_url}/" in server.output()
        page = httpx.get(f"{base_url}/", timeout=30)
        assert page.status_code == 200 and 'id="messages"' in page.text
    assert server.stopped_by == "SIGINT", server.output()[-4000:]
    output = server.output()
    assert "Traceback" not in output, output[-4000:]
    assert "Finished server process" in output
    assert wait_port_free(port), f"port {port} is still taken after the server stopped"
