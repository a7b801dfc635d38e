"""Shape d: editing and extraction tasks whose answers copy long spans of their prompts.

This is the work speculative decoding by prompt lookup is for (`scheduler.speculation`): a user pastes
code, a config or a paragraph and asks for it back with a small change, or for the sentences that say
something. Each task is a chat turn (the model's chat template, as token ids, so every server gets the
same ids); its answer's length is the pasted text's length in tokens plus a few, so most of what is
generated is the copy when the model copies. Greedy, `ignore_eos`: every server does the same work.

Shape d sends the tasks one after another (the single stream); shape d4 sends four at once.
"""

from __future__ import annotations

from collections.abc import Callable

from ferrox_batch.bench.workloads import Request

_CODE_TOTAL = '''def order_total(items, discounts, tax_rate):
    """The price of an order: every item's price times its count, less its discount, plus tax."""
    subtotal = 0.0
    for item in items:
        price = item.unit_price * item.count
        discount = discounts.get(item.sku, 0.0)
        if discount > 0:
            price = price * (1.0 - discount)
        subtotal += price
    if subtotal <= 0:
        return 0.0
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)
'''

_CODE_PARSE = '''def parse_settings(lines):
    settings = {}
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected key = value, got {line!r}")
        key, value = line.split("=", 1)
        key = key.strip().lower()
        value = value.strip()
        if value.isdigit():
            value = int(value)
        elif value.lower() in ("true", "false"):
            value = value.lower() == "true"
        settings[key] = value
    return settings
'''

_CONFIG = '''server:
  host: 0.0.0.0
  port: 8000
  workers: 4
  timeout_seconds: 30
database:
  url: postgres://app@db.internal:5432/orders
  pool_size: 10
  statement_timeout_ms: 5000
cache:
  backend: redis
  url: redis://cache.internal:6379/0
  ttl_seconds: 300
logging:
  level: info
  format: json
'''

_STORY = ("The river town of Alder Ford grew up around a wooden bridge built in 1820. For decades the bridge "
          "was the only crossing for forty miles, and farmers brought their grain to the mill beside it. "
          "In the spring of 1861 a flood carried the bridge away, and the town was cut off for three months. "
          "The townspeople rebuilt it in stone, and the new bridge still stands today. The mill closed in "
          "1932, when the railway reached the valley. Its building became a school, and later a library. "
          "Every June the town holds a fair on the river bank to remember the flood and the rebuilding.")

_EMAIL = ("Hi Sam, thanks for sending the draft of the quarterly report. I read it this morning and it looks "
          "good overal. The sales figures in the second section need to be updated with the numbers from "
          "March, since the ones in the draft stop at February. The chart on page four is missing its axis "
          "labells. Could you also add a short paragraph about the new office in Lyon? Please send me the "
          "updated version by Thursday so that I can share it with the board on Friday. Best, Alex")

#: (the user's message with `{text}` where the pasted text goes, the pasted text): each answer copies
#: much of the pasted text (worded so that the default 135M model does: it rewrites code fenced before
#: the instruction, and drops the body of code an instruction precedes).
TASKS: tuple[tuple[str, str], ...] = (
    ("```python\n{text}```\n\nRename `subtotal` to `net` in the code above and show the complete code.",
     _CODE_TOTAL),
    ("```python\n{text}```\n\nRename `settings` to `result` in the code above and show the complete code.",
     _CODE_PARSE),
    ("```yaml\n{text}```\n\nChange the port to 8080 in the config above and show the complete file.", _CONFIG),
    ("Copy out, word for word, every sentence of this text that mentions the bridge or the mill.\n\n{text}",
     _STORY),
    ("Correct the spelling in this email and reply with the whole corrected email:\n\n{text}", _EMAIL),
    ("Summarise this text in a few sentences, quoting it where you can:\n\n{text}", _STORY),
)

#: Tokens an answer may run past its pasted text (a changed word, a reply's opening line).
SLACK = 16
QUICK_PROMPT = 200


def copying_requests(encode_chat: Callable[[list[dict[str, str]]], list[int]],
                     encode: Callable[[str], list[int]], concurrent: bool = False,
                     quick: bool = False) -> list[Request]:
    """Shape d's requests (`concurrent`: d4's four). `encode_chat` renders one user turn with the chat
    template and a generation prompt; `encode` counts the pasted text's tokens. `quick`: 2 tasks x 8
    tokens, each prompt cut to its last `QUICK_PROMPT` tokens (for a tiny test model's short context)."""
    tasks = TASKS[:4] if concurrent else TASKS
    out = [Request(encode_chat([{"role": "user", "content": message.format(text=text)}]), len(encode(text)) + SLACK)
           for message, text in tasks]
    if quick:
        out = [Request(r.prompt[-QUICK_PROMPT:], 8) for r in out[:2]]
    return out
