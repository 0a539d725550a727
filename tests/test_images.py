"""Image preprocessing against transformers' Gemma 4 image processor (its PIL backend, the oracle): the same
resize, patches, positions and soft-token counts, bit for bit, on generated files of every kind; and every
bad input as a one-line ImageError."""

import math
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from transformers.image_utils import load_image as hf_load_image
from transformers.models.gemma4.image_processing_pil_gemma4 import (
    Gemma4ImageProcessorPil,
    get_aspect_ratio_preserving_size,
)

from gemma_ane.runtime.images import SOFT_TOKEN_BUDGETS, ImageError, load_image, preprocess, target_size


def noise(h, w, channels=3, seed=0):
    """Random pixels: the worst case for a resampling filter, every neighbour differs."""
    shape = (h, w, channels) if channels > 1 else (h, w)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def assert_same(ours, image, budget):
    """`ours` (a Patches) equals transformers' processor on `image`, exactly."""
    ref = Gemma4ImageProcessorPil(max_soft_tokens=budget)(image, return_tensors="np")
    assert ours.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"][0])
    np.testing.assert_array_equal(ours.positions, ref["image_position_ids"][0])
    assert ours.soft_tokens == ref["num_soft_tokens_per_image"][0]
    rows, cols = ours.grid
    assert ours.positions[rows * cols - 1].tolist() == [cols - 1, rows - 1]  # the grid is the real patches'
    assert (ours.positions[rows * cols :] == -1).all()


# sizes: tiny, odd, portrait, landscape, square, a 4:3 photo, strips past every budget's aspect limit
CASES = [
    ((5, 7), 70, "png"),
    ((17, 29), 140, "jpeg"),
    ((333, 101), 280, "png"),
    ((101, 333), 560, "webp"),
    ((240, 240), 1120, "bmp"),
    ((480, 640), 280, "jpeg"),
    ((1, 20000), 280, "png"),
    ((20000, 1), 1120, "png"),
    ((3, 1000), 70, "tiff"),
]


@pytest.mark.parametrize("size,budget,fmt", CASES)
def test_files_match_transformers(tmp_path, size, budget, fmt):
    path = tmp_path / f"x.{fmt}"
    Image.fromarray(noise(*size)).save(path)
    assert_same(preprocess(path, budget), Image.open(path), budget)


def test_a_large_photo_in_memory():
    image = Image.fromarray(np.kron(noise(300, 400), np.ones((10, 10, 1), np.uint8)))  # 3000x4000, downscaled
    assert_same(preprocess(image, 560), image, 560)


def test_target_size_is_transformers_arithmetic():
    """Every budget, random sizes from 1 px to strips of 10^5: same size (both fallback branches included)."""
    rng = np.random.default_rng(1)
    sizes = np.exp(rng.uniform(0, math.log(1e5), (3000, 2))).astype(int) + 1
    for budget in SOFT_TOKEN_BUDGETS:
        for h, w in sizes:
            want = get_aspect_ratio_preserving_size(int(h), int(w), 16, budget * 9, 3)
            assert target_size(int(h), int(w), budget) == want, (h, w, budget)


def test_soft_tokens_of_a_4_by_3_photo():
    """The prompt length an image costs: a 4:3 photo (4032x3024) resized to 432x336 ... 1824x1344."""
    sizes = [target_size(3024, 4032, budget) for budget in SOFT_TOKEN_BUDGETS]
    assert [h * w // (16 * 16 * 9) for h, w in sizes] == [63, 130, 266, 540, 1064]
    assert preprocess(Image.new("RGB", (4032, 3024)), 280).soft_tokens == 266


def picture(mode, seed=2):
    """A 53x37 noise image in `mode`; palettes of 16 colours whose entry 0, black, is the transparent one."""
    if mode == "P":
        image = Image.frombytes("P", (53, 37), (noise(37, 53, 1, seed) % 16).tobytes())
        image.putpalette([0, 0, 0, *noise(15, 3, seed=seed).ravel()])
        return image
    channels = {"RGBA": 4, "LA": 2, "CMYK": 4, "L": 1, "1": 1}.get(mode, 3)
    pixels = noise(37, 53, channels, seed)
    if mode in ("RGBA", "LA"):
        pixels[..., -1] = np.where(pixels[..., -1] < 128, 0, pixels[..., -1])  # fully transparent areas too
    return Image.fromarray(pixels).convert(mode)


@pytest.mark.parametrize(
    "mode,fmt",
    [("RGBA", "png"), ("LA", "png"), ("P", "png"), ("P", "gif"), ("L", "png"), ("1", "png"), ("CMYK", "jpeg")],
)
def test_modes_convert_as_transformers(tmp_path, mode, fmt):
    """Alpha composited onto white, palettes with a transparent entry, CMYK, grayscale and 1-bit converted
    as transformers' convert_to_rgb does."""
    path = tmp_path / f"x.{fmt}"
    picture(mode).save(path, **({"transparency": 0} if mode == "P" else {}))
    assert Image.open(path).mode == mode
    ours = preprocess(path, 70)
    assert_same(ours, Image.open(path), 70)
    if mode in ("RGBA", "P"):  # it did composite: with alpha dropped, transparent pixels show their colour
        dropped = Image.fromarray(np.asarray(Image.open(path).convert("RGB")))  # without the transparency key
        dropped = Gemma4ImageProcessorPil(max_soft_tokens=70)(dropped, return_tensors="np")
        assert not np.array_equal(ours.pixel_values, dropped["pixel_values"][0])


def test_16_bit_grayscale_keeps_its_picture(tmp_path):
    """transformers' convert("RGB") clips 16-bit samples to 255 (white); we take the high byte, the picture."""
    samples = noise(40, 30, 1, seed=3).astype(np.uint16) * 255 + 256  # all above 255
    Image.fromarray(samples).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    ours = preprocess(tmp_path / "g16.png", 70)
    assert_same(ours, Image.fromarray((samples >> 8).astype(np.uint8)), 70)
    clipped = Gemma4ImageProcessorPil(max_soft_tokens=70)(Image.open(tmp_path / "g16.png"), return_tensors="np")
    assert (clipped["pixel_values"][0][: math.prod(ours.grid)] == 1).all()  # what transformers sees: white


def test_exif_orientation_is_applied_as_transformers_load_image(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: rotate 90 degrees clockwise to view
    Image.fromarray(noise(30, 80)).save(tmp_path / "phone.jpg", exif=exif)
    assert load_image(tmp_path / "phone.jpg").size == (30, 80)
    assert_same(preprocess(tmp_path / "phone.jpg", 140), hf_load_image(str(tmp_path / "phone.jpg")), 140)


def test_sources_path_bytes_and_pil_agree(tmp_path):
    path = tmp_path / "x.png"
    Image.fromarray(noise(20, 30)).save(path)
    a, b, c = (preprocess(s, 70).pixel_values for s in (str(path), path.read_bytes(), Image.open(path)))
    assert np.array_equal(a, b) and np.array_equal(a, c)


def test_mpo_gives_its_primary_picture(tmp_path):
    frames = [Image.fromarray(noise(24, 32, seed=s)) for s in (4, 5)]
    frames[0].save(tmp_path / "camera.mpo", format="MPO", save_all=True, append_images=frames[1:])
    assert Image.open(tmp_path / "camera.mpo").n_frames == 2
    first = np.asarray(Image.open(tmp_path / "camera.mpo").convert("RGB"))
    assert np.array_equal(np.asarray(load_image(tmp_path / "camera.mpo")), first)


def one_line_error(src, match, **kw):
    with pytest.raises(ImageError, match=match) as e:
        load_image(src, **kw)
    assert "\n" not in str(e.value), str(e.value)


def test_bad_files_are_one_line_errors(tmp_path):
    (tmp_path / "notes.txt").write_text("not a picture\n")
    one_line_error(tmp_path / "notes.txt", r"^image .*notes.txt: not an image")
    Image.fromarray(noise(64, 64)).save(tmp_path / "x.jpg")
    one_line_error(
        (tmp_path / "x.jpg").read_bytes()[:1500], r"^image 2: truncated or corrupt .*truncated", what="image 2"
    )
    Image.fromarray(noise(64, 64)).save(tmp_path / "x.png")
    one_line_error((tmp_path / "x.png").read_bytes()[:3000], r"^image: truncated or corrupt")
    one_line_error(tmp_path / "missing.png", r"missing.png: No such file or directory$")
    one_line_error(tmp_path, r": Is a directory$")
    one_line_error(42, r"^image: expected a path, bytes or a PIL image, not int$")
    one_line_error(Image.new("RGB", (0, 5)), r"^image: empty \(0x5 pixels\)$")
    one_line_error(Image.fromarray(np.zeros((4, 4), np.int32)), r"mode I \(32-bit pixels\) has no known range")


def test_animations_are_refused(tmp_path):
    frames = [Image.fromarray(noise(8, 8, seed=s)) for s in range(3)]
    for name in ("a.gif", "a.png", "a.webp"):
        frames[0].save(tmp_path / name, save_all=True, append_images=frames[1:])
        one_line_error(tmp_path / name, rf"{name}: 3 frames .*pass a single frame$")
    one_line_error(Image.open(tmp_path / "a.gif"), r"^image: 3 frames")
    frames[0].save(tmp_path / "still.gif")
    assert load_image(tmp_path / "still.gif").size == (8, 8)


def test_pillows_bomb_limit_is_not_the_one_that_answers(tmp_path, monkeypatch):
    """Our max_pixels decides, from the header: Pillow's global MAX_IMAGE_PIXELS is neither consulted nor needed."""
    Image.fromarray(noise(50, 50)).save(tmp_path / "bomb.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow would refuse past twice this
    assert load_image(tmp_path / "bomb.png").size == (50, 50)
    one_line_error(tmp_path / "bomb.png", r"bomb.png: 50x50 pixels, more than the limit of 2499$", max_pixels=2499)


def test_unsupported_budget():
    with pytest.raises(ValueError, match="max_soft_tokens must be one of 70, 140, 280, 560, 1120, not 256"):
        preprocess(Image.new("RGB", (8, 8)), 256)


WITHOUT_PILLOW = r"""
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("PIL", "torch", "transformers"):
            raise ImportError(f"{name} is walled off")
sys.meta_path.insert(0, Block())
import gemma_ane.runtime.images as images
try:
    images.load_image(b"")
except images.ImageError as e:
    print(e)
"""


def test_without_pillow_import_works_and_use_says_what_to_install():
    r = subprocess.run([sys.executable, "-c", WITHOUT_PILLOW], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == "image input needs Pillow: pip install 'gemma-ane[vision]'\n"


EPS = b"""%!PS-Adobe-3.0 EPSF-3.0
%%BoundingBox: 0 0 64 64
%%EndComments
newpath 0 0 moveto 64 64 lineto stroke
showpage
%%EOF
"""


def test_eps_is_refused_before_pillow_or_ghostscript_sees_it(tmp_path, monkeypatch):
    """Pillow's EPS plugin runs Ghostscript on the file: the bytes are refused by their magic number, and neither
    the plugin nor any program is reached (each records its call here instead of running)."""
    from PIL import EpsImagePlugin

    reached = []
    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", lambda self: reached.append("EpsImagePlugin"))
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *a, **k: reached.append("Ghostscript"))
    monkeypatch.setattr(subprocess, "check_call", lambda *a, **k: reached.append(("check_call", a)))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: reached.append(("Popen", a)))
    (tmp_path / "x.eps").write_bytes(EPS)
    refused = r"PostScript \(EPS\) is not an accepted image format \(PNG, JPEG, WebP, GIF, BMP or TIFF\)$"
    one_line_error(tmp_path / "x.eps", rf"^image .*x.eps: {refused}")
    one_line_error(EPS, rf"^messages\[0\].content\[1\]: {refused}", what="messages[0].content[1]")
    binary = b"\xc5\xd0\xd3\xc6" + (30).to_bytes(4, "little") + len(EPS).to_bytes(4, "little") + bytes(18) + EPS
    one_line_error(binary, rf"^image: {refused}")
    assert reached == []


def test_only_the_accepted_formats_are_read(tmp_path):
    """Formats Pillow reads but the model does not need are refused from their first bytes, named when known."""
    picture = Image.fromarray(noise(16, 16))
    for name, found in [
        ("x.ico", "ICO"),
        ("x.ppm", r"Netpbm \(PPM/PGM/PBM\)"),
        ("x.pdf", "PDF"),
        ("x.jp2", "JPEG 2000"),
        ("x.tga", None),
        ("x.pcx", None),
    ]:
        try:
            picture.save(tmp_path / name)
        except OSError:  # this Pillow was built without the writer (JPEG 2000's openjpeg)
            continue
        want = f"{found} is not an accepted image format" if found else "not an image in an accepted format"
        one_line_error(tmp_path / name, rf"{name}: {want} \(PNG, JPEG, WebP, GIF, BMP or TIFF\)$")
    for fmt in ("png", "jpeg", "webp", "gif", "bmp", "tiff"):  # each accepted one still reads
        picture.save(tmp_path / f"ok.{fmt}")
        assert load_image(tmp_path / f"ok.{fmt}").size == (16, 16)


def png_header(width: int, height: int) -> bytes:
    """A PNG's signature and IHDR claiming width x height (8-bit RGB), and a few bytes of IDAT: what a 685 KB
    file of 13000 x 13000 pixels starts with, without its data."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(1000)))


@pytest.mark.parametrize("side", [13000, 20000])  # past Pillow's bomb warning (89 MP), and its refusal (179 MP)
def test_the_pixel_limit_answers_from_the_header(side):
    """The size comes from the header and is refused before any pixel is decoded (the data here is cut short:
    a decode would fail differently), by our limit, not by Pillow's decompression-bomb warning or error."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one_line_error(png_header(side, side), rf"^image: {side}x{side} pixels, more than the limit of 40000000$")
        one_line_error(png_header(side, side), r"more than the limit of 10$", max_pixels=10)
        with pytest.raises(ImageError, match=r"^image: 200x200 pixels, more than the limit of 1000$"):
            preprocess(png_header(200, 200), 70, max_pixels=1000)


def test_the_pixel_limit_is_the_callers(tmp_path):
    Image.fromarray(noise(20, 30)).save(tmp_path / "x.png")
    assert load_image(tmp_path / "x.png", max_pixels=600).size == (30, 20)  # at the limit: taken
    one_line_error(tmp_path / "x.png", r"x.png: 30x20 pixels, more than the limit of 599$", max_pixels=599)
    lazy = Image.open(tmp_path / "x.png")  # a caller's PIL image, not decoded yet: checked before it is
    one_line_error(lazy, r"^image: 30x20 pixels, more than the limit of 599$", max_pixels=599)
    assert lazy.tile  # Pillow clears its tiles once it has decoded them
