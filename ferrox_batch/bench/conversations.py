"""Shape (c): a multi-turn chat in a closed loop, the workload of the prefix cache's benchmark.

16 conversations x 4 turns, seeded (`--seed`). Every conversation shares one system prompt of about 300
tokens (`workloads.SYSTEM_PROMPT`); each user turn is 20-60 tokens (an opener or a follow-up question,
padded with background text to its drawn length) and each reply 32-64 tokens (`max_tokens` drawn per
turn, EOS ignored, so a reply has exactly that length). `--quick`: 2 conversations x 2 turns x 8 tokens.

Turn k's prompt is the chat so far, system + user 1 + reply 1 + ... + user k, rendered by the model's chat
template and encoded by our tokenizer (`Tokenizer.encode_chat`) into token ids. Each reply is the text the
method returned (over HTTP the streamed text, in process `GenerationResult.text`, for transformers its ids
decoded by our tokenizer, which is how our batcher makes its text), not its ids appended: that is what a
chat client sends back and what a server renders, and the template gives no exact id-level splice
(a generated id sequence need not be the tokenizer's encoding of its own text). So turn k+1's prompt
starts with turn k's prompt (the template only appends) and, as far as the reply's text re-encodes to the
ids that were generated, with its reply too: that is where a prefix cache gets its hits. Each run counts
the turns whose prompt starts exactly with the previous prompt + reply ids (over HTTP, which returns no
ids, + the reply text re-encoded).

Closed loop: one thread per conversation, all started behind one barrier; a conversation sends turn k+1
only once turn k's reply has arrived. Each run reports tok/s (completion tokens over first submit -> last
finish), TTFT and ITL percentiles, and the prefix-cache hit rate in tokens (hits / queries between
`stats()` before and after the run, when the stats have `prefix_cache_queries` and `prefix_cache_hits`;
else n/a), beside the reusable share: the prompt tokens that are a prefix of some sequence (prompt +
reply) finished before the turn was sent, an upper bound on what any cache could hit in that run.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ferrox_batch.bench.workloads import FOLLOW_UPS, OPENERS, PROMPTS, SYSTEM_PROMPT, Request

CONVERSATIONS, TURNS = 16, 4
USER_TOKENS, REPLY_TOKENS = (20, 60), (32, 64)
QUICK = (2, 2, 8)  # conversations, turns, tokens per reply
CACHE_KEYS = ("prefix_cache_queries", "prefix_cache_hits")
STATIC_SKIPPED = "the static peer runs one fixed batch and cannot send a turn after the previous reply (closed loop)"


@dataclass(frozen=True, slots=True)
class Turn:
    user: str
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Plan:
    system: str
    conversations: tuple[tuple[Turn, ...], ...]


@dataclass(slots=True)
class Reply:
    """One turn's answer: its text, completion tokens, the arrival time of each chunk and, where known, its ids."""

    text: str
    tokens: int
    times: list[float]
    ids: list[int] | None = None


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def user_text(tokenizer, question: str, background: str, length: int) -> str:
    """`question`, then background words until the text reaches `length` tokens (at most 60)."""
    words, text = background.split(" "), question
    for m in range(1, len(words) + 1):
        if len(_encode(tokenizer, text)) >= length:
            break
        candidate = f"{question}\n\nBackground: {' '.join(words[:m])}"
        if len(_encode(tokenizer, candidate)) > USER_TOKENS[1]:
            break
        text = candidate
    return text


def build_plan(tokenizer, seed: int = 0, quick: bool = False) -> Plan:
    """The conversations of shape c, deterministic for a seed (the user texts' lengths are our tokenizer's)."""
    rng = random.Random(seed + 2)
    openers = rng.sample(range(len(OPENERS)), CONVERSATIONS)
    conversations = []
    for c in range(CONVERSATIONS):
        turns = []
        for question in [OPENERS[openers[c]], *rng.sample(FOLLOW_UPS, TURNS - 1)]:
            j = rng.randrange(len(PROMPTS))
            background = f"{PROMPTS[j]} {PROMPTS[(j + 1) % len(PROMPTS)]}"
            length, max_tokens = rng.randint(*USER_TOKENS), rng.randint(*REPLY_TOKENS)
            turns.append(Turn(user_text(tokenizer, question, background, length), max_tokens))
        conversations.append(tuple(turns))
    if quick:
        n, k, tokens = QUICK
        conversations = [tuple(Turn(t.user, tokens) for t in conv[:k]) for conv in conversations[:n]]
    return Plan(SYSTEM_PROMPT, tuple(conversations))


def chat_messages(system: str, users: Sequence[str], replies: Sequence[str]) -> list[dict[str, str]]:
    """system, user 1, assistant 1, ..., user k: the chat as it stands when user k is sent."""
    if len(users) != len(replies) + 1:
        raise ValueError(f"{len(users)} user turns need {len(users) - 1} replies, got {len(replies)}")
    out = [{"role": "system", "content": system}]
    for user, reply in itertools.zip_longest(users, replies):
        out.append({"role": "user", "content": user})
        if reply is not None:
            out.append({"role": "assistant", "content": reply})
    return out


def turn_prompt(tokenizer, plan: Plan, c: int, replies: Sequence[str]) -> list[int]:
    """The ids of conversation c's next turn, after `replies` (the texts of its earlier replies)."""
    users = [t.user for t in plan.conversations[c][:len(replies) + 1]]
    return tokenizer.encode_chat(chat_messages(plan.system, users, replies))


def sizing_requests(tokenizer, plan: Plan) -> list[Request]:
    """Per conversation a stand-in for its longest sequence, to size KV caches by (placeholder ids, 0).

    Its last prompt with every reply counted twice (a reply's text can re-encode to more ids than were
    generated), then its last reply. The untimed warm-ups send the first 16 of these ids: nothing the chat shares.
    """
    out = []
    for c, conv in enumerate(plan.conversations):
        base = len(turn_prompt(tokenizer, plan, c, [""] * (len(conv) - 1)))
        out.append(Request([0] * (base + 2 * sum(t.max_tokens for t in conv[:-1])), conv[-1].max_tokens))
    return out


def describe_plan(tokenizer, plan: Plan) -> str:
    users = [len(_encode(tokenizer, t.user)) for conv in plan.conversations for t in conv]
    outs = [t.max_tokens for conv in plan.conversations for t in conv]
    return (f"{len(plan.conversations)} conversations x {len(plan.conversations[0])} turns, closed loop; system "
            f"prompt {len(_encode(tokenizer, plan.system))} tokens, user turns {sum(users):,} tokens "
            f"({min(users)}-{max(users)}), replies {sum(outs):,} tokens ({min(outs)}-{max(outs)})")


# ------------------------------------------------------------------ the closed-loop driver

def run_chats(tokenizer, plan: Plan, send: Callable[[list[int], int], Reply], timeout: float) -> dict:
    """Every conversation on its own thread, started together; per turn its prompt, times and reply."""
    n = len(plan.conversations)
    barrier = threading.Barrier(n)
    records: list[list[dict]] = [[] for _ in range(n)]
    errors: list[str] = []
    clock = time.perf_counter

    def one(c: int) -> None:
        replies: list[str] = []
        prompt = turn_prompt(tokenizer, plan, c, replies)
        barrier.wait()
        for k, turn in enumerate(plan.conversations[c]):
            record = {"prompt": prompt, "max_tokens": turn.max_tokens, "submit": clock()}
            records[c].append(record)
            try:
                reply = send(prompt, turn.max_tokens)
                record.update(done=clock(), reply=reply)
                replies.append(reply.text)
                if k + 1 < len(plan.conversations[c]):
                    prompt = turn_prompt(tokenizer, plan, c, replies)
            except Exception as error:  # noqa: BLE001 - reported, not raised; the conversation stops
                record.setdefault("done", clock())
                errors.append(f"conversation {c} turn {k}: {type(error).__name__}: {error}")
                return

    threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if stuck := sum(t.is_alive() for t in threads):
        errors.append(f"{stuck} conversations still running after {timeout:.0f} s")
    return {"records": [list(r) for r in records], "errors": errors}


def reply_ids(tokenizer, reply: Reply) -> list[int]:
    return reply.ids if reply.ids is not None else _encode(tokenizer, reply.text)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def flatten(tokenizer, plan: Plan, chats: dict) -> dict:
    """The run in the benchmarks' raw form, one entry per planned turn in (conversation, turn) order."""
    records, requests, ids, tokens, times, ttfts = chats["records"], [], [], [], [], []
    extends = checked = 0
    for c, conv in enumerate(plan.conversations):
        for k, turn in enumerate(conv):
            rec = records[c][k] if k < len(records[c]) else {"prompt": [], "submit": None}
            reply = rec.get("reply")
            requests.append(Request(rec["prompt"], turn.max_tokens))
            ids.append(list(reply.ids or []) if reply else [])
            tokens.append(reply.tokens if reply else 0)
            times.append(list(reply.times) if reply else [])
            if reply and reply.times:
                ttfts.append(reply.times[0] - rec["submit"])
            if k and rec["prompt"] and records[c][k - 1].get("reply"):
                before = records[c][k - 1]["prompt"] + reply_ids(tokenizer, records[c][k - 1]["reply"])
                checked += 1
                extends += rec["prompt"][:len(before)] == before
    sent = [r for conv in records for r in conv]
    finished = sorted((r["done"], r["prompt"] + reply_ids(tokenizer, r["reply"])) for r in sent if "reply" in r)
    reusable = sum(max((common_prefix(r["prompt"], seq) for done, seq in finished if done <= r["submit"]), default=0)
                   for r in sent)
    prompt_tokens = sum(len(r["prompt"]) for r in sent)
    return {"start": min((r["submit"] for r in sent), default=0.0),
            "end": max((r.get("done", r["submit"]) for r in sent), default=0.0),
            "requests": requests, "ids": ids, "tokens": tokens, "times": times, "ttfts": ttfts,
            "errors": chats["errors"], "chunks": sum(len(t) for t in times),
            "chat": {"turns_done": len(finished), "turns": len(requests), "prompt_tokens": prompt_tokens,
                     "extends": [extends, checked], "reusable": reusable / prompt_tokens if prompt_tokens else None}}


# ------------------------------------------------------------------ the prefix cache's counters

def stats_dict(stats) -> dict | None:
    """A batcher's `stats()` (`BatcherStats`) or `GET /stats` (a dict) as a dict; None stays None."""
    if stats is None or isinstance(stats, Mapping):
        return None if stats is None else dict(stats)
    return stats.to_dict() if hasattr(stats, "to_dict") else dataclasses.asdict(stats)


def chat_extra(raw: dict, before, after) -> dict:
    """The run's chat counters (taken out of `raw`) and the prefix cache's hit rate between the two stats."""
    return {"chat": raw.pop("chat"), **prefix_cache_rate(stats_dict(before), stats_dict(after))}


def prefix_cache_rate(before: Mapping | None, after: Mapping | None) -> dict:
    """Prefix-cache hits over queries (tokens) between two stats snapshots; None where the stats lack them."""
    if not all(isinstance(s, Mapping) and all(k in s for k in CACHE_KEYS) for s in (before, after)):
        return {"prefix_hit_rate": None, "prefix_hits": None, "prefix_queries": None}
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return {"prefix_hit_rate": hits / queries if queries else None, "prefix_hits": hits, "prefix_queries": queries}


def chat_shape(tokenizer, seed: int, quick: bool, skip_static: bool = False) -> tuple[list[Request], str]:
    """Shape c for the batcher benchmark's parent: its sizing requests and its description line."""
    plan = build_plan(tokenizer, seed, quick)
    skipped = f"; static skipped: {STATIC_SKIPPED}" if skip_static else ""
    return sizing_requests(tokenizer, plan), describe_plan(tokenizer, plan) + skipped


def chat_state(run: Mapping) -> str:
    """A run's chat extras for its progress line: hit rate, reusable share, exact extensions."""
    chat = run["chat"]
    reusable = "-" if chat["reusable"] is None else f"{chat['reusable']:.1%}"
    return (f", prefix hits {hits_text(run)}, reusable {reusable}, {chat['extends'][0]}/{chat['extends'][1]} "
            f"turns extend the previous prompt + reply ids, {chat['turns_done']}/{chat['turns']} turns done")


def hits_text(run: Mapping) -> str:
    rate = run.get("prefix_hit_rate")
    if rate is None:
        return "n/a" if run.get("prefix_queries") is None else f"0 of {run['prefix_queries']} tokens"
    return f"{rate:.1%} ({run['prefix_hits']:,}/{run['prefix_queries']:,} tokens)"
