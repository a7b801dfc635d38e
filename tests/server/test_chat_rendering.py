"""How a conversation is rendered: `--chat-template` (a template in place of the checkpoint's), and vLLM's
`chat_template_kwargs`, `add_generation_prompt` and `continue_final_message`, on the chat endpoint and
`/tokenize` alike.

Pins: a template given at load replaces the checkpoint's (and one that does not compile fails the load);
a request's template variables reach the template (Qwen3's `enable_thinking`); without the generation
prompt the text ends after the last message; continuing the final message ends the text where its
content does, so the answer continues it; bad combinations and reserved or oversized variables are 400s
naming the field. With Qwen-, Llama 3- and Gemma-style templates, a variable named after what the template
environment defines (`namespace`, `range`, `raise_exception`, `loop`, ...) or what the server sets
(`messages`, `tools`, `add_generation_prompt`, ...) is a 400 naming `chat_template_kwargs` and the name,
while the variables those templates read (`enable_thinking`, `date_string`) reach them; a value the template
cannot use (a number where it adds strings) is a 400 naming the messages, never a 500.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import httpx
import pytest
from server_helpers import MODEL_NAME, openai_client, served, tiny_batcher
from tiny_checkpoint import write_tiny_checkpoint

from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.loading.loader import load_model
from ferrox_batch.runtime.loading.chat_template import SERVER_VARIABLES, TEMPLATE_GLOBALS

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


#: Family templates as their checkpoints write them, cut to what they use: Qwen3's `namespace` scanned
#: backwards for the last user turn and its `enable_thinking`; Llama 3.2's `strftime_now` date with the
#: `date_string` a request may set; Gemma 3's `raise_exception` on turns that do not alternate, and `loop`.
FAMILY_TEMPLATES = {
    "qwen3": (
        "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
        "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
        "{%- if ns.multi_step_tool and message.role == 'user' %}"
        "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
        "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
        "{%- endif %}{%- endif %}"),
    "llama3": (
        "{{- bos_token }}"
        "{%- if not date_string is defined %}{%- if strftime_now is defined %}"
        "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}{%- set date_string = '26 Jul 2024' %}"
        "{%- endif %}{%- endif %}"
        "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
        "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
        "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
        "{{- 'Cutting Knowledge Date: December 2023\\n' }}{{- 'Today Date: ' + date_string + '\\n\\n' }}"
        "{{- system_message }}{{- '<|eot_id|>' }}"
        "{%- for message in messages %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
        " + '<|eot_id|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"),
    "gemma3": (
        "{{ bos_token }}"
        "{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
        "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}"
        "{%- set loop_messages = messages -%}{%- endif -%}"
        "{%- for message in loop_messages -%}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
        "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}"
        "{%- set role = message['role'] -%}{%- endif -%}"
        "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
        "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"),
}
#: Names a request could try to set that the template environment or the server already gives a meaning.
TAKEN_NAMES = ("namespace", "range", "dict", "cycler", "joiner", "lipsum", "raise_exception", "strftime_now",
               "loop", "self", "caller", "messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


@pytest.fixture(scope="module")
def family_server(tmp_path_factory):
    """A tiny checkpoint served; each test sets the family template it renders with (`family_template`)."""
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-families"), tie=False, std=0.15, seed=5)
    model = load_model(folder, device="cpu", dtype="float32")
    with served(tiny_batcher(model)) as (base_url, _app):
        yield base_url, model.tokenizer


@contextlib.contextmanager
def family(family_server, name: str) -> Iterator[str]:
    """The family server rendering with `name`'s template (its base URL), the checkpoint's again afterwards."""
    base_url, tokenizer = family_server
    original = tokenizer.chat_template
    tokenizer.set_chat_template(FAMILY_TEMPLATES[name])
    RENDERERS[base_url] = tokenizer
    try:
        yield base_url
    finally:
        tokenizer.set_chat_template(original)
        RENDERERS.pop(base_url, None)


@pytest.fixture(params=sorted(FAMILY_TEMPLATES))
def family_template(request, family_server):
    with family(family_server, request.param) as base_url:
        yield request.param, base_url


def test_the_taken_names_are_what_the_environment_and_the_server_define():
    assert set(TAKEN_NAMES) <= TEMPLATE_GLOBALS | SERVER_VARIABLES
    assert {"namespace", "range", "dict", "cycler", "joiner", "lipsum"} <= TEMPLATE_GLOBALS  # Jinja's own


@pytest.mark.parametrize("name", TAKEN_NAMES)
def test_a_variable_named_after_a_template_global_or_a_server_variable_is_a_400(family_template, name):
    family, base_url = family_template
    for path, body in (("/v1/chat/completions", {"model": MODEL_NAME, "messages": HISTORY[:1], "max_tokens": 1}),
                       ("/tokenize", {"messages": HISTORY[:1]})):
        reply = httpx.post(f"{base_url}{path}", json={**body, "chat_template_kwargs": {name: "x"}}, timeout=30)
        assert reply.status_code == 400, (family, name, path, reply.text)
        error = reply.json()["error"]
        assert error["param"] == "chat_template_kwargs" and repr(name) in error["message"], error


def test_the_variables_family_templates_read_reach_them(family_template):
    family, base_url = family_template
    plain = render(base_url, messages=HISTORY[:1])
    if family == "llama3":
        assert "Today Date: 01 Jan 2026" in render(base_url, messages=HISTORY[:1],
                                                   chat_template_kwargs={"date_string": "01 Jan 2026"})
    if family == "qwen3":
        off = render(base_url, messages=HISTORY[:1], chat_template_kwargs={"enable_thinking": False})
        assert off == plain + "<think>\n\n</think>\n\n"
    with openai_client(base_url) as client:
        reply = client.chat.completions.create(model=MODEL_NAME, messages=HISTORY[:1], max_tokens=1,
                                               extra_body={"chat_template_kwargs": {"unused_flag": True}})
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_value_the_template_cannot_use_is_a_400_naming_the_messages(family_server):
    with family(family_server, "llama3") as base_url:  # it adds `date_string` to a string
        for path, body in (("/v1/chat/completions", {"model": MODEL_NAME, "messages": HISTORY[:1], "max_tokens": 1}),
                           ("/tokenize", {"messages": HISTORY[:1]})):
            reply = httpx.post(f"{base_url}{path}", json={**body, "chat_template_kwargs": {"date_string": 5}},
                               timeout=30)
            assert reply.status_code == 400, (path, reply.text)
            assert reply.json()["error"]["param"] == "messages"
