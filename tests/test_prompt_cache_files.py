"""Prompt cache files from a hostile source (issue 25): every malformed file is one PromptCacheError line naming the
file and the field, a zip bomb is refused in little memory, and image keys keep their pictures apart across
processes. No converted bundle: the reader needs only the engine's geometry (context, window, the chunks' states),
which a stand-in gives; tests/test_prompt_cache.py runs the real thing."""

import json
import os
import struct
import tracemalloc
import warnings
import zipfile

import numpy as np
import pytest

from gemma_ane.runtime import encoder
from gemma_ane.runtime.encoder import media_number, soft_keys
from gemma_ane.runtime.prompt_cache import PromptCacheError, load, save

BUNDLE = "0123456789abcdef0123456789abcdef"
CONTEXT, WINDOW = 16, 4
STATES = [  # chunk_1 and chunk_2 as the real ones: a full cache (slots on axis 2) and a ring
    {"kv_cache_full": {"shape": [2, 1, CONTEXT, 8], "dtype": "float16"}},
    {
        "kv_cache_full": {"shape": [1, 1, CONTEXT, 8], "dtype": "float16"},
        "kv_cache_sliding": {"shape": [1, 1, 4, 8], "dtype": "float16"},
    },
]


class Chunk:
    def __init__(self, states):
        self.interfaces = {"infer": {"states": states}}


class Engine:
    """What prompt_cache reads of an engine: its geometry, and tokens and caches to save or restore."""

    context, window = CONTEXT, WINDOW
    ring = WINDOW + 2  # a drafter's verify batch of 2: rejected drafts may reach 2 positions past the tokens

    def __init__(self, tokens=()):
        self.chunks = [Chunk(s) for s in STATES]
        self.tokens = list(tokens)
        self.restored = None

    def caches(self, position):
        rng = np.random.default_rng(position)
        return [
            {
                n: rng.normal(size=t["shape"] if n == "kv_cache_sliding" else [*t["shape"][:2], position, 8]).astype(
                    np.float16
                )
                for n, t in s.items()
            }
            for s in STATES
        ]

    def ring_top_at(self, position):
        return position  # one rejected draft past the tokens

    def restore(self, tokens, caches, top=None):
        self.restored = (tokens, caches, top)


def arrays_of(path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.npz"
    save(path, Engine([2, 10, 11, 12, 13]), 5, BUNDLE)
    return path


def test_a_file_round_trips(good):
    engine = Engine()
    assert load(good, engine, BUNDLE) == 5
    tokens, caches, top = engine.restored
    assert tokens == [2, 10, 11, 12, 13] and top == 5  # the rings' newest write travels with them
    want = Engine().caches(5)
    for got, expected in zip(caches, want):
        assert got.keys() == expected.keys()
        for name in got:
            np.testing.assert_array_equal(got[name], expected[name])


def npy(shape, descr: str, data: bytes = b"", version=(1, 0)) -> bytes:
    """An .npy member as written by hand: its header may declare anything."""
    header = repr({"descr": descr, "fortran_order": False, "shape": tuple(shape)}).encode()
    header += b" " * (63 - (len(header) + 10) % 64) + b"\n"
    size = struct.pack("<H", len(header)) if version == (1, 0) else struct.pack("<I", len(header))
    return b"\x93NUMPY" + bytes(version) + size + header + data


def rewrite(path, out, replace=None, drop=(), extra=None):
    """`path`'s archive copied to `out`, members replaced (name -> bytes), dropped or added."""
    with zipfile.ZipFile(path) as z, zipfile.ZipFile(out, "w") as w, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a member twice is one of the cases
        for info in z.infolist():
            if info.filename in drop:
                continue
            w.writestr(info.filename, (replace or {}).get(info.filename, z.read(info)))
        for name, data in (extra or {}).items():
            w.writestr(name, data)
    return out


def save_npy(array) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def meta_of(path) -> dict:
    return json.loads(str(arrays_of(path)["meta"]))


def patch_declared_size(path, member: str, size: int) -> None:
    """Set the uncompressed size a member's local and central headers declare."""
    data = bytearray(path.read_bytes())
    name = member.encode()
    for signature, offset in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        i = 0
        while (i := data.find(signature, i)) >= 0:
            name_at = i + (30 if signature == b"PK\x03\x04" else 46)
            if data[name_at : name_at + len(name)] == name:
                data[i + offset : i + offset + 4] = struct.pack("<I", size)
            i += 4
    path.write_bytes(bytes(data))


def malformed(good, tmp_path):
    """name -> (file, the field its message must name, what else it must say)."""
    out = tmp_path
    meta = meta_of(good)
    state = "chunk_1/kv_cache_full.npy"
    cases = {
        "meta a JSON list": (
            rewrite(good, out / "a.npz", {"meta.npy": save_npy(np.array("[1, 2]"))}),
            "meta",
            "JSON object",
        ),
        "meta not JSON": (rewrite(good, out / "b.npz", {"meta.npy": save_npy(np.array("{oops"))}), "meta", "not JSON"),
        "meta a number": (rewrite(good, out / "c.npz", {"meta.npy": save_npy(np.arange(3))}), "meta", "dtype int64"),
        "meta pickled": (
            rewrite(good, out / "d.npz", {"meta.npy": save_npy(np.array([{}], object))}),
            "meta",
            "dtype object",
        ),
        "meta of another context": (
            rewrite(good, out / "e.npz", {"meta.npy": save_npy(np.array(json.dumps({**meta, "context": 4096})))}),
            "context",
            "made for another bundle",
        ),
        "meta without a bundle": (
            rewrite(good, out / "f.npz", {"meta.npy": save_npy(np.array(json.dumps({"format": 1})))}),
            "bundle",
            "made for another bundle",
        ),
        "ring_top past a verify batch": (
            rewrite(good, out / "top1.npz", {"meta.npy": save_npy(np.array(json.dumps({**meta, "ring_top": 7})))}),
            "ring_top",
            "ring_top 7, expected an integer from 4 to 6",
        ),
        "ring_top before the tokens": (
            rewrite(good, out / "top3.npz", {"meta.npy": save_npy(np.array(json.dumps({**meta, "ring_top": 3})))}),
            "ring_top",
            "ring_top 3, expected an integer from 4 to 6",
        ),
        "ring_top a string": (
            rewrite(good, out / "top2.npz", {"meta.npy": save_npy(np.array(json.dumps({**meta, "ring_top": "5"})))}),
            "ring_top",
            "expected an integer",
        ),
        "tokens 0-d": (rewrite(good, out / "g.npz", {"tokens.npy": save_npy(np.array(5))}), "tokens", "got []"),
        "tokens 2-D": (
            rewrite(good, out / "h.npz", {"tokens.npy": save_npy(np.ones((5, 1), np.int64))}),
            "tokens",
            "got [5, 1]",
        ),
        "tokens float": (rewrite(good, out / "i.npz", {"tokens.npy": save_npy(np.ones(5))}), "tokens", "dtype float64"),
        "tokens empty": (
            rewrite(good, out / "j.npz", {"tokens.npy": save_npy(np.ones(0, np.int64))}),
            "tokens",
            "0 ids",
        ),
        "tokens past the context": (
            rewrite(good, out / "k.npz", {"tokens.npy": save_npy(np.ones(CONTEXT + 1, np.int64))}),
            "tokens",
            f"{CONTEXT + 1} ids, expected 1 to {CONTEXT}",
        ),
        "tokens declaring 10**12": (
            rewrite(good, out / "l.npz", {"tokens.npy": npy([10**12], "<i8")}),
            "tokens",
            "1000000000000 ids",
        ),
        "a state declaring 10**12": (
            rewrite(good, out / "m.npz", {state: npy([10**12], "<f2")}),
            "chunk_1/kv_cache_full",
            "got [1000000000000]",
        ),
        "a datetime64 state": (
            rewrite(good, out / "n.npz", {state: save_npy(np.zeros((2, 1, 5, 8), "datetime64[s]"))}),
            "chunk_1/kv_cache_full",
            "dtype datetime64[s]",
        ),
        "an int8 state": (
            rewrite(good, out / "o.npz", {state: save_npy(np.zeros((2, 1, 5, 8), np.int8))}),
            "chunk_1/kv_cache_full",
            "dtype int8, expected float16 or float32",
        ),
        "a pickled state": (
            rewrite(good, out / "p.npz", {state: save_npy(np.array([None]))}),
            "chunk_1/kv_cache_full",
            "dtype object",
        ),
        "a cut state": (
            rewrite(good, out / "q.npz", {state: save_npy(np.zeros((2, 1, 3, 8), np.float16))}),
            "chunk_1/kv_cache_full",
            "expected shape [2, 1, 5, 8], got [2, 1, 3, 8]",
        ),
        "a state missing": (
            rewrite(good, out / "r.npz", drop=["chunk_2/kv_cache_sliding.npy"]),
            "chunk_2/kv_cache_sliding",
            "missing",
        ),
        "no meta": (rewrite(good, out / "s.npz", drop=["meta.npy"]), "meta", "missing"),
        "an unknown member": (
            rewrite(good, out / "t.npz", extra={"chunk_1/extra.npy": b"x"}),
            "chunk_1/extra.npy",
            "not a member",
        ),
        "a member twice": (
            rewrite(good, out / "u.npz", extra={"tokens.npy": save_npy(np.ones(5, np.int64))}),
            "tokens",
            "stored twice",
        ),
        "a state shorter than its header": (
            rewrite(good, out / "v.npz", {state: npy([2, 1, 5, 8], "<f2", b"\0" * 10)}),
            "chunk_1/kv_cache_full",
            "unreadable",
        ),
        "not .npy": (rewrite(good, out / "w.npz", {state: b"hello, world"}), "chunk_1/kv_cache_full", "unreadable"),
        "a big-endian state": (
            rewrite(good, out / "x.npz", {state: save_npy(np.zeros((2, 1, 5, 8), ">f2"))}),
            "chunk_1/kv_cache_full",
            "dtype >f2",
        ),
        "a soft token of no image": (
            rewrite(good, out / "y.npz", {"tokens.npy": save_npy(np.array([2, -5, 11, 12, 13]))}),
            "meta.images",
            "names no image",
        ),
        "meta.images not an object": (
            rewrite(good, out / "z.npz", {"meta.npy": save_npy(np.array(json.dumps({**meta, "images": [1]})))}),
            "meta.images",
            "expected an object",
        ),
        "not a zip": (out / "junk.npz", "not an .npz archive", "not a prompt cache file"),
        "missing": (out / "nowhere.npz", "no such", "prompt cache file"),
        "a directory": (out / "dir.npz", "a directory", "not a regular file"),
        "a FIFO": (out / "fifo.npz", "a FIFO", "not a regular file"),
        "a device": ("/dev/zero", "a character device", "not a regular file"),
    }
    (out / "junk.npz").write_text("not a zip")
    (out / "dir.npz").mkdir()
    os.mkfifo(out / "fifo.npz")
    declared = rewrite(good, out / "huge.npz")
    patch_declared_size(declared, state, 2**31)
    cases["a member declaring 2 GiB"] = (declared, "chunk_1/kv_cache_full", "declares 2147483648 bytes")
    corrupt = bytearray(good.read_bytes())
    at = corrupt.find(b"\x93NUMPY", corrupt.find(state.encode())) + 200  # inside the state's data (stored)
    corrupt[at] ^= 0xFF
    (out / "crc.npz").write_bytes(bytes(corrupt))
    cases["a member failing its CRC"] = (out / "crc.npz", "chunk_1/kv_cache_full", "unreadable")
    return cases


def test_every_malformed_file_is_one_line_naming_the_file_and_the_field(good, tmp_path):
    cases = malformed(good, tmp_path)
    failures = []
    for name, (path, field, needle) in cases.items():
        engine = Engine()
        try:
            load(path, engine, BUNDLE)
        except PromptCacheError as e:
            message = str(e)
            if not (message.startswith(f"{path}: ") and field in message and needle in message and "\n" not in message):
                failures.append(f"{name}: {message!r}")
        except Exception as e:  # a traceback in the CLI: the case fails, and the others still run
            failures.append(f"{name}: {type(e).__name__}: {e}")
        else:
            failures.append(f"{name}: accepted")
        if engine.restored is not None:
            failures.append(f"{name}: restored the engine")
    assert not failures, "\n".join(failures)


def bomb(path, member: str, size: int) -> None:
    """A good file's members, then `member` inflating from a few hundred KB to `size` bytes of zeros."""
    with zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED) as z, z.open(member, "w", force_zip64=True) as f:
        block = bytes(1 << 20)
        for _ in range(size >> 20):
            f.write(block)


@pytest.mark.parametrize("member", ["bomb.npy", "chunk_1/kv_cache_full.npy"], ids=["extra", "expected"])
def test_a_zip_bomb_is_refused_in_little_memory(good, tmp_path, member):
    path = rewrite(good, tmp_path / "bomb.npz", drop=[member])
    bomb(path, member, 256 << 20)
    assert path.stat().st_size < 2 << 20
    tracemalloc.start()
    try:
        load(path, Engine(), BUNDLE)
    except PromptCacheError as e:
        error = str(e)
    else:
        error = "accepted"
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2**20:.0f} MiB to refuse a bomb"
    assert error.startswith(f"{path}: {member.removesuffix('.npy')}")


# -- image keys (item 7) ---------------------------------------------------------------------------------------


@pytest.fixture
def fresh_process(monkeypatch):
    """The picture numbers of a new process: none given yet."""
    monkeypatch.setattr(encoder, "_numbers", {})
    monkeypatch.setattr(encoder, "_identities", {})


def colliding(n: int) -> list[bytes]:
    """n identities whose first 48 bits agree: what a 50-second search for a collision of 48 bits finds."""
    return [b"\x7f" * 6 + bytes([i]) * 26 for i in range(n)]


def test_pictures_whose_48_bits_collide_get_different_keys(fresh_process):
    a, b = colliding(2)
    keys_a, keys_b = soft_keys(a, 70), soft_keys(b, 70)
    assert set(keys_a).isdisjoint(keys_b)
    assert soft_keys(a, 70) == keys_a and soft_keys(b, 70) == keys_b  # the same picture: the same keys
    assert max(keys_a + keys_b) < 0


def test_the_identity_hashes_the_preprocessing_too():
    from PIL import Image

    img = Image.new("RGB", (4, 4), (10, 20, 30))
    identity = encoder.image_identity(img, 280, 16, 3)
    assert len(identity) == 32 and identity == encoder.image_identity(img.copy(), 280, 16, 3)
    others = {encoder.image_identity(img, 70, 16, 3), encoder.image_identity(img, 280, 14, 3)}
    others.add(encoder.image_identity(img, 280, 16, 2))
    others.add(encoder.image_identity(Image.new("RGB", (4, 4), (10, 20, 31)), 280, 16, 3))
    assert identity not in others and len(others) == 4


def test_a_file_maps_its_keys_to_this_process_pictures(tmp_path, fresh_process, monkeypatch):
    a, b = colliding(2)
    soft_keys(a, 3)  # this process met picture a first: b took the next number
    b_keys = soft_keys(b, 3)
    path = tmp_path / "b.npz"
    save(path, Engine([2, *b_keys, 9]), 5, BUNDLE)
    assert meta_of(path)["images"] == {str(media_number(b)): b.hex()}
    monkeypatch.setattr(encoder, "_numbers", {})  # another process, which meets b first
    monkeypatch.setattr(encoder, "_identities", {})
    engine = Engine()
    assert load(path, engine, BUNDLE) == 5
    here = soft_keys(b, 3)
    assert engine.restored[0] == [2, *here, 9] and here != b_keys  # b's keys in this process
    assert set(soft_keys(a, 3)).isdisjoint(engine.restored[0])  # a, met later, never matches b's tokens


def test_saving_keys_of_no_known_picture_is_refused(tmp_path, fresh_process):
    with pytest.raises(ValueError, match="keys of no known image"):
        save(tmp_path / "x.npz", Engine([2, -7, 9]), 3, BUNDLE)
    assert not (tmp_path / "x.npz").exists()
