"""docs/CONTRACT.md and docs/model_config.schema.json against the code: every field of every model_config.json
record stated in both, the schema file what the records generate, and no module the contract names that is gone."""

import re
from dataclasses import fields
from pathlib import Path

import pytest

from gemma_ane.bundle import schema, schema_doc
from gemma_ane.bundle.errors import BundleError
from gemma_ane.bundle.plan import ChunkPlan, parse_split
from gemma_ane.bundle.spec import ModelSpec

ROOT = Path(__file__).parent.parent
CONTRACT = (ROOT / "docs" / "CONTRACT.md").read_text()
RECORDS = [schema.TextConfig, schema.WeightsConfig, *schema.ENTRIES.values()]


def section(title: str) -> str:
    start = CONTRACT.index(f"## {title}")
    end = CONTRACT.find("\n## ", start + 1)
    return CONTRACT[start : end if end > 0 else None]


def test_the_schema_file_is_what_the_records_generate():
    """A field added to a record (or a rule's wording changed) without regenerating the file fails here."""
    assert schema_doc.SCHEMA_FILE.read_text() == schema_doc.render(), "run python -m gemma_ane.bundle.schema_doc"
    assert schema_doc.main(["--check"]) == 0


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.__name__)
def test_every_record_field_is_in_the_schema_file_and_the_contract(record):
    generated = schema_doc.json_schema()["properties"]
    where = {schema.TextConfig: generated, schema.WeightsConfig: generated["weights"]["properties"]}
    key = {v: k for k, v in schema.ENTRIES.items()}.get(record)
    props = where.get(record) or generated[key]["properties"]
    bundle_on_disk = section("§2 The bundle on disk")
    for f in fields(record):
        assert f.name in props, f"{record.__name__}.{f.name}: not in model_config.schema.json"
        assert f"`{f.name}`" in bundle_on_disk, f"{record.__name__}.{f.name}: not stated in CONTRACT §2"
    if key:
        assert f"`{key}`" in bundle_on_disk


def test_a_record_field_the_schema_cannot_type_is_refused():
    """The generator names an annotation it has no JSON type for, rather than writing a wrong schema."""
    with pytest.raises(TypeError, match="complex"):
        schema_doc._type("complex")


def test_the_chunk_entries_state_what_the_plan_describes(e2b_config):
    """`chunks` (a split of other than three): each key ChunkPlan.describe writes is in the schema and the contract."""
    plan = ChunkPlan.build(ModelSpec.from_config(e2b_config), split=parse_split("8,15,25"))
    items = schema_doc.json_schema()["properties"]["chunks"]["items"]["properties"]
    for entry in plan.describe(4):
        for name in entry:
            assert name in items, name
            assert f"`{name}`" in section("§2 The bundle on disk"), name


WEIGHTS = {"quant": "block", "bits": 4, "group_size": 32, "group_axis": "input", "keep": ["o_proj"]}


def test_the_weights_record_is_checked_field_by_field():
    text = schema.TextConfig(
        hidden_size=8,
        num_hidden_layers=2,
        vocab_size=16,
        per_layer_dim=4,
        embed_scale=1.0,
        per_layer_embed_scale=1.0,
        weights=schema.WeightsConfig(**WEIGHTS).to_json(),
    )
    config = schema.model_config(text)
    schema.check_model_config(config, "m")
    assert config["weights"] == WEIGHTS
    for field, bad in (("quant", "gguf"), ("group_size", 0), ("group_axis", "rows"), ("keep", "o_proj")):
        with pytest.raises(BundleError, match="weights="):
            schema.check_model_config({**config, "weights": {**WEIGHTS, field: bad}}, "m")
    with pytest.raises(BundleError, match="weights="):
        schema.check_model_config({**config, "weights": {k: v for k, v in WEIGHTS.items() if k != "bits"}}, "m")


def test_the_contract_names_no_retired_module():
    """Every `path.py` the contract cites exists (under gemma_ane/, a folder of it, or the repository root)."""
    cited = set(re.findall(r"`([\w/]+\.py)`", CONTRACT))
    assert cited
    package = ROOT / "gemma_ane"
    for name in cited:
        candidates = [ROOT / name, package / name, *package.glob(f"*/{name}"), *package.glob(f"*/*/{name}")]
        assert any(p.is_file() for p in candidates), f"CONTRACT cites {name}, which no longer exists"
    assert "runtime.py" not in cited and "mil.py" not in cited


def test_the_contract_calls_the_last_chunk_the_head_chunk():
    """`chunk_3` only where the default split's file is meant (§2's table, and the definition of the head chunk)."""
    lines = [line for line in CONTRACT.splitlines() if "chunk_3" in line]
    assert len(lines) == 2 and all("the head chunk" in line for line in lines), lines


def test_the_contract_states_what_a_second_implementation_needs():
    for title, needles in {
        "§2 The bundle on disk": ["`audio.mlpackage`", "`weights`", "`buckets`", "model_config.schema.json"],
        "§3 Chunk I/O": ["**Wiring N chunks.**", "**The audio model**", "`input_features_mask`", "`audio_embeds`"],
        "§5 Core ML facts": ["**Block quantization**", "constexpr_blockwise_shift_scale"],
        "§6 The host's own formats": ["**Prompt cache files**", "`ring_top`", "**Stop strings**", "held-back tail"],
    }.items():
        text = section(title)
        for needle in needles:
            assert needle in text, (title, needle)
