"""`ContinuousBatcher`: the handle any number of threads share to generate through one worker (docs/upstream.md, The handle).

A caller's `generate*` does every refusal that needs no worker state on its
own thread, in the upstream order: fit (clamp `max_tokens` to the context
ceiling) -> held positions -> blocks -> `immovable_refusal` (context ceiling,
then the whole block budget) -> queue reservation -> send -> cancel hook
(registered only after a successful send) -> wait for its own reply queue.
Nothing is queued for a request that can never fit (the argument checks and
the sizing are `engine.intake`). Chunks are delivered to `on_chunk` on the
caller's thread.

Lifetime (a port-only choice, docs/upstream.md D6): Python cannot observe "the last clone was
dropped", so the handle has `close()` (also `with ContinuousBatcher...:` and a
finalizer as a safety net). Closing refuses new requests at once with
`BatcherClosed`; the worker finishes everything already submitted, answers
every caller, and exits. A worker that crashes answers everyone with
`WorkerDied`, and every later call gets it at once; `stats().worker_alive`
says so.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Sequence

from ferrox_batch.admission.budget import ContextCeiling
from ferrox_batch.admission.config import BatcherConfig, decode_log_interval_from_env
from ferrox_batch.admission.counters import BatcherStats
from ferrox_batch.checks import check_seconds
from ferrox_batch.engine.intake import check_samplable, checked_prompt, size_request
from ferrox_batch.engine.text import Messages, generate_text
from ferrox_batch.engine.ticket import Ticket
from ferrox_batch.engine.wiring import build_worker, config_ceiling
from ferrox_batch.engine.worker import Worker
from ferrox_batch.errors import InvalidRequest, QueueFull
from ferrox_batch.generation_types import GenerationParams, GenerationResult
from ferrox_batch.grammar_limits import GrammarLimits
from ferrox_batch.policy.stop import StopMatcher
from ferrox_batch.runtime.kernels.openmp import release_thread_pool
from ferrox_batch.runtime.kv.paged_kv import PagedKvConfig
from ferrox_batch.runtime.loading.loader import LoadedModel
from ferrox_batch.runtime.loading.tokenizer import Tokenizer
from ferrox_batch.runtime.sampling.grammar import Grammars
from ferrox_batch.scheduler.request import DecodeFn, Request
from ferrox_batch.scheduler.sink import OnceSink, QueueSink, ReplySink
from ferrox_batch.stop_tokens import StopTokens

WORKER_THREAD_NAME = "ferrox-continuous-batch"


class ContinuousBatcher:
    def __init__(self, worker: Worker, thread: threading.Thread, tokenizer: Tokenizer | None = None) -> None:
        """The handle over `worker`, running on `thread`: it shares the worker's channel, lifecycle,
        counters, queue gate, block budget, abort inbox and store (built by `wiring.build_worker`)."""
        self._jobs = worker.jobs
        self._lifecycle = worker.lifecycle
        self._counters = worker.scheduler.counters
        self._worker_time = worker.time
        self._queue = worker.scheduler.queue_gate
        self._budget = worker.scheduler.budget
        self._aborts = worker.aborts
        self._config = worker.scheduler.config
        self._clock = worker.scheduler.clock  # queue deadlines are read on the scheduler's clock
        self._vocab_size = worker.scheduler.vocab_size
        self._thread = thread
        self.store = worker.runner.store
        #: How a row's local KV groups slide (the model's window over the store's blocks), else None.
        self._window = worker.runner.window
        #: What a row costs over the store's KV groups, priced with that window.
        self._pricing = worker.runner.pricing
        self.tokenizer = tokenizer
        #: The width of the model's hidden states (an embedding's length), where the runner's model says.
        self.hidden_size: int | None = getattr(getattr(getattr(worker.runner, "decoder", None), "config", None),
                                               "hidden_size", None)
        #: What `/stats` reports about the model beside the batcher's counters (`from_model` fills it).
        self.model_stats: dict[str, Any] = {}
        #: The grammar engine structured output is compiled with, shared with the worker's sampler (None:
        #: this batcher has none, and a request for structured output is refused).
        self._grammars = worker.runner.sampler.grammars
        #: Where a request's sampling bias is prepared at submit, on the caller's thread (`submit`).
        self._sampler = worker.runner.sampler
        self._finalizer = weakref.finalize(self, worker.lifecycle.close, worker.jobs)

    # ---------------------------------------------------------- constructors

    @classmethod
    def spawn_with_ceiling(
        cls,
        decoder,
        decode: DecodeFn,
        config: BatcherConfig,
        ceiling: ContextCeiling,
        paged: PagedKvConfig | None = None,
        grammars: Grammars | None = None,
    ) -> "ContinuousBatcher":
        """The production entry point: start the worker thread and return the handle.

        On the CPU this also releases the calling thread's OpenMP helper threads
        (`runtime.kernels.openmp`): the worker runs every forward, and a second idle pool would
        make each of its kernels slower. Load the model, then spawn, then serve.
        """
        worker = build_worker(decoder, decode, config, ceiling, paged, log_interval=decode_log_interval_from_env(),
                              grammars=grammars)
        thread = threading.Thread(target=worker.run, name=WORKER_THREAD_NAME, daemon=True)
        thread.start()
        if worker.runner.store.device.type == "cpu":
            release_thread_pool()  # this thread most likely built the model: see runtime.kernels.openmp
        return cls(worker, thread)

    @classmethod
    def from_model(cls, model: LoadedModel, config: BatcherConfig | None = None,
                   grammar_limits: GrammarLimits = GrammarLimits()) -> "ContinuousBatcher":
        """Serve a loaded checkpoint: its tokenizer decodes, and the ceiling prices KV in the store's dtype.

        `config` defaults to `BatcherConfig.from_env()` over the serving defaults
        (`BatcherConfig.serving()`, not the upstream ones); with no `kv_blocks` the KV budget is a
        share of the machine's memory (`runtime.kv.memory`). `grammar_limits`: what one request's
        structured output may cost (`ferrox_batch.grammar_limits`).
        """
        config = config if config is not None else BatcherConfig.from_env(defaults=BatcherConfig.serving())
        ceiling = ContextCeiling(config.context_limit(model.config.max_position_embeddings), model.kv_shape())
        grammars = Grammars(model.tokenizer.inner.to_str(), model.config.vocab_size,
                            sorted(model.tokenizer.stop_tokens.ids), limits=grammar_limits)
        batcher = cls.spawn_with_ceiling(model.decoder, model.tokenizer.decode, config, ceiling, grammars=grammars)
        batcher.tokenizer = model.tokenizer
        batcher.model_stats = {"precision": model.precision, "weight_bytes": model.decoder.weight_bytes,
                               "weight_formats": model.decoder.weight_formats,
                               "batch_invariant": model.batch_invariant}
        return batcher

    @classmethod
    def spawn_with_config(cls, decoder, decode: DecodeFn, config: BatcherConfig) -> "ContinuousBatcher":
        return cls.spawn_with_config_paged(decoder, decode, config, None)

    @classmethod
    def spawn_with_config_paged(
        cls, decoder, decode: DecodeFn, config: BatcherConfig, paged: PagedKvConfig | None
    ) -> "ContinuousBatcher":
        """Ceiling from `config.max_context`, priced with the model's f32 `KvShape`, as upstream.

        Divergence (docs/upstream.md D7): with no `max_context`, the ceiling is the model's trained context
        (`max_position_embeddings`) rather than none, since positions past it cannot be computed.
        """
        return cls.spawn_with_ceiling(decoder, decode, config, config_ceiling(decoder, config), paged)

    # ----------------------------------------------------------------- stats

    def stats(self) -> BatcherStats:
        prefill_chunks, prefill_tokens, decode_steps, peak = self._counters.snapshot()
        prefix_queries, prefix_hits = self._counters.prefix_cache()
        drafts, draft_tokens, accepted_tokens, accepted_per_pos = self._counters.speculation()
        total = self._budget.total
        times = self._worker_time.snapshot()
        held_global, held_local = self.store.blocks_by_kind()
        return BatcherStats(
            prefill_chunks=prefill_chunks,
            prefill_tokens=prefill_tokens,
            decode_steps=decode_steps,
            queue_depth=self._queue.depth(),
            queue_rejected=self._queue.rejected(),
            kv_blocks_total=total or 0,
            kv_blocks_free=self._budget.free(),
            kv_block_size=self._budget.block_size,
            kv_rejected_too_large=self._budget.rejected_too_large(),
            kv_rejected_context_length=self._budget.ceiling.refused(),
            kv_blocks_peak=peak,
            aborted=self._aborts.aborted(),
            max_seqs=0 if self._config.unlimited_seqs else self._config.max_seqs,
            prefill_chunk=self._config.prefill_chunk,
            max_batch_tokens=self._config.max_batch_tokens,
            worker_alive=self._thread.is_alive() and self._lifecycle.dead is None,
            prefix_cache_queries=prefix_queries,
            prefix_cache_hits=prefix_hits,
            spec_decode_num_drafts=drafts,
            spec_decode_num_draft_tokens=draft_tokens,
            spec_decode_num_accepted_tokens=accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=accepted_per_pos,
            kv_blocks_cached=self.store.pool.num_cached,
            kv_blocks_global=held_global,
            kv_blocks_local=held_local,
            worker_idle_ms=round(times.idle_s * 1e3),
            worker_scheduling_ms=round(times.scheduling_s * 1e3),
            worker_forward_ms=round(times.forward_s * 1e3),
            worker_forward_off_cpu_ms=round(times.forward_off_cpu_s * 1e3),
        )

    @property
    def config(self) -> BatcherConfig:
        return self._config

    @property
    def vocab_size(self) -> int:
        """The ids a request may name: `[0, vocab_size)`."""
        return self._vocab_size

    @property
    def ceiling(self) -> ContextCeiling:
        return self._budget.ceiling

    # -------------------------------------------------------------- generate

    def generate(
        self, prompt_tokens: Sequence[int], params: GenerationParams, stop_tokens: StopTokens | None = None,
        *, timeout: float | None = None,
    ) -> GenerationResult:
        """Block until the request finishes (see `generate_streaming`); `stop_tokens=None` means the
        model's stop tokens when the batcher has a tokenizer (`from_model`), else none."""
        return self.generate_streaming(prompt_tokens, params, stop_tokens, None, timeout=timeout)

    def generate_streaming(
        self,
        prompt_tokens: Sequence[int],
        params: GenerationParams,
        stop_tokens: StopTokens | None,
        on_chunk: Callable[[str], None] | None,
        *,
        timeout: float | None = None,
    ) -> GenerationResult:
        """Block until the request finishes; raise its typed `DecodeError` if it is refused or fails.

        `stop_tokens=None` means the model's stop tokens (`tokenizer.stop_tokens`) when the batcher
        has a tokenizer, else none; an explicit `StopTokens` wins (an empty one stops on no token).
        If `on_chunk` raises, the request is cancelled, the rest of its events are drained,
        and the callback's exception propagates (how a server stops work for a client that left).
        After `timeout` seconds without the answer the request is cancelled and `WaitTimedOut` is
        raised; any other exception raised into the wait (a `KeyboardInterrupt`) cancels it too.
        """
        if timeout is not None:
            check_seconds("timeout", timeout)  # a bad timeout is refused before anything is queued
        return self.submit(prompt_tokens, params, stop_tokens).wait(on_chunk, timeout)

    def submit(
        self, prompt_tokens: Sequence[int], params: GenerationParams, stop_tokens: StopTokens | None = None,
        *, sink: ReplySink | None = None, after: Ticket | None = None,
    ) -> Ticket:
        """Run every refusal and queue the request without waiting; raise the typed refusal if any.

        `stop_tokens=None` means the model's stop tokens when the batcher has a tokenizer, else none.
        `sink`: where the worker sends the request's text and its one final event (called on the
        worker's thread; it must not block). None: a queue the returned ticket's `wait` reads.
        `after`: the ticket of a request with the same prompt (another choice of it): this one is admitted
        only once that one's prompt is through, so with the prefix cache it adopts the prompt's blocks
        instead of computing them again.
        """
        prompt = checked_prompt(prompt_tokens, params, self._vocab_size)
        refusal = self._lifecycle.refusal()
        if refusal is not None:
            raise refusal
        sized = size_request(prompt, params, self._budget, self._grammars, self._window, groups=self._pricing)
        params = sized.params  # `max_tokens` clamped to the context ceiling
        # Built here, on the caller's thread and before a queue slot is taken: its cost grows with the
        # stop strings, and the worker serves everyone.
        stops = StopMatcher(params.stop, params.all_stop_ids)
        if stop_tokens is None:
            stop_tokens = self.tokenizer.stop_tokens if self.tokenizer is not None else StopTokens.default()
        special_texts = None
        if not params.skip_special_tokens:
            if self.tokenizer is None:
                raise InvalidRequest("skip_special_tokens", False, "needs a batcher that knows its tokenizer's "
                                                                   "special tokens (ContinuousBatcher.from_model)")
            special_texts = self.tokenizer.special_texts
        check_samplable(params, {*params.stop_token_ids, *(() if params.ignore_eos else stop_tokens.ids)})
        # The bias grows with the request's lists (`allowed_token_ids` up to the vocabulary): checked and
        # compacted here, once for a prompt's choices with the same settings, into a form no bigger than the
        # lists (never a [vocab] tensor while it waits); the worker only scatters it into each admitted row.
        if after is not None and after.sampling is params.sampling:
            bias = after.bias
        else:
            bias = self._sampler.prepare_bias(params.sampling)
        depth = self._queue.try_reserve()
        if depth is not None:
            raise QueueFull(depth, self._queue.cap)
        abort = self._aborts.next_id()
        replies = QueueSink() if sink is None else None
        request = Request(prompt, params, stop_tokens, OnceSink(replies if sink is None else sink), abort,
                          sized.blocks, sized.positions, stops=stops, grammar=sized.grammar, window=sized.window,
                          after=None if after is None else after.abort_id, special_texts=special_texts,
                          bias=bias)
        try:
            request.queued(self._clock(), self._config.max_queue_wait_ms)
            self._lifecycle.send(self._jobs, request)
        except BaseException:
            self._queue.release()
            raise
        ticket = Ticket(prompt_tokens=len(prompt), max_tokens=params.max_tokens,
                        reply=None if replies is None else replies.events, abort=abort, aborts=self._aborts,
                        sampling=params.sampling, bias=bias)
        if params.cancel is not None:
            # Registered only after a successful send; hooks are never unregistered, and once
            # the ticket is answered a late cancel does nothing.
            params.cancel.on_cancel(ticket.cancel)
        return ticket

    def generate_text(
        self,
        prompt: str | Messages,
        *,
        max_tokens: int = 128,
        on_chunk: Callable[[str], None] | None = None,
        **options: Any,
    ) -> GenerationResult:
        """Text or chat messages in, text out (see `engine.text`); needs a batcher made by `from_model`.

        `options`: temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty,
        frequency_penalty, logit_bias, seed, stop, stop_token_ids, ignore_eos, cancel, cache_salt, priority,
        max_queue_wait_ms, logprobs, prompt_logprobs, structured, min_tokens, include_stop_str_in_output,
        skip_special_tokens, spaces_between_special_tokens, stream_token_ids, bad_words, allowed_token_ids.
        """
        if self.tokenizer is None:
            raise ValueError("generate_text needs a tokenizer: build the batcher with ContinuousBatcher.from_model")
        return generate_text(self, self.tokenizer, prompt, max_tokens=max_tokens, on_chunk=on_chunk, **options)

    # -------------------------------------------------------------- lifetime

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new work, let the worker finish what was submitted, and wait for it (up to `timeout`).

        Returns True once the worker thread has exited.
        """
        self._lifecycle.close(self._jobs)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> "ContinuousBatcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
