"""Each family's chat format, rendered by our template engine exactly as transformers renders it.

A checkpoint brings its own chat template (`tokenizer_config.json`, or a GGUF's `tokenizer.chat_template`);
the runtime renders whatever it brings. These templates are written here in the formats of the families
the runtime runs, using what those templates use: Gemma's turns (a `model` role, the system prompt folded
into the first user turn, `raise_exception` on roles that do not alternate, `bos_token`), Phi's role tags
closed by `<|end|>` and the EOS when no reply is asked for, and Qwen3's ChatML with a `namespace` scanned
backwards for the last user turn and an empty thinking block before earlier replies. Each is rendered by
transformers' `apply_chat_template` from the same folder and must agree character for character.
"""

from __future__ import annotations

import json
import shutil

import pytest

from ferrox_batch.runtime.loading.tokenizer import Tokenizer

GEMMA = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\\n\\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('turns must alternate user/assistant') }}{% endif %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + (m['content'] | trim) }}"
    "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
PHI = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)
QWEN3 = (
    "{% set ns = namespace(last_user=messages | length - 1) %}"
    "{% for m in messages[::-1] %}{% if m['role'] == 'user' and ns.last_user == messages | length - 1 %}"
    "{% set ns.last_user = messages | length - 1 - loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'].split('</think>')[-1].lstrip('\\n') }}"
    "{{ '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "<think>easy</think>\n4"}, {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": "Caf\u00e9 \U0001f680"}, {"role": "assistant", "content": "Oui."},
     {"role": "user", "content": "\u65e5\u672c\u8a9e?"}],
]


TEMPLATES = {"gemma": GEMMA, "phi": PHI, "qwen3": QWEN3}


def with_template(family: str, source, folder):
    """A copy of the tiny checkpoint's tokenizer with `family`'s template (and a BOS for it to write)."""
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        shutil.copy(source / name, folder / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.update(chat_template=TEMPLATES[family], bos_token="<|endoftext|>")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def family_dir(request, tiny_llama_dir, tmp_path_factory):
    return request.param, with_template(request.param, tiny_llama_dir, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("prompt", [True, False])
def test_each_family_template_renders_as_transformers_renders_it(family_dir, index, prompt):
    transformers = pytest.importorskip("transformers")
    family, folder = family_dir
    messages = CONVERSATIONS[index]
    if family == "gemma" and not prompt and messages[-1]["role"] == "user":
        prompt = True  # a Gemma conversation is asked for its reply
    ours = Tokenizer.from_dir(folder).apply_chat_template(messages, add_generation_prompt=prompt)
    theirs = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, add_generation_prompt=prompt, tokenize=False)
    assert ours == theirs


def test_a_template_that_refuses_the_turns_is_a_clear_error(tiny_llama_dir, tmp_path):
    tok = Tokenizer.from_dir(with_template("gemma", tiny_llama_dir, tmp_path))
    with pytest.raises(ValueError, match="turns must alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "first"}])
