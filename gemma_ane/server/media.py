"""Media parts of a request: images (data: URLs, or fetched ones: gemma_ane.server.fetch) and audio clips, each
decoded and bounded (bytes, pixels, seconds, count) before the request queues; the body-size allowance they take."""

from __future__ import annotations

import dataclasses
import io
import sys

from ..errors import InputError
from ..runtime.audio import AudioError, input_audio_bytes, load_audio, probe_audio
from ..runtime.images import MAX_PIXELS, ImageError, data_url_bytes, open_image
from . import fetch
from .errors import APIError

TEXT_BODY = 1_000_000  # bytes: a request body without images


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """What the images of one request may be; each is checked before the request queues."""

    max_image_bytes: int = 10_000_000  # an image's file, decoded from base64
    max_image_pixels: int = MAX_PIXELS  # width * height, from the file's header
    max_images: int = 4  # in one request: with the bytes, bounds the body a vision bundle admits (~54 MB)
    # fetch http(s) image URLs (serve --allow-remote-images). Off by default: the server then fetches nothing for a
    # client. On, only public addresses are fetched (see gemma_ane.server.fetch)...
    remote_images: bool = False
    # ...and these hosts and networks (serve --allow-fetch-from): addresses, CIDR networks or host names
    allow_fetch_from: tuple[str, ...] = ()

    def __post_init__(self):
        for name, low in (("max_image_bytes", 1), ("max_image_pixels", 1), ("max_images", 0)):
            if getattr(self, name) < low:
                raise InputError(f"{name}={getattr(self, name)}: must be >= {low}")
        fetch.Allowlist(self.allow_fetch_from)  # a bad entry is refused before a bundle loads

    def max_body(self, model) -> int:
        """The default body limit: text, plus max_images files as base64 when the model takes images, plus
        MAX_AUDIOS clips' (audio_limit) when it takes audio."""
        images = 0 if model.images is None else self.max_images * 4 * -(-self.max_image_bytes // 3)
        return TEXT_BODY + images + MAX_AUDIOS * 4 * -(-audio_limit(model) // 3)


def check_images(messages: list[dict], model, limits: ImageLimits, fetched: dict) -> None:
    """Replaces each image_url part by {"type": "image", "image": the file's bytes}, as the runtime takes it, once
    the request is within every limit: the model takes images, their count, then each file's size and pixels."""
    found = [
        (m["content"], j, f"messages[{i}].content[{j}]")
        for i, m in enumerate(messages)
        if isinstance(m["content"], list)
        for j, p in enumerate(m["content"])
        if p["type"] == "image_url"
    ]
    if not found:
        return
    if model.images is None:
        where = found[0][2]
        raise APIError(400, f"{where}: this model takes no images (its bundle has no vision model)", param=where)
    if len(found) > limits.max_images:
        message = f"messages: {len(found)} images, more than the {limits.max_images} a request may hold"
        raise APIError(400, message, param="messages")
    for i, m in enumerate(messages):
        parts = m["content"] if isinstance(m["content"], list) else []
        image = next((j for j, p in enumerate(parts) if p["type"] == "image_url"), None)
        why = media_not_here(messages, i) if image is not None else None
        if why:
            where = f"messages[{i}].content[{image}]"
            raise APIError(400, f"{where}: {why}; send images in user messages", param=where)
    for content, j, where in found:
        url = content[j]["image_url"]
        content[j] = {"type": "image", "image": _image_file(url, f"{where}.image_url", limits, fetched)}


def media_not_here(messages: list[dict], i: int, media: str = "images") -> str | None:
    """Why the chat template would drop the `media` of messages[i] (their placeholders never rendered), or None."""
    role = messages[i]["role"]
    if role == "system" and i == 0:
        return f"a leading system message cannot hold {media} (the template renders only its text)"
    if role == "tool":
        k = i
        while k > 0 and messages[k - 1]["role"] == "tool":
            k -= 1
        if k == 0 or not messages[k - 1].get("tool_calls"):
            return f"a tool message that answers no assistant tool_calls cannot hold {media} (the template drops it)"
    if role not in ("user", "assistant", "system", "tool"):
        return f"a {role!r} message cannot hold {media}"
    return None


# Audio parts (OpenAI's input_audio). A clip's file is at most audio_limit bytes: the bundle's longest clip (its
# largest bucket) as 48 kHz stereo 32-bit PCM, the largest common uncompressed recording, plus a header's room;
# a compressed file of that length is smaller. MAX_AUDIOS clips a request, as max_images images.
MAX_AUDIOS = 4
AUDIO_BYTES_PER_SECOND = 48_000 * 2 * 4
AUDIO_HEADER = 65_536


def audio_limit(model) -> int:
    """The largest audio file a request may send this model, in bytes: 0 when it has no audio model."""
    encoder = model.audio
    return 0 if encoder is None else int(encoder.max_seconds * AUDIO_BYTES_PER_SECOND) + AUDIO_HEADER


def check_audios(messages: list[dict], model) -> int:
    """Checks each input_audio part, once the request is within every limit: the model hears, the clips' count,
    where they stand, then each file's format field against its first bytes, base64, size, and its header (a
    container and encoding read, the rate, the channels, no longer than the largest bucket), without decoding a
    sample. Each part becomes {"type": "audio", "audio": the file's bytes}, for decode_audios once the request is
    known to fit the context and the queue. Returns the tokens the clips add to the prompt, as their headers state
    them: each clip's soft tokens and its begin and end tokens, in place of its one placeholder."""
    found = [
        (m["content"], i, j, f"messages[{i}].content[{j}]")
        for i, m in enumerate(messages)
        if isinstance(m["content"], list)
        for j, p in enumerate(m["content"])
        if p["type"] == "input_audio"
    ]
    if not found:
        return 0
    encoder = model.audio
    if encoder is None:
        where = found[0][3]
        raise APIError(400, f"{where}: this bundle has no audio model (converted without one)", param=where)
    if len(found) > MAX_AUDIOS:
        message = f"messages: {len(found)} audio clips, more than the {MAX_AUDIOS} a request may hold"
        raise APIError(400, message, param="messages")
    for _, i, _, where in found:
        why = media_not_here(messages, i, "audio")
        if why:
            raise APIError(400, f"{where}: {why}; send audio in user messages", param=where)
    limit, tokens = audio_limit(model), 0
    for content, _, j, where in found:
        try:
            data = input_audio_bytes(content[j].get("input_audio"), f"{where}.input_audio")
            if len(data) > limit:
                message = f"{where}: the audio file is {len(data)} bytes, more than the limit of {limit}"
                raise APIError(413, message, param=where, code="audio_too_large")
            tokens += probe_audio(data, where, encoder.max_seconds).soft_tokens + 1
        except AudioError as e:
            raise APIError(400, str(e), param=where) from None
        content[j] = {"type": "audio", "audio": data}
    return tokens


def decode_audios(prepared, model):
    """Decodes each clip check_audios passed (bounded: runtime.audio) into float32 samples at 16 kHz, once, into a
    prepared request's media (Model.prepare's `sources`; every choice of it shares them), so the worker gets the
    samples as they are (the runtime's cache is keyed by their full hash). A clip whose data fails past its header
    is a 400 naming its part."""

    def samples(where: str, source):
        if not isinstance(source, bytes):
            return source
        try:
            return load_audio(source, where, model.audio.max_seconds)
        except AudioError as e:
            raise APIError(400, str(e), param=where) from None

    sources = [(kind, where, samples(where, s) if kind == "audio" else s) for kind, where, s in prepared.sources]
    return dataclasses.replace(prepared, sources=sources)


def remote_urls(body: dict, model, limits: ImageLimits) -> list[str]:
    """The http(s) image URLs of a chat request to fetch before it is checked: none unless remote images are on,
    the model takes images and the request holds no more than max_images (it is refused otherwise)."""
    messages = body.get("messages")
    if not limits.remote_images or model.images is None or not isinstance(messages, list):
        return []
    urls, images = [], 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "image_url":
                images += 1
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if isinstance(url, str) and url.startswith(("http://", "https://")):
                    urls.append(url)
    return urls if images <= limits.max_images else []


def _image_file(url, where: str, limits: ImageLimits, fetched: dict) -> bytes:
    """The file a data: URL holds, or with remote_images the one an http(s) URL served (`fetched`: by URL, None
    for a failed fetch), within the limits; a remote URL is otherwise refused (never fetched)."""
    url = url["url"] if isinstance(url, dict) else url
    try:
        if limits.remote_images and url.startswith(("http://", "https://")):
            data = fetched.get(url)
            if data is None:
                raise ImageError(f"{where}: {fetch.failure(url)}")
        else:
            data = data_url_bytes(url, where)
        if len(data) > limits.max_image_bytes:
            message = f"{where}: the image is {len(data)} bytes, more than the limit of {limits.max_image_bytes}"
            raise APIError(413, message, param=where, code="image_too_large")
        width, height = _image_size(data, where)
    except ImageError as e:
        raise APIError(400, str(e), param=where) from None
    if width * height > limits.max_image_pixels:
        message = f"{where}: {width}x{height} pixels, more than the limit of {limits.max_image_pixels}"
        raise APIError(413, message, param=where, code="image_too_large")
    return data


def _image_size(data: bytes, where: str) -> tuple[int, int]:
    """(width, height) from the file's header, in an accepted format (images.open_image: decided from the magic
    number, so no other Pillow plugin sees the bytes; no pixel decoded: the runtime does that, once). The pixel
    limit is checked by the caller, which answers 413 rather than the runtime's 400."""
    try:
        with open_image(io.BytesIO(data), where, max_pixels=sys.maxsize) as img:
            return img.size
    except ImageError:
        raise
    except Exception as e:  # a header cut short or damaged: SyntaxError, OSError, struct.error...
        detail = " ".join(str(e).split())
        raise ImageError(f"{where}: truncated or corrupt header ({type(e).__name__}: {detail})") from None
