"""Image prompts end to end: a bundle with a vision model (conftest's `vision_bundle`: 16-bit, 70 soft tokens an
image, context 256) against transformers' Gemma4ForConditionalGeneration fed the same files (through its own
processor), at every position; then the Python API, prefix reuse, prompt cache files and the CLI with images."""

import base64
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from gemma_ane import load
from gemma_ane.bundle import BundleError, check_bundle, inspect_bundle, read_model_config
from gemma_ane.errors import InputError
from gemma_ane.oracle.tokenizer_files import TINY_MEDIA_TOKENS
from gemma_ane.oracle.verify import FP16_MIN_COSINE, FP16_MIN_TOP1, verify_bundle
from gemma_ane.runtime.encoder import soft_keys
from gemma_ane.runtime.engine import ContextOverflow
from gemma_ane.runtime.images import ImageError

pytestmark = pytest.mark.slow

SIZES = {"wide": (40, 60), "tall": (90, 30), "strip": (12, 100)}  # (height, width): 3:2, 1:3, 1:8, upscaled


def picture(h: int, w: int, seed: int) -> Image.Image:
    """A smooth colour field with noise: every patch differs from its neighbours."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(7 * x + c + seed) * np.cos(5 * y - c) for c in range(3)], axis=-1)
    pixels = np.clip(127.5 * (1 + 0.8 * base) + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("images")
    paths = {}
    for i, (name, (h, w)) in enumerate(SIZES.items()):
        paths[name] = d / f"{name}.png"
        picture(h, w, i).save(paths[name])
    return paths


@pytest.fixture(scope="module")
def model(vision_bundle):
    return load(vision_bundle, backend="mil")


def user(*parts):
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


def image(source):
    return {"type": "image", "image": source}


# -- the proof ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("names", [["wide"], ["tall", "strip"]], ids=["wide", "tall+strip"])
def test_image_prompts_match_transformers_at_every_position(tiny_e2b, vision_bundle, images, names):
    """Soft tokens from the vision model (MIL executor) in the chunks' prompt path (prefill batches, then decode
    steps), against Gemma4ForConditionalGeneration with pixel_values: as tight as text prompts."""
    report = verify_bundle(tiny_e2b, vision_bundle, tokens=16, prompt_len=6, images=[images[n] for n in names])
    assert report["image_tokens"] >= 40 * len(names)  # every image resized up to the 70-token budget
    assert report["positions"] == 16 + report["image_tokens"] + 2 * len(names)
    assert report["top1_agreement"] >= FP16_MIN_TOP1 and report["min_cosine"] >= FP16_MIN_COSINE, report


def test_verify_refuses_media_the_bundle_has_no_model_for(tiny_e2b, tiny_bundle16, images):
    """A text-only bundle (tiny presets convert no audio tower) asked to prove an image or a clip: one line naming
    the flag, before either side runs."""
    for kind, name in (("images", "vision"), ("audio", "audio")):
        flag = "--image" if kind == "images" else "--audio"
        with pytest.raises(InputError, match=f"^{flag}: .* has no {name} model"):
            verify_bundle(tiny_e2b, tiny_bundle16, tokens=16, **{kind: [images["wide"]]})
    with pytest.raises(InputError, match="one kind of media a run"):
        verify_bundle(tiny_e2b, tiny_bundle16, images=[images["wide"]], audio=[images["wide"]])


def test_image_prompts_through_kv_only_prefill_match_transformers(tiny_e2b, vision_bundle, images):
    """The prompt as generation runs it: KV-only batches write the image positions' caches (no logits), and every
    row from the prompt's last on, which attends to them, matches transformers."""
    report = verify_bundle(
        tiny_e2b,
        vision_bundle,
        tokens=16,
        prompt_len=6,
        images=[images["tall"], images["strip"]],
        prompt_path="generate",
    )
    assert any(f.startswith("prefill_kv") for f in report["prompt_functions"]), report["prompt_functions"]
    assert report["positions"] == 16 - 6 + 1
    assert report["top1_agreement"] >= FP16_MIN_TOP1 and report["min_cosine"] >= FP16_MIN_COSINE, report


def test_verify_cli_with_images(tiny_e2b, vision_bundle, images):
    args = [sys.executable, "-m", "gemma_ane.cli", "verify", str(tiny_e2b), "--bundle", str(vision_bundle)]
    r = subprocess.run([*args, "--image", str(images["wide"]), "--tokens", "12"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "of images)" in r.stdout and "PASS" in r.stdout
    r = subprocess.run([*args[:5], "--image", str(images["wide"])], capture_output=True, text=True)
    assert r.returncode != 0 and "--image: needs --bundle" in r.stderr


# -- the runtime ----------------------------------------------------------------------------------------------


def test_the_prompt_holds_the_images_soft_tokens(model, images):
    ids = model.prompt_ids(messages=[user(image(images["wide"]), "What is this?")])
    boi, placeholder, eoi = model.images.token_ids
    assert (boi, placeholder, eoi) == tuple(TINY_MEDIA_TOKENS)  # from the bundle's config, not hard-coded
    assert ids.count(placeholder) == 1  # the template renders one placeholder; the runtime expands it
    r = model.generate(messages=[user(image(images["wide"]), "What is this?")], max_tokens=1, temperature=0)
    tokens = model.engine.tokens
    start = tokens.index(boi)
    keys = tokens[start + 1 : tokens.index(eoi)]
    assert len(keys) >= 40 and all(k < 0 for k in keys) and placeholder not in tokens
    assert r.prompt_tokens == len(ids) + len(keys) + 1


def test_every_source_of_the_same_picture_gives_the_same_tokens(model, images):
    path = images["tall"]
    data = path.read_bytes()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    sources = [str(path), path, data, Image.open(path), {"type": "image_url", "image_url": {"url": url}}]
    prompts, results = set(), []
    for s in sources:
        part = s if isinstance(s, dict) else image(s)
        results.append(model.generate(messages=[user(part, "Describe.")], max_tokens=3, temperature=0))
        prompts.add(tuple(model.engine.tokens[: results[-1].prompt_tokens]))
    assert len(prompts) == 1  # one picture: the same keys, whatever it came from
    assert len({tuple(r.tokens) for r in results}) == 1


def test_a_follow_up_about_the_same_image_reuses_it(model, images):
    model.reset()
    before = model.images.encoded
    first = [user(image(picture(50, 50, 7)), "What is this?")]
    a = model.generate(messages=first, max_tokens=4, temperature=0)
    assert model.images.encoded == before + 1 and a.reused_tokens == 0
    follow = [*first, {"role": "assistant", "content": a.text}, user("And its colour?")]
    b = model.generate(messages=follow, max_tokens=4, temperature=0, logprobs=0)
    assert model.images.encoded == before + 1  # not encoded again
    assert b.reused_tokens >= a.prompt_tokens - 1  # the image's positions are reused, not recomputed
    model.reset()  # the same follow-up with nothing cached: the same answer
    fresh = model.generate(messages=follow, max_tokens=4, temperature=0, logprobs=0)
    assert fresh.reused_tokens == 0 and fresh.tokens == b.tokens
    np.testing.assert_allclose(fresh.logprobs, b.logprobs, atol=2e-2)
    other = [user(image(picture(40, 40, 99)), "What is this?")]  # a picture no other test shows
    model.generate(messages=other, max_tokens=1, temperature=0)
    assert model.images.encoded == before + 2


def test_two_images_in_one_prompt_take_their_places(model, images):
    r = model.generate(
        messages=[user("Compare", image(images["tall"]), "with", image(images["strip"]), ".")], max_tokens=2
    )
    boi, _, eoi = model.images.token_ids
    tokens = model.engine.tokens[: r.prompt_tokens]
    assert tokens.count(boi) == 2 and tokens.count(eoi) == 2
    first, second = (tokens[i + 1 : tokens.index(eoi, i)] for i in [j for j, t in enumerate(tokens) if t == boi])
    assert set(first).isdisjoint(second)  # each picture its own keys


def test_prompt_cache_file_keeps_an_image(model, vision_bundle, images, tmp_path):
    messages = [user(image(images["wide"]), "What is this?")]
    model.reset()
    a = model.generate(messages=messages, max_tokens=3, temperature=0)
    path = tmp_path / "cache.npz"
    model.save_prompt_cache(path, a.prompt_tokens)
    other = load(vision_bundle, backend="mil")
    assert other.load_prompt_cache(path) == a.prompt_tokens
    b = other.generate(messages=messages, max_tokens=3, temperature=0)
    assert b.reused_tokens == a.prompt_tokens - 1 and b.tokens == a.tokens
    assert min(np.load(path)["tokens"]) < -(2**31)  # the keys need int64


def test_pictures_whose_first_48_bits_collide_never_share_tokens(model, vision_bundle, monkeypatch, tmp_path):
    """Issue 25: keys were 48 bits of the pixel hash, and a collision found in 50 s made the model answer about
    picture B from picture A's cached tokens. Forced here: every identity starts with the same 48 bits."""
    from gemma_ane.runtime import encoder

    real = encoder.image_identity
    monkeypatch.setattr(encoder, "image_identity", lambda *a: b"\0" * 6 + real(*a)[6:])
    a, b = picture(4, 4, 31), picture(4, 4, 32)

    def question(img):
        return [user(image(img), "What is this?")]

    model.reset()
    first = model.generate(messages=question(a), max_tokens=3, temperature=0)
    # a follow-up shape, so the first prompt's end is a snapshot a collision could reuse past the ring's wrap
    follow = [*question(b), {"role": "assistant", "content": first.text}, user("And its colour?")]
    after_a = model.generate(messages=follow, max_tokens=3, temperature=0, logprobs=0)
    start = model.engine.tokens.index(model.images.token_ids[0])
    assert after_a.reused_tokens <= start + 1  # the text before the picture, never A's soft tokens
    model.reset()
    alone = model.generate(messages=follow, max_tokens=3, temperature=0, logprobs=0)
    assert alone.tokens == after_a.tokens
    np.testing.assert_allclose(alone.logprobs, after_a.logprobs, atol=2e-2)
    both = model.generate(messages=[user(image(a), image(b), "Compare.")], max_tokens=1, temperature=0)
    boi, _, eoi = model.images.token_ids
    tokens = model.engine.tokens[: both.prompt_tokens]
    first, second = (tokens[i + 1 : tokens.index(eoi, i)] for i in [j for j, t in enumerate(tokens) if t == boi])
    assert set(first).isdisjoint(second)  # in one prompt too: each picture its own rows
    path = tmp_path / "b.npz"  # B (the second number of its 48 bits here) in a file, read by a new process
    model.reset()
    saved = model.generate(messages=question(b), max_tokens=3, temperature=0)
    model.save_prompt_cache(path, saved.prompt_tokens)
    monkeypatch.setattr(encoder, "_numbers", {})
    monkeypatch.setattr(encoder, "_identities", {})
    other = load(vision_bundle, backend="mil")
    assert other.load_prompt_cache(path) == saved.prompt_tokens
    about_a = other.generate(messages=question(a), max_tokens=3, temperature=0)
    assert about_a.reused_tokens <= start + 1
    other.load_prompt_cache(path)
    about_b = other.generate(messages=question(b), max_tokens=3, temperature=0)
    assert about_b.reused_tokens == saved.prompt_tokens - 1 and about_b.tokens == saved.tokens


def test_bad_image_input_is_one_line(model, tiny_bundle16, images, tmp_path):
    (tmp_path / "not.png").write_text("hello")
    bad = {
        "video": ({"type": "video", "video": "a.mp4"}, "video input is not supported"),
        "no source": ({"type": "image"}, "an image part needs 'image'"),
        "remote": ({"type": "image_url", "image_url": {"url": "https://x/y.png"}}, "remote image URLs are not"),
        "not base64": ({"type": "image_url", "image_url": {"url": "data:image/png,abc"}}, "must be base64"),
        "not an image": (image(tmp_path / "not.png"), "not.png: not an image"),
        "missing": (image(tmp_path / "nowhere.png"), "nowhere.png: No such file"),
    }
    for part, needle in bad.values():
        with pytest.raises(ImageError, match=needle) as e:
            model.generate(messages=[user(part, "Hi")], max_tokens=1)
        assert "\n" not in str(e.value) and "messages[0].content[0]" in str(e.value)
    text_only = load(tiny_bundle16, backend="mil")
    with pytest.raises(ImageError, match="has no vision model"):
        text_only.generate(messages=[user(image(images["wide"]), "Hi")], max_tokens=1)
    model.allow_special_tokens = True  # a user who spells the placeholder: one placeholder more than images
    try:
        with pytest.raises(ImageError, match="2 image placeholder"):
            model.generate(messages=[user(image(images["wide"]), "<|image|>")], max_tokens=1)
    finally:
        model.allow_special_tokens = False


def test_images_beyond_the_context_are_refused_before_encoding(model, images):
    before = model.images.encoded
    many = [image(picture(30 + i, 40, 10 + i)) for i in range(4)]  # 4 x ~70 soft tokens > 256
    with pytest.raises(ContextOverflow, match=r"\(image included\)"):
        model.generate(messages=[user(*many, "Hi")], max_tokens=1)
    assert model.images.encoded == before


def test_soft_keys_are_negative_and_distinct():
    a, b = soft_keys(b"\x01" * 16, 1120), soft_keys(b"\x02" * 16, 1120)
    assert max(a + b) < 0 and len(set(a + b)) == 2240


# -- the bundle and the CLI -----------------------------------------------------------------------------------


def test_the_bundle_states_its_vision_model(vision_bundle, tiny_bundle16):
    config = read_model_config(vision_bundle)
    assert config["vision"]["image_tokens"] == 70 and config["vision"]["image_token_id"] == 121
    manifest = json.loads((vision_bundle / "manifest.json").read_text())
    assert "vision.mlpackage/Manifest.json" in manifest["files"] and "encode" in manifest["vision"]["functions"]
    assert inspect_bundle(vision_bundle, sha256=False)["vision"]["functions"]["encode"]["macs_per_token"] > 0
    assert "image-text-to-text" in (vision_bundle / "README.md").read_text()
    # without the option (conftest converts text-only bundles): no vision model, no entry
    assert "vision" not in read_model_config(tiny_bundle16) and not (tiny_bundle16 / "vision.mlpackage").exists()


def test_a_damaged_vision_entry_is_named(vision_bundle, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(vision_bundle, bundle)
    config = json.loads((bundle / "model_config.json").read_text())
    (bundle / "vision_position_embeddings.npy").unlink()
    assert any("vision_position_embeddings.npy: missing" in p for p in check_bundle(bundle, sha256=False))
    for field, value, needle in [
        ("image_tokens", 71, "vision.image_tokens=71: expected one of 70"),
        ("position_table", "../x.npy", "vision.position_table='../x.npy'"),
        ("eoi_token_id", 10**9, "vision.eoi_token_id=1000000000"),
    ]:
        bad = {**config, "vision": {**config["vision"], field: value}}
        (bundle / "model_config.json").write_text(json.dumps(bad))
        with pytest.raises(BundleError, match=needle.replace(".", r"\.").replace("(", r"\(")):
            read_model_config(bundle)


def test_generate_cli_with_an_image(model, vision_bundle, images):
    cmd = [sys.executable, "-m", "gemma_ane.cli", "generate", str(vision_bundle), "--backend", "mil", "-p", "What?"]
    r = subprocess.run(
        [*cmd, "--image", str(images["wide"]), "--max-tokens", "3", "--temperature", "0", "--json"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    expected = model.generate(messages=[user(image(images["wide"]), "What?")], max_tokens=3, temperature=0)
    assert json.loads(r.stdout)["tokens"] == expected.tokens
    for extra, needle in [
        (["--image", str(images["wide"]), "--raw"], "--image: a raw prompt has no chat template"),
        (["--image", "/nowhere.png"], "/nowhere.png: No such file"),
    ]:
        r = subprocess.run([*cmd, *extra], capture_output=True, text=True)
        assert r.returncode != 0 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_convert_refuses_a_budget_it_cannot_serve(tiny_e2b, tmp_path):
    for flags, needle in [
        (["--image-tokens", "71"], "--image-tokens 71: choose one of 70, 140, 280, 560, 1120"),
        (["--vision-bits", "3"], "--vision-bits 3: choose 4, 6, 8 or 16"),
    ]:
        r = subprocess.run(
            [sys.executable, "-m", "gemma_ane.cli", "convert", str(tiny_e2b), str(tmp_path / "out"), *flags],
            capture_output=True,
            text=True,
        )
        assert r.returncode != 0 and needle in r.stderr and not (tmp_path / "out").exists(), r.stderr
