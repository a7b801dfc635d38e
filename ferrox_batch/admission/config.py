"""`BatcherConfig` and the scheduler's defaults (the upstream's, and the ones a server starts from).

This is the only module that reads the environment (`BatcherConfig.from_env`,
`decode_log_interval_from_env`); everything else takes a config value. A
malformed `FERROX_CB_*` variable stops start-up with
`"{name} must be a positive integer"` (upstream panics with the same text):
a typo in an operator's setting must not silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Mapping

from ferrox_batch.admission.window import DEFAULT_SWA_EVICTION_INTERVAL
from ferrox_batch.checks import UNLIMITED

#: Prompt tokens per prefill chunk when unset: the ceiling of the per-tick prefill budget (docs/upstream.md,
#: Step budget).
DEFAULT_PREFILL_CHUNK = 128
#: Token positions per KV block: the admission quantum.
DEFAULT_KV_BLOCK_SIZE = 256
#: Jobs allowed to wait for admission before new ones are refused.
DEFAULT_MAX_QUEUE = 512
#: Tokens per tick, prompt + generated (upstream keeps it in `step_budget`, which imports it from here).
DEFAULT_MAX_BATCH_TOKENS = 256
#: Decode forwards between two decode log lines (upstream keeps it in `status`).
DEFAULT_DECODE_LOG_INTERVAL = 40
#: Prompts advanced per tick: 1 is the upstream tick, one prefill chunk per tick (docs/upstream.md D9).
DEFAULT_MAX_PREFILLS_PER_TICK = 1

# What a server starts from (`BatcherConfig.serving()`): the upstream defaults serve a burst of prompts
# one 128-token chunk per forward; these trade a little of the best throughput found for a bound on
# inter-token latency (the HTTP benchmark in docs/benchmarks.md, AVX2 CPU in fp32: 0.96x the best flags
# found, ITL p99 3.0x lower than the same flags without the step target; a 400 ms target cost 13% of a
# burst's throughput, 500 ms about 4-9%). Port-only, like the server.
SERVING_PREFILL_CHUNK = 256
SERVING_MAX_BATCH_TOKENS = 1024
SERVING_KV_BLOCK_SIZE = 16
SERVING_MAX_PREFILLS_PER_TICK = 8
SERVING_STEP_TARGET_MS = 500
#: How long a request may wait behind more urgent ones before it is served in arrival order
#: (`WaitingQueue` aging; the upstream has one priority and no aging). Long enough that priorities decide
#: the order under a burst, short enough that a flood of urgent requests cannot starve the rest.
SERVING_PRIORITY_AGING_MS = 30_000
#: The ways a row may draft tokens for speculative decoding: "ngram", prompt lookup (`scheduler.ngram_draft`).
SPECULATIVE_METHODS = ("ngram",)

ENV_MAX_SEQS = "FERROX_CB_MAX_SEQS"
ENV_PREFILL_CHUNK = "FERROX_CB_PREFILL_CHUNK"
ENV_MAX_BATCH_TOKENS = "FERROX_CB_MAX_BATCH_TOKENS"
ENV_MAX_QUEUE = "FERROX_CB_MAX_QUEUE"
ENV_KV_BLOCK_SIZE = "FERROX_CB_KV_BLOCK_SIZE"
ENV_KV_BLOCKS = "FERROX_CB_KV_BLOCKS"
ENV_MAX_CONTEXT = "FERROX_CB_MAX_CONTEXT"
ENV_MAX_PREFILLS_PER_TICK = "FERROX_CB_MAX_PREFILLS_PER_TICK"
ENV_STEP_TARGET_MS = "FERROX_CB_STEP_TARGET_MS"
ENV_PREFIX_CACHE = "FERROX_CB_PREFIX_CACHE"
ENV_MAX_QUEUE_WAIT_MS = "FERROX_CB_MAX_QUEUE_WAIT_MS"
ENV_PRIORITY_AGING_MS = "FERROX_CB_PRIORITY_AGING_MS"
ENV_SLIDE_INTERVAL = "FERROX_CB_SLIDE_INTERVAL"
ENV_SPECULATIVE = "FERROX_CB_SPECULATIVE"
ENV_SPECULATIVE_METHOD = "FERROX_CB_SPECULATIVE_METHOD"
ENV_SPECULATIVE_TOKENS = "FERROX_CB_SPECULATIVE_TOKENS"
ENV_SPECULATIVE_NGRAM_MIN = "FERROX_CB_SPECULATIVE_NGRAM_MIN"
ENV_SPECULATIVE_NGRAM_MAX = "FERROX_CB_SPECULATIVE_NGRAM_MAX"
ENV_SPECULATIVE_MAX_BATCH = "FERROX_CB_SPECULATIVE_MAX_BATCH"
ENV_DECODE_LOG_INTERVAL = "FERROX_DECODE_LOG_INTERVAL"

#: Upstream `prefill_batch::PREFILL_CHUNK_ENV_KEYS`, ported to the FERROX_ prefix:
#: index PRIVATE_PATH_KEY is the private decode path's variable, BATCH_PATH_KEY the batcher's.
PREFILL_CHUNK_ENV_KEYS = ("FERROX_CHUNKED_PREFILL", ENV_PREFILL_CHUNK)
PRIVATE_PATH_KEY = 0
BATCH_PATH_KEY = 1

# Rust's `usize::from_str`: ASCII digits with an optional leading '+', nothing else
# (no whitespace, no underscores, no sign '-'), unlike Python's int().
_USIZE = re.compile(r"\+?[0-9]+")


def _parse_usize(raw: str) -> int | None:
    if not _USIZE.fullmatch(raw):
        return None
    value = int(raw)
    return value if value <= UNLIMITED else None


def env_positive(env: Mapping[str, str], name: str) -> int | None:
    """None when `name` is unset; its value when a positive integer; else ValueError."""
    raw = env.get(name)
    if raw is None:
        return None
    value = _parse_usize(raw)
    if value is None or value == 0:
        raise ValueError(f"{name} must be a positive integer")
    return value


def env_switch(env: Mapping[str, str], name: str) -> bool | None:
    """None when `name` is unset; True for 1, false for 0; else ValueError."""
    raw = env.get(name)
    if raw is None:
        return None
    if raw.strip() not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1")
    return raw.strip() == "1"


def _check_field(name: str, value: object, *, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        what = "a positive integer or None" if optional else f"an integer >= {minimum}"
        raise ValueError(f"BatcherConfig.{name} must be {what}, got {value!r}")
    if not minimum <= value <= UNLIMITED:
        raise ValueError(f"BatcherConfig.{name} must be an integer in [{minimum}, 2**64 - 1], got {value!r}")


@dataclass(frozen=True, slots=True)
class BatcherConfig:
    """Scheduler limits. Immutable; use `dataclasses.replace` for a variant.

    `max_seqs` UNLIMITED means no sequence cap; `kv_blocks` None means no block
    budget; `max_context` None means no per-request ceiling. `max_queue` may be
    0 (refuse every job: upstream's own test does this) although the
    environment variable must be positive.

    `max_prefills_per_tick` (port-only): how many admitted prompts one tick may
    advance, sharing the tick's token budget. 1 is the upstream tick; more
    lets a burst of prompts prefill together instead of one per forward
    (measured in docs/benchmarks.md).

    `prefix_cache` (port-only here; the upstream's radix cache is configured
    on its paged store): requests adopt the cached KV blocks of their
    prompt's longest cached prefix instead of computing them, and publish
    their own full blocks when they finish (`runtime.kv.block_pool`).

    `step_target_ms` (port-only): a latency target for a tick that has rows
    decoding. The worker learns what a prompt token costs (`step_cost`) and
    caps the tick's prompt tokens so the tick stays under it; None is no time
    cap (the upstream tick, bounded by `max_batch_tokens` alone).

    `max_queue_wait_ms` (port-only): how long a request may wait for
    admission before it is refused with `QueueTimeout` (a 503 with
    Retry-After) instead of being admitted late; a request's own
    `GenerationParams.max_queue_wait_ms` wins. None: no limit.

    `priority_aging_ms` (port-only): a waiting request that has waited this
    long moves ahead of every request that has not, whatever their
    priorities, so no priority starves (`scheduler.waiting`). None: no aging.
    With one priority in use it changes nothing.

    `slide_interval`: for a model whose every layer slides by one window,
    the decode steps between two slides of a row's pages (`admission.window`;
    the upstream carries it on its paged-store config, ours is here because
    most batchers build their own store). Fewer steps price a sliding row
    lower and update its block table more often.

    The field defaults are the upstream's; `serving()` holds the defaults
    the server, the CLI and `ContinuousBatcher.from_model` start from.
    """

    max_seqs: int = UNLIMITED
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_queue: int = DEFAULT_MAX_QUEUE
    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE
    kv_blocks: int | None = None
    max_context: int | None = None
    max_prefills_per_tick: int = DEFAULT_MAX_PREFILLS_PER_TICK
    step_target_ms: int | None = None
    prefix_cache: bool = False
    max_queue_wait_ms: int | None = None
    priority_aging_ms: int | None = None
    slide_interval: int = DEFAULT_SWA_EVICTION_INTERVAL
    #: Speculative decoding (`scheduler.speculation`, port-only): whether rows draft, how (`SPECULATIVE_METHODS`:
    #: prompt lookup), the most tokens a row drafts per step, the n-gram lengths looked up, and the most
    #: decoding rows a step may have for rows to draft. 15 drafted tokens make a step of 16 positions, which
    #: fills the bf16 kernel's four-row tiles; replayed on the copying tasks, 15 kept the most tokens per
    #: second of 8, 12, 15 and 16 (`scripts/bench_draft_policy.py`).
    speculative: bool = False
    speculative_method: str = "ngram"
    speculative_tokens: int = 15
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 4
    speculative_max_batch: int = 4

    def __post_init__(self) -> None:
        _check_field("max_seqs", self.max_seqs, minimum=1)
        _check_field("prefill_chunk", self.prefill_chunk, minimum=1)
        _check_field("max_batch_tokens", self.max_batch_tokens, minimum=1)
        _check_field("max_queue", self.max_queue, minimum=0)
        _check_field("kv_block_size", self.kv_block_size, minimum=1)
        _check_field("kv_blocks", self.kv_blocks, minimum=1, optional=True)
        _check_field("max_context", self.max_context, minimum=1, optional=True)
        _check_field("max_prefills_per_tick", self.max_prefills_per_tick, minimum=1)
        _check_field("step_target_ms", self.step_target_ms, minimum=1, optional=True)
        if not isinstance(self.prefix_cache, bool):
            raise TypeError(f"prefix_cache must be a bool, got {self.prefix_cache!r}")
        _check_field("max_queue_wait_ms", self.max_queue_wait_ms, minimum=1, optional=True)
        _check_field("priority_aging_ms", self.priority_aging_ms, minimum=1, optional=True)
        _check_field("slide_interval", self.slide_interval, minimum=1)
        if not isinstance(self.speculative, bool):
            raise TypeError(f"speculative must be a bool, got {self.speculative!r}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.speculative_method!r}")
        _check_field("speculative_tokens", self.speculative_tokens, minimum=1)
        _check_field("speculative_ngram_min", self.speculative_ngram_min, minimum=1)
        _check_field("speculative_ngram_max", self.speculative_ngram_max, minimum=self.speculative_ngram_min)
        _check_field("speculative_max_batch", self.speculative_max_batch, minimum=1)

    @classmethod
    def default(cls) -> BatcherConfig:
        return cls()

    @classmethod
    def serving(cls) -> BatcherConfig:
        """The defaults a server starts from: fast settings with a latency bound (docs/benchmarks.md). It
        speculates: on copying edits one stream decodes about twice as fast, and the burst and the chat,
        whose batches are too wide to draft, measured no slower."""
        return cls(prefill_chunk=SERVING_PREFILL_CHUNK, max_batch_tokens=SERVING_MAX_BATCH_TOKENS,
                   kv_block_size=SERVING_KV_BLOCK_SIZE, max_prefills_per_tick=SERVING_MAX_PREFILLS_PER_TICK,
                   step_target_ms=SERVING_STEP_TARGET_MS, prefix_cache=True,
                   priority_aging_ms=SERVING_PRIORITY_AGING_MS, speculative=True)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, defaults: BatcherConfig | None = None) -> BatcherConfig:
        """Read `FERROX_CB_*` (from `env`, or the process environment); unset fields keep `defaults`' values
        (the upstream defaults when None; `BatcherConfig.serving()` for a server).

        The prefill chunk is `FERROX_CB_PREFILL_CHUNK`, falling back to
        `FERROX_CHUNKED_PREFILL` (the private path's variable) when only that
        one is set. Raises ValueError `"{name} must be a positive integer"`
        for a set variable that is empty, not a plain decimal integer, or 0.
        """
        if env is None:
            env = os.environ
        base = defaults if defaults is not None else cls()
        prefill_chunk = env_positive(env, PREFILL_CHUNK_ENV_KEYS[BATCH_PATH_KEY])
        if prefill_chunk is None:
            prefill_chunk = env_positive(env, PREFILL_CHUNK_ENV_KEYS[PRIVATE_PATH_KEY])
        found = {
            "max_seqs": env_positive(env, ENV_MAX_SEQS),
            "prefill_chunk": prefill_chunk,
            "max_batch_tokens": env_positive(env, ENV_MAX_BATCH_TOKENS),
            "max_queue": env_positive(env, ENV_MAX_QUEUE),
            "kv_block_size": env_positive(env, ENV_KV_BLOCK_SIZE),
            "kv_blocks": env_positive(env, ENV_KV_BLOCKS),
            "max_context": env_positive(env, ENV_MAX_CONTEXT),
            "max_prefills_per_tick": env_positive(env, ENV_MAX_PREFILLS_PER_TICK),
            "step_target_ms": env_positive(env, ENV_STEP_TARGET_MS),
            "prefix_cache": env_switch(env, ENV_PREFIX_CACHE),
            "max_queue_wait_ms": env_positive(env, ENV_MAX_QUEUE_WAIT_MS),
            "priority_aging_ms": env_positive(env, ENV_PRIORITY_AGING_MS),
            "slide_interval": env_positive(env, ENV_SLIDE_INTERVAL),
            "speculative": env_switch(env, ENV_SPECULATIVE),
            "speculative_method": env.get(ENV_SPECULATIVE_METHOD),
            "speculative_tokens": env_positive(env, ENV_SPECULATIVE_TOKENS),
            "speculative_ngram_min": env_positive(env, ENV_SPECULATIVE_NGRAM_MIN),
            "speculative_ngram_max": env_positive(env, ENV_SPECULATIVE_NGRAM_MAX),
            "speculative_max_batch": env_positive(env, ENV_SPECULATIVE_MAX_BATCH),
        }
        return dataclasses.replace(base, **{name: value for name, value in found.items() if value is not None})

    def context_limit(self, trained: int) -> int:
        """The per-request position ceiling: `max_context` capped at the model's `trained` context (positions
        past it cannot be computed), or `trained` when unset."""
        return min(self.max_context or trained, trained)

    @property
    def unlimited_seqs(self) -> bool:
        return self.max_seqs == UNLIMITED


def decode_log_interval_from_env(env: Mapping[str, str] | None = None) -> int:
    """`FERROX_DECODE_LOG_INTERVAL`; 40 when unset or unparseable (never fails). 0 is kept (the reporter clamps it)."""
    if env is None:
        env = os.environ
    raw = env.get(ENV_DECODE_LOG_INTERVAL)
    if raw is None:
        return DEFAULT_DECODE_LOG_INTERVAL
    value = _parse_usize(raw)
    return DEFAULT_DECODE_LOG_INTERVAL if value is None else value
