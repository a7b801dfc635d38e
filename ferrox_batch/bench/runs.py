"""The measured runs of the batcher benchmark's children (`bench.batcher --child`): ours, and the cb peer on shape c.

`run_ours` runs our batcher (built as the server builds it) on shape a or b's requests, or on shape c's chat
(`bench.conversations`); `run_cb_chat` runs transformers' continuous batching on the chat (on shapes a and b
the peers are `workloads.run_static` and `workloads.run_cb`). Each returns the raw run: start/end
(perf_counter), per-request (per-turn) ids, errors, TTFTs and token times.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable

from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.bench.conversations import (
    REPLY_TOKENS,
    STATIC_SKIPPED,
    Plan,
    Reply,
    build_plan,
    chat_extra,
    flatten,
    run_chats,
    sizing_requests,
)
from ferrox_batch.bench.workloads import Request, load_hf, peak_rss_mb

#: Our batcher's methods, and what each changes of the server's defaults.
OURS: dict[str, dict[str, bool]] = {"ours": {}, "ours-nocache": {"prefix_cache": False},
                                    "ours-nospec": {"speculative": False}}


def run_ours(args, requests: list[Request], kv_blocks: int, chat=None, *, method: str = "ours",
             one_at_a_time: bool = False) -> dict:
    """`chat`: (tokenizer, plan) of shape c, run instead of `requests` (then only the warm-up's source).
    `method`: a key of `OURS`. `one_at_a_time`: each request sent once the one before has finished (the
    single stream), instead of all at once."""
    from ferrox_batch.checks import UNLIMITED
    from ferrox_batch.engine.handle import ContinuousBatcher
    from ferrox_batch.generation_types import GenerationParams
    from ferrox_batch.runtime.loading.loader import load_model

    model = load_model(args.model, device="cpu", dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    loaded = peak_rss_mb()
    serving = BatcherConfig.serving()
    prefix_cache = OURS[method].get("prefix_cache", True)
    speculative = OURS[method].get("speculative", serving.speculative)
    config = BatcherConfig(max_seqs=args.max_seqs or UNLIMITED, prefill_chunk=args.prefill_chunk,
                           max_batch_tokens=args.max_batch_tokens, kv_block_size=args.kv_block_size,
                           kv_blocks=kv_blocks, max_prefills_per_tick=args.max_prefills_per_tick,
                           step_target_ms=args.step_target_ms or None, prefix_cache=prefix_cache,
                           speculative=speculative, speculative_tokens=serving.speculative_tokens)
    batcher = ContinuousBatcher.from_model(model, config)  # as the server builds it
    stop = model.tokenizer.stop_tokens

    def closed_loop(reqs: list[Request]) -> dict:
        n = len(reqs)
        barrier = threading.Barrier(n)
        submit, done = [0.0] * n, [0.0] * n
        chunks: list[list[float]] = [[] for _ in range(n)]
        results: list = [None] * n
        errors: list[str] = []

        def one(i: int) -> None:
            params = GenerationParams(max_tokens=reqs[i].max_tokens, ignore_eos=True,
                                      logprobs=args.logprobs if args.logprobs >= 0 else None)
            times, clock = chunks[i], time.perf_counter
            barrier.wait()
            submit[i] = clock()
            try:
                results[i] = batcher.generate_streaming(reqs[i].prompt, params, stop, lambda _t: times.append(clock()))
            except BaseException as error:  # noqa: BLE001 - reported, not raised
                errors.append(f"request {i}: {type(error).__name__}: {error}")
            done[i] = clock()

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + args.timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            raise RuntimeError(f"ours: {sum(t.is_alive() for t in threads)} requests still waiting after "
                               f"{args.timeout:.0f} s; stats {batcher.stats()}")
        ids = [list(r.token_ids) if r is not None else [] for r in results]
        return {"start": min(submit), "end": max(done), "ids": ids, "errors": errors,
                "ttfts": [c[0] - s for c, s in zip(chunks, submit) if c], "times": chunks,
                "chunks": sum(len(c) for c in chunks)}

    closed_loop([Request(r.prompt[:16], 4) for r in requests[:2]])  # warm-up, untimed
    before = batcher.stats()
    if chat is not None:
        out = run_ours_chat(batcher, stop, *chat, args.timeout)
    elif one_at_a_time:
        out = sequential(closed_loop, requests)
    else:
        out = closed_loop(requests)
    stats = batcher.stats()
    closed = batcher.close(timeout=60)
    out["extra"] = {"config": {"max_seqs": args.max_seqs or "unlimited", "prefill_chunk": args.prefill_chunk,
                               "max_batch_tokens": args.max_batch_tokens, "kv_block_size": args.kv_block_size,
                               "kv_blocks": kv_blocks, "max_prefills_per_tick": args.max_prefills_per_tick,
                               "step_target_ms": args.step_target_ms or None, "prefix_cache": prefix_cache,
                               "speculative": speculative,
                               "logprobs": args.logprobs if args.logprobs >= 0 else None},
                    "stats": {k: getattr(stats, k) for k in stats.__dataclass_fields__}, "closed": closed,
                    "chunks_per_token": out.pop("chunks") / max(1, sum(len(i) for i in out["ids"])),
                    **(chat_extra(out, before, stats) if chat else {})}
    out["rss_after_load_mb"] = loaded
    return out


def sequential(closed_loop: Callable[[list[Request]], dict], requests: list[Request]) -> dict:
    """`closed_loop` run on one request at a time, its runs joined into one (from the first start to the
    last end)."""
    runs = [closed_loop([request]) for request in requests]
    joined = {key: [x for run in runs for x in run[key]] for key in ("ids", "errors", "ttfts", "times")}
    return {"start": runs[0]["start"], "end": runs[-1]["end"], "chunks": sum(run["chunks"] for run in runs),
            **joined}


def run_ours_chat(batcher, stop, tokenizer, plan: Plan, timeout: float) -> dict:
    """Our batcher on the chat: each turn one `generate_streaming` call; the reply text is `GenerationResult.text`."""
    from ferrox_batch.generation_types import GenerationParams

    def send(prompt: list[int], max_tokens: int) -> Reply:
        times: list[float] = []
        result = batcher.generate_streaming(prompt, GenerationParams(max_tokens=max_tokens, ignore_eos=True), stop,
                                            lambda _text: times.append(time.perf_counter()))
        return Reply(result.text, len(result.token_ids), times, list(result.token_ids))

    return flatten(tokenizer, plan, run_chats(tokenizer, plan, send, timeout))


def run_cb_chat(args, tokenizer, plan: Plan, cb_blocks: int) -> dict:
    """transformers' continuous batching on the chat: turns go in with `add_request`, one thread routes results."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_hf(args)
    loaded = peak_rss_mb()
    if args.cb_release_openmp:
        from ferrox_batch.runtime.kernels.openmp import release_thread_pool

        release_thread_pool()
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=REPLY_TOKENS[1])
    cfg = ContinuousBatchingConfig(num_blocks=cb_blocks, page_size=args.cb_page_size,
                                   max_batch_tokens=args.cb_max_batch_tokens)
    boxes: dict[str, queue.Queue] = {}
    lock, done, counter = threading.Lock(), threading.Event(), itertools.count()
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cfg,
                                                   warmup=False) as manager:
        def route() -> None:
            while not done.is_set():
                result = manager.get_result(timeout=0.2)
                if result is None and not manager.is_running():
                    time.sleep(0.05)  # get_result returns at once once the loop has stopped
                elif result is not None and result.is_finished():
                    with lock:
                        box = boxes.pop(result.request_id, None)
                    if box is not None:
                        box.put(result)

        def send(prompt: list[int], max_tokens: int) -> Reply:
            rid, box = f"chat-{next(counter)}", queue.Queue()
            with lock:
                boxes[rid] = box
            if manager.add_request(prompt, request_id=rid, max_new_tokens=max_tokens, record_timestamps=True) is None:
                raise RuntimeError("cb refused the request")
            try:
                out = box.get(timeout=args.timeout)
            except queue.Empty:
                raise RuntimeError(f"cb: no result within {args.timeout:.0f} s, "
                                   f"loop running: {manager.is_running()}") from None
            if out.error:
                raise RuntimeError(f"cb: {out.error}")
            ids = list(out.generated_tokens)
            return Reply(tokenizer.decode_text(ids), len(ids), list(out.timestamps or []), ids)

        router = threading.Thread(target=route, daemon=True)
        router.start()
        for r in sizing_requests(tokenizer, plan)[:2]:
            send(r.prompt[:16], 4)  # the untimed warm-up
        raw = flatten(tokenizer, plan, run_chats(tokenizer, plan, send, args.timeout))
        done.set()
        router.join(5)
    raw["rss_after_load_mb"] = loaded
    raw["extra"] = chat_extra(raw, None, None)  # its block sharing keeps no hit counters
    return raw


def child_chat(args, method: str, tokenizer, sized: Callable) -> dict:
    """One measured run of shape c: ours or the cb peer, their KV caches sized by `sized` (`bench.batcher`'s)."""
    if method == "static":
        raise SystemExit(f"shape c: {STATIC_SKIPPED}")
    plan = build_plan(tokenizer, args.seed, args.quick)
    requests = sizing_requests(tokenizer, plan)
    kv_blocks, cb_blocks = sized(args, requests)
    if method in OURS:
        return run_ours(args, requests, kv_blocks, chat=(tokenizer, plan), method=method)
    return run_cb_chat(args, tokenizer, plan, cb_blocks)
