"""How a conversation is rendered: `--chat-template` (a template in place of the checkpoint's), and vLLM's
`chat_template_kwargs`, `add_generation_prompt` and `continue_final_message`, on the chat endpoint and
`/tokenize` alike.

Pins: a template given at load replaces the checkpoint's (and one that does not compile fails the load);
a request's template variables reach the template (Qwen3's `enable_thinking`); without the generation
prompt the text ends after the last message; continuing the final message ends the text where its
content does, so the answer continues it; bad combinations and reserved or oversized variables are 400s
naming the field.
"""

from __future__ import annotations

import argparse

import httpx
import pytest
from server_helpers import MODEL_NAME, openai_client, served, tiny_batcher
from tiny_checkpoint import write_tiny_checkpoint

from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.loading.loader import load_model

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
HISTORY = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]


@pytest.fixture(scope="module")
def rendered_server(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-template"), tie=False, std=0.15, seed=5)
    model = load_model(folder, device="cpu", dtype="float32", chat_template=TEMPLATE)
    assert model.tokenizer.chat_template == TEMPLATE
    with served(tiny_batcher(model)) as (base_url, app):
        RENDERERS[base_url] = model.tokenizer
        yield base_url
        RENDERERS.clear()


#: The served model's tokenizer, by base URL, to write the ids `/tokenize` returns as text, special tokens
#: included.
RENDERERS: dict[str, object] = {}


def render(base_url: str, **fields) -> str:
    reply = httpx.post(f"{base_url}/tokenize", json=fields, timeout=30)
    assert reply.status_code == 200, reply.text
    tokenizer = RENDERERS[base_url]
    return "".join(tokenizer.special_texts.get(t, tokenizer.decode([t])).decode() for t in reply.json()["tokens"])


def test_template_variables_reach_the_template(rendered_server):
    plain = render(rendered_server, messages=HISTORY[:1])
    off = render(rendered_server, messages=HISTORY[:1], chat_template_kwargs={"enable_thinking": False})
    assert plain.endswith("<|im_start|>assistant\n") and off.endswith("<think>\n\n</think>\n\n")
    with openai_client(rendered_server) as client:
        a = client.chat.completions.create(model=MODEL_NAME, messages=HISTORY[:1], max_tokens=1)
        b = client.chat.completions.create(model=MODEL_NAME, messages=HISTORY[:1], max_tokens=1,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert b.usage.prompt_tokens > a.usage.prompt_tokens


def test_the_generation_prompt_and_continuing_the_final_message(rendered_server):
    closed = render(rendered_server, messages=HISTORY, add_generation_prompt=False)
    assert closed.endswith("The color is<|im_end|>\n")
    kept_open = render(rendered_server, messages=HISTORY, add_generation_prompt=False, continue_final_message=True)
    assert kept_open.endswith("<|im_start|>assistant\nThe color is")
    with openai_client(rendered_server) as client:
        reply = client.chat.completions.create(model=MODEL_NAME, messages=HISTORY, max_tokens=3,
                                               extra_body={"add_generation_prompt": False,
                                                           "continue_final_message": True,
                                                           "return_token_ids": True})
    assert len(reply.model_extra["prompt_token_ids"]) == len(render_ids(rendered_server, HISTORY))


def render_ids(base_url: str, messages) -> list[int]:
    return httpx.post(f"{base_url}/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                                    "continue_final_message": True}, timeout=30).json()["tokens"]


@pytest.mark.parametrize("fields, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # with the default generation prompt
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"big": "x" * 20_000}}, "chat_template_kwargs"),
    ({"add_generation_prompt": "no"}, "add_generation_prompt"),
])
def test_bad_rendering_fields_are_400s(rendered_server, fields, param):
    for path, body in (("/v1/chat/completions", {"model": MODEL_NAME, "messages": HISTORY, "max_tokens": 1}),
                       ("/tokenize", {"messages": HISTORY})):
        reply = httpx.post(f"{rendered_server}{path}", json={**body, **fields}, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_a_template_that_does_not_compile_fails_the_load(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "m", tie=False)
    with pytest.raises(ModelLoadError, match="chat template"):
        load_model(folder, device="cpu", dtype="float32", chat_template="{% for x in %}")


def test_the_cli_reads_the_template_file(tmp_path):
    from ferrox_batch.cli.common import CliError, chat_template_text

    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    assert chat_template_text(argparse.Namespace(chat_template=str(path))) == TEMPLATE
    assert chat_template_text(argparse.Namespace(chat_template=None)) is None
    with pytest.raises(CliError, match="--chat-template"):
        chat_template_text(argparse.Namespace(chat_template=str(tmp_path / "missing.jinja")))
