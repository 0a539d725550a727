"""The audio model's place in a bundle, without converting it: model_config.json's `audio` entry (the same rules on
write and read), the converter's options and its component (which checkpoints get an audio model, its buckets and
token ids), and the tiny audio preset's tokenizer (audio tokens, while every other preset's stays byte for byte)."""

import copy
import json

import pytest

from gemma_ane.bundle import BundleError
from gemma_ane.bundle.schema import AUDIO_FIELDS, AudioConfig, audio_function, check_model_config
from gemma_ane.convert import ConvertOptions
from gemma_ane.convert.audio import AudioComponent, buckets, token_ids
from gemma_ane.convert.models.audio import AudioSpec
from gemma_ane.convert.options import AUDIO_BUCKET_SECONDS, ConvertError
from gemma_ane.oracle.tokenizer_files import (
    GEMMA4_AUDIO_CHAT_TEMPLATE,
    GEMMA4_CHAT_TEMPLATE,
    TINY_AUDIO_TOKENS,
    build_tokenizer,
)
from gemma_ane.runtime.chat import ChatTemplate


def config_with(entry: dict) -> dict:
    return {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "per_layer_dim": 8,
        "embed_scale": 8.0,
        "per_layer_embed_scale": 2.0,
        "audio": entry,
    }


def test_the_audio_entry_is_checked_on_write_and_read():
    good = AudioConfig.of([240, 144], (123, 124, 125)).to_json()
    assert good["buckets"] == [144, 240]
    check_model_config(config_with(good), "model_config.json")
    bad = {
        "buckets": ([144, 144], [240, 144], [], [145], [0], 3120, [48, 3120]),
        "mel_bins": (80, "128"),
        "sample_rate": (44100,),
        "boa_token_id": (512, -1, None),
        "audio_token_id": (600,),
        "eoa_token_id": (True,),
    }
    assert set(bad) == set(AUDIO_FIELDS)
    for field, values in bad.items():
        for value in values:
            entry = {**copy.deepcopy(good), field: value}
            with pytest.raises(BundleError, match=rf"audio\.{field}="):
                check_model_config(config_with(entry), "model_config.json")
        entry = {k: v for k, v in good.items() if k != field}
        with pytest.raises(BundleError, match=rf"audio\.{field}: missing"):
            check_model_config(config_with(entry), "model_config.json")


def test_each_bucket_is_a_function_and_the_largest_is_encode():
    assert [audio_function(f, [144, 240, 480]) for f in (144, 240, 480)] == ["encode_144", "encode_240", "encode"]


def test_the_default_buckets_double_up_to_30_seconds(e2b_config):
    spec = AudioSpec.from_config(e2b_config)
    frames = buckets(spec, AUDIO_BUCKET_SECONDS)
    assert frames == [288, 528, 1008, 2016, 3024]  # 2.5 .. 30 s in 48-frame steps (4 x the 12-frame block)
    assert all(b / a <= 2.0 for a, b in zip(frames, frames[1:]))
    assert token_ids(e2b_config) == (256000, 258881, 258883)


@pytest.mark.parametrize(
    "options,needle",
    [
        (dict(audio_bits=5), "--audio-bits 5"),
        (dict(audio_seconds=()), "audio_seconds=()"),
        (dict(audio_seconds=(1.0, 31.0)), r"each must be in \(0, 30\]"),
    ],
)
def test_bad_audio_options_are_refused(options, needle):
    with pytest.raises(ConvertError, match=needle):
        ConvertOptions(**options).check()


def test_the_component_is_found_only_for_a_tower_that_runs(tiny_audio, tiny_e2b, capsys):
    found = AudioComponent.find(ConvertOptions(), tiny_audio)
    assert found is not None and found.token_ids == tuple(TINY_AUDIO_TOKENS)
    assert found.config_entry().buckets == found.buckets == [288, 528, 1008, 2016, 3024]
    assert set(found.manifest_entry()["functions"]) == {
        "encode_288",
        "encode_528",
        "encode_1008",
        "encode_2016",
        "encode",
    }
    assert AudioComponent.find(ConvertOptions(audio=False), tiny_audio) is None  # --no-audio
    assert AudioComponent.find(ConvertOptions(layout="published"), tiny_audio) is None
    # e2b-mini's audio tower is too narrow for transformers itself to run: converted without it, saying so
    assert AudioComponent.find(ConvertOptions(), tiny_e2b) is None
    assert "subsampling_conv_channels" in capsys.readouterr().out


def test_only_the_audio_preset_has_audio_tokens(tiny_audio, tiny_e2b):
    plain, with_audio = build_tokenizer(512), build_tokenizer(512, audio=True)
    for i, token in TINY_AUDIO_TOKENS.items():
        assert plain.id_to_token(i) == f"<unused{i}>" and with_audio.id_to_token(i) == token
    assert [plain.id_to_token(i) for i in range(512) if i not in TINY_AUDIO_TOKENS] == [
        with_audio.id_to_token(i) for i in range(512) if i not in TINY_AUDIO_TOKENS
    ]
    assert (tiny_e2b / "chat_template.jinja").read_text() == GEMMA4_CHAT_TEMPLATE
    assert (tiny_audio / "chat_template.jinja").read_text() == GEMMA4_AUDIO_CHAT_TEMPLATE
    config = json.loads((tiny_audio / "config.json").read_text())
    assert (config["boa_token_id"], config["audio_token_id"], config["eoa_token_index"]) == tuple(TINY_AUDIO_TOKENS)


@pytest.mark.parametrize("kind", ["audio", "input_audio"])
def test_the_audio_template_renders_audio_parts_as_gemma_4_does(kind):
    messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": "Hi"}]}]
    ours = ChatTemplate(GEMMA4_AUDIO_CHAT_TEMPLATE).render(messages, add_generation_prompt=True)
    assert ours == "<bos><|turn>user\n<|audio|>Hi<turn|>\n<|turn>model\n"
    assert "<|audio|>" not in ChatTemplate(GEMMA4_CHAT_TEMPLATE).render(messages, add_generation_prompt=True)
    assert "<|audio|>Hi" in ChatTemplate(None).render(messages)  # the built-in formatter (no template in a bundle)


def test_gemma_4s_own_template_and_the_built_in_formatter_agree_on_audio_parts():
    """Google's template (tests/fixtures) renders both audio part types as one `<|audio|>`, as ours do."""
    from pathlib import Path

    from gemma_ane.runtime.chat import gemma4_prompt

    google = ChatTemplate((Path(__file__).parent / "fixtures" / "gemma4_chat_template.jinja").read_text())
    content = [{"type": "audio", "audio": "a.wav"}, {"type": "input_audio"}, {"type": "text", "text": "Hi"}]
    messages = [{"role": "user", "content": content}]
    rendered = google.render(messages, add_generation_prompt=True)
    assert rendered.count("<|audio|>") == 2 and rendered == gemma4_prompt(messages, add_generation_prompt=True)
    assert ChatTemplate(GEMMA4_AUDIO_CHAT_TEMPLATE).render(messages).count("<|audio|>") == 2
