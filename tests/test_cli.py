"""The `gemma-ane` command line: output of plan/tiny/verify, and one-line errors with exit status 2."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from margins import assert_top1
from safetensors.torch import load_file, save_file

from gemma_ane.cli import main
from gemma_ane.oracle.verify import FP32_LOGIT_ERR

FIXTURES = Path(__file__).parent / "fixtures"
E2B = str(FIXTURES / "e2b_config.json")
LM = "model.language_model."


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def run_process(*argv, script=False):
    # A real process: a traceback or a stray print would show up here and nowhere else.
    cmd = [str(Path(sys.executable).parent / "gemma-ane")] if script else [sys.executable, "-m", "gemma_ane.cli"]
    return subprocess.run(
        cmd + [str(a) for a in argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def assert_one_line_error(err, command, *needles):
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"gemma-ane {command}: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)


def shapes(io):
    return {k: tuple(v["shape"]) for k, v in io.items()}


# -- plan ----------------------------------------------------------------------------------------


def test_plan_json_is_the_published_e2b_contract(capsys):
    rc, out, err = run(capsys, "plan", E2B, "--json", "--kv-prefill-batches", "")  # the published functions only
    assert rc == 0 and err == ""
    plan = json.loads(out)
    assert plan["context"] == 2048 and plan["split"] == [8, 25] and plan["prefill_batch"] == 8
    c1, c2, c3 = plan["chunks"]
    assert [c["name"] for c in plan["chunks"]] == ["chunk_1", "chunk_2", "chunk_3"]
    assert (c1["layers"], c2["layers"], c3["layers"]) == (list(range(8)), list(range(8, 25)), list(range(25, 35)))

    assert shapes(c1["states"]) == {"kv_cache_sliding": (14, 1, 512, 512), "kv_cache_full": (2, 1, 2048, 512)}
    assert shapes(c2["states"]) == {"kv_cache_sliding": (10, 1, 512, 512), "kv_cache_full": (4, 1, 2048, 512)}
    assert c3["states"] == {}
    assert all(t["dtype"] == "float16" for c in (c1, c2) for t in c["states"].values())

    assert set(c1["functions"]) == set(c2["functions"]) == {"infer", "prefill_b8"}
    assert set(c3["functions"]) == {"infer"}
    for fname, T in (("infer", 1), ("prefill_b8", 8)):
        ins = shapes(c1["functions"][fname]["inputs"])
        assert ins == {
            "hidden_states": (1, T, 1536),
            "causal_mask_full": (1, 1, T, 2048),
            "causal_mask_sliding": (1, 1, T, 512),
            "per_layer_raw": (1, T, 8960),
            "cos_s": (1, 1, T, 256),
            "sin_s": (1, 1, T, 256),
            "cos_f": (1, 1, T, 512),
            "sin_f": (1, 1, T, 512),
            "current_pos": (1,),
            "ring_pos": (1,),
        }
        assert c1["functions"][fname]["inputs"]["current_pos"]["dtype"] == "int32"
        assert shapes(c1["functions"][fname]["outputs"]) == {
            "hidden_states_out": (1, T, 1536),
            "per_layer_combined_out": (1, T, 8960),
        }
        c2_ins = shapes(c2["functions"][fname]["inputs"])
        assert "per_layer_combined" in c2_ins and "per_layer_raw" not in c2_ins
        assert shapes(c2["functions"][fname]["outputs"]) == {
            "hidden_states_out": (1, T, 1536),
            "kv13_k": (1, 1, 512, 256),
            "kv13_v": (1, 1, 512, 256),
            "kv14_k": (1, 1, 2048, 512),
            "kv14_v": (1, 1, 2048, 512),
        }
    c3_infer = c3["functions"]["infer"]
    assert shapes(c3_infer["outputs"]) == {"logits": (1, 1, 262144)}
    c3_ins = shapes(c3_infer["inputs"])
    assert c3_ins["kv13_k"] == (1, 1, 512, 256) and c3_ins["kv14_v"] == (1, 1, 2048, 512)
    assert "current_pos" not in c3_ins and "ring_pos" not in c3_ins


def test_plan_shows_the_functions_convert_builds_by_default(capsys):
    """Without --kv-prefill-batches, plan shows convert's default: the KV-only prefill batches of 64 and 8 that
    divide the window (E2B's 512: both)."""
    rc, out, err = run(capsys, "plan", E2B, "--json")
    c1, c2 = json.loads(out)["chunks"][:2]
    assert set(c1["functions"]) == set(c2["functions"]) == {"infer", "prefill_b8", "prefill_kv_b64", "prefill_kv_b8"}


@pytest.mark.slow
def test_plan_shows_what_convert_built(capsys, tiny_e2b, tiny_bundle16):
    """The same options, the same chunks and functions: plan's JSON against the plan a default conversion states
    in its manifest (e2b-mini's window of 16 takes the batch of 8 only)."""
    built = json.loads((tiny_bundle16 / "manifest.json").read_text())["plan"]
    rc, out, err = run(capsys, "plan", tiny_e2b, "--context", str(built["context"]), "--json")
    shown = json.loads(out)
    assert rc == 0 and any("prefill_kv_b8" in c["functions"] for c in shown["chunks"])
    assert [(c["layers"], c["functions"]) for c in shown["chunks"]] == [
        (c["layers"], c["functions"]) for c in built["chunks"]
    ]


def test_plan_table_is_readable(capsys):
    rc, out, err = run(capsys, "plan", E2B)
    assert rc == 0 and err == ""
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)
    for text in (
        "chunk_1: layers 0-7",
        "chunk_2: layers 8-24",
        "chunk_3: layers 25-34",
        "kv_cache_sliding",
        "[14, 1, 512, 512]",
        "[10, 1, 512, 512]",
        "kv_cache_full",
        "[2, 1, 2048, 512]",
        "[4, 1, 2048, 512]",
        "prefill_b8",
        "kv13_k",
        "[1, 1, 512, 256]",
        "logits",
        "[1, 1, 262144]",
    ):
        assert text in out, text
    # Each state line carries its name and its shape together.
    state_lines = [line.split() for line in out.splitlines() if line.strip().startswith("state")]
    assert [(s[1], " ".join(s[2:-1])) for s in state_lines] == [
        ("kv_cache_sliding", "[14, 1, 512, 512]"),
        ("kv_cache_full", "[2, 1, 2048, 512]"),
        ("kv_cache_sliding", "[10, 1, 512, 512]"),
        ("kv_cache_full", "[4, 1, 2048, 512]"),
    ]


def test_plan_split_and_context(capsys):
    rc, out, err = run(capsys, "plan", E2B, "--split", "6,20", "--context", "1024", "--json")
    assert rc == 0 and err == ""
    plan = json.loads(out)
    assert plan["context"] == 1024 and plan["split"] == [6, 20]
    c1, c2, c3 = plan["chunks"]
    assert (c1["layers"], c2["layers"], c3["layers"]) == (list(range(6)), list(range(6, 20)), list(range(20, 35)))
    # chunk_1 owns sliding 0-3,5 and full 4; chunk_2 sliding 6-8,10-13 and full 9,14.
    assert shapes(c1["states"]) == {"kv_cache_sliding": (10, 1, 512, 512), "kv_cache_full": (2, 1, 1024, 512)}
    assert shapes(c2["states"]) == {"kv_cache_sliding": (14, 1, 512, 512), "kv_cache_full": (4, 1, 1024, 512)}
    assert c2["functions"]["infer"]["outputs"]["kv14_k"]["shape"] == [1, 1, 1024, 512]
    assert c1["functions"]["prefill_b8"]["inputs"]["causal_mask_full"]["shape"] == [1, 1, 8, 1024]
    # The sliding mask is the window, not the context.
    assert c1["functions"]["infer"]["inputs"]["causal_mask_sliding"]["shape"] == [1, 1, 1, 512]


def test_console_script_prints_the_same_plan(capsys):
    rc, out, _ = run(capsys, "plan", E2B, "--json")
    proc = run_process("plan", E2B, "--json", script=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert json.loads(proc.stdout) == json.loads(out)


# -- tiny ----------------------------------------------------------------------------------------


def test_tiny_writes_refuses_to_overwrite_and_forces(capsys, tmp_path, tiny_e2b):
    out_dir = tmp_path / "made"
    rc, out, err = run(capsys, "tiny", out_dir, "--preset", "e2b-mini")
    assert rc == 0 and err == "" and str(out_dir) in out
    made = load_file(out_dir / "model.safetensors")
    ref = load_file(tiny_e2b / "model.safetensors")
    # Same preset and default seed as the session fixture: the CLI must have passed them through.
    assert made.keys() == ref.keys() and all(made[k].equal(ref[k]) for k in ref)
    assert (out_dir / "config.json").is_file() and (out_dir / "tokenizer.json").is_file()

    stamp = (out_dir / "model.safetensors").stat().st_mtime_ns
    rc, out, err = run(capsys, "tiny", out_dir, "--preset", "e2b-mini", "--seed", "1")
    assert rc == 2 and out == ""
    assert_one_line_error(err, "tiny", str(out_dir), "--force")
    assert (out_dir / "model.safetensors").stat().st_mtime_ns == stamp  # left alone

    rc, out, err = run(capsys, "tiny", out_dir, "--preset", "e2b-mini", "--seed", "1", "--force")
    assert rc == 0 and err == ""
    forced = load_file(out_dir / "model.safetensors")
    assert not forced[LM + "embed_tokens.weight"].equal(ref[LM + "embed_tokens.weight"])
    # Atomic replacement leaves no temporary directory behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["made"]


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--preset", "nope"], ["'nope'", "e2b-mini", "gqa-mini"]),
        (["--shards", "0"], ["--shards 0"]),
        (["--preset", "demo", "--seed", "3"], ["--seed 3", "seed 0", "--train"]),
        (["--preset", "e2b-mini", "--train"], ["--train", "demo", "e2b-mini"]),
    ],
)
def test_tiny_bad_options(capsys, tmp_path, args, needles):
    try:
        rc, out, err = run(capsys, "tiny", tmp_path / "out", *args)
    except SystemExit as e:  # argparse itself refuses a preset not in the table, listing the table
        rc, (out, err) = e.code, capsys.readouterr()
    assert rc == 2 and out == ""
    assert_one_line_error(err, "tiny", *needles)
    assert list(tmp_path.iterdir()) == []


# -- verify --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_verify_json(capsys, tiny_e2b):
    rc, out, err = run(capsys, "verify", tiny_e2b, "--tokens", "40", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["positions"] == 40 and report["precision"] == "fp32" and report["passed"] is True
    assert_top1(report, FP32_LOGIT_ERR, "fp32 graph vs transformers")  # the bound the next lines hold it to
    assert report["min_cosine"] >= 0.9999
    assert 0.0 <= report["max_abs_logit_diff"] < FP32_LOGIT_ERR == 1e-2


@pytest.mark.slow
def test_verify_fp16_text_line(capsys, tiny_bf16_sharded):
    rc, out, err = run(capsys, "verify", tiny_bf16_sharded, "--tokens", "40", "--precision", "fp16")
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 1 and "(fp16)" in lines[0] and "40 positions" in lines[0] and lines[0].endswith("PASS")


def test_verify_reports_a_missing_tensor(capsys, tiny_e2b, copy_ckpt):
    root = copy_ckpt(tiny_e2b)
    name = LM + "layers.7.mlp.down_proj.weight"
    tensors = load_file(root / "model.safetensors")
    del tensors[name]
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    rc, out, err = run(capsys, "verify", root, "--tokens", "40")
    assert rc == 2 and out == ""
    assert_one_line_error(err, "verify", name)


# -- plan errors ---------------------------------------------------------------------------------


@pytest.fixture
def moe_config(tmp_path, e2b_config):
    cfg = json.loads(json.dumps(e2b_config))
    cfg["text_config"]["enable_moe_block"] = True
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("case", ["missing_path", "moe", "context", "split_order", "split_text"])
def test_plan_errors_are_one_line(case, capsys, tmp_path, moe_config):
    argv, needles = {
        "missing_path": (["plan", tmp_path / "absent.json"], ["absent.json"]),
        "moe": (["plan", moe_config], ["enable_moe_block"]),
        "context": (["plan", E2B, "--context", "100"], ["--context 100"]),
        "split_order": (["plan", E2B, "--split", "20,8"], ["--split 20,8"]),
        "split_text": (["plan", E2B, "--split", "x"], ["--split", "'x'"]),
    }[case]
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert_one_line_error(err, "plan", *needles)


def test_plan_error_in_a_real_process():
    proc = run_process("plan", E2B, "--split", "20,8")
    assert proc.returncode == 2 and proc.stdout == ""
    assert_one_line_error(proc.stderr, "plan", "--split 20,8")


def test_plan_context_is_bounded_by_max_position_embeddings(capsys):
    from gemma_ane.bundle.plan import ChunkPlan
    from gemma_ane.bundle.spec import ConfigError, ModelSpec

    rc, out, err = run(capsys, "plan", E2B, "--context", "1000000000")
    assert rc == 2 and out == ""
    assert_one_line_error(err, "plan", "--context 1000000000", "max_position_embeddings=131072")
    rc, out, err = run(capsys, "plan", E2B, "--context", "131072", "--json")  # the bound itself is fine
    assert rc == 0 and json.loads(out)["context"] == 131072
    with pytest.raises(ConfigError, match="max_position_embeddings=131072"):  # the Python API too
        ChunkPlan.build(ModelSpec.from_pretrained(E2B), context=131072 + 32)


# -- convert: what it must refuse before it writes anything --------------------------------------


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))}


def test_convert_context_beyond_the_model_is_refused(capsys, tiny_e2b, tmp_path):
    # e2b-mini says max_position_embeddings=4096; a bigger context used to die in a torch allocation
    rc, out, err = run(capsys, "convert", tiny_e2b, tmp_path / "out", "--context", "1000000000", "--quiet")
    assert rc == 2 and out == ""
    assert_one_line_error(err, "convert", "--context 1000000000", "max_position_embeddings=4096")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", ["out_is_src", "out_inside_src", "src_inside_out", "src_is_a_link_to_out"])
def test_convert_never_replaces_the_checkpoint(case, capsys, tiny_e2b, tmp_path):
    real = tmp_path / "outer" / "ckpt"
    shutil.copytree(tiny_e2b, real)
    src, out = {
        "out_is_src": (real, real),
        "out_inside_src": (real, real / "bundle"),
        "src_inside_out": (real, tmp_path / "outer"),
        "src_is_a_link_to_out": (tmp_path / "link", real),
    }[case]
    if case == "src_is_a_link_to_out":
        src.symlink_to(real)
    before = tree(tmp_path)
    rc, stdout, err = run(capsys, "convert", src, out, "--force", "--context", "128", "--bits", "16", "--quiet")
    assert rc == 2 and stdout == ""
    assert_one_line_error(err, "convert", str(out), str(src))
    assert tree(tmp_path) == before  # nothing written, nothing removed


# -- signals and pipes ---------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["script", "module"])
def test_a_closed_pipe_ends_quietly(cmd):
    # The reader leaves before a byte is written (as `| head` does once it has its lines), so the
    # write fails whatever the size of the output: in the print itself for the JSON plan (14 kB), only
    # when stdout is flushed for the table (5 kB: buffered, as stdout is without PYTHONUNBUFFERED).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    exe = (
        [str(Path(sys.executable).parent / "gemma-ane")] if cmd == "script" else [sys.executable, "-m", "gemma_ane.cli"]
    )
    for argv in (["plan", E2B], ["plan", E2B, "--json"]):
        proc = subprocess.Popen([*exe, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) in (0, 141) and err == "", (argv, err)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_during_convert_leaves_nothing_behind(signum, tiny_e2b, tmp_path):
    tmp = tmp_path / "tmp"  # the child's $TMPDIR
    tmp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gemma_ane.cli", "convert", tiny_e2b, tmp_path / "out", "--context", "128", "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp), "PYTHONWARNINGS": "ignore"},
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.partial-*")):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no partial bundle within 120 s"
        time.sleep(0.02)
    proc.send_signal(signum)
    err = proc.communicate(timeout=120)[1]
    # 128 + N, or (Ctrl-C, rarely) an end by the signal itself, which CPython chooses once a
    # KeyboardInterrupt escaped some C-level call on the way: a shell reports 128 + N for both
    assert proc.returncode in (128 + signum, -signum if signum == signal.SIGINT else None), err
    assert err.splitlines() == [f"gemma-ane convert: interrupted ({signal.Signals(signum).name})"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"] and list(tmp.iterdir()) == []


@pytest.mark.parametrize("stage", ["trace_function", "merge_functions"])
def test_a_signal_a_library_swallows_still_stops_the_conversion(capsys, tiny_e2b, tmp_path, monkeypatch, stage):
    """A bare `except:` in a library can swallow the exception a signal handler raises; the signal is
    remembered, and the next stage, or at the latest publishing the bundle, ends the conversion."""
    from gemma_ane import files
    from gemma_ane.convert import coreml as convert_mod

    monkeypatch.setattr(files, "_received", [])

    def swallowed(*a, **k):
        try:
            files.stop(signal.SIGTERM)
        except BaseException:  # noqa: S110 (what the library does)
            pass

    monkeypatch.setattr(convert_mod, "trace_function", lambda *a: None)
    monkeypatch.setattr(convert_mod, "finish_function", lambda *a, **k: None)
    monkeypatch.setattr(convert_mod, "merge_functions", lambda *a, **k: None)
    monkeypatch.setattr(convert_mod, stage, swallowed)
    rc, out, err = run(capsys, "convert", tiny_e2b, tmp_path / "out", "--bits", "16", "--context", "128", "--quiet")
    assert rc == 128 + signal.SIGTERM and err == "gemma-ane convert: interrupted (SIGTERM)\n", err
    assert list(tmp_path.iterdir()) == []


def test_temporary_packages_live_in_the_partial_bundle(capsys, tiny_e2b, tmp_path, monkeypatch):
    """coremltools' save_multifunction leaves a whole package in $TMPDIR until the process exits
    (an atexit hook): never, if it is killed. Tracing is skipped here; the merge makes its temporary
    package as coremltools does, then Ctrl-C arrives."""
    import tempfile

    from gemma_ane.convert import coreml as convert_mod

    made = []

    def merge(paths, out):
        made.append(Path(tempfile.mkdtemp(suffix=".mlpackage")))  # what coremltools' _create_mlpackage does
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_mod, "trace_function", lambda *a: None)
    monkeypatch.setattr(convert_mod, "finish_function", lambda *a, **k: None)
    monkeypatch.setattr(convert_mod, "merge_functions", merge)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    rc, out, err = run(capsys, "convert", tiny_e2b, tmp_path / "out", "--bits", "16", "--context", "128", "--quiet")
    assert rc == 130 and err == "gemma-ane convert: interrupted (SIGINT)\n", err
    assert made and made[0].relative_to(tmp_path).parts[0].startswith(".out.partial-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"] and list(tmp.iterdir()) == []
