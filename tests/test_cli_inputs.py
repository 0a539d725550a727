"""Bad command-line input found before the long work: one line naming the flag as typed, exit 2, nothing written."""

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gemma_ane.bundle.spec import AssistantSpec, ConfigError, ModelSpec
from gemma_ane.cli import main

FIXTURES = Path(__file__).parent / "fixtures"
E2B = FIXTURES / "e2b_config.json"


def refused(capsys, command, *argv, needle):
    """Run `gemma-ane COMMAND ARGV...` in this process; it must fail in one line holding `needle`, exit 2."""
    rc = main([command, *map(str, argv)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, out, err)
    assert len(err.splitlines()) == 1 and err.startswith(f"gemma-ane {command}: error: "), err
    assert needle in err, (needle, err)


# -- tiny ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("out, assistant", [("t6", "t6"), ("t8", "t8/inner"), ("t9/inner", "t9"), ("a/../t", "t")])
def test_tiny_refuses_an_assistant_that_is_holds_or_lies_in_out(capsys, tmp_path, out, assistant):
    refused(capsys, "tiny", tmp_path / out, "--assistant", tmp_path / assistant, needle="--assistant ")
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_tiny_refuses_an_existing_out_as_its_assistant_even_with_force(capsys, tmp_path):
    (tmp_path / "ckpt").mkdir()
    refused(
        capsys, "tiny", tmp_path / "ckpt", "--assistant", tmp_path / "ckpt" / "asst", "--force", needle="--assistant"
    )
    assert list((tmp_path / "ckpt").iterdir()) == []


@pytest.mark.parametrize("seed", ["99999999999999999999999", "-1", str(2**63)])
def test_tiny_refuses_a_seed_out_of_range_naming_it(capsys, tmp_path, seed):
    refused(capsys, "tiny", tmp_path / "x", "--seed", seed, needle=f"--seed {seed}: must be in [0, 2**63)")
    assert not (tmp_path / "x").exists()


# -- convert --stats -------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["dir", "missing/s.json", "file/s.json"])
def test_convert_refuses_an_unwritable_stats_before_converting(capsys, tmp_path, tiny_e2b, where):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("")
    stats = tmp_path / where
    refused(capsys, "convert", tiny_e2b, tmp_path / "out", "--stats", stats, needle=f"--stats {stats}: ")
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]  # no temp file left either


# -- generate and chat --prompt-cache ----------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("where", ["dir", "missing/x.npz", "file/x.npz"])
def test_an_unwritable_prompt_cache_is_refused_before_loading(capsys, tmp_path, command, where):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("")
    cache = tmp_path / where
    prompt = ["-p", "hi"] if command == "generate" else []
    # no bundle at all: the check comes before the load, so it is the one refused
    refused(
        capsys, command, tmp_path / "no-bundle", *prompt, "--prompt-cache", cache, needle=f"--prompt-cache {cache}: "
    )


# -- closed standard streams -------------------------------------------------------------------------


def closed(redirect: str, *argv) -> subprocess.CompletedProcess:
    """`gemma-ane ARGV` from a shell that closed a standard stream (`<&-`, `>&-`): Python sees it as None, unlike
    subprocess.DEVNULL, which is an open file."""
    cmd = shlex.join([sys.executable, "-m", "gemma_ane.cli", *map(str, argv)])
    return subprocess.run(
        ["sh", "-c", f"exec {cmd} {redirect}"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


@pytest.mark.parametrize(
    "redirect, argv, message",
    [
        ("<&-", ["chat", "BUNDLE", "--backend", "mil"], "gemma-ane chat: error: standard input is closed"),
        (">&-", ["generate", "BUNDLE", "--backend", "mil", "-p", "hi"], "gemma-ane generate: error: standard output"),
        (">&-", ["plan", E2B], "gemma-ane plan: error: standard output is closed"),
    ],
)
def test_a_closed_standard_stream_is_one_line_and_exit_2(tmp_path, redirect, argv, message):
    argv = [tmp_path / "bundle" if a == "BUNDLE" else a for a in argv]
    r = closed(redirect, *argv)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(message), r.stderr


# -- config: rms_norm_eps ------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [math.nan, math.inf, 0, -1e-6])
def test_a_non_finite_or_non_positive_eps_is_refused_naming_the_field(eps):
    config = json.loads(E2B.read_text())
    config["text_config"]["rms_norm_eps"] = eps
    with pytest.raises(ConfigError, match="rms_norm_eps=.*: must be a finite number > 0"):
        ModelSpec.from_config(config)


def test_an_assistant_with_a_nan_eps_is_refused():
    target = ModelSpec.from_config(json.loads(E2B.read_text()))
    config = json.loads((FIXTURES / "e2b_assistant_config.json").read_text())
    config["text_config"]["rms_norm_eps"] = math.nan
    with pytest.raises(ConfigError, match="rms_norm_eps=nan"):
        AssistantSpec.from_config(config, target)


def test_a_nan_eps_is_one_line_on_the_cli(capsys, tmp_path):
    config = json.loads(E2B.read_text())
    config["text_config"]["rms_norm_eps"] = math.nan
    (tmp_path / "config.json").write_text(json.dumps(config))  # json writes NaN, as a hand-edited config may hold
    refused(capsys, "plan", tmp_path / "config.json", needle="rms_norm_eps=nan: must be a finite number > 0")


# -- plan --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--bits", "-5"], "--bits -5: choose 4, 6, 8 or 16"),
        (["--bits", "0"], "--bits 0: choose 4, 6, 8 or 16"),
        (["--bits", "3"], "--bits 3: choose 4, 6, 8 or 16"),
        (["--kv-prefill-batches", ","], "--kv-prefill-batches ','"),
        (["--kv-prefill-batches", "8,,64"], "--kv-prefill-batches '8,,64'"),
        (["--max-chunk-mb", "nan"], "--max-chunk-mb nan: must be a finite number of MB > 0"),
        (["--max-chunk-mb", "inf"], "--max-chunk-mb inf: must be a finite number of MB > 0"),
    ],
)
def test_plan_refuses_a_bad_flag_naming_it(capsys, argv, needle):
    refused(capsys, "plan", E2B, *argv, needle=needle)


@pytest.mark.parametrize("argv", [["--bits", "6"], ["--bits", "16"], ["--kv-prefill-batches", ""]])
def test_plan_takes_what_convert_takes(capsys, argv):
    assert main(["plan", str(E2B), *argv]) == 0
    capsys.readouterr()


# -- verify --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", ["0", "-3"])
@pytest.mark.parametrize("mode", [[], ["--bundle", "no-bundle"]])  # "bundle" would mark it slow (conftest)
def test_verify_refuses_a_bad_prefill_batch_with_or_without_a_bundle(capsys, tiny_e2b, batch, mode):
    refused(capsys, "verify", tiny_e2b, *mode, "--prefill-batch", batch, needle=f"--prefill-batch {batch}: ")


@pytest.mark.parametrize("mode", [[], ["--bundle", "no-bundle"]])  # "bundle" would mark it slow (conftest)
def test_verify_names_the_seed_it_refuses(capsys, tiny_e2b, mode):
    refused(capsys, "verify", tiny_e2b, *mode, "--seed", "-1", needle="--seed -1: must be >= 0")


def test_verify_blames_tokens_not_prompt_tokens(capsys, tiny_e2b):
    refused(capsys, "verify", tiny_e2b, "--bundle", "no-bundle", "--tokens", "0", needle="--tokens 0: ")


def test_verify_refuses_a_bundle_of_another_checkpoint_up_front(capsys, tiny_gqa, tiny_bundle16):
    refused(capsys, "verify", tiny_gqa, "--bundle", tiny_bundle16, needle="the bundle is not of this checkpoint")
