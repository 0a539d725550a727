"""model_config.json's typed records (bundle/schema.py): `to_json` writes a record's fields in the file's
order, `from_json` reads them back after the same rules, and a record that breaks a rule is refused on write
with the message a reader of the same file would get."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gemma_ane.bundle import BundleError
from gemma_ane.bundle.layout import MODEL_CONFIG, VISION_POSITION_TABLE
from gemma_ane.bundle.schema import (
    ASSISTANT,
    VISION,
    AssistantConfig,
    TextConfig,
    VisionConfig,
    check_model_config,
    model_config,
    read_model_config,
    write_model_config,
)
from gemma_ane.bundle.spec import FULL, SLIDING

TEXT = TextConfig(
    model_name="tiny",
    architecture="gemma4",
    hidden_size=64,
    num_hidden_layers=4,
    num_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    global_head_dim=64,
    vocab_size=512,
    context_length=128,
    sliding_window=16,
    per_layer_dim=8,
    num_kv_shared_layers=2,
    layer_types=[SLIDING, SLIDING, SLIDING, FULL],
    embed_scale=8.0,
    per_layer_embed_scale=2.828,
    per_layer_model_projection_scale=0.125,
    per_layer_input_scale=2**-0.5,
    rms_norm_eps=1e-6,
    bos_token_id=2,
    eos_token_id=1,
    final_logit_softcapping=30.0,
    quantization="none",
    compute_units="CPU_AND_NE",
    prefill_batch=8,
    split=[1, 3],
    head="logits",
)
ASSIST = AssistantConfig(
    draft_tokens=3, hidden_size=32, backbone_hidden_size=64, num_centroids=0, centroid_top_k=0, producers={FULL: 3}
)
SEE = VisionConfig(
    image_tokens=70,
    patch_size=16,
    pooling_kernel_size=3,
    head_dim=32,
    rope_theta=100.0,
    position_table=VISION_POSITION_TABLE,
    boi_token_id=255,
    image_token_id=258,
    eoi_token_id=256,
)


def test_the_records_write_their_fields_in_order_and_read_back_equal(tmp_path):
    config = model_config(TEXT, **{ASSISTANT: ASSIST, VISION: SEE})
    assert list(config)[:3] == ["model_name", "architecture", "hidden_size"]
    assert list(config)[-2:] == [ASSISTANT, VISION]
    assert list(config[VISION]) == [f.name for f in dataclasses.fields(VisionConfig)]
    write_model_config(tmp_path, config)
    read = read_model_config(tmp_path)
    where = str(tmp_path / MODEL_CONFIG)
    assert TextConfig.from_json(read, where) == TEXT
    assert AssistantConfig.from_json(read, where) == ASSIST and VisionConfig.from_json(read, where) == SEE


def test_a_field_a_bundle_need_not_state_is_left_out_when_none():
    """null is no value the reader takes for an optional field: the record leaves the field out, and a file
    without it reads back as None."""
    config = model_config(dataclasses.replace(TEXT, bos_token_id=None, split=None))
    assert "bos_token_id" not in config and "split" not in config
    check_model_config(config, "model_config.json")
    assert TextConfig.from_json(config, "model_config.json").bos_token_id is None


@pytest.mark.parametrize(
    "text,entries,needle",
    [
        (dataclasses.replace(TEXT, vocab_size=0), {}, "vocab_size=0: expected a positive integer"),
        (dataclasses.replace(TEXT, eos_token_id=512), {}, "eos_token_id=512: expected a token id below vocab_size"),
        (TEXT, {ASSISTANT: dataclasses.replace(ASSIST, backbone_hidden_size=32)}, "assistant.backbone_hidden_size=32"),
        (TEXT, {VISION: dataclasses.replace(SEE, image_tokens=71)}, "vision.image_tokens=71: expected one of"),
    ],
    ids=["text", "token", "assistant", "vision"],
)
def test_a_record_that_breaks_a_rule_is_refused_on_write_as_on_read(tmp_path, text, entries, needle):
    config = model_config(text, **entries)
    with pytest.raises(BundleError, match=needle) as written:
        write_model_config(tmp_path, config)
    assert not (tmp_path / MODEL_CONFIG).exists()
    (tmp_path / MODEL_CONFIG).write_text(json.dumps(config))
    with pytest.raises(BundleError) as read:
        read_model_config(tmp_path)
    assert str(read.value) == str(written.value)


def test_an_entry_reads_its_rules_off_the_whole_file():
    config = model_config(TEXT, **{ASSISTANT: ASSIST})
    del config[ASSISTANT]["producers"]
    with pytest.raises(BundleError, match=r"^f: assistant\.producers: missing$"):
        AssistantConfig.from_json(config, "f")


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("rms_norm_eps", "1e-6", "rms_norm_eps='1e-6': expected a positive fp32 number"),
        ("rms_norm_eps", float("nan"), "rms_norm_eps=nan: expected a positive fp32 number"),
        ("rms_norm_eps", 0, "rms_norm_eps=0: expected a positive fp32 number"),
        ("final_logit_softcapping", -30.0, "final_logit_softcapping=-30.0: expected a positive fp32 number"),
        ("final_logit_softcapping", 0, "final_logit_softcapping=0: expected a positive fp32 number"),
        ("quantization", "q3", "quantization='q3': expected \"none\""),
        ("quantization", ["int4"], "quantization=['int4']: expected \"none\""),
        ("context_length", 10**12, "context_length=1000000000000: expected a positive integer, at most"),
        ("split", [3, 1], "split=[3, 1]: expected ascending layer indices"),
        ("split", [1, 1], "split=[1, 1]: expected ascending layer indices"),
        ("split", [1, 5], "split=[1, 5]: expected boundaries up to num_hidden_layers 4"),
        (
            "layer_types",
            [FULL],
            "layer_types=['full_attention']: expected one per layer, as many as num_hidden_layers 4",
        ),
    ],
)
def test_a_text_field_no_conversion_writes_is_refused_on_write_as_on_read(tmp_path, field, value, needle):
    config = {**model_config(TEXT), field: value}
    with pytest.raises(BundleError, match=rf"^{tmp_path / MODEL_CONFIG}: ") as written:
        write_model_config(tmp_path, config)
    assert needle in str(written.value)
    (tmp_path / MODEL_CONFIG).write_text(json.dumps(config))
    with pytest.raises(BundleError) as read:
        read_model_config(tmp_path)
    assert str(read.value) == str(written.value)


@pytest.mark.parametrize(
    "field, value",
    [
        ("quantization", "int4"),
        ("quantization", "none"),
        ("final_logit_softcapping", None),  # a checkpoint without one
        ("split", [4]),  # a last chunk of the head alone
        ("context_length", 2**17),
    ],
)
def test_the_values_a_conversion_writes_are_accepted(field, value):
    check_model_config({**model_config(TEXT), field: value}, "model_config.json")


def test_a_model_config_nested_past_the_stack_is_a_bundle_error(tmp_path):
    (tmp_path / MODEL_CONFIG).write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(BundleError, match=r"model_config\.json: unreadable JSON \(nested too deeply\)$"):
        read_model_config(tmp_path)
