"""The drafter's conversion (the model itself: models/assistant.py): its `draft` interface described as a chunk
(draft_io), its checkpoint opened against the target's spec, the package and the centroid head's sidecars, and
its model_config.json entry."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..bundle import layout, schema
from ..bundle.host import quantize_rows
from ..bundle.plan import Chunk, ChunkPlan, Tensor, kv_name
from ..bundle.spec import FULL, SLIDING, AssistantSpec, ConfigError, ModelSpec
from ..files import tree_size
from . import coreml
from .checkpoint import Checkpoint, CheckpointError
from .models.assistant import FUNCTION, MASKS, SHORT, load_assistant, skeleton
from .options import ConvertError, ConvertOptions
from .text import ROW_BLOCK


def producers(spec: AssistantSpec) -> dict[str, int]:
    """Layer type -> the target layer whose K/V the drafter's layers of that type read (sliding first)."""
    return {t: spec.kv_source[spec.layer_types.index(t)] for t in (SLIDING, FULL) if t in spec.layer_types}


def draft_io(spec: AssistantSpec, plan: ChunkPlan) -> Chunk:
    """The drafter's package described as a chunk (what coreml.trace_function reads): one stateless function
    `draft`, whose K/V inputs are exactly the chunks' outputs of the same names (the ring is `plan.ring` slots)."""
    Hb = spec.backbone_hidden_size
    given = {k: v for c in plan.chunks for k, v in c.functions["infer"]["outputs"].items()}
    ins = {"embedding": Tensor((1, 1, Hb)), "carry": Tensor((1, 1, Hb))}
    for p in producers(spec).values():
        for which in ("k", "v"):
            name = kv_name(p, which)
            if name not in given:
                split = ",".join(map(str, plan.split))
                raise ConfigError(f"assistant reads {name}, which no chunk returns (split {split})")
            ins[name] = given[name]
    for t, p in producers(spec).items():  # rows of the ring (sliding) or the context (full): the cache's axis 2
        ins[MASKS[t]] = Tensor((1, 1, 1, given[kv_name(p, "k")].shape[2]))
    for t in producers(spec):
        D = spec.head_dims[spec.layer_types.index(t)]
        ins[f"cos_{SHORT[t]}"] = ins[f"sin_{SHORT[t]}"] = Tensor((1, 1, 1, D))
    outs = {"carry_out": Tensor((1, 1, Hb))}
    if spec.num_centroids:
        outs.update(centroid_scores=Tensor((1, 1, spec.num_centroids)), hidden_out=Tensor((1, 1, spec.hidden_size)))
    else:
        outs["logits"] = Tensor((1, 1, spec.vocab_size))
    return Chunk(
        name="assistant",
        layers=tuple(range(len(spec.layer_types))),
        stateful=False,
        sliding_layers=(),
        full_layers=(),
        states={},
        functions={FUNCTION: {"T": 1, "inputs": ins, "outputs": outs}},
        has_head=True,
        computes_ple=False,
    )


def config_entry(spec: AssistantSpec, plan: ChunkPlan) -> schema.AssistantConfig:
    """model_config.json's `assistant` (bundle.schema's): what the runtime needs to drive the package and its
    head."""
    return schema.AssistantConfig.of(spec, plan.draft_tokens, producers(spec))


# -- the checkpoint and the conversion ----------------------------------------------------------------


def open_assistant(src: str | Path, target: ModelSpec) -> tuple[AssistantSpec, Checkpoint]:
    """The drafter's spec, checked against its target, and its checkpoint with every tensor's name and shape
    checked (headers only): a bad pairing or a damaged checkpoint fails here in one line."""
    try:
        spec = AssistantSpec.from_pretrained(src, target)
        ckpt = Checkpoint(src, spec=target)  # found by model.embed_tokens.weight; the target spec is not used
    except (ConfigError, CheckpointError) as e:
        raise ConvertError(f"--assistant: {e}") from None
    ckpt.prefix = ""  # a drafter's tensors are named from the top (model.*, pre_projection, masked_embedding.*)
    expected = {n: tuple(t.shape) for n, t in skeleton(spec).state_dict().items() if n != "lm_head.weight"}
    expected["model.embed_tokens.weight"] = (spec.vocab_size, spec.hidden_size)
    if spec.num_centroids:
        expected["masked_embedding.token_ordering"] = (spec.vocab_size,)
    for name, shape in expected.items():
        found = ckpt.shape_of(name) if name in ckpt else None
        if found != shape:
            ckpt.close()
            what = "missing" if found is None else f"has shape {found}, expected {shape}"
            raise ConvertError(f"--assistant {ckpt.root}: tensor {name} {what}")
    return spec, ckpt


def convert_assistant(
    src: str | Path, plan: ChunkPlan, options: ConvertOptions, out: Path, timer, compile_: bool = False
) -> int:
    """OUT/assistant.mlpackage (or .mlmodelc) and, for a centroid head, its sidecars; returns the package's size."""
    out = Path(out)
    with timer("load"):
        spec, ckpt = open_assistant(src, plan.spec)
    try:
        package = draft_io(spec, plan)
        with timer("load"):
            model = load_assistant(ckpt, spec, package, fp16_range=True)
        prog = coreml.trace_function(model, package, FUNCTION, timer)
        final = coreml.save_one_function(prog, FUNCTION, "assistant", options, out, timer, compile_)
        if spec.num_centroids:
            with timer("sidecars"):
                write_head_sidecars(ckpt, spec, out)
    finally:
        ckpt.close()
    return tree_size(final)


def write_head_sidecars(ckpt: Checkpoint, spec: AssistantSpec, out: Path) -> None:
    """The centroid head's tables for the host, in cluster order: row j of ASSISTANT_EMBED_Q8 (int8, with its
    fp16 scale in ASSISTANT_EMBED_SCALES, CONTRACT §2's row format, multiplier 1: the tied head reads the unscaled
    embedding) is token ASSISTANT_TOKEN_ORDERING[j] (int32), so a cluster is one contiguous read."""
    order = ckpt.raw("masked_embedding.token_ordering").astype(np.int64)
    if not np.array_equal(np.sort(order), np.arange(spec.vocab_size)):
        raise ConvertError(f"--assistant {ckpt.root}: masked_embedding.token_ordering is not a permutation of the ids")
    table = ckpt["model.embed_tokens.weight"]
    with open(out / layout.ASSISTANT_EMBED_Q8, "wb") as fq, open(out / layout.ASSISTANT_EMBED_SCALES, "wb") as fs:
        for start in range(0, spec.vocab_size, ROW_BLOCK):
            q, scale = quantize_rows(table[order[start : start + ROW_BLOCK]])
            fq.write(q.tobytes())
            fs.write(scale.astype("<f2").tobytes())
    (out / layout.ASSISTANT_TOKEN_ORDERING).write_bytes(order.astype("<i4").tobytes())


@dataclass
class AssistantComponent:
    """The drafter, when --assistant names one: its pairing with the target and its tensors checked when found."""

    options: ConvertOptions
    plan: ChunkPlan
    spec: AssistantSpec
    package: Chunk
    source: dict  # the drafter's checkpoint, as the manifest records it
    name = schema.ASSISTANT
    without = "convert without --assistant for no drafter"

    @classmethod
    def find(cls, options: ConvertOptions, plan: ChunkPlan) -> AssistantComponent | None:
        if not options.assistant:
            return None
        spec, ckpt = open_assistant(options.assistant, plan.spec)
        ckpt.close()
        try:
            package = draft_io(spec, plan)
        except ConfigError as e:
            raise ConvertError(f"--assistant: {e}") from None
        config_sha = hashlib.sha256((ckpt.root / "config.json").read_bytes()).hexdigest()
        return cls(options, plan, spec, package, {"path": str(ckpt.root), "config_sha256": config_sha})

    def config_entry(self) -> dict:
        return config_entry(self.spec, self.plan)

    def manifest_entry(self) -> dict:
        return {"source": self.source, **self.package.to_json()}

    def convert(self, out: Path, timer, compile_: bool) -> int:
        return convert_assistant(self.options.assistant, self.plan, self.options, out, timer, compile_)
