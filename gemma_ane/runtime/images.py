"""Image input on the host: decoding (Pillow) and Gemma 4's preprocessing (numpy), equal to transformers'
`Gemma4ImageProcessorPil` bit for bit; every bad input is a one-line ImageError.

Runtime side: numpy and Pillow only, Pillow imported on first use (the `vision` extra). A second modality
(audio) gets a module of the same shape beside this one: `load_*` turns a source into a decoded signal or a
one-line error, `preprocess` into the encoder's fixed-shape inputs and the number of soft tokens its
placeholder expands to in the prompt.

What `load_image` does with awkward input (as transformers, unless said otherwise):
- alpha (RGBA, LA, PA, or a transparent colour in the file): composited onto white, as the processor's
  `convert_to_rgb`. (transformers' `load_image`, which chat templates use for paths, drops alpha instead.)
- CMYK, palette, 1-bit, grayscale, YCbCr: Pillow's `convert("RGB")`, without ICC colour management.
- 16-bit grayscale (Pillow's I;16 modes): the high byte of each sample, the picture it shows. transformers
  hands it to `convert("RGB")`, which clips every sample above 255 to white. 16-bit RGB(A) files Pillow
  itself reads as their high bytes, so there both agree.
- 32-bit integer or float pixels (modes I, F): refused, their range is unknown.
- EXIF orientation: applied, so a phone photo comes out upright (as transformers' `load_image`).
- several frames: an animation (GIF, PNG, WebP) or a multi-page TIFF is refused, the caller picks a frame;
  an MPO (the JPEG of many phones and cameras, with depth or stereo frames) gives its primary picture.
- extreme aspect ratios: no limit. As in transformers, a short side that would round to nothing becomes
  one pooling cell (48 px) and the long side at most `max_soft_tokens` cells: a 1x20000 strip is resized to
  48x13440 at 280 (squeezed, never refused).
- formats: PNG, JPEG (and MPO), WebP, GIF, BMP and TIFF, told apart by their magic numbers before Pillow sees
  the bytes, and each read by its own Pillow plugin only. Anything else is refused, naming the format when it
  is a known one (EPS, PDF, PSD, HEIF...): Pillow's EPS plugin runs Ghostscript on the file, and a vision
  model needs none of the rest. A PIL image passed in is the caller's own choice of plugin.
- size: more than `max_pixels` (width x height, default MAX_PIXELS) is refused from the file's header, before
  any pixel is decoded; the caller sets the limit (serve --max-image-pixels, generate/verify's flag of that
  name, `load(max_image_pixels=)`). Pillow's own decompression-bomb check is never reached.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import math
import os
from dataclasses import dataclass

import numpy as np

from ..errors import InputError

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # transformers' _SUPPORTED_SOFT_TOKENS; E2B's default is 280
MAX_PIXELS = 40_000_000  # width * height: a 40 MP photo decodes to 120 MB of RGB; the server's default too

# The accepted formats by their magic numbers, as Pillow's plugins name them (MPO is a JPEG to its plugin)
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"II+\x00", "TIFF"),  # BigTIFF
    (b"MM\x00+", "TIFF"),
)
ACCEPTED = "PNG, JPEG, WebP, GIF, BMP or TIFF"
# Refused formats named in the error, so that a caller knows what was sent (the rest is "not an image")
_REFUSED = (
    (b"%!PS", "PostScript (EPS)"),
    (b"\xc5\xd0\xd3\xc6", "PostScript (EPS)"),  # DOS EPS binary header
    (b"%PDF", "PDF"),
    (b"8BPS", "Photoshop (PSD)"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"qoif", "QOI"),
    (b"icns", "ICNS"),
    (b"DDS ", "DDS"),
    (b"v/1\x01", "OpenEXR"),
    (b"<svg", "SVG"),
)


class ImageError(InputError):
    """An image that cannot be used; the message names the image and the problem, on one line."""


def pil():
    try:
        from PIL import Image, ImageOps
    except ImportError:
        raise ImageError("image input needs Pillow: pip install 'gemma-ane[vision]'") from None
    return Image, ImageOps


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def image_format(head: bytes, name: str = "image") -> str:
    """The accepted format (Pillow's name) whose magic number `head` (a file's first 16 bytes) starts with, or a
    one-line ImageError naming the format found."""
    for magic, fmt in _MAGIC:
        if head.startswith(magic):
            return fmt
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    found = next((what for magic, what in _REFUSED if head.startswith(magic)), None)
    if found is None and head[4:8] == b"ftyp":
        found = "HEIF/AVIF (or another ISO media file)"
    if found is None and head[:1] == b"P" and head[1:2] in b"1234567" and head[2:3].isspace():
        found = "Netpbm (PPM/PGM/PBM)"
    if found is None:
        raise ImageError(f"{name}: not an image in an accepted format ({ACCEPTED})")
    raise ImageError(f"{name}: {found} is not an accepted image format ({ACCEPTED})")


def open_image(fp, name: str = "image", max_pixels: int = MAX_PIXELS):
    """The file `fp` (a binary stream at its start) opened lazily as a PIL image, no pixel decoded yet: its format
    from its magic number, its size within max_pixels from its header."""
    Image, _ = pil()
    fmt = image_format(fp.read(16), name)
    fp.seek(0)
    Image.init()
    if fmt not in Image.OPEN:
        raise ImageError(f"{name}: this Pillow cannot read {fmt} (built without it)")
    # Image.open(fp, formats=[fmt]) minus its decompression-bomb check, which would warn (over 89 MP) or refuse
    # (over 179 MP) before our own limit, the caller's, could answer
    img = Image.OPEN[fmt][0](fp, None)
    _check_pixels(img, name, max_pixels)
    return img


def _check_pixels(img, name: str, max_pixels: int) -> None:
    if img.width * img.height > max_pixels:
        raise ImageError(f"{name}: {img.width}x{img.height} pixels, more than the limit of {max_pixels}")


def load_image(src, what: str = "image", max_pixels: int = MAX_PIXELS):
    """`src` (a path, a file's bytes, or a PIL image) as an upright RGB PIL image; the module doc says how.
    Errors name `what`, and the path when there is one."""
    Image, ImageOps = pil()
    is_path = isinstance(src, (str, os.PathLike))
    name = f"{what} {os.fspath(src)}" if is_path else what
    if not (is_path or isinstance(src, (bytes, bytearray, memoryview, Image.Image))):
        raise ImageError(f"{name}: expected a path, bytes or a PIL image, not {type(src).__name__}")
    try:
        if isinstance(src, Image.Image):
            _check_pixels(src, name, max_pixels)  # one from Image.open may still be undecoded
            img, fp = src, contextlib.nullcontext()
        else:
            fp = open(src, "rb") if is_path else io.BytesIO(src)
        with fp:  # the file stays open until its pixels are in: Pillow reads it lazily
            if not isinstance(src, Image.Image):
                img = open_image(fp, name, max_pixels)
            frames = getattr(img, "n_frames", 1)
            if frames > 1 and img.format != "MPO":
                raise ImageError(f"{name}: {frames} frames (an animation or a multi-page file); pass a single frame")
            img.load()  # Pillow decodes lazily: a truncated or corrupt file fails here, inside this try
        img = ImageOps.exif_transpose(img)
    except ImageError:
        raise
    except Image.DecompressionBombError as e:  # a frame or tile past Pillow's limit, met while decoding
        raise ImageError(f"{name}: {_one_line(e)}") from None
    except OSError as e:
        if e.strerror:  # the file system's answer: no such file, a directory, no permission
            raise ImageError(f"{name}: {e.strerror}") from None
        raise ImageError(f"{name}: truncated or corrupt ({_one_line(e)})") from None
    except Exception as e:  # corrupt data also surfaces as SyntaxError, ValueError, EOFError, struct.error
        raise ImageError(f"{name}: corrupt ({type(e).__name__}: {_one_line(e)})") from None
    if 0 in img.size:
        raise ImageError(f"{name}: empty ({img.width}x{img.height} pixels)")
    return _to_rgb(img, name, Image)


def _to_rgb(img, name: str, Image):
    if img.mode.startswith("I;16"):
        img = Image.fromarray((np.asarray(img) >> 8).astype(np.uint8))  # convert() would clip to 255
    elif img.mode in ("I", "F"):
        raise ImageError(f"{name}: mode {img.mode} (32-bit pixels) has no known range; save it as 8 or 16 bits")
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        # transformers' convert_to_rgb: composite onto white, not drop the alpha (transparent black shows black)
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, img.convert("RGBA")).convert("RGB")
    return img.convert("RGB")


def data_url_bytes(url, what: str = "image_url") -> bytes:
    """The bytes of a `data:` URL (base64), as OpenAI clients send images. Remote URLs are refused: the runtime
    never fetches anything on a caller's behalf."""
    if not isinstance(url, str):
        raise ImageError(f"{what}: expected a URL string, not {type(url).__name__}")
    if url.startswith(("http://", "https://")):
        raise ImageError(f"{what}: remote image URLs are not fetched; send the image as a data: URL (base64)")
    head, comma, data = url.partition(",")
    if not url.startswith("data:") or not comma:
        raise ImageError(f"{what}: expected a data: URL (data:image/png;base64,...), got {url[:40]!r}")
    if not head.endswith(";base64"):
        raise ImageError(f"{what}: the data: URL must be base64-encoded ({head[:40]!r} says otherwise)")
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as e:
        raise ImageError(f"{what}: the data: URL is not valid base64 ({_one_line(e)})") from None


@dataclass(frozen=True)
class Patches:
    """One image as the vision encoder takes it, padded to a fixed patch count so that one compiled model
    serves every aspect ratio (max_patches = max_soft_tokens * pooling_kernel_size**2).

    pixel_values: float32 (max_patches, 3 * patch_size**2): a patch per row, its pixels in (row, column,
        channel) order, in [0, 1] (the encoder maps them to [-1, 1] itself); padding rows are 0.
    positions: int32 (max_patches, 2): a patch's (x, y) = (column, row) in the patch grid; padding rows are
        (-1, -1), which is how the encoder tells padding apart. Real patches come first, row by row.
    grid: (rows, columns) of real patches, each a multiple of pooling_kernel_size.
    soft_tokens: rows * columns / pooling_kernel_size**2, the encoder's output count for this image: the
        prompt holds that many image placeholders, between begin- and end-of-image tokens.
    """

    pixel_values: np.ndarray
    positions: np.ndarray
    grid: tuple[int, int]
    soft_tokens: int


def target_size(height: int, width: int, max_soft_tokens: int, patch_size: int = 16, pooling_kernel_size: int = 3):
    """The (height, width) transformers resizes an image to: the largest multiples of a pooling cell
    (pooling_kernel_size * patch_size pixels) that keep the aspect ratio within the budget's patches. A side
    that would round to 0 becomes one cell, the other floor(ratio) cells, at most max_soft_tokens.
    Same float arithmetic as transformers' get_aspect_ratio_preserving_size, so the same rounding."""
    cell = pooling_kernel_size * patch_size
    factor = math.sqrt(max_soft_tokens * pooling_kernel_size**2 * patch_size**2 / (height * width))
    h = int(math.floor(factor * height / cell)) * cell
    w = int(math.floor(factor * width / cell)) * cell
    if h == 0:  # both cannot be 0: the budget is far more than one cell's area
        return cell, min(int(math.floor(width / height)), max_soft_tokens) * cell
    if w == 0:
        return min(int(math.floor(height / width)), max_soft_tokens) * cell, cell
    return h, w


def preprocess(
    image,
    max_soft_tokens: int = 280,
    patch_size: int = 16,
    pooling_kernel_size: int = 3,
    what="image",
    max_pixels: int = MAX_PIXELS,
):
    """`image` (anything load_image takes, within max_pixels) resized, scaled and cut into patches as
    transformers' Gemma 4 image processor does it: Pillow's bicubic resize of the 8-bit RGB image (its PIL
    backend's filter), then x / 255 in float64 rounded to float32, with no normalisation."""
    if max_soft_tokens not in SOFT_TOKEN_BUDGETS:
        raise ValueError(
            f"max_soft_tokens must be one of {', '.join(map(str, SOFT_TOKEN_BUDGETS))}, not {max_soft_tokens}"
        )
    Image, _ = pil()
    img = load_image(image, what, max_pixels)
    h, w = target_size(img.height, img.width, max_soft_tokens, patch_size, pooling_kernel_size)
    pixels = np.asarray(img.resize((w, h), Image.Resampling.BICUBIC))  # Pillow returns a copy when sizes match
    pixels = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
    rows, cols, p = h // patch_size, w // patch_size, patch_size
    patches = pixels.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, p * p * 3)
    y, x = np.divmod(np.arange(rows * cols, dtype=np.int32), cols)
    max_patches = max_soft_tokens * pooling_kernel_size**2
    pixel_values = np.zeros((max_patches, p * p * 3), np.float32)
    positions = np.full((max_patches, 2), -1, np.int32)
    pixel_values[: rows * cols], positions[: rows * cols] = patches, np.stack([x, y], axis=1)
    return Patches(pixel_values, positions, (rows, cols), rows * cols // pooling_kernel_size**2)
