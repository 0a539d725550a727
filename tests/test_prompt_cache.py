"""Prompt cache files (issue 19): the caches of a prompt prefix saved with its token ids, so a long
system prompt is processed once across processes; a file is never misread by another bundle."""

import json

import numpy as np
import pytest
from margins import assert_same_greedy, recorded_rows

import gemma_ane
from gemma_ane.runtime.prompt_cache import PromptCacheError

SYSTEM = "You are a careful assistant who answers every question about foxes, rivers and old towns briefly."
KW = dict(temperature=0, repetition_penalty=2.0, logprobs=3, max_tokens=10)


def conversation(question):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def saved(tiny_bundle16, tmp_path_factory):
    """A first process: one question under the long system prompt, its system turn saved."""
    model = gemma_ane.load(tiny_bundle16, backend="mil")
    messages = conversation("Where do foxes live?")
    model.generate(messages=messages, **KW)
    system_end = model.turn_ends(messages, model.prompt_ids(messages=messages))[0]
    assert system_end > model.engine.window and model.engine.position > system_end  # the rings wrapped past it
    path = tmp_path_factory.mktemp("cache") / "system.npz"
    assert model.save_prompt_cache(path, system_end) == system_end
    return path, system_end


def test_a_saved_system_prompt_is_not_processed_again(tiny_bundle16, saved):
    path, system_end = saved
    second = gemma_ane.load(tiny_bundle16, backend="mil")  # another process
    assert second.load_prompt_cache(path) == system_end
    question = conversation("And what do they eat in winter?")
    with recorded_rows(second.engine) as rows:
        r = second.generate(messages=question, **KW)
    assert r.reused_tokens == system_end
    third = gemma_ane.load(tiny_bundle16, backend="mil")
    with recorded_rows(third.engine) as fresh_rows:
        fresh = third.generate(messages=question, **KW)
    assert fresh.reused_tokens == 0
    # the saved caches were filled in other batches than a fresh prefill's: equal up to fp16 rounding, so the
    # tokens up to a near-tie (the bound: the logprob tolerance this test had)
    ids = second.prompt_ids(messages=question)
    assert_same_greedy(r.tokens, rows, fresh.tokens, fresh_rows, 2e-2, 8, ids, KW["repetition_penalty"], "cache file")


def test_a_file_round_trips_the_caches_exactly(tiny_bundle16, saved, tmp_path):
    path, system_end = saved
    model = gemma_ane.load(tiny_bundle16, backend="mil")
    model.load_prompt_cache(path)
    model.save_prompt_cache(tmp_path / "again.npz")
    with np.load(path) as a, np.load(tmp_path / "again.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        full = a["chunk_1/kv_cache_full"]
        assert full.shape[2] == system_end and np.any(full[:, :, -1])  # rows up to the save point only
        assert a["tokens"].tolist() == model.engine.tokens


def test_a_file_saved_after_a_shorter_reuse_loads(tiny_bundle16, tmp_path):
    """A second prompt that reuses part of a longer first one leaves that sequence's later rows in the rings
    (masked, not yet wrapped over): the rings' newest write is past the tokens saved. The file holds them as they
    are, and a fresh model continues from it bit for bit (ring_top 10 over 6 tokens was refused: 'expected an
    integer from 5 to 5')."""
    model = gemma_ane.load(tiny_bundle16, backend="mil")
    engine = model.engine
    engine.prompt(list(range(2, 13)))  # positions 0-10, under the window: the rings have not wrapped
    assert engine.prompt([2, 3, 4, 5, 50, 51])[0] == 4 and (engine.position, engine.ring_top) == (6, 10)
    model.save_prompt_cache(tmp_path / "p.npz")
    fresh = gemma_ane.load(tiny_bundle16, backend="mil")
    assert fresh.load_prompt_cache(tmp_path / "p.npz") == 6 and fresh.engine.ring_top == 10
    np.testing.assert_array_equal(fresh.engine.feed([60])[-1], engine.feed([60])[-1])


def test_a_file_for_another_bundle_or_a_broken_one_is_refused(tiny_bundle4, tiny_bundle16, saved, tmp_path):
    path, _ = saved
    other = gemma_ane.load(tiny_bundle4, backend="mil")
    with pytest.raises(PromptCacheError, match=r"system.npz: made for another bundle \(bundle '"):
        other.load_prompt_cache(path)
    model = gemma_ane.load(tiny_bundle16, backend="mil")
    (tmp_path / "junk.npz").write_text("not a zip")
    with pytest.raises(PromptCacheError, match=r"junk.npz: not a prompt cache file"):
        model.load_prompt_cache(tmp_path / "junk.npz")
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    arrays["chunk_2/kv_cache_sliding"] = arrays["chunk_2/kv_cache_sliding"][:, :, :3]
    np.savez(tmp_path / "cut.npz", **arrays)
    with pytest.raises(
        PromptCacheError, match=r"cut.npz: chunk_2/kv_cache_sliding: expected shape \[\d+, 1, 16, \d+\]"
    ):
        model.load_prompt_cache(tmp_path / "cut.npz")
    meta = json.loads(str(arrays.pop("meta")))
    np.savez(tmp_path / "ctx.npz", meta=np.array(json.dumps({**meta, "context": 4096})), **arrays)
    with pytest.raises(PromptCacheError, match=r"ctx.npz: made for another bundle \(context 4096, this one 128\)"):
        model.load_prompt_cache(tmp_path / "ctx.npz")
    assert model.engine.position == 0  # nothing half-loaded
    model.generate("Hi", raw=True, max_tokens=2)
    with pytest.raises(ValueError, match="no caches of exactly 1 tokens here"):
        model.save_prompt_cache(tmp_path / "x.npz", 1)  # no snapshot there
    assert not (tmp_path / "x.npz").exists()


def test_the_cli_saves_the_system_turn_and_the_next_run_starts_from_it(tiny_bundle16, tmp_path, capsys):
    from gemma_ane.cli import main

    path = tmp_path / "system.npz"
    args = ["--system", SYSTEM, "--prompt-cache", str(path), "--max-tokens", "3", "--temperature", "0"]
    args += ["--backend", "mil"]
    assert main(["generate", str(tiny_bundle16), "-p", "Where do foxes live?", *args]) == 0
    saved = int(capsys.readouterr().err.split(": saved ")[1].split()[0])
    assert main(["generate", str(tiny_bundle16), "-p", "What do they eat?", *args]) == 0
    err = capsys.readouterr().err
    assert f"prompt cache {path}: {saved} tokens" in err and f"tokens ({saved} reused)" in err
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 not really")
    assert main(["generate", str(tiny_bundle16), "-p", "x", "--prompt-cache", str(tmp_path / "junk.npz")]) == 2
    assert "junk.npz: not a prompt cache file" in capsys.readouterr().err
    assert main(["generate", str(tiny_bundle16), "-p", "x", "--prompt-cache", str(tmp_path)]) == 2
    # refused before the bundle loads: the file is written only after the answer
    assert f"--prompt-cache {tmp_path}: is a directory (give a file name)" in capsys.readouterr().err
