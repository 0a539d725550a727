"""The CLI explains itself: `--version`, help text on every argument of every command, each option's default
shown, and the choices a user must pick from listed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from gemma_ane import __version__
from gemma_ane.cli import build_parser, main


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _arguments(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield action


def _off(default) -> bool:
    return default is None or default is False or (isinstance(default, list) and not default)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"gemma-ane {__version__}"


def test_every_argument_has_help_and_shows_its_default():
    missing, hidden = [], []
    for name, parser in _commands().items():
        formatter = parser._get_formatter()
        for action in _arguments(parser):
            label = f"{name} {'/'.join(action.option_strings) or action.dest}"
            if not (action.help or "").strip():
                missing.append(label)
            elif action.option_strings and not _off(action.default):
                if "default" not in formatter._get_help_string(action) % {"default": action.default}:
                    hidden.append(label)
    assert not missing, f"arguments without help: {missing}"
    assert not hidden, f"options whose default the help does not show: {hidden}"


def test_help_shows_defaults_and_choices(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 2048)" in text  # --context
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 256)" in text  # --max-tokens
    assert "--top-k N draw from the k most likely tokens only (0: all) (default:" in text


def test_tiny_lists_its_presets(capsys):
    from gemma_ane.oracle.tiny import PRESETS

    preset = next(a for a in _arguments(_commands()["tiny"]) if a.dest == "preset")
    assert sorted(preset.choices) == sorted(PRESETS)
    assert {"demo", "e4b-mini", "e2b-mini"} <= set(preset.choices)
    with pytest.raises(SystemExit) as e:
        main(["tiny", "out", "--preset", "nope"])
    assert e.value.code == 2
    assert "e4b-mini" in capsys.readouterr().err


# -- messages a CLI user reads -------------------------------------------------------------------------------------


def test_one_token_summary_claims_no_rate():
    from gemma_ane.cli.run import _summary
    from gemma_ane.runtime.events import Event

    one = _summary(Event(prompt_tokens=5, prefill_tokens_per_s=50.0, generated_tokens=1, finish_reason="length"))
    assert "generation: 1 token |" in one  # no "1 tokens", and no "0.0 tok/s": one token has no decode rate
    assert "tok/s" not in one.split("generation:")[1]
    many = _summary(Event(generated_tokens=3, decode_tokens_per_s=2.5, finish_reason="stop"))
    assert "generation: 3 tokens, 2.5 tok/s" in many


def test_text_prompt_overflow_names_no_images():
    from gemma_ane.runtime.encoder import expand_media
    from gemma_ane.runtime.engine import ContextOverflow

    with pytest.raises(ContextOverflow) as e:
        expand_media(list(range(200)), [], {}, [], 128)
    assert str(e.value) == "prompt of 200 tokens exceeds the context of 128"


def test_backend_advice_speaks_to_both_cli_and_python():
    import platform

    from gemma_ane.errors import GemmaAneError
    from gemma_ane.runtime.device import pick_backend

    if platform.system() == "Darwin":
        pytest.skip("Core ML runs here")
    with pytest.raises(GemmaAneError) as e:
        pick_backend("coreml")
    assert "backend='" not in str(e.value)  # Python syntax means nothing to a CLI user
    assert "needs macOS" in str(e.value) and "mil" in str(e.value)


E2B_CONFIG = str(Path(__file__).parent / "fixtures" / "e2b_config.json")


@pytest.mark.parametrize(
    "argv, said",
    [
        (["plan", E2B_CONFIG, "--context", "100"], "--context 100: must be at least the sliding window (512)"),
        (["plan", E2B_CONFIG, "--split", "9,5"], "--split 9,5: boundary 5 does not come after 9; boundaries ascend"),
        (["generate", "no-bundle", "-p", "hi", "--temperature", "-1"], "--temperature -1.0: must be >= 0.0"),
        (
            ["generate", "no-bundle", "-p", "hi", "--logit-bias", "5=300"],
            "--logit-bias: 5: 300.0: expected a number in [-100, 100]",
        ),
        (["serve", "no-bundle", "--max-images", "-1"], "--max-images -1: must be >= 0"),
    ],
)
def test_errors_name_the_flag_not_the_python_keyword(argv, said, capsys):
    """The API raises `context=100: ...` (its keyword); a CLI user typed --context, and reads that back."""
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"gemma-ane {argv[0]}: error: {said}"]


# -- progress on the long steps ------------------------------------------------------------------------------------

LONG_STEPS = {
    "generate": (["generate", "{missing}", "-p", "Hi", "--backend", "mil"], "loading"),
    "chat": (["chat", "{missing}", "--backend", "mil"], "loading"),
    "inspect": (["inspect", "{missing}"], "reading"),
    "audit": (["inspect", "{missing}", "--ane"], "auditing every model"),
    "tiny": (["tiny", "{existing}"], "writing the e2b-mini checkpoint"),
    "verify": (["verify", "{missing}"], "running transformers and our chunk graph"),
}


@pytest.mark.parametrize("name", list(LONG_STEPS))
@pytest.mark.parametrize("quiet", [False, True])
def test_long_steps_say_what_they_do_unless_quiet(name, quiet, capsys, monkeypatch, tmp_path):
    argv, words = LONG_STEPS[name]
    (tmp_path / "existing").mkdir()
    argv = [x.format(missing=tmp_path / "missing", existing=tmp_path / "existing") for x in argv]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a person watching
    rc = main(argv + ["--quiet"] * quiet)
    err = capsys.readouterr().err.splitlines()
    assert rc == 2  # each fails at once here (no such bundle, checkpoint; OUT exists): the step line comes first
    command = argv[0]
    steps = [line for line in err if line.startswith(f"gemma-ane {command}: {words}")]
    assert steps == ([] if quiet else [steps[0]]) and (quiet or steps[0].endswith(" ..."))
    assert err[-1].startswith(f"gemma-ane {command}: error: ")


def test_no_progress_lines_into_a_pipe(capsys, tmp_path):
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1  # the error alone, as a script reads it


@pytest.mark.parametrize("tty", [True, False], ids=["terminal", "pipe"])
@pytest.mark.parametrize("quiet", [False, True], ids=["", "quiet"])
def test_bars_only_on_a_terminal(tty, quiet, monkeypatch, tmp_path):
    """convert and eval draw their bars for a person watching: never into a pipe, nor with --quiet."""
    import gemma_ane.convert
    import gemma_ane.oracle.evaluate

    asked = {}

    def convert(src, out, options, progress, timer):
        asked["convert"] = progress
        return {}

    def evaluate(*args, progress, **kw):
        asked["eval"] = progress
        raise gemma_ane.oracle.evaluate.EvalError("stopped here")

    monkeypatch.setattr(gemma_ane.convert, "convert", convert)
    monkeypatch.setattr(gemma_ane.oracle.evaluate, "evaluate", evaluate)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    quietly = ["--quiet"] * quiet
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out"), *quietly]) == 0
    assert main(["eval", str(tmp_path / "ckpt"), "--bundle", str(tmp_path), "--text", "t.txt", *quietly]) == 2
    assert asked == {"convert": tty and not quiet, "eval": tty and not quiet}


@pytest.mark.slow
def test_convert_names_each_model_without_a_bar(tiny_e2b, tmp_path, capsys, monkeypatch):
    """The chunks have a bar each; the vision model (minutes at E2B's size) says when it starts."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a person watching
    argv = ["convert", str(tiny_e2b), str(tmp_path / "b"), "--bits", "16", "--context", "128", "--functions", "infer"]
    assert main([*argv, "--image-tokens", "70", "--no-audio"]) == 0
    assert "convert vision ..." in capsys.readouterr().err.splitlines()


def test_the_image_oracle_loads_without_a_bar(tiny_e2b, capfd):
    """verify --image loads transformers' multimodal model: its own "Loading weights" bar stays out of verify's
    report, and the caller's setting of transformers' bars is left as it was."""
    from transformers.utils import logging as hf_logging

    from gemma_ane.convert.checkpoint import Checkpoint
    from gemma_ane.oracle.verify import _oracle_conditional, int8_tables

    ckpt = Checkpoint(tiny_e2b)
    try:
        _oracle_conditional(ckpt, int8_tables(ckpt))
    finally:
        ckpt.close()
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
