"""A mixture-of-experts model decodes without drafts unless speculation was asked for.

A drafted position reads its own row's experts in every sparse layer, so the serving default (drafts on)
is resolved per model: off for a model whose config has a mixture-of-experts shape, unchanged for a dense
one, and whatever `--speculative`/`--no-speculative` or `FERROX_CB_SPECULATIVE` said where either was given.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from ferrox_batch import cli
from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.cli.batcher_settings import speculative_given
from ferrox_batch.engine.wiring import with_model_drafts

SPARSE = SimpleNamespace(config=SimpleNamespace(moe=object()))
DENSE = SimpleNamespace(config=SimpleNamespace(moe=None))


def serve_args(*flags: str):
    return cli.build_parser().parse_args(["serve", *flags])


@pytest.mark.parametrize("decoder, drafts", [(SPARSE, False), (DENSE, True)])
def test_the_default_drafts_only_for_a_dense_model(decoder, drafts) -> None:
    config = BatcherConfig.serving()
    assert config.speculative
    resolved = with_model_drafts(config, decoder, speculative_given=False)
    assert resolved == dataclasses.replace(config, speculative=drafts)


@pytest.mark.parametrize("asked", [True, False])
@pytest.mark.parametrize("decoder", [SPARSE, DENSE])
def test_speculation_asked_for_is_kept_either_way(decoder, asked) -> None:
    config = dataclasses.replace(BatcherConfig.serving(), speculative=asked)
    assert with_model_drafts(config, decoder, speculative_given=True) == config


@pytest.mark.parametrize("flags, env, given", [
    ((), {}, False),
    (("--speculative",), {}, True),
    (("--no-speculative",), {}, True),
    ((), {"FERROX_CB_SPECULATIVE": "1"}, True),
    ((), {"FERROX_CB_SPECULATIVE": "0"}, True),
    (("--max-seqs", "4"), {"FERROX_CB_MAX_SEQS": "8"}, False),
])
def test_speculation_is_given_by_its_flag_or_its_variable(flags, env, given) -> None:
    assert speculative_given(serve_args(*flags), env) is given


def test_the_help_says_a_mixture_of_experts_model_does_not_draft() -> None:
    assert "mixture-of-experts" in cli.BATCHER_SWITCHES["speculative"][2]
