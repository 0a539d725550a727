"""expand_media with two encoders side by side: the host's prompt expansion takes any encoder that meets
encoder.MediaEncoder, each with its own placeholder, begin and end ids (the image encoder's run: test_image_prompts)."""

import numpy as np
import pytest

from gemma_ane.runtime.audio import AudioError
from gemma_ane.runtime.encoder import SoftTokens, expand_media, media_sources
from gemma_ane.runtime.engine import ContextOverflow
from gemma_ane.runtime.images import ImageError


class Stub:
    """An encoder whose source is the number of soft tokens it makes; keys start at `base`, rows hold the key."""

    def __init__(self, kind: str, token_ids: tuple[int, int, int], base: int):
        self.kind, self.token_ids, self.base, self.encoded = kind, token_ids, base, []

    def prepare(self, source, what):
        return source

    def soft_tokens(self, prepared) -> int:
        return prepared

    def encode(self, source, what, prepared=None) -> SoftTokens:
        self.encoded.append(what)
        keys = [self.base - 100 * len(self.encoded) - j for j in range(source)]
        return SoftTokens(keys, np.array([[k] for k in keys], np.float32))


IMAGE, AUDIO = (10, 11, 12), (20, 21, 22)


def encoders():
    return {"image": Stub("image", IMAGE, -1000), "audio": Stub("audio", AUDIO, -5000)}


def test_two_kinds_of_media_expand_in_prompt_order():
    enc = encoders()
    ids = [2, 11, 5, 21, 6, 11, 7]  # an image, a clip, another image
    sources = [("image", "m[0]", 2), ("audio", "m[1]", 3), ("image", "m[2]", 1)]
    out, marks, soft = expand_media(ids, [2, 4, 6], enc, sources, context=64)
    first, clip, second = [-1100, -1101], [-5100, -5101, -5102], [-1200]
    assert out == [2, 10, *first, 12, 5, 20, *clip, 22, 6, 10, *second, 12, 7]
    assert [out[m] for m in marks] == [5, 6, 7]  # marks move with the text they point at
    assert soft == {k: np.float32(k) for k in first + clip + second} and enc["image"].encoded == ["m[0]", "m[2]"]


def test_each_kind_counts_its_own_placeholders_and_the_context_is_checked_first():
    enc = encoders()
    with pytest.raises(AudioError, match=r"1 audio placeholder\(s\) for 0 audio\(s\)"):
        expand_media([2, 11, 21], [], enc, [("image", "m[0]", 1)], context=64)
    with pytest.raises(ContextOverflow, match="prompt of 13 tokens"):
        expand_media([2, 11, 21], [], enc, [("image", "m[0]", 4), ("audio", "m[1]", 4)], context=12)
    assert enc["image"].encoded == enc["audio"].encoded == []  # refused before anything is encoded
    with pytest.raises(ImageError, match=r"m\[0\]: this bundle has no vision model"):
        expand_media([2, 11], [], {"audio": enc["audio"]}, [("image", "m[0]", 1)], context=64)


def test_media_sources_name_each_part():
    messages = [
        {"role": "system", "content": "text only"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "image": "p.png"}]},
    ]
    assert media_sources(messages) == [("image", "messages[1].content[1]", "p.png")]
    with pytest.raises(ImageError, match=r"messages\[0\].content\[0\]: video input is not supported"):
        media_sources([{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]}])


def test_media_sources_read_audio_parts():
    """Both audio part types are of type "audio": the template's `audio` (a path, bytes or samples) and OpenAI's
    `input_audio` (base64 with a format), decoded to bytes here; a malformed one is refused naming its part."""
    content = [
        {"type": "audio", "audio": "a.wav"},
        {"type": "input_audio", "input_audio": {"data": "UklGRgAAAABXQVZF", "format": "wav"}},  # a WAV's first bytes
    ]
    assert media_sources([{"role": "user", "content": content}]) == [
        ("audio", "messages[0].content[0]", "a.wav"),
        ("audio", "messages[0].content[1]", b"RIFF\0\0\0\0WAVE"),
    ]
    bad = {
        "needs 'audio'": {"type": "audio"},
        r"content\[0\].input_audio.format: 'aiff' is not one of": {
            "type": "input_audio",
            "input_audio": {"data": "UklGRg==", "format": "aiff"},
        },
        r"content\[0\].input_audio.format: 'wav', but the data is FLAC": {
            "type": "input_audio",
            "input_audio": {"data": "ZkxhQw==", "format": "wav"},
        },
        r"content\[0\].input_audio.data: not valid base64": {
            "type": "input_audio",
            "input_audio": {"data": "%%%", "format": "wav"},
        },
    }
    for needle, part in bad.items():
        with pytest.raises(AudioError, match=needle):
            media_sources([{"role": "user", "content": [part]}])
