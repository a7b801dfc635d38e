"""`serve`'s request-cost flags: each is in `--help` with its default, takes only a positive integer, reaches
`create_app` as its keyword on one process and on every replica, and its default is the server's."""

from __future__ import annotations

import inspect

import pytest

from ferrox_batch import cli
from ferrox_batch.cli import request_cap_flags
from ferrox_batch.cli.replicas import replica_app_settings
from ferrox_batch.cli.request_cap_flags import REQUEST_CAP_FLAGS, request_cap_settings
from ferrox_batch.server import request_caps
from ferrox_batch.server.app import create_app
from ferrox_batch.server.run import serve

GIVEN = {"max_allowed_token_ids": 100, "max_stop_chars": 64, "max_prompt_logprobs": 5000,
         "max_tokenization_ids": 300, "max_detokenize_bytes": 4096}


def parse(*flags: str):
    return cli.build_parser().parse_args(["serve", *flags])


def test_every_cap_has_a_flag_that_reaches_the_app():
    assert set(REQUEST_CAP_FLAGS) == set(GIVEN)
    argv = [part for keyword, value in GIVEN.items() for part in (REQUEST_CAP_FLAGS[keyword][0], str(value))]
    args = parse(*argv)
    assert request_cap_settings(args) == GIVEN
    settings = replica_app_settings(parse("--replicas", "2", *argv), ())
    assert {k: settings[k] for k in GIVEN} == GIVEN
    for keyword in GIVEN:  # keywords the server takes, under the same names
        assert keyword in inspect.signature(create_app).parameters
        assert keyword in inspect.signature(serve).parameters


def test_the_defaults_are_the_servers_and_help_shows_them(capsys):
    defaults = request_cap_settings(parse())
    caps = request_caps.RequestCaps()
    assert defaults == {keyword: getattr(caps, keyword) for keyword in GIVEN}
    for name in ("DEFAULT_MAX_STOP_CHARS", "DEFAULT_MAX_PROMPT_LOGPROBS", "DEFAULT_MAX_TOKENIZATION_IDS",
                 "DEFAULT_MAX_DETOKENIZE_BYTES"):
        assert getattr(request_cap_flags, name) == getattr(request_caps, name)
    for keyword in GIVEN:
        assert inspect.signature(create_app).parameters[keyword].default == getattr(caps, keyword)
        assert inspect.signature(serve).parameters[keyword].default == getattr(caps, keyword)
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"], {})
    out = " ".join(capsys.readouterr().out.split())
    for flag, default, _meaning in REQUEST_CAP_FLAGS.values():
        assert flag in out
        assert (f"default: {default:,}" if default is not None else "default: the model's vocabulary size") in out


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "many"])
def test_a_cap_takes_only_a_positive_integer(value, capsys):
    for flag, _default, _meaning in REQUEST_CAP_FLAGS.values():
        with pytest.raises(SystemExit) as stopped:
            parse(flag, value)
        assert stopped.value.code == 2


def test_the_readme_documents_every_cap():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for flag, _default, _meaning in REQUEST_CAP_FLAGS.values():
        assert f"`{flag} N`" in readme, flag
