"""Gemma 3 270M (`ferrox-batch fetch gemma3-270m`, fetched by `make test`) against transformers reading its GGUF.

Ours is the folder the fetch converted, in fp32; the reference is transformers' own GGUF loader on the
downloaded file: two independent readings of the same Q4_K_M/Q5_0/Q8_0/Q6_K blocks. Every sequence runs
past the 512-position window of the local layers (five in six), so those layers really attend over a
window: a 625-token prompt (the window slides through the prefill) and a 490-token prompt whose 48
generated tokens slide it through the decode. Greedy ids must be identical, every step decided by the
arithmetic (`assert_decisive`).

Measured on this project's 2-core machine, one torch thread: loading ours 13-27 s, transformers' GGUF
load 55-88 s and its tokenizer 25-41 s, each comparison 10-20 s. (A short prompt and 540 greedy tokens
also matched, every step decisive, but took 170 s: the 48 tokens past a longer prompt cross the window the
same way.)
"""

from __future__ import annotations

import os

import pytest
import torch
from numerics import assert_decisive, assert_logits_close

from ferrox_batch.runtime.kv.batch_inputs import SeqChunk
from ferrox_batch.runtime.loading.fetch import (
    GEMMA3_270M,
    default_gguf_path,
    ferrox_home_from_env,
    fetch_default_model,
)
from ferrox_batch.runtime.loading.loader import load_model

pytestmark = pytest.mark.real_model

LONG_PROMPT = """Continuous batching is a way of serving a language model to many people at once. Instead of \
waiting until a fixed group of requests has finished, the server adds a new request to the running batch as soon as \
there is room for it, and removes each request the moment it is done. The model then spends its time on useful work: \
every forward pass carries one new token for each conversation that is still going, plus a slice of the prompts that \
have just arrived.

The idea sounds simple, but it changes how memory is managed. Each conversation keeps the keys and values of every \
token it has seen, and those grow with every step. A paged cache stores them in small blocks, the way an operating \
system stores the pages of a program, so that a request only holds the blocks it needs and returns them when it ends. \
A scheduler decides, before every step, which requests may run, which prompts may be read in, and whether there is \
enough memory to admit one more.

Long prompts are read in chunks. A chunk of a few hundred tokens goes into the same forward pass as the decoding \
steps of the other requests, so that nobody waits for a long prompt to be read before getting their next word. The \
size of the chunk is a trade between throughput, which likes large chunks, and latency, which likes small ones.

There is more to serving than the model itself. The server must count tokens, stop at the right words, stream text \
back as it is produced, refuse what it cannot do with a clear message, and keep running when a client disappears in \
the middle of an answer. It must also be fair: a request that has waited for a long time should not be passed over \
again and again by newer ones.

Some models look only at a window of recent tokens in most of their layers. Gemma 3, for instance, has five local \
layers for every global one, and its local layers attend to the last few hundred positions only. This keeps the \
memory of a long conversation small, because most layers can forget what lies behind the window, while the global \
layers still see everything. A server that knows this can give back the memory of the old positions for the local \
layers, and admit more requests at the same time.

The history of computing is full of such trades. Early machines had so little memory that programmers counted every \
word, and the first operating systems invented paging to let several programs share one machine. Networks learned to \
send packets instead of holding a line open for each call. In each case the answer was to cut a large resource into \
small pieces and hand them out as they were needed, rather than reserving the whole of it for one user at a time.

In the end, the measure of a serving system is simple: how many people it can answer, how quickly the first word of \
each answer arrives, and how steadily the rest follows. Everything else, from the kernels that multiply the matrices \
to the rules that decide who goes next, exists to move those three numbers in the right direction.

Here is a short summary of the main points:"""


@pytest.fixture(scope="module")
def gemma() -> dict:
    home = ferrox_home_from_env(os.environ)
    return {"folder": fetch_default_model(home, progress=False, log=lambda *_: None, source=GEMMA3_270M),
            "gguf": default_gguf_path(home, GEMMA3_270M)}


@pytest.fixture(scope="module")
def ours(gemma, device):
    return load_model(gemma["folder"], device=device, dtype="float32")


@pytest.fixture(scope="module")
def reference(gemma):
    transformers = pytest.importorskip("transformers")
    gguf = gemma["gguf"]
    return transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                             dtype=torch.float32).eval()


def greedy(model, ids: list[int], new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    blocks = -(-(len(ids) + new_tokens) // 16)
    store = model.decoder.new_store(16, num_blocks=16 * blocks)  # room for every KV group's lease
    store.add_sequence(0, len(ids) + new_tokens)
    logits = model.decoder.forward([SeqChunk(0, ids)], store)
    first, out = logits[0].cpu(), []
    for _ in range(new_tokens):
        out.append(int(logits[0].argmax()))
        logits = model.decoder.forward([SeqChunk(0, [out[-1]])], store)
    return first, out


def compare(ours, reference, ids: list[int], new_tokens: int) -> None:
    assert ids[0] == 2  # <bos>: the file asks for it
    got_last, got = greedy(ours, ids, new_tokens)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert_logits_close(got_last, out.logits[0][0], ours.config, len(ids))
    assert_decisive([step[0] for step in out.logits], ours.config, len(ids))
    assert got == out.sequences[0, len(ids):].tolist()


def test_the_converted_folder_is_gemma3_270m(ours) -> None:
    c = ours.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (18, 640, 4, 1, 256)
    assert (c.intermediate_size, c.sliding_window, c.local_rope_theta, c.rope_theta) == (2048, 512, 10_000.0, 1e6)
    assert c.window_layers == tuple((i + 1) % 6 != 0 for i in range(18)) and c.attention_scale == 256 ** -0.5
    assert ours.tokenizer.stop_tokens.ids == {1, 106}  # <eos>, <end_of_turn>


def test_the_prompts_tokenize_as_transformers_gguf_tokenizer_does(ours, gemma) -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(gemma["gguf"].parent, gguf_file=gemma["gguf"].name)
    for text in (LONG_PROMPT, "The history of the printing press", "  two\n\nlines  ", "café 日本語 😀 x = 12345",
                 "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"):
        assert ours.tokenizer.encode(text) == theirs(text)["input_ids"], text


def test_a_600_token_prompt_then_32_greedy_tokens_match_transformers(ours, reference) -> None:
    """The window slides through the prefill: the prompt's last positions see only its last 512 in the local
    layers."""
    ids = ours.tokenizer.encode(LONG_PROMPT)
    assert len(ids) > 600
    compare(ours, reference, ids, 32)


def test_greedy_tokens_that_cross_the_window_match_transformers(ours, reference) -> None:
    """The window slides through the decode: a 490-token prompt and 48 tokens, the last 26 of them past it."""
    ids = ours.tokenizer.encode(LONG_PROMPT)[:490]
    compare(ours, reference, ids, 48)
    assert len(ids) + 48 > ours.config.sliding_window + 16
