"""The tokenizer: encode, raw-byte decode, chat templates (rendered by `chat_template`) and the model's stop
tokens.

`decode(ids) -> bytes` is the upstream `DecodeFn` contract: it returns raw
bytes, because a character may straddle two tokens; the batcher's per-row
`Utf8Stream` turns bytes into text. Bytes come from a per-token table built
once at load:

* byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen2): each vocabulary string maps
  back through the byte-to-unicode alphabet to its raw bytes;
* SentencePiece-style (Llama 2, Mistral): `<0xNN>` byte-fallback pieces are
  single bytes and `\u2581` is a space.

Special (control) tokens decode to no bytes, as llama.cpp renders them by
default; they are handled by id (stop tokens), never by text.

Encoding goes through the `tokenizers` batch call, which releases the GIL
while it works (the single-text call holds it: a megabyte prompt would stall
every other thread of the process, an event loop included). And a text's
length alone bounds its id count from below (`least_tokens`): one token
stands for at most `max_token_chars` characters, worked out once at load
from the vocabulary and the pipeline, so a caller can refuse a text that can
never fit a context without tokenizing it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

from tokenizers import Tokenizer as HfTokenizer

from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.loading.chat_template import (  # noqa: F401 - ChatMessage and the names: re-exported
    SERVER_VARIABLES,
    TEMPLATE_GLOBALS,
    ChatMessage,
    ChatTemplate,
    compile_template,
    template_text,
)
from ferrox_batch.runtime.loading.control_text import ControlText, control_texts
from ferrox_batch.runtime.loading.length_bound import LengthBound, length_bound
from ferrox_batch.stop_tokens import StopTokens

_T = TypeVar("_T")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-unicode map, as unicode char -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class Tokenizer:
    def __init__(
        self,
        tokenizer: HfTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos: bool = False,
        stop_tokens: StopTokens = StopTokens.default(),
    ) -> None:
        self.inner = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self.stop_tokens = stop_tokens
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        spec = json.loads(tokenizer.to_str())
        self._bytes = self._byte_table(spec)
        #: The most bytes one id decodes to (padding past the table decodes to none).
        self.longest_token_bytes = max(map(len, self._bytes), default=0)
        #: Each special token's own text, which `decode` leaves out (a request that keeps special tokens
        #: gets these instead).
        self.special_texts: dict[int, bytes] = {
            index: token.content.encode("utf-8")
            for index, token in tokenizer.get_added_tokens_decoder().items() if token.special}
        #: The added tokens a message's content may spell, and their escape (`control_text`).
        self.control_text = ControlText(control_texts(
            (token.content, token.special) for token in tokenizer.get_added_tokens_decoder().values()))
        #: How few ids a text can encode to, from its length (None: the pipeline may drop or merge any
        #: amount of input, and no length bound holds). See `least_tokens`.
        self.length_bound: LengthBound | None = length_bound(spec, tokenizer, self._bytes, byte_level_alphabet())
        self.set_chat_template(chat_template)

    def set_chat_template(self, chat_template: str | None) -> None:
        """Use `chat_template` (Jinja text; None: none) for chat, in place of the checkpoint's: a template
        that does not compile is a `ModelLoadError`."""
        self._template = ChatTemplate(chat_template) if chat_template else None
        self.chat_template = chat_template
        #: Whether the chat template reads `tools` (renders the tool definitions a request offers).
        self.supports_tools = self._template is not None and self._template.supports_tools

    @staticmethod
    def check_chat_template(chat_template: str) -> None:
        """`ModelLoadError` unless `chat_template` compiles."""
        compile_template(chat_template)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"no tokenizer.json in {path}")
        return cls.from_parts(
            tok_file.read_text(encoding="utf-8"),
            tokenizer_config=_read_json(path / "tokenizer_config.json"),
            generation_config=_read_json(path / "generation_config.json"),
            model_config=_read_json(path / "config.json"),
            source=str(tok_file),
        )

    @classmethod
    def from_parts(
        cls,
        tokenizer_json: str,
        *,
        tokenizer_config: Mapping[str, Any],
        generation_config: Mapping[str, Any],
        model_config: Mapping[str, Any],
        source: str = "tokenizer.json",
    ) -> "Tokenizer":
        """Build from the contents of a Hugging Face folder's tokenizer files (or a GGUF's equivalents)."""
        try:
            inner = HfTokenizer.from_str(tokenizer_json)
        except Exception as bad:  # the tokenizers library raises a bare Exception
            raise ModelLoadError(f"{source} could not be read: {bad}") from None
        bos = _token_text(tokenizer_config.get("bos_token"))
        eos = _token_text(tokenizer_config.get("eos_token"))
        stop_ids: set[int] = set()
        for ids in (generation_config.get("eos_token_id"), model_config.get("eos_token_id")):
            stop_ids.update(_ids(ids))
        eos_id = inner.token_to_id(eos) if eos is not None else None
        if eos_id is not None:
            stop_ids.add(eos_id)
        return cls(
            inner,
            chat_template=template_text(tokenizer_config.get("chat_template")),
            bos_token=bos,
            eos_token=eos,
            add_bos=bool(tokenizer_config.get("add_bos_token", False)) and bos is not None,
            stop_tokens=StopTokens(frozenset(stop_ids)),
        )

    def _byte_table(self, spec: Mapping[str, Any]) -> list[bytes]:
        vocab = self.inner.get_vocab(with_added_tokens=True)
        table = [b""] * (max(vocab.values(), default=-1) + 1)
        special = {t.content for t in self.inner.get_added_tokens_decoder().values() if t.special}
        decoder = spec.get("decoder") or {}
        kinds = _decoder_kinds(decoder)
        alphabet = byte_level_alphabet()
        for text, index in vocab.items():
            if text in special:
                continue
            if "ByteLevel" in kinds and all(ch in alphabet for ch in text):
                table[index] = bytes(alphabet[ch] for ch in text)
            elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                table[index] = bytes([int(text[3:5], 16)])
            else:
                table[index] = text.replace("\u2581", " ").encode("utf-8")
        return table

    def pad_to(self, vocab_size: int) -> None:
        """Let ids up to the model's (padded) vocabulary decode, as no bytes.

        Checkpoints often pad the lm head past the tokenizer (Qwen2 does); a sampled padding id
        must not be an error.
        """
        if vocab_size > len(self._bytes):
            self._bytes.extend([b""] * (vocab_size - len(self._bytes)))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self.encode_within(text, None, add_special_tokens=add_special_tokens)[1]
        assert ids is not None
        return ids

    def encode_within(self, text: str, most: int | None, *,
                      add_special_tokens: bool = True) -> tuple[int, list[int] | None]:
        """`encode(text)`'s length, and its ids unless there are more than `most`: those are not built (a list
        of a million ids takes the interpreter tens of milliseconds in one call), and the length is then the
        text's own, less the BOS that `encode` may put in front."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        # The batch call releases the GIL while it works; `encode_batch_fast` (tokenizers >= 0.21) also
        # skips the character offsets nobody here reads, most of the work. Same ids as `inner.encode`.
        encode_batch = getattr(self.inner, "encode_batch_fast", None) or self.inner.encode_batch
        encoding = encode_batch([text], add_special_tokens=False)[0]
        bos_id = None
        if add_special_tokens and self.add_bos and self.bos_token is not None:
            bos_id = self.inner.token_to_id(self.bos_token)
        count = len(encoding)
        if most is not None and count > most:  # a BOS in front would make it longer still
            return count, None
        ids = encoding.ids
        if bos_id is not None and (not ids or ids[0] != bos_id):
            ids = [bos_id, *ids]
        return len(ids), None if most is not None and len(ids) > most else ids

    @property
    def max_token_chars(self) -> int | None:
        """The most input characters one id can stand for (None: no bound is known)."""
        return None if self.length_bound is None else self.length_bound.max_token_chars

    def least_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))`, without tokenizing (0 when no bound is known)."""
        return 0 if self.length_bound is None else self.length_bound.least_tokens(text)

    def decode(self, ids: Iterable[int]) -> bytes:
        """Raw bytes of `ids` (special tokens render as nothing); ids outside the vocabulary raise."""
        return self._looked_up(ids, lambda parts: b"".join(parts))

    def _looked_up(self, ids: Iterable[int], reduce: Callable[[Iterator[bytes]], _T]) -> _T:
        """`reduce` of the table's entries for `ids`, each id in the table (ValueError naming the first that
        is not). Walked by C loops (`min`, `map`), not bytecode, and once: a long list (a `/detokenize` of
        262,144 ids) then costs a few milliseconds instead of tens, and the worker waits for the interpreter
        that much less. Only the negative ids need a pass of their own (the list would index them from its
        end); one past the table raises `IndexError` in the lookup itself."""
        ids = ids if isinstance(ids, list) else list(ids)
        size = len(self._bytes)
        try:
            if ids and min(ids) < 0:
                raise IndexError
            return reduce(map(self._bytes.__getitem__, ids))
        except IndexError:
            bad = next(i for i in ids if not 0 <= i < size)
            raise ValueError(f"token id {bad} is outside the tokenizer's {size} ids") from None

    @property
    def decodable_ids(self) -> int:
        """How many ids `decode` takes: 0 up to this, the vocabulary and any padding past it (`pad_to`)."""
        return len(self._bytes)

    def decoded_size(self, ids: Iterable[int]) -> int:
        """How many bytes `decode(ids)` returns (the UTF-8 text's, where they are valid), without building
        them; ids outside the vocabulary raise."""
        return self._looked_up(ids, lambda parts: sum(map(len, parts)))

    def decode_text(self, ids: Iterable[int]) -> str:
        return self.decode(ids).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage | Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        escape_control_text: bool = False,
    ) -> str:
        """The conversation as the checkpoint's template writes it; `tools` (OpenAI tool definitions) are
        handed to the template, which must read them (`supports_tools`). `continue_final_message`: the text
        ends where the last message's content does (the model continues it, as transformers and vLLM do);
        `template_kwargs`: more variables for the template (`enable_thinking`), never one of those above nor a
        name the template environment defines (`TEMPLATE_GLOBALS`).
        `escape_control_text`: control-token text in any content but an assistant's (whose markup the
        template reads, and which is the model's own) and in the tool definitions is spelt to be read as
        text (`control_text`)."""
        if self._template is None:
            raise ValueError("this checkpoint has no chat template; send a plain prompt instead")
        return self._template.render(messages, bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     control_text=self.control_text, add_generation_prompt=add_generation_prompt,
                                     tools=tools, continue_final_message=continue_final_message,
                                     template_kwargs=template_kwargs, escape_control_text=escape_control_text)

    def encode_chat(self, messages: Sequence[ChatMessage | Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        # The template writes any BOS itself, so none is added here.
        return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)


def _decoder_kinds(decoder: Mapping[str, Any]) -> set[str]:
    kinds = {decoder.get("type", "")}
    for inner in decoder.get("decoders") or []:
        kinds |= _decoder_kinds(inner)
    return kinds


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        raise ModelLoadError(f"{path} is not valid JSON: {bad}") from None
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []
