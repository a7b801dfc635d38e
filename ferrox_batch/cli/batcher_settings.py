"""The batcher's settings as `serve` takes them: one flag per `BatcherConfig` field, each shown in `--help`
with its `FERROX_CB_*` variable and default, and how flags, variables and defaults resolve into a
`BatcherConfig` and a KV memory budget.

One table (`BATCHER_FLAGS`, `BATCHER_SWITCHES`) drives both the flags and their resolution, so a setting
cannot have a flag that is not applied, nor be applied without a flag. Every setting is checked without
loading anything, so a bad one is a `CliError` with status 2 before the (slow) model load; only turning a
memory budget into blocks needs the loaded model, and `with_kv_budget` imports the batch wiring (and so
torch) only when it is called, which keeps `--help` free of torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from ferrox_batch.admission.config import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_SWA_EVICTION_INTERVAL,
    ENV_KV_BLOCK_SIZE,
    ENV_KV_BLOCKS,
    ENV_MAX_BATCH_TOKENS,
    ENV_MAX_CONTEXT,
    ENV_MAX_PREFILLS_PER_TICK,
    ENV_MAX_QUEUE,
    ENV_MAX_QUEUE_WAIT_MS,
    ENV_MAX_SEQS,
    ENV_PREFILL_CHUNK,
    ENV_PREFIX_CACHE,
    ENV_PRIORITY_AGING_MS,
    ENV_SLIDE_INTERVAL,
    ENV_SPECULATIVE,
    ENV_SPECULATIVE_MAX_BATCH,
    ENV_SPECULATIVE_METHOD,
    ENV_SPECULATIVE_NGRAM_MAX,
    ENV_SPECULATIVE_NGRAM_MIN,
    ENV_SPECULATIVE_TOKENS,
    ENV_STEP_TARGET_MS,
    PREFILL_CHUNK_ENV_KEYS,
    PRIVATE_PATH_KEY,
    SERVING_KV_BLOCK_SIZE,
    SERVING_MAX_BATCH_TOKENS,
    SERVING_MAX_PREFILLS_PER_TICK,
    SERVING_PREFILL_CHUNK,
    SERVING_PRIORITY_AGING_MS,
    SERVING_STEP_TARGET_MS,
    SPECULATIVE_METHODS,
    BatcherConfig,
)
from ferrox_batch.cli.common import (
    DEFAULT_KV_MEMORY,
    ENV_KV_MEMORY,
    CliError,
    _memory_size,
    env_config,
    non_negative_int,
    parse_memory_size,
    positive_int,
)

if TYPE_CHECKING:  # the CLI imports torch only once a command needs it: `--help` stays quick
    from ferrox_batch.runtime.loading.loader import LoadedModel


#: BatcherConfig field -> (flag, environment variable, default shown in --help, meaning). The README's
#: configuration table lists the same rows. The defaults are the serving ones (`BatcherConfig.serving()`).
BATCHER_FLAGS: Mapping[str, tuple[str, str, str, str]] = MappingProxyType({
    "max_seqs": ("--max-seqs", ENV_MAX_SEQS, "unlimited", "sequences decoded at once"),
    "prefill_chunk": ("--prefill-chunk", ENV_PREFILL_CHUNK, str(SERVING_PREFILL_CHUNK),
                      "prompt tokens per prefill chunk"),
    "max_batch_tokens": ("--max-batch-tokens", ENV_MAX_BATCH_TOKENS, str(SERVING_MAX_BATCH_TOKENS),
                         "tokens per forward, decodes + prefill chunk"),
    "max_queue": ("--max-queue", ENV_MAX_QUEUE, str(DEFAULT_MAX_QUEUE),
                  "requests waiting for admission before new ones get 503"),
    "kv_block_size": ("--kv-block-size", ENV_KV_BLOCK_SIZE, str(SERVING_KV_BLOCK_SIZE),
                      "token positions per KV block"),
    "kv_blocks": ("--kv-blocks", ENV_KV_BLOCKS, "from --kv-memory",
                  "KV blocks in the budget (wins over --kv-memory)"),
    "max_context": ("--max-context", ENV_MAX_CONTEXT, "the model's context",
                    "prompt + max_tokens ceiling per request"),
    "max_prefills_per_tick": ("--max-prefills-per-tick", ENV_MAX_PREFILLS_PER_TICK,
                              str(SERVING_MAX_PREFILLS_PER_TICK),
                              "prompts one forward may advance, sharing --max-batch-tokens"),
    "step_target_ms": ("--step-target-ms", ENV_STEP_TARGET_MS, str(SERVING_STEP_TARGET_MS),
                       "while rows decode, a forward holds only the prompt tokens that keep it under this "
                       "many milliseconds (learnt as it runs); 0: no time target"),
    "max_queue_wait_ms": ("--max-queue-wait-ms", ENV_MAX_QUEUE_WAIT_MS, "none",
                          "a request still waiting for admission this many milliseconds after it arrived is "
                          "refused with 503 queue_timeout (a request's max_queue_wait_ms wins); 0: no limit"),
    "priority_aging_ms": ("--priority-aging-ms", ENV_PRIORITY_AGING_MS, str(SERVING_PRIORITY_AGING_MS),
                          "a request that has waited this many milliseconds goes ahead of every request that "
                          "has not, whatever their priorities, so none starves; 0: no aging"),
    "slide_interval": ("--slide-interval", ENV_SLIDE_INTERVAL, str(DEFAULT_SWA_EVICTION_INTERVAL),
                       "for a model whose every layer slides by one window: decode steps between two slides "
                       "of a row's KV pages behind the window (fewer price a long row lower)"),
    "speculative_tokens": ("--speculative-tokens", ENV_SPECULATIVE_TOKENS, "15",
                           "speculative decoding: the most tokens a decoding row drafts per step"),
    "speculative_ngram_min": ("--speculative-ngram-min", ENV_SPECULATIVE_NGRAM_MIN, "2",
                              "the shortest n-gram a draft is looked up by"),
    "speculative_ngram_max": ("--speculative-ngram-max", ENV_SPECULATIVE_NGRAM_MAX, "4",
                              "the longest n-gram a draft is looked up by (tried first)"),
    "speculative_max_batch": ("--speculative-max-batch", ENV_SPECULATIVE_MAX_BATCH, "4",
                              "rows draft only while at most this many decode together"),
})
#: BatcherConfig field -> (flag, environment variable (0 or 1), default shown in --help, meaning), for the
#: on/off settings: each gets `--flag` and `--no-flag`.
BATCHER_SWITCHES: Mapping[str, tuple[str, str, str, str]] = MappingProxyType({
    "prefix_cache": ("--prefix-cache", ENV_PREFIX_CACHE, "on",
                     "reuse the KV of cached prompt prefixes (full blocks) instead of computing them again"),
    "speculative": ("--speculative", ENV_SPECULATIVE,
                    ("on" if BatcherConfig.serving().speculative else "off") + ", off for a mixture-of-experts model",
                    "speculative decoding: small batches' rows draft their next tokens (--speculative-method) "
                    "and one forward verifies them; the output is what it would be without"),
})
#: The speculative method's flag: a choice, not a count.
METHOD_FLAG = ("--speculative-method", ENV_SPECULATIVE_METHOD, "ngram",
               "how a row drafts: ngram, the tokens that followed the latest earlier occurrence of its last "
               "n-gram in its prompt and output (prompt lookup)")
#: Flags whose 0 means "none" (the variable, like every FERROX_CB_* one, must still be positive).
_ZERO_IS_NONE = ("step_target_ms", "max_queue_wait_ms", "priority_aging_ms")


def add_batcher_flags(parser: argparse.ArgumentParser) -> None:
    """The "batcher" group: a flag per `BATCHER_FLAGS` row, `--flag`/`--no-flag` per `BATCHER_SWITCHES` row,
    and the block count and `--kv-memory` as two exclusive ways to set the KV budget.

    Every flag defaults to None, so that `batcher_config` can tell a flag that was given from one that was
    not and let only the given ones win over the environment.
    """
    batcher = parser.add_argument_group(
        "batcher", "Each flag wins over its FERROX_CB_* variable; a malformed variable stops start-up.")
    for field, (flag, env_name, default, meaning) in BATCHER_FLAGS.items():
        if field == "kv_blocks":
            continue  # in the exclusive group below
        also = f", else ${PREFILL_CHUNK_ENV_KEYS[PRIVATE_PATH_KEY]}" if field == "prefill_chunk" else ""
        batcher.add_argument(flag, dest=field,
                             type=non_negative_int if field in _ZERO_IS_NONE else positive_int,
                             default=None, metavar="N", help=f"{meaning} (${env_name}{also}; default: {default})")
    for field, (flag, env_name, default, meaning) in BATCHER_SWITCHES.items():
        batcher.add_argument(flag, dest=field, action=argparse.BooleanOptionalAction, default=None,
                             help=f"{meaning} (${env_name}=0 or 1; default: {default})")
    flag, env_name, default, meaning = METHOD_FLAG
    batcher.add_argument(flag, dest="speculative_method", choices=SPECULATIVE_METHODS, default=None,
                         help=f"{meaning} (${env_name}; default: {default})")
    budget = batcher.add_mutually_exclusive_group()
    flag, env_name, _, meaning = BATCHER_FLAGS["kv_blocks"]
    budget.add_argument(flag, dest="kv_blocks", type=positive_int, default=None, metavar="N",
                        help=f"{meaning} (${env_name}; default: derived from the KV memory)")
    budget.add_argument("--kv-memory", type=_memory_size, default=None, metavar="SIZE",
                        help=f"KV memory budget, e.g. 512MiB or 2GiB: as many blocks as fit in the loaded "
                             f"model's KV dtype; used when no block count is set (${ENV_KV_MEMORY}; "
                             f"default: {DEFAULT_KV_MEMORY})")


def batcher_config(args: argparse.Namespace, env: Mapping[str, str]) -> BatcherConfig:
    """`FERROX_CB_*` read from `env`, then every batcher flag that was given on top (flags win).

    `kv_blocks` may still be None here: the memory budget becomes blocks once the model is loaded.
    """
    config = env_config(env)
    fields = [*BATCHER_FLAGS, *BATCHER_SWITCHES, "speculative_method"]
    given = {field: getattr(args, field) for field in fields if getattr(args, field, None) is not None}
    given.update({field: None for field in _ZERO_IS_NONE if given.get(field) == 0})
    if getattr(args, "kv_memory", None) is not None:
        given["kv_blocks"] = None  # an explicit --kv-memory wins over $FERROX_CB_KV_BLOCKS
    try:
        return dataclasses.replace(config, **given)
    except ValueError as err:
        raise CliError(str(err), status=2) from None


def speculative_given(args: argparse.Namespace, env: Mapping[str, str]) -> bool:
    """Whether `--speculative`/`--no-speculative` or its variable was given: where neither was, a
    mixture-of-experts model decodes without drafts (`engine.wiring.with_model_drafts`)."""
    return getattr(args, "speculative", None) is not None or ENV_SPECULATIVE in env


def with_model_drafts(config: BatcherConfig, model: LoadedModel, given: bool) -> BatcherConfig:
    """`config` with the drafts default resolved for the loaded model (`engine.wiring.with_model_drafts`)."""
    from ferrox_batch.engine.wiring import with_model_drafts as resolve

    return resolve(config, model.decoder, speculative_given=given)


def kv_memory(args: argparse.Namespace, env: Mapping[str, str]) -> int | None:
    """The KV memory budget in bytes: `--kv-memory`, else `$FERROX_CB_KV_MEMORY`, else None (the machine's
    share, `runtime.kv.memory.default_kv_memory`, once the model is loaded)."""
    if args.kv_memory is not None:
        return args.kv_memory
    raw = env.get(ENV_KV_MEMORY)
    if raw is None:
        return None
    try:
        return parse_memory_size(raw)
    except ValueError as err:
        raise CliError(f"{ENV_KV_MEMORY}: {err}", status=2) from None


def with_kv_budget(config: BatcherConfig, memory_bytes: int | None, model: LoadedModel) -> BatcherConfig:
    """`config`, with `kv_blocks` derived from the memory budget (None: the machine's share) when no block
    count was set (`engine.wiring.with_kv_budget`); a budget too small for one block is a usage error."""
    from ferrox_batch.engine.wiring import with_kv_budget as derive

    try:
        return derive(config, memory_bytes, model.decoder)
    except ValueError as err:
        raise CliError(f"{err}: raise --kv-memory or lower --kv-block-size", status=2) from None
