"""The CLI explains itself: `--version`, help text on every argument of every command, each option's default
shown, and the choices a user must pick from listed."""

from __future__ import annotations

import argparse

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
