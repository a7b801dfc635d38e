"""`serve`'s request-cost flags: each is in `--help` with its default, takes only a positive integer, reaches
the app as one `RequestCaps` on one process and on every replica, and its default is the value's own."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from ferrox_batch import cli
from ferrox_batch.cli.replicas import replica_app_settings
from ferrox_batch.cli.request_cap_flags import REQUEST_CAP_FLAGS, request_caps
from ferrox_batch.request_caps import RequestCaps
from ferrox_batch.server.app import create_app
from ferrox_batch.server.run import serve

GIVEN = {"max_allowed_token_ids": 100, "max_stop_chars": 64, "max_prompt_logprobs": 5000,
         "max_tokenization_ids": 300, "max_detokenize_bytes": 4096}


def parse(*flags: str):
    return cli.build_parser().parse_args(["serve", *flags])


def test_every_cap_has_a_flag_that_reaches_the_app():
    assert set(REQUEST_CAP_FLAGS) == set(GIVEN) == {f.name for f in dataclasses.fields(RequestCaps)}
    argv = [part for keyword, value in GIVEN.items() for part in (REQUEST_CAP_FLAGS[keyword][0], str(value))]
    assert request_caps(parse(*argv)) == RequestCaps(**GIVEN)
    # The replicas' app settings carry no cap of their own: the spec carries the one value.
    assert not set(replica_app_settings(parse("--replicas", "2", *argv), ())) & set(GIVEN)


def test_every_replica_gets_the_caps_from_the_flags_and_from_a_config_file(tiny_batch_dir):
    pytest.importorskip("ray", reason="needs the test extra (ray[serve])")
    from ferrox_batch.admission.config import BatcherConfig
    from ferrox_batch.cli.replicas import replica_spec
    from ferrox_batch.deploy.serve_args import CAP_KEYS, app_builder

    argv = [part for keyword, value in GIVEN.items() for part in (REQUEST_CAP_FLAGS[keyword][0], str(value))]
    args = parse("--replicas", "2", "--model", str(tiny_batch_dir), *argv)
    assert replica_spec(args, {}, BatcherConfig.serving(), None, ()).caps == RequestCaps(**GIVEN)
    # A config file's keys are the flags in snake case, read from strings as `serve run key=value` passes them.
    assert set(CAP_KEYS) == set(GIVEN)
    app = app_builder({"model": str(tiny_batch_dir), "replicas": "2", **{k: str(v) for k, v in GIVEN.items()}})
    assert app._bound_deployment.init_args[0]._bound_deployment.init_args[0].caps == RequestCaps(**GIVEN)
    for key in CAP_KEYS:
        for bad in ("0", "-3", "1.5", "many"):
            with pytest.raises(ValueError, match=key):
                app_builder({"model": "/m", key: bad})


def test_the_server_takes_one_value():
    for taker in (create_app, serve):
        parameters = inspect.signature(taker).parameters
        assert parameters["request_caps"].default == RequestCaps()
        assert not set(parameters) & set(GIVEN)


def test_the_defaults_are_the_values_and_help_shows_them(capsys):
    assert request_caps(parse()) == RequestCaps()
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"], {})
    out = " ".join(capsys.readouterr().out.split())
    for keyword, (flag, _meaning) in REQUEST_CAP_FLAGS.items():
        default = getattr(RequestCaps(), keyword)
        assert flag in out
        assert (f"default: {default:,}" if default is not None else "default: the model's vocabulary size") in out


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "many"])
def test_a_cap_takes_only_a_positive_integer(value, capsys):
    for flag, _meaning in REQUEST_CAP_FLAGS.values():
        with pytest.raises(SystemExit) as stopped:
            parse(flag, value)
        assert stopped.value.code == 2


def test_the_readme_documents_every_cap():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for flag, _meaning in REQUEST_CAP_FLAGS.values():
        assert f"`{flag} N`" in readme, flag
