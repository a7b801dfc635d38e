"""Ollama's `options` object, said as the chat or completion body fields it amounts to.

Every option Ollama documents is in exactly one of three sets:

* **mapped** onto the body fields our parsers read (which then check their types and ranges, as for any
  request): `num_predict` (`max_tokens`; -1 and -2, "until the context is full", are the context ceiling;
  absent: the server's chat default), `temperature`, `top_k`, `top_p`, `min_p`, `repeat_penalty`
  (`repetition_penalty`), `presence_penalty`, `frequency_penalty`, `seed` (-1: none), `stop`. Absent
  `temperature`, `top_k` and `top_p` take Ollama's documented defaults (0.8, 40, 0.9), which an Ollama
  client expects; the others default as on the OpenAI endpoints. `num_ctx` is checked against the served
  context length (a 400 above it) and otherwise changes nothing: every request runs in the server's context
  window, which is never cut per request. `repeat_last_n` may only say "the whole context" (-1), which is
  what our penalties look at, or turn the penalties off (0).
* **not applicable**, accepted and ignored (`RUNNER_ONLY`): how Ollama's runner loads and runs the model
  (threads, GPU layers, mmap, batch size, ...) and `num_keep` (what survives a context shift: this server
  never shifts, it refuses a prompt that does not fit) and `penalize_newline` (Ollama's own engine ignores
  it). This server was started with its model and its settings; no request changes them.
* **refused** with a 400 naming `options.<name>`: the samplers this engine does not have, at any value but
  the one that turns them off (`typical_p`, `tfs_z`: 1; `mirostat`: 0, with its `mirostat_tau` and
  `mirostat_eta` then meaningless and accepted), and any name Ollama does not document (a typo must not be
  silently dropped).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox_batch.checks import UNLIMITED
from ferrox_batch.errors import InvalidRequest
from ferrox_batch.server.fields import is_int, is_number

#: Options mapped one to one onto a body field of the same meaning (Ollama's name -> ours).
RENAMED = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
           "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty"}
#: Ollama's documented defaults where they differ from the OpenAI endpoints' (ours: 1.0, off, 1.0).
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
#: How Ollama's runner loads and runs a model, and what it keeps on a context shift: accepted, not applicable.
RUNNER_ONLY = frozenset({"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                         "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep",
                         "penalize_newline"})
#: Samplers this engine does not have -> the one value that turns each off (accepted).
SAMPLERS_OFF = {"typical_p": 1, "tfs_z": 1, "mirostat": 0}
#: Settings of a sampler that is off: meaningless, accepted.
MIROSTAT_SETTINGS = ("mirostat_tau", "mirostat_eta")
#: Options read here beside the renamed ones.
HANDLED = frozenset({"num_predict", "num_ctx", "seed", "stop", "repeat_last_n"})
#: `num_predict`'s values for "as many as the context allows" (-2 is Ollama's "fill the context").
TO_THE_CEILING = (-1, -2)


def options_fields(value: Any, *, context_length: int | None, sampling: bool = True) -> dict[str, Any]:
    """The body fields `options` amounts to; `sampling`: the request generates (an embedding's options may
    only say what does not apply to it). `context_length`: the served context (None: unbounded)."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise InvalidRequest("options", value, "must be an object")
    fields: dict[str, Any] = dict(DEFAULTS) if sampling else {}
    for name, setting in value.items():
        if setting is None:
            continue
        where = f"options.{name}"
        if name in RUNNER_ONLY or name in MIROSTAT_SETTINGS:
            continue
        if name == "num_ctx":
            _num_ctx(setting, context_length)
        elif not sampling:
            raise InvalidRequest(where, setting, "does not apply to an embedding")
        elif name in SAMPLERS_OFF:
            off = SAMPLERS_OFF[name]
            if not is_number(setting) or setting != off:
                raise InvalidRequest(where, setting, f"is not supported by this server: it has no such sampler "
                                                     f"(leave it out or send {off})")
        elif name in RENAMED:
            fields[RENAMED[name]] = setting  # its type and range: the parser's to check, under its name
        elif name == "num_predict":
            fields["max_tokens"] = _num_predict(setting, context_length)
        elif name == "seed":
            if is_int(setting) and setting < 0:  # Ollama's -1: a random seed, which is no seed here
                continue
            fields["seed"] = setting
        elif name == "stop":
            fields["stop"] = setting
        elif name == "repeat_last_n":
            _repeat_last_n(setting, fields)
        else:
            raise InvalidRequest(where, setting, "is not an option this server knows")
    if value.get("repeat_last_n") == 0:  # after every option is read: the penalties are off, whatever said them
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            fields.pop(name, None)
    return fields


def _num_predict(value: Any, context_length: int | None) -> int:
    if not is_int(value):
        raise InvalidRequest("options.num_predict", value, "must be an integer")
    if value in TO_THE_CEILING:
        return context_length if context_length is not None else UNLIMITED
    if value < 0:
        raise InvalidRequest("options.num_predict", value, "must be a non-negative integer, -1 or -2")
    return value


def _num_ctx(value: Any, context_length: int | None) -> None:
    if not is_int(value) or value < 1:
        raise InvalidRequest("options.num_ctx", value, "must be a positive integer")
    if context_length is not None and value > context_length:
        raise InvalidRequest("options.num_ctx", value, f"is more than this server's context length of "
                                                       f"{context_length} tokens")


def _repeat_last_n(value: Any, fields: Mapping[str, Any]) -> None:
    if not is_int(value) or value not in (-1, 0):
        raise InvalidRequest("options.repeat_last_n", value, "must be -1 (the whole context, which the penalties "
                                                             "always look at here) or 0 (penalties off)")
