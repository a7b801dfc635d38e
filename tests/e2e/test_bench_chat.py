"""Shape (c), the multi-turn chat: its plan, its prompts, the closed-loop driver, its counters and reports."""

from __future__ import annotations

import json
import threading
import time

import pytest
from tiny_checkpoint import CHATML_TEMPLATE, build_tokenizer, write_tiny_checkpoint

from ferrox_batch.bench import conversations as cv
from ferrox_batch.bench.http import main as http_main
from ferrox_batch.bench.http import report as http_report
from ferrox_batch.bench.report import report
from ferrox_batch.runtime.loading.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The tiny checkpoints' byte-level BPE with the ChatML template: no weights needed."""
    return Tokenizer(build_tokenizer(384), chat_template=CHATML_TEMPLATE)


def lengths(tokenizer, plan: cv.Plan) -> tuple[list[int], list[int]]:
    users = [len(tokenizer.encode(t.user, add_special_tokens=False)) for conv in plan.conversations for t in conv]
    return users, [t.max_tokens for conv in plan.conversations for t in conv]


def test_the_plan_is_16_conversations_of_4_turns_in_the_shapes_lengths(tokenizer) -> None:
    plan = cv.build_plan(tokenizer, seed=0)
    assert plan.system == cv.SYSTEM_PROMPT and [len(c) for c in plan.conversations] == [4] * 16
    users, replies = lengths(tokenizer, plan)
    assert all(20 <= n <= 60 for n in users) and all(32 <= n <= 64 for n in replies)
    assert len(set(replies)) > 8 and len(set(users)) > 8  # drawn, not fixed
    assert len({conv[0].user for conv in plan.conversations}) == 16  # every conversation opens differently


def test_the_plan_follows_the_seed_and_quick_keeps_2_conversations_of_2_turns_at_8_tokens(tokenizer) -> None:
    plan = cv.build_plan(tokenizer, seed=3)
    assert cv.build_plan(tokenizer, seed=3) == plan and cv.build_plan(tokenizer, seed=4) != plan
    quick = cv.build_plan(tokenizer, seed=3, quick=True)
    assert [[t.max_tokens for t in conv] for conv in quick.conversations] == [[8, 8], [8, 8]]
    assert [[t.user for t in conv] for conv in quick.conversations] == [
        [t.user for t in conv[:2]] for conv in plan.conversations[:2]]


@pytest.mark.real_model
def test_the_system_prompt_is_about_300_tokens_of_the_default_model(real_model_dir) -> None:
    real = Tokenizer.from_dir(real_model_dir)
    assert 280 <= len(real.encode(cv.SYSTEM_PROMPT, add_special_tokens=False)) <= 320
    users, _ = lengths(real, cv.build_plan(real, seed=0))
    assert all(20 <= n <= 60 for n in users)


def test_a_turns_messages_are_the_chat_so_far() -> None:
    assert cv.chat_messages("S", ["u1", "u2"], ["a1"]) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    with pytest.raises(ValueError, match="2 user turns need 1 replies"):
        cv.chat_messages("S", ["u1", "u2"], [])


def replying(tokenizer, *, canonical: bool = True, delay: float = 0.0):
    """A fake method: each reply is max_tokens ids of words, encoded by the tokenizer (or not, if not canonical)."""
    words = "the quick brown fox jumps over the lazy dog and keeps every request moving".split()
    sent: list[tuple[float, int]] = []
    lock = threading.Lock()

    def send(prompt: list[int], max_tokens: int) -> cv.Reply:
        with lock:
            sent.append((time.perf_counter(), len(prompt)))
        time.sleep(delay)
        text = " ".join(words[(len(prompt) + i) % len(words)] for i in range(max_tokens // 2))
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not canonical:
            ids = [b for i in ids for b in tokenizer.encode(tokenizer.decode_text([i]), add_special_tokens=False)][::-1]
        now = time.perf_counter()
        return cv.Reply(text, max_tokens, [now + i * 1e-3 for i in range(max_tokens)], ids)

    return send, sent


def test_each_turns_prompt_starts_with_the_previous_prompt_and_reply_ids(tokenizer) -> None:
    plan = cv.build_plan(tokenizer, seed=1, quick=False)
    send, sent = replying(tokenizer)
    raw = cv.flatten(tokenizer, plan, cv.run_chats(tokenizer, plan, send, timeout=60))
    assert not raw["errors"] and len(sent) == len(raw["requests"]) == 64
    for c in range(16):
        turns = raw["requests"][4 * c:4 * c + 4]
        for k in range(1, 4):
            before = turns[k - 1].prompt + raw["ids"][4 * c + k - 1]
            assert turns[k].prompt[:len(before)] == before and len(turns[k].prompt) > len(before)
        first = turns[0].prompt
        assert first == tokenizer.encode_chat(cv.chat_messages(plan.system, [plan.conversations[c][0].user], []))
    system = len(tokenizer.encode(plan.system, add_special_tokens=False))
    assert all(cv.common_prefix(r.prompt, raw["requests"][0].prompt) > system for r in raw["requests"])
    chat = raw["chat"]
    assert chat["extends"] == [48, 48] and chat["turns_done"] == chat["turns"] == 64
    assert 0 < chat["reusable"] < 1 and raw["ttfts"] and all(len(t) == r.max_tokens
                                                              for t, r in zip(raw["times"], raw["requests"]))


def test_the_loop_is_closed_and_every_conversation_starts_at_once(tokenizer) -> None:
    plan = cv.build_plan(tokenizer, seed=0, quick=True)
    send, _ = replying(tokenizer, delay=0.5)
    chats = cv.run_chats(tokenizer, plan, send, timeout=60)
    for records in chats["records"]:
        assert records[1]["submit"] >= records[0]["done"]  # turn 2 only after turn 1's reply
    firsts = [records[0]["submit"] for records in chats["records"]]
    assert max(firsts) - min(firsts) < 0.25  # behind one barrier, not one after the other's reply


def test_a_reply_whose_ids_do_not_re_encode_is_counted_and_a_failed_turn_ends_its_conversation(tokenizer) -> None:
    plan = cv.build_plan(tokenizer, seed=0, quick=True)
    send, _ = replying(tokenizer, canonical=False)
    raw = cv.flatten(tokenizer, plan, cv.run_chats(tokenizer, plan, send, timeout=60))
    assert raw["chat"]["extends"] == [0, 2]  # the template splices the text, not those ids

    def failing(prompt, max_tokens):
        raise RuntimeError("refused")

    raw = cv.flatten(tokenizer, plan, cv.run_chats(tokenizer, plan, failing, timeout=60))
    assert len(raw["errors"]) == 2 and "conversation 0 turn 0: RuntimeError: refused" in raw["errors"]
    assert raw["requests"][1].prompt == [] and raw["tokens"] == [0, 0, 0, 0]  # turn 2 never sent
    assert raw["chat"]["turns_done"] == 0


def test_the_hit_rate_is_the_counters_difference_or_na_without_them() -> None:
    before = {"prefix_cache_queries": 100, "prefix_cache_hits": 10, "decode_steps": 1}
    after = {"prefix_cache_queries": 1100, "prefix_cache_hits": 760, "decode_steps": 9}
    rate = cv.prefix_cache_rate(before, after)
    assert rate == {"prefix_hit_rate": 0.75, "prefix_hits": 750, "prefix_queries": 1000}
    assert cv.hits_text(rate) == "75.0% (750/1,000 tokens)"
    for missing in ({"decode_steps": 1}, None):
        assert cv.prefix_cache_rate(missing, after)["prefix_hit_rate"] is None
        assert cv.hits_text(cv.prefix_cache_rate(before, missing)) == "n/a"
    assert cv.hits_text(cv.prefix_cache_rate(before, before)) == "0 of 0 tokens"


def test_the_reports_give_the_hit_rate_and_skip_static_on_the_chat() -> None:
    chat = {"extends": [1, 1], "reusable": 0.5, "turns_done": 4, "turns": 4}
    runs = [{"config": "cache", "tok_s": 10.0, "prefix_hit_rate": 0.5, "chat": chat},
            {"config": "nocache", "tok_s": 5.0, "prefix_hit_rate": None, "chat": chat}]
    lines = http_report(["cache", "nocache"], runs)
    assert "| prefix hits |" in lines[0] and lines[1].count("|") == lines[0].count("|")
    assert lines[2].endswith("| 50.0% | - | 1.00 |") and lines[3].endswith("| n/a | - | 0.50 |")
    runs = [{"method": m, "shape": "c", "tok_s": t, "prefix_hit_rate": h} for m, t, h in
            (("ours", 20.0, 0.4), ("cb", 10.0, None))]
    lines, summary = report(["c"], ["ours", "static", "cb"], runs)
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["ours", "cb"] and "static:c" not in summary
    assert lines[2].endswith("| 40.0% | - |") and lines[3].endswith("| n/a | 2.00 |")


@pytest.fixture(scope="module")
def tiny_long_dir(tmp_path_factory: pytest.TempPathFactory):
    """The tiny batch checkpoint with room for the chat (its tokenizer spends about 1,100 ids on the system prompt)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-chat"), tie=False, std=0.15, seed=5,
                                 max_positions=4096)


@pytest.mark.slow
def test_a_quick_http_run_of_the_chat_serves_every_turn(tiny_long_dir, tmp_path, capsys) -> None:
    out = tmp_path / "http.json"
    code = http_main(["--model", str(tiny_long_dir), "--quick", "--dtype", "fp32", "--shape", "c",
                      "--config", "defaults=", "--json", str(out)], {})
    assert code == 0, capsys.readouterr()
    (run,) = json.loads(out.read_text())["runs"]
    assert run["config"] == "defaults" and run["tokens"] == 2 * 2 * 8 and not run["errors"] and not run["short"]
    assert run["chat"]["turns_done"] == 4 and run["chat"]["extends"][1] == 2 and run["chat"]["reusable"] > 0
    printed = capsys.readouterr()
    assert "2 conversations x 2 turns" in printed.out and "| prefix hits |" in printed.out
    assert "prefix hits" in printed.err and "turns extend the previous prompt" in printed.err


@pytest.mark.slow
def test_a_quick_in_process_run_of_the_chat_skips_static_and_runs_ours_with_and_without_the_cache(
        tiny_long_dir, tmp_path, capsys) -> None:
    from ferrox_batch.bench.batcher import main as bench_main

    out = tmp_path / "bench.json"
    code = bench_main(["--model", str(tiny_long_dir), "--quick", "--shapes", "c", "--methods",
                       "ours,ours-nocache,static", "--dtype", "fp32", "--json", str(out)], {})
    assert code == 0, capsys.readouterr()
    cached, plain = json.loads(out.read_text())["runs"]
    for run in (cached, plain):
        assert run["useful_tokens"] == 2 * 2 * 8 and not run["errors"] and run["chat"]["turns_done"] == 4
    assert cached["method"] == "ours" and cached["config"]["prefix_cache"] and cached["prefix_hit_rate"] > 0
    assert plain["method"] == "ours-nocache" and not plain["config"]["prefix_cache"]
    assert plain["prefix_hit_rate"] is None
    printed = capsys.readouterr().out
    assert "static skipped: the static peer" in printed and "| ours | c |" in printed
    assert "| ours-nocache | c |" in printed and "| n/a |" in printed
