"""Checkpoint: lazy, text-only, exact reading of HF Gemma 4 safetensors, and one-line errors."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import gemma_ane.convert.checkpoint as checkpoint_module
from gemma_ane.bundle.plan import ChunkPlan
from gemma_ane.convert.checkpoint import Checkpoint, CheckpointError
from gemma_ane.convert.models.text import build_chunks

TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
LM = "model.language_model."
INDEX = "model.safetensors.index.json"


def shards(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors"))


def header(path: Path) -> tuple[int, dict]:
    """(byte offset of the data region, header without metadata), parsed independently of the loader."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return 8 + n, h


def shard_of(root: Path, name: str) -> Path:
    return next(p for p in shards(root) if name in header(p)[1])


def rewrite(path: Path, mutate) -> None:
    tensors = load_file(path)
    mutate(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def overwrite_regions(path: Path, select) -> int:
    """Fill the data bytes of the selected tensors with 0xFF (NaN in fp32 and bf16); file size kept."""
    size = path.stat().st_size
    start, h = header(path)
    done = 0
    with open(path, "r+b") as f:
        for name, e in h.items():
            if select(name):
                begin, end = e["data_offsets"]
                f.seek(start + begin)
                f.write(b"\xff" * (end - begin))
                done += 1
    assert path.stat().st_size == size
    return done


def chunk_params(ckpt: Checkpoint) -> dict:
    plan = ChunkPlan.build(ckpt.spec, context=64)
    return {
        f"{m.chunk.name}.{k}": v.clone()
        for m in build_chunks(plan, ckpt)
        for k, v in m.state_dict().items()
        if k not in m.chunk.states
    }


# -- values --------------------------------------------------------------------------------------


def test_single_file_fp32_values_are_exact(tiny_e2b):
    ckpt = Checkpoint(tiny_e2b)
    ckpt.validate()
    assert ckpt.prefix == LM and [p.name for p in shards(tiny_e2b)] == ["model.safetensors"]
    ref = load_file(tiny_e2b / "model.safetensors")
    text = [k for k in ref if k.startswith(LM)]
    assert len(text) > 200
    for k in text:
        ours = ckpt[k[len(LM) :]]
        assert ours.dtype == np.float32 and ours.shape == tuple(ref[k].shape), k
        np.testing.assert_array_equal(ours, ref[k].numpy(), err_msg=k)


def test_three_bf16_shards_widen_exactly(tiny_bf16_sharded, tiny_e2b):
    ckpt = Checkpoint(tiny_bf16_sharded)
    ckpt.validate()
    files = shards(tiny_bf16_sharded)
    assert len(files) == 3
    ref = {}
    for f in files:
        ref.update(load_file(f))
    text = [k for k in ref if k.startswith(LM)]
    # The text model must really be spread over the shards, or this is a single-file test again.
    assert {ckpt.entries[k][0].name for k in text} == {f.name for f in files}
    for k in text:
        assert ckpt.dtype_of(k[len(LM) :]) == "BF16"
        ours = ckpt[k[len(LM) :]]
        assert ours.dtype == np.float32, k
        np.testing.assert_array_equal(ours, ref[k].float().numpy(), err_msg=k)
    # Same seed as the fp32 fixture: the bf16 values are its rounding, not a copy of it.
    w32 = Checkpoint(tiny_e2b)["layers.0.mlp.up_proj.weight"]
    w16 = ckpt["layers.0.mlp.up_proj.weight"]
    assert not np.array_equal(w16, w32)
    np.testing.assert_allclose(w16, w32, rtol=2**-8)


# -- text only -----------------------------------------------------------------------------------


class RecordingDict(dict):
    """Records every name looked up, however the loader looks it up."""

    def __init__(self, data):
        super().__init__(data)
        self.seen = set()

    def __getitem__(self, k):
        self.seen.add(k)
        return super().__getitem__(k)

    def get(self, k, default=None):
        self.seen.add(k)
        return super().get(k, default)

    def __contains__(self, k):
        self.seen.add(k)
        return super().__contains__(k)


@pytest.mark.parametrize("fixture", ["tiny_e2b", "tiny_bf16_sharded"])
def test_building_every_chunk_touches_text_tensors_only(fixture, request, monkeypatch):
    root = request.getfixturevalue(fixture)
    ckpt = Checkpoint(root)
    ckpt.entries = RecordingDict(ckpt.entries)
    tower_bytes = {}  # shard -> [(begin, end)) absolute byte ranges of tower tensors
    for f in shards(root):
        start, h = header(f)
        tower_bytes[f] = [
            (start + e["data_offsets"][0], start + e["data_offsets"][1]) for k, e in h.items() if k.startswith(TOWERS)
        ]
    assert sum(map(len, tower_bytes.values())) > 50  # the fixture does carry towers to avoid

    reads = []  # (shard, first byte, end byte) of every read
    real_read = ckpt._read

    def spy(path, offset, nbytes):
        reads.append((path, offset, offset + nbytes))
        return real_read(path, offset, nbytes)

    monkeypatch.setattr(ckpt, "_read", spy)
    plan = ChunkPlan.build(ckpt.spec, context=64)
    models = build_chunks(plan, ckpt)
    monkeypatch.undo()

    assert [m.chunk.name for m in models] == ["chunk_1", "chunk_2", "chunk_3"]
    touched = sorted(k for k in ckpt.entries.seen if k.startswith(TOWERS))
    assert not touched, touched
    # Everything but the PLE table, which the host looks up outside the chunks.
    assert set(ckpt.expected()) - {"embed_tokens_per_layer.weight"} <= {k[len(LM) :] for k in ckpt.entries.seen}
    assert len(reads) >= len(ckpt.expected()) - 1
    for path, lo, hi in reads:
        hits = [r for r in tower_bytes[path] if lo < r[1] and r[0] < hi]
        assert not hits, f"{path.name}: read bytes [{lo}, {hi}) overlap a tower tensor"
    # The instrument itself must see a tower lookup, or the assertions above prove nothing.
    ckpt.entries.get(next(k for k in dict.keys(ckpt.entries) if k.startswith(TOWERS)))
    assert any(k.startswith(TOWERS) for k in ckpt.entries.seen)


@pytest.mark.parametrize("fixture", ["tiny_e2b", "tiny_bf16_sharded"])
def test_garbage_in_the_towers_does_not_matter(fixture, request, copy_ckpt):
    src = request.getfixturevalue(fixture)
    root = copy_ckpt(src)
    assert sum(overwrite_regions(f, lambda k: k.startswith(TOWERS)) for f in shards(root)) > 50
    victim = next(k for f in shards(root) for k in header(f)[1] if k.startswith("model.vision_tower."))
    assert torch.isnan(load_file(shard_of(root, victim))[victim].float()).all()  # the garbage landed

    ckpt = Checkpoint(root)
    ckpt.validate()
    ours, ref = chunk_params(ckpt), chunk_params(Checkpoint(src))
    assert ours.keys() == ref.keys()
    for k, v in ours.items():
        assert torch.isfinite(v).all(), k
        assert torch.equal(v, ref[k]), k


def make_text_only(src: Path, dst: Path, shard_count: int = 1) -> Path:
    """Gemma4ForCausalLM layout: `model.*` keys, no towers, a text config."""
    tensors = {}
    for f in shards(src):
        tensors.update(load_file(f))
    text = {"model." + k[len(LM) :]: v for k, v in tensors.items() if k.startswith(LM)}
    assert not any(k.startswith(LM) or k.startswith(TOWERS) for k in text)
    dst.mkdir()
    if shard_count == 1:
        save_file(text, dst / "model.safetensors", metadata={"format": "pt"})
    else:
        names = sorted(text)
        groups = [names[i::shard_count] for i in range(shard_count)]
        wm = {}
        for i, g in enumerate(groups, 1):
            fname = f"model-{i:05d}-of-{shard_count:05d}.safetensors"
            save_file({k: text[k] for k in g}, dst / fname, metadata={"format": "pt"})
            wm.update(dict.fromkeys(g, fname))
        (dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    cfg = json.loads((src / "config.json").read_text())["text_config"]
    cfg["architectures"] = ["Gemma4ForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("shard_count", [1, 2])
def test_text_only_layout(tiny_bf16_sharded, tmp_path, shard_count):
    root = make_text_only(tiny_bf16_sharded, tmp_path / "text", shard_count)
    ckpt = Checkpoint(root)
    assert ckpt.prefix == "model."
    ckpt.validate()
    full = Checkpoint(tiny_bf16_sharded)
    for name in ckpt.expected():
        np.testing.assert_array_equal(ckpt[name], full[name], err_msg=name)
    ours, ref = chunk_params(ckpt), chunk_params(full)
    assert all(torch.equal(v, ref[k]) for k, v in ours.items())


# -- errors --------------------------------------------------------------------------------------

Q3 = "layers.3.self_attn.q_proj.weight"


def _drop_from_single(root):
    rewrite(root / "model.safetensors", lambda t: t.pop(LM + Q3))
    return [LM + Q3]


def _drop_from_shard(root):
    shard = shard_of(root, LM + Q3)
    rewrite(shard, lambda t: t.pop(LM + Q3))
    return [LM + Q3, shard.name]


def _drop_from_shard_and_index(root):
    _drop_from_shard(root)
    index = json.loads((root / INDEX).read_text())
    del index["weight_map"][LM + Q3]
    (root / INDEX).write_text(json.dumps(index))
    return [LM + Q3, INDEX]


def _wrong_shape(root):
    name = LM + "layers.0.mlp.up_proj.weight"
    shard = shard_of(root, name)
    rewrite(shard, lambda t: t.update({name: t[name].T.contiguous()}))
    return [shard.name, name, "(64, 128)", "expected (128, 64)"]


def _duplicate_across_shards(root):
    name = LM + "norm.weight"
    home = shard_of(root, name)
    other = next(p for p in shards(root) if p != home)
    rewrite(other, lambda t: t.update({name: torch.zeros(64, dtype=torch.bfloat16)}))
    return [name, home.name, other.name]


def _wrong_data_extent(root):
    # A header that declares fewer bytes than shape x dtype needs: reading it would run into the
    # next tensor, so validate() must refuse before any data is read.
    name = LM + "norm.weight"
    path = root / "model.safetensors"
    start, h = header(path)
    with open(path, "rb") as f:
        f.seek(8)
        raw = json.loads(f.read(start - 8))
    begin, end = raw[name]["data_offsets"]
    raw[name]["data_offsets"] = [begin, begin + (end - begin) // 2]
    text = json.dumps(raw, separators=(",", ":")).encode()
    text += b" " * (start - 8 - len(text))
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(text)
    return [name, "data_offsets"]


VALIDATE_ERRORS = {
    "missing_tensor": ("tiny_e2b", _drop_from_single),
    "missing_tensor_in_shard": ("tiny_bf16_sharded", _drop_from_shard),
    "missing_tensor_and_index_entry": ("tiny_bf16_sharded", _drop_from_shard_and_index),
    "wrong_shape": ("tiny_bf16_sharded", _wrong_shape),
    "wrong_data_extent": ("tiny_e2b", _wrong_data_extent),
}


@pytest.mark.parametrize("case", VALIDATE_ERRORS)
def test_tensor_errors_are_one_line_and_name_the_tensor(case, request, copy_ckpt):
    fixture, break_it = VALIDATE_ERRORS[case]
    root = copy_ckpt(request.getfixturevalue(fixture))
    needles = break_it(root)
    ckpt = Checkpoint(root)  # headers still parse; the problem is in what they hold
    with pytest.raises(CheckpointError) as e:
        ckpt.validate()
    msg = str(e.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    if case.startswith("missing"):
        # Reading it directly fails the same way, not with a KeyError.
        with pytest.raises(CheckpointError, match=Q3.replace(".", r"\.")):
            ckpt[Q3]


def _weights_removed(root):
    for f in shards(root):
        f.unlink()
    (root / INDEX).unlink()
    return root, [str(root), "safetensors"]


def _broken_index(root):
    (root / INDEX).write_text('{"weight_map": {"a": ')
    return root, [INDEX, "broken"]


def _index_names_absent_shard(root):
    index = json.loads((root / INDEX).read_text())
    index["weight_map"][LM + Q3] = "model-00009-of-00003.safetensors"
    (root / INDEX).write_text(json.dumps(index))
    return root, [INDEX, "model-00009-of-00003.safetensors"]


def _index_escapes_dir(root):
    index = json.loads((root / INDEX).read_text())
    index["weight_map"][LM + Q3] = "../copy/model-00001-of-00003.safetensors"
    (root / INDEX).write_text(json.dumps(index))
    return root, [INDEX, "../copy/model-00001-of-00003.safetensors"]


def _truncate(keep):
    def go(root):
        shard = shards(root)[1]
        size = shard.stat().st_size
        with open(shard, "r+b") as f:
            f.truncate(keep(size))
        return root, [shard.name, "truncated"]

    return go


def _header_not_an_object(root):
    shard = shards(root)[0]
    body = b"[1, 2, 3]"
    shard.write_bytes(struct.pack("<Q", len(body)) + body)
    return root, [shard.name]


def _duplicated(root):
    return root, _duplicate_across_shards(root)


def _not_a_directory(root):
    return root / "config.json", ["config.json", "not a checkpoint directory"]


def _nowhere(root):
    return root / "absent", ["absent", "not a checkpoint directory"]


OPEN_ERRORS = {
    "no_weights": _weights_removed,
    "broken_index_json": _broken_index,
    "index_lists_absent_shard": _index_names_absent_shard,
    "index_escapes_directory": _index_escapes_dir,
    "truncated_data": _truncate(lambda size: size - 100),
    "truncated_header": _truncate(lambda size: 20),
    "truncated_to_nothing": _truncate(lambda size: 0),
    "header_not_an_object": _header_not_an_object,
    "tensor_in_two_shards": _duplicated,
    "not_a_directory": _not_a_directory,
    "no_such_path": _nowhere,
}


@pytest.mark.parametrize("case", OPEN_ERRORS)
def test_file_errors_are_one_line_at_open(case, tiny_bf16_sharded, copy_ckpt):
    path, needles = OPEN_ERRORS[case](copy_ckpt(tiny_bf16_sharded))
    # Raised by the constructor itself: a checkpoint object that exists is a readable one.
    with pytest.raises(CheckpointError) as e:
        Checkpoint(path)
    msg = str(e.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_truncated_single_file_is_reported_even_if_only_towers_are_cut(tiny_e2b, copy_ckpt):
    # The file disagrees with its own header, as after an interrupted download; safetensors refuses
    # it too, and so must we, even though no text tensor lies in the lost bytes.
    root = copy_ckpt(tiny_e2b)
    path = root / "model.safetensors"
    start, h = header(path)
    last = max(h, key=lambda k: h[k]["data_offsets"][1])
    assert last.startswith(TOWERS)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4)
    with pytest.raises(CheckpointError, match="truncated"):
        Checkpoint(root)


# -- laziness ------------------------------------------------------------------------------------


def test_constructor_and_validate_read_headers_only(tiny_bf16_sharded, copy_ckpt, monkeypatch):
    root = copy_ckpt(tiny_bf16_sharded)
    assert sum(overwrite_regions(f, lambda k: True) for f in shards(root)) > 300
    header_end = {str(f): header(f)[0] for f in shards(root)}

    furthest = {}
    real_open = open

    class Tracked:
        def __init__(self, f, name):
            self.f, self.name = f, name

        def read(self, *a):
            out = self.f.read(*a)
            furthest[self.name] = max(furthest.get(self.name, 0), self.f.tell())
            return out

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, attr):
            return getattr(self.f, attr)

    def tracked_open(path, mode="r", *a, **kw):
        return Tracked(real_open(path, mode, *a, **kw), str(path))

    def no_read(*a, **kw):
        raise AssertionError("tensor data read before any tensor was asked for")

    monkeypatch.setattr(checkpoint_module, "open", tracked_open, raising=False)
    monkeypatch.setattr(Checkpoint, "_read", no_read)
    ckpt = Checkpoint(root)
    ckpt.validate()
    assert furthest.keys() == header_end.keys()
    for name, pos in furthest.items():
        assert pos <= header_end[name], (name, pos, header_end[name])
    monkeypatch.undo()

    # Data is read on demand, and what is read is the garbage, not something cached earlier.
    assert np.isnan(ckpt["norm.weight"]).all()
