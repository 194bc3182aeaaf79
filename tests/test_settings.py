"""The settings schema (redraft.settings) and run_cli (redraft.cli): one declaration gives typed
values, checks, flags and YAML reading; one helper gives every CLI its exit codes."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from redraft.cli import run_cli
from redraft.errors import ConfigError, DataError
from redraft.settings import Range, Settings, load_yaml, setting


@dataclass
class Demo(Settings):
    KIND = "demo setting"
    lr: float = setting(
        1e-3, "Peak learning rate.", range=Range(0, lo_open=True), hint=" (e.g. 1e-3)"
    )
    steps: int | None = setting(None, "At most this many steps.", range=Range(1), flags=("--n",))
    loss: str = setting("ce", "The loss.", choices=("ce", "kd"))
    rnn: bool = setting(True, "Use the recurrence.")
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW betas.", metavar=("B1", "B2"))
    names: list[str] = setting(default_factory=lambda: ["a", "b"], help="A comma list.")
    secret: str = setting("x", "Not a flag.", cli=False)

    def check(self):
        if self.loss == "kd" and not self.rnn:
            raise ConfigError("loss kd needs rnn.", param="loss")


@dataclass
class Other(Settings):
    KIND = "other setting"
    port: int = setting(8000, "TCP port.", range=Range(0, 65535))


# ---- unknown keys


def test_an_unknown_key_names_the_file_and_the_closest_keys(tmp_path):
    with pytest.raises(ConfigError) as exc:
        Demo.from_dict({"lr": 1e-3, "step": 3}, where=str(tmp_path / "r.yaml"))
    msg = str(exc.value)
    assert msg.startswith("Unknown demo setting 'step' in ") and str(tmp_path / "r.yaml") in msg
    assert "Did you mean steps?" in msg and exc.value.param == "step"
    assert "Known settings: betas, loss, lr, names, rnn, secret, steps." in msg


def test_yaml_keys_are_split_across_schemas_and_a_key_no_schema_owns_is_an_error(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("lr: 3e-4\nport: 9000\nnames: x,y\n")
    demo, other = load_yaml(path, Demo, Other)
    assert demo == {"lr": "3e-4", "names": "x,y"} and other == {"port": 9000}
    assert Demo.from_dict(demo, coerce=True).names == ["x", "y"]
    path.write_text("lr: 1\npotr: 1\n")
    with pytest.raises(
        ConfigError, match=r"Unknown setting 'potr' in .*r\.yaml\. Did you mean port\?"
    ):
        load_yaml(path, Demo, Other)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping of settings, got list"):
        load_yaml(path, Demo, what="recipe")
    path.write_text("lr: [unclosed\n")
    with pytest.raises(ConfigError, match="recipe .*r.yaml is not valid YAML"):
        load_yaml(path, Demo, what="recipe")


# ---- coercion


@pytest.mark.parametrize(
    "key, raw, want",
    [
        ("lr", "3e-4", 3e-4),
        ("lr", 2, 2.0),
        ("steps", "7", 7),
        ("steps", 7.0, 7),
        ("steps", "none", None),
        ("steps", "", None),
        ("rnn", "false", False),
        ("rnn", True, True),
        ("betas", ["0.8", "0.95"], (0.8, 0.95)),
        ("betas", "[0.8, 0.95]", (0.8, 0.95)),
        ("names", "a, b,,c", ["a", "b", "c"]),
        ("names", ["q"], ["q"]),
        ("loss", "none", "none"),  # a non-optional string keeps its text
    ],
)
def test_values_are_converted_to_the_field_type(key, raw, want):
    got = Demo.coerce(key, raw)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize(
    "key, raw",
    [("lr", "fast"), ("steps", "2.5"), ("steps", True), ("rnn", "maybe"), ("rnn", 1), ("lr", [1])],
)
def test_a_value_of_the_wrong_type_is_an_error_naming_flag_value_and_type(key, raw):
    with pytest.raises(ConfigError, match=r"has the wrong type") as exc:
        Demo.coerce(key, raw, where="r.yaml")
    assert str(exc.value).startswith(f"--{key}") and f"({key} in r.yaml)" in str(exc.value)
    assert exc.value.param == key


def test_an_unknown_key_given_to_coerce_is_an_error():
    with pytest.raises(ConfigError, match="Unknown demo setting 'lrr'.*Did you mean lr"):
        Demo.coerce("lrr", "1")


# ---- checks


def test_ranges_choices_types_and_the_cross_field_check_are_enforced():
    assert Demo().validate() == Demo()
    assert Demo(steps=None).validate().steps is None  # optional: None allowed whatever the range
    with pytest.raises(
        ConfigError, match=r"^--lr 0 is out of range: must be > 0 \(e\.g\. 1e-3\)\.$"
    ) as exc:
        Demo(lr=0).validate()
    assert exc.value.param == "lr"
    with pytest.raises(ConfigError, match=r"^--lr nan is out of range"):
        Demo(lr=float("nan")).validate()
    with pytest.raises(ConfigError, match=r"^--steps 0 is out of range: must be >= 1\.$"):
        Demo(steps=0).validate()
    with pytest.raises(ConfigError, match=r"^--loss 'mse': use one of ce, kd\.$"):
        Demo(loss="mse").validate()
    with pytest.raises(ConfigError, match=r"^--rnn 'yes': use true or false\.$"):
        Demo(rnn="yes").validate()
    with pytest.raises(ConfigError, match=r"^--steps '3': use an integer >= 1 or none\.$"):
        Demo(steps="3").validate()
    with pytest.raises(ConfigError, match=r"^--steps True: use an integer"):
        Demo(steps=True).validate()
    with pytest.raises(ConfigError, match="loss kd needs rnn"):
        Demo(loss="kd", rnn=False).validate()


def test_from_dict_is_strict_unless_asked_to_coerce():
    with pytest.raises(ConfigError, match="use an integer"):
        Demo.from_dict({"steps": "3"})
    assert Demo.from_dict({"steps": "3"}, coerce=True).steps == 3
    d = Demo().replace(lr=0.5)
    assert d.lr == 0.5 and d.to_dict()["lr"] == 0.5
    with pytest.raises(ConfigError, match="Unknown demo setting 'nope'"):
        Demo().replace(nope=1)


# ---- generated flags


def _parser(**kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demo")
    Demo.add_arguments(p, "demo settings", **kw)
    return p


def test_flags_are_generated_from_the_schema_and_given_tells_what_was_typed():
    p = _parser()
    args = p.parse_args(
        ["--lr", "3e-4", "--no-rnn", "--betas", "0.8", "0.95", "--n", "4", "--names", "x,y"]
    )
    given = Demo.given(args)
    assert given == {
        "lr": "3e-4",
        "rnn": False,
        "betas": ["0.8", "0.95"],
        "steps": "4",
        "names": "x,y",
    }
    cfg = Demo.from_dict(given, coerce=True)
    assert (cfg.lr, cfg.rnn, cfg.betas, cfg.steps, cfg.names) == (
        3e-4,
        False,
        (0.8, 0.95),
        4,
        ["x", "y"],
    )
    assert Demo.given(p.parse_args([])) == {}
    assert "--secret" not in p.format_help()  # cli=False


def test_flag_help_shows_help_default_and_choices():
    p = _parser(shown={"lr": 0.05})
    text = " ".join(p.format_help().split())
    assert "--lr LR Peak learning rate. (default: 0.05)" in text
    assert "--rnn, --no-rnn Use the recurrence. (default: True)" in text
    assert "--betas B1 B2 AdamW betas. (default: 0.9 0.999)" in text
    assert "--loss {ce,kd}" in text and "--steps STEPS, --n STEPS" in text
    # a choice outside the schema's is refused by validate(), as in a YAML file
    with pytest.raises(ConfigError, match="--loss 'mse': use one of ce, kd"):
        Demo.from_dict(Demo.given(p.parse_args(["--loss", "mse"])), coerce=True)


def test_only_and_exclude_pick_the_flags():
    assert {a.dest for a in _parser(only={"lr", "rnn"})._actions} == {"help", "lr", "rnn"}
    assert "lr" not in {a.dest for a in _parser(exclude={"lr"})._actions}


# ---- run_cli


def test_run_cli_maps_errors_to_one_line_and_exit_codes(capsys):
    assert run_cli("redraft-x", lambda: None) == 0
    assert run_cli("redraft-x", lambda: 3) == 3

    def bad():
        raise DataError("file f.jsonl line 3:\n  not JSON;   fix it.")

    assert run_cli("redraft-x", bad) == 2
    assert capsys.readouterr().err == "redraft-x: error: file f.jsonl line 3: not JSON; fix it.\n"

    def ctrl_c():
        raise KeyboardInterrupt

    assert run_cli("redraft-x", ctrl_c, interrupted="the tables written so far are kept") == 130
    assert capsys.readouterr().err == "redraft-x: interrupted; the tables written so far are kept\n"
    assert run_cli("redraft-x", ctrl_c) == 130
    assert capsys.readouterr().err == "redraft-x: interrupted\n"


def test_run_cli_lets_a_bug_keep_its_traceback_and_maps_listed_errors():
    def bug():
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        run_cli("redraft-x", bug)

    def oserror():
        raise PermissionError(13, "Permission denied", "/ro/x")

    assert run_cli("redraft-x", oserror, errors=(PermissionError,)) == 2


# ---- the shared model flags


def test_model_flags_are_declared_once_and_a_command_keeps_its_own_defaults():
    from redraft.cli import ModelSettings

    p = argparse.ArgumentParser(prog="demo")
    ModelSettings.add_arguments(
        p, only=("target", "dtype", "drafters"), shown={"dtype": "bfloat16"}
    )
    assert "(default: bfloat16)" in " ".join(p.format_help().split())
    args = p.parse_args(["--drafter", "a", "--drafter", "b"])
    got = ModelSettings.from_args(args, defaults={"dtype": "bfloat16"})
    assert (got.target, got.dtype, got.drafters) == ("default", "bfloat16", ["a", "b"])
    assert (args.target, args.dtype) == ("default", "bfloat16") and not hasattr(args, "threads")
    args = p.parse_args(["--dtype", "float32"])
    assert (
        ModelSettings.from_args(args, defaults={"dtype": "bfloat16"}).dtype
        == "float32"
        == args.dtype
    )
    p.add_argument("--threads")
    with pytest.raises(ConfigError, match=r"^--threads 0 is out of range: must be >= 1\.$"):
        ModelSettings.from_args(p.parse_args(["--threads", "0"]))


def test_a_literal_string_setting_keeps_none_as_typed():
    @dataclass
    class Keyed(Settings):
        key: str | None = setting(None, "A secret.", literal=True)
        name: str | None = setting(None, "A name.")

    assert Keyed.coerce("key", "none") == "none" and Keyed.coerce("name", "none") is None
