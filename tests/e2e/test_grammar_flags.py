"""`serve`'s structured-output flags: each is in `--help` with its default, takes only a positive integer, and
reaches the grammar engine as its `GrammarLimits` field on one process and on every replica (from the flags
and from a Ray Serve config file alike); the defaults are `GrammarLimits`'; the README lists every flag."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from ferrox_batch import cli
from ferrox_batch.cli.grammar_flags import GRAMMAR_FLAGS, grammar_limits
from ferrox_batch.grammar_limits import LIMIT_FLAGS, GrammarLimits
from ferrox_batch.server.run import serve

#: A value for each limit, none of them its default.
GIVEN = GrammarLimits(compile_ms=123, first_masks_ms=7, mask_deadline_ms=4321, live_bytes=99_999,
                      client_live_bytes=11_111, gbnf_ms=555)


def parse(*flags: str):
    return cli.build_parser().parse_args(["serve", *flags])


def given_flags() -> list[str]:
    return [part for field, (flag, _meaning) in GRAMMAR_FLAGS.items() for part in (flag, str(getattr(GIVEN, field)))]


def test_every_limit_has_a_flag_that_reaches_the_one_process_server():
    assert set(GRAMMAR_FLAGS) == {f.name for f in dataclasses.fields(GrammarLimits)} == set(LIMIT_FLAGS)
    assert all(value != getattr(GrammarLimits(), field) for field, value in dataclasses.asdict(GIVEN).items())
    assert grammar_limits(parse(*given_flags())) == GIVEN
    assert inspect.signature(serve).parameters["grammar_limits"].default == GrammarLimits()


def test_every_replica_gets_the_limits_from_the_flags_and_from_a_config_file(tiny_batch_dir):
    pytest.importorskip("ray", reason="needs the test extra (ray[serve])")
    from ferrox_batch.admission.config import BatcherConfig
    from ferrox_batch.cli.replicas import replica_spec
    from ferrox_batch.deploy.serve_args import GRAMMAR_KEYS, app_builder

    args = parse("--replicas", "2", "--model", str(tiny_batch_dir), *given_flags())
    assert replica_spec(args, {}, BatcherConfig.serving(), None, ()).grammar == GIVEN
    assert replica_spec(parse("--replicas", "2", "--model", "/m"), {}, BatcherConfig.serving(), None,
                        ()).grammar == GrammarLimits()
    # A config file's keys are the flags in snake case, read from strings as `serve run key=value` passes them.
    assert set(GRAMMAR_KEYS) == {flag[2:].replace("-", "_") for flag, _meaning in GRAMMAR_FLAGS.values()}
    keys = {key: str(getattr(GIVEN, field)) for key, field in GRAMMAR_KEYS.items()}
    app = app_builder({"model": str(tiny_batch_dir), "replicas": "2", **keys})
    assert app._bound_deployment.init_args[0]._bound_deployment.init_args[0].grammar == GIVEN
    for key in GRAMMAR_KEYS:
        for bad in ("0", "-3", "1.5", "many"):
            with pytest.raises(ValueError, match=key):
                app_builder({"model": "/m", key: bad})


def test_a_replica_builds_its_batcher_with_the_specs_limits(monkeypatch, tiny_batch_dir):
    pytest.importorskip("ray", reason="needs the test extra (ray[serve])")
    from types import SimpleNamespace

    from ferrox_batch.deploy import ray_serve
    from ferrox_batch.engine.handle import ContinuousBatcher

    seen: list[GrammarLimits] = []

    class Built(Exception):
        pass

    def from_model(model, config=None, grammar_limits=GrammarLimits()):
        seen.append(grammar_limits)
        raise Built  # what the batcher is given is all this test reads

    monkeypatch.setattr(ContinuousBatcher, "from_model", from_model)
    monkeypatch.setattr(ray_serve, "replica_ports_on_node", lambda: None)
    monkeypatch.setattr(ray_serve.serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="r1")))
    spec = ray_serve.ReplicaSpec(str(tiny_batch_dir), device="cpu", dtype="float32", grammar=GIVEN)
    with pytest.raises(Built):
        ray_serve.FerroxReplica(spec)
    assert seen == [GIVEN]
    with pytest.raises(ValueError, match="grammar"):
        ray_serve.ReplicaSpec("/m", grammar={"compile_ms": 5})  # type: ignore[arg-type]


def test_the_defaults_are_the_engines_and_help_shows_them(capsys):
    assert grammar_limits(parse()) == GrammarLimits()
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"], {})
    out = " ".join(capsys.readouterr().out.split())
    for field, (flag, _meaning) in GRAMMAR_FLAGS.items():
        assert f"{flag} N" in out and f"(default: {getattr(GrammarLimits(), field)})" in out


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "many"])
def test_a_limit_takes_only_a_positive_integer(value, capsys):
    for flag, _meaning in GRAMMAR_FLAGS.values():
        with pytest.raises(SystemExit) as stopped:
            parse(flag, value)
        assert stopped.value.code == 2


def test_the_readme_documents_every_limit():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for field, (flag, _meaning) in GRAMMAR_FLAGS.items():
        default = getattr(GrammarLimits(), field)
        assert f"| `{flag} N` | | `{default}`" in readme, flag
