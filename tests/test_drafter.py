"""The drafter as a Core ML model (assistant.py, drafter.py) against transformers' Gemma4AssistantForCausalLM: the
torch module, the converted package run by the MIL executor (16 and 4 bits), the host's centroid head, and
`convert --assistant` end to end."""

import copy
import json
import math
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from margins import assert_argmax, repetition_penalised
from safetensors.numpy import load_file, save_file

from gemma_ane.bundle import (
    Bundle,
    BundleConfig,
    BundleError,
    RowTable,
    check_bundle,
    load_host,
    open_bundle,
    read_model_config,
)
from gemma_ane.bundle.host import quantize_rows, rope_tables
from gemma_ane.bundle.plan import ChunkPlan
from gemma_ane.bundle.spec import FULL, SLIDING, ModelSpec
from gemma_ane.cli import main
from gemma_ane.convert.assistant import config_entry, draft_io, open_assistant
from gemma_ane.convert.checkpoint import Checkpoint
from gemma_ane.convert.models.assistant import AssistantModel, load_assistant
from gemma_ane.mil.package import Package
from gemma_ane.oracle.tiny import write_tiny
from gemma_ane.runtime.device import Device
from gemma_ane.runtime.drafter import CentroidHead, Drafter, open_drafter
from gemma_ane.runtime.engine import FunctionUnavailable, HostTables

W, H, V = 16, 64, 512  # e2b-mini's window, hidden size and vocabulary
CONTEXT, K = 64, 3  # the torch drafter's context; K drafts per verify call: rings of 16 + 32 = 48 slots
BUNDLE_CONTEXT = 256  # the converted bundle's (conftest's e2b_full16)
N = CONTEXT  # positions the target runs: K/V for every draft position and the rejected rows after it
# past the window (17 = W+1: the first position where the drafter's W+1 rows leave one out), past the ring (48)
POSITIONS = (1, 9, 17, 30, 50, 60)


@pytest.fixture(scope="module")
def plan(pair):
    return ChunkPlan.build(ModelSpec.from_pretrained(pair[0]), CONTEXT, 8, draft_tokens=K)


@pytest.fixture(scope="module")
def oracle(pair):
    """transformers' drafter, and what the target gives it: every position's producer K/V and final-norm state."""
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForConditionalGeneration

    target = Gemma4ForConditionalGeneration.from_pretrained(pair[0]).eval()
    ids = torch.randint(3, V, (1, N), generator=torch.Generator().manual_seed(1))
    normed = []
    hook = target.model.language_model.norm.register_forward_hook(lambda m, a, o: normed.append(o))
    with torch.no_grad():
        kv = target(ids, return_shared_kv_states=True).shared_kv_states
    hook.remove()
    assistant = Gemma4AssistantForCausalLM.from_pretrained(pair[1]).eval()
    return SimpleNamespace(assistant=assistant, ids=ids[0].tolist(), kv=kv, normed=normed[0][0])


def embedding(host, token: int) -> np.ndarray:
    """The target's scaled embedding row of a token as the host holds it (int8 row times sqrt(H))."""
    scale = np.float32(host.embed_scales[token]) / 127
    return np.asarray(host.embed_q[[token]], np.float32)[0] * scale * math.sqrt(H)


def transformers_draft(assistant, o, emb, carry, P):
    """transformers' drafter at position P: sliding layers get the W+1 rows up to P-1, full layers 0..P-1."""
    shared = {
        SLIDING: tuple(t[:, :, max(0, P - W - 1) : P] for t in o.kv[SLIDING]),
        FULL: tuple(t[:, :, :P] for t in o.kv[FULL]),
    }
    x = torch.cat([torch.from_numpy(emb), torch.as_tensor(carry, dtype=torch.float32)]).reshape(1, 1, -1)
    with torch.no_grad():
        out = assistant(inputs_embeds=x, position_ids=torch.tensor([[P]]), shared_kv_states=shared)
    return out.logits[0, 0].numpy(), out.last_hidden_state[0, 0].numpy()


def caches(o, P, widths):
    """chunk_2's producer outputs after a verify call whose K drafts past P-1 were all rejected: rows up to P-1+K,
    the sliding ring at slot = position % its width, the full cache as wide as the drafter's context; slots never
    written hold noise (the masks must hide all but the rows the drafter reads)."""
    rng, top = np.random.default_rng(P), P - 1 + K
    (ks, vs), (kf, vf) = ([t[0].numpy() for t in o.kv[x]] for x in (SLIDING, FULL))
    out = {}
    for name, src, rows in (("kv8", (ks, vs), widths[SLIDING]), ("kv9", (kf, vf), widths[FULL])):
        for which, t in zip("kv", src):
            a = rng.standard_normal((1, t.shape[0], rows, t.shape[-1])).astype(np.float32)
            for q in range(max(0, top - rows + 1), top + 1):
                a[0, :, q % rows] = t[:, q]
            out[f"{name}_{which}"] = a
    return out


def expand(proposal) -> np.ndarray:
    full = np.full(proposal.vocab, np.nan if proposal.fill is None else proposal.fill, np.float32)
    full[proposal.ids] = proposal.logits
    return full


def bursts(drafter, o, host, assistant=None, steps=2):
    """Per position and draft step: (our proposal, our carry, transformers' logits, its carry). The first step
    continues from the target's final-norm state at P-1, the next from each side's own carry_out."""
    for P in POSITIONS:
        kv = caches(o, P, drafter.widths)
        token, ours, theirs = o.ids[P], o.normed[P - 1].numpy(), o.normed[P - 1].numpy()
        for _ in range(steps):
            proposal, ours = drafter.step(token, ours, P, kv)
            logits, theirs = transformers_draft(assistant or o.assistant, o, embedding(host, token), theirs, P)
            yield P, proposal, ours, logits, theirs
            token = int(logits.argmax())


# -- the torch module against transformers -----------------------------------------------------------------


class TorchDraft:
    """An AssistantModel as the package a Drafter drives (numpy in and out), so the host side runs as shipped."""

    name = "assistant"

    def __init__(self, model: AssistantModel):
        self.model = model
        io = model.chunk.functions["draft"]
        self.interfaces = {"draft": {k: {n: t.to_json() for n, t in io[k].items()} for k in ("inputs", "outputs")}}

    def load(self, function):
        pass

    def predict(self, function, inputs, state):
        args = [torch.from_numpy(np.asarray(inputs[n], np.float32)) for n in self.model.input_names]
        with torch.no_grad():
            return {n: o.numpy() for n, o in zip(self.model.output_names, self.model(*args))}


@pytest.fixture(scope="module")
def torch_drafter(pair, plan, tmp_path_factory):
    """The fp32 module behind a Drafter, its host tables quantised as a bundle's, its head's rows exact (fp32)."""
    spec, ckpt = open_assistant(pair[1], plan.spec)
    package = draft_io(spec, plan)
    model = load_assistant(ckpt, spec, package)
    order = ckpt.raw("masked_embedding.token_ordering").astype(np.int64)
    rows = tmp_path_factory.mktemp("head") / "rows.bin"
    ckpt["model.embed_tokens.weight"][order].tofile(rows)
    ckpt.close()
    head = CentroidHead(RowTable(rows, np.float32, (V, spec.hidden_size)), np.ones(V), order, 32, 4)
    target = Checkpoint(pair[0])
    q, scales = quantize_rows(target["embed_tokens.weight"])
    L = plan.spec.per_layer_total
    host = HostTables(
        q, scales, np.zeros((V, L), np.int8), np.zeros(V, np.float16), math.sqrt(H), 4.0, rope_tables(plan.spec, 128)
    )
    config = {"sliding_window": W, "vocab_size": V, "assistant": config_entry(spec, plan).to_json()}
    return Drafter(TorchDraft(model), host, config, head), host


def test_the_torch_drafter_equals_transformers(torch_drafter, oracle):
    """At positions inside and past the window and the ring, with rejected drafts' rows in the caches: the carry
    (post_projection of the final norm) and the logits after the centroid head, for a first and a second step."""
    drafter, host = torch_drafter
    seen = 0
    for P, proposal, carry, logits, ref_carry in bursts(drafter, oracle, host):
        assert carry.shape == (H,)
        np.testing.assert_allclose(carry, ref_carry, atol=2e-5, err_msg=f"P={P}")
        assert set(proposal.ids.tolist()) == set(np.flatnonzero(logits > logits.min()).tolist()), P
        np.testing.assert_allclose(expand(proposal), logits, atol=1e-4, err_msg=f"P={P}")
        seen += 1
    assert seen == 2 * len(POSITIONS)


@pytest.fixture(scope="module")
def plain(pair, plan, oracle, tmp_path_factory):
    """The same drafter with a plain tied head (use_ordered_embeddings off): transformers' model and ours."""
    from transformers import Gemma4AssistantForCausalLM

    config = copy.deepcopy(oracle.assistant.config)
    config.use_ordered_embeddings = False
    model = Gemma4AssistantForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(oracle.assistant.state_dict(), strict=False)
    assert not missing and unexpected == ["masked_embedding.token_ordering", "masked_embedding.centroids.weight"]
    out = tmp_path_factory.mktemp("plain")
    model.save_pretrained(out)
    spec, ckpt = open_assistant(out, plan.spec)
    assert spec.num_centroids == 0
    package = draft_io(spec, plan)
    assert list(package.functions["draft"]["outputs"]) == ["carry_out", "logits"]
    ours = load_assistant(ckpt, spec, package)
    ckpt.close()
    return ours, model, config_entry(spec, plan).to_json()


def test_a_plain_head_drafter_equals_transformers(plain, torch_drafter, oracle):
    ours, theirs, entry = plain
    _, host = torch_drafter
    drafter = Drafter(TorchDraft(ours), host, {"sliding_window": W, "vocab_size": V, "assistant": entry}, None)
    for P, proposal, carry, logits, ref_carry in bursts(drafter, oracle, host, assistant=theirs):
        assert proposal.fill is None and np.array_equal(proposal.ids, np.arange(V))
        np.testing.assert_allclose(proposal.logits, logits, atol=1e-4, err_msg=f"P={P}")
        np.testing.assert_allclose(carry, ref_carry, atol=2e-5, err_msg=f"P={P}")


@pytest.mark.parametrize(
    "producers, head, needle",
    [
        ({SLIDING: 7, FULL: 9}, True, "assistant: draft has no 'kv7_k', which model_config.json implies"),
        ({SLIDING: 8, FULL: 9}, False, "assistant: draft has no 'logits', which model_config.json implies"),
    ],
)
def test_a_package_that_disagrees_with_model_config_is_refused(torch_drafter, producers, head, needle):
    drafter, host = torch_drafter
    config = {"sliding_window": W, "vocab_size": V, "assistant": {"draft_tokens": K, "producers": producers}}
    with pytest.raises(BundleError, match=re.escape(needle)):
        Drafter(drafter.package, host, config, drafter.head if head else None)


@pytest.mark.parametrize("P", [0, CONTEXT])
def test_a_draft_position_outside_the_context_is_refused(torch_drafter, oracle, P):
    drafter, _ = torch_drafter
    with pytest.raises(ValueError, match=rf"draft position {P}: must lie in \[1, context 64\)"):
        drafter.step(1, np.zeros(H, np.float32), P, caches(oracle, 1, drafter.widths))


# -- the converted package ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle16(e2b_full16):
    """`convert --assistant` (K = 3), 16 bits, a context of 256, with its vision model: conftest's e2b_full16, which
    test_bench, test_nchunks and test_byte_identity read too (so tests here read it and damage only copies). The
    command line's drafter flags reaching the converter: test_the_drafter_flags_reach_the_options."""
    return e2b_full16


def test_the_drafter_flags_reach_the_options(capsys, pair, tmp_path, monkeypatch):
    import gemma_ane.convert

    seen = []
    monkeypatch.setattr(gemma_ane.convert, "convert", lambda src, out, opts, **kw: seen.append(opts) or {})
    argv = ["convert", str(pair[0]), str(tmp_path / "out"), "--assistant", str(pair[1]), "--quiet"]
    assert main(argv) == 0
    assert main([*argv, "--draft-tokens", "5", "--kv-prefill-batches", ""]) == 0
    default, chosen = seen
    assert (default.assistant, default.draft_tokens, default.kv_prefill_batches) == (str(pair[1]), 3, None)
    assert (chosen.assistant, chosen.draft_tokens, chosen.kv_prefill_batches) == (str(pair[1]), 5, ())


def _open(root, host_root=None, backend="mil", compute_units="cpu_and_ne"):
    config = read_model_config(host_root or root)
    host = load_host(host_root or root, config)
    return open_drafter(stated(root, config), Device.of(backend, "fp16", compute_units), host), host


def stated(root, config: dict) -> Bundle:
    """The bundle at `root` as if its model_config.json were `config` (its chunks not needed here)."""
    return Bundle(Path(root), BundleConfig.of(config, "model_config.json"), [])


def test_the_16bit_package_equals_transformers(bundle16, oracle):
    drafter, host = _open(bundle16)
    assert drafter.widths == {SLIDING: 48, FULL: BUNDLE_CONTEXT}
    clear = 0
    for P, proposal, carry, logits, ref_carry in bursts(drafter, oracle, host):
        # Measured: carry within 0.52 % of its largest value, logits within 0.135 (range ~25; the head's
        # int8 rows included), the same scored ids and argmax everywhere.
        assert np.abs(carry - ref_carry).max() <= 0.01 * np.abs(ref_carry).max(), P
        assert set(proposal.ids.tolist()) == set(np.flatnonzero(logits > logits.min()).tolist()), P
        np.testing.assert_allclose(expand(proposal), logits, atol=0.25, err_msg=f"P={P}")
        # the argmax: equal unless transformers' top two are within 2 x 0.25 (the logits' bound just above)
        clear += assert_argmax(proposal.argmax(), logits, 0.25, f"P={P}")
    assert clear >= len(POSITIONS), clear  # of the 2 x len(POSITIONS) steps, enough had a clear choice


def test_the_host_centroid_head_equals_transformers(bundle16, oracle, pair):
    """From the int8 sidecars: transformers' own cluster scores and final-norm state in, its masked logits out:
    the same scored ids (the top clusters' tokens); logits and fill (min - 1) within the int8 rows' error."""
    drafter, host = _open(bundle16)
    table = load_file(pair[1] / "model.safetensors")["model.embed_tokens.weight"]
    a = oracle.assistant
    captured = {}
    hooks = [
        a.model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("h", o[0, 0].numpy())),
        a.masked_embedding.centroids.register_forward_hook(lambda m, i, o: captured.__setitem__("c", o[0, 0].numpy())),
    ]
    try:
        for P in POSITIONS:
            emb = embedding(host, oracle.ids[P])
            logits, _ = transformers_draft(a, oracle, emb, oracle.normed[P - 1].numpy(), P)
            h = captured["h"]
            proposal = drafter.head(captured["c"], h)
            scored = logits > logits.min()  # transformers fills the others with the scored minimum - 1
            assert len(proposal.ids) == 4 * 16 == scored.sum()
            assert set(proposal.ids.tolist()) == set(np.flatnonzero(scored).tolist()), P
            # int8 rounds each weight by at most max|row| / 254 (measured: up to 0.42 of this bound)
            bound = np.abs(h).sum() * np.abs(table[proposal.ids]).max(1) / 254 * 1.01
            assert np.all(np.abs(proposal.logits - logits[proposal.ids]) <= bound), P
            assert proposal.fill == pytest.approx(logits.min(), abs=float(bound.max()))
            assert proposal.fill == proposal.logits.min() - 1
    finally:
        for hook in hooks:
            hook.remove()


def _dequantised(package: Path) -> dict:
    """Linear weight name (the checkpoint's) -> the dense weight the program holds, its LUT decompressed here."""
    weights = {}
    for op in Package.open(package).program().functions["draft"].operations:
        if op.op_type != "linear":
            continue
        w = op.weight
        if w.op.op_type == "constexpr_lut_to_dense":
            lut, idx = np.asarray(w.op.lut.val, np.float32), np.asarray(w.op.indices.val).astype(np.intp)
            dense = lut[np.arange(idx.shape[0])[:, None] // (idx.shape[0] // lut.shape[0]), 0, idx, 0]
        else:
            dense = np.asarray(w.val, np.float32)
        weights[re.sub(r"(_to_fp16)?(_palettized)?$", "", w.name)] = (dense, w.op.op_type)
    return weights


@pytest.mark.slow
def test_the_4bit_package_equals_transformers_with_its_weights(e2b_full4, oracle):
    """4-bit LUTs move a random tiny drafter far from its fp32 self, so the oracle gets the program's own
    (decompressed) weights: then the proposals and carries agree within fp16 bounds, and so does the argmax.
    The package is conftest's e2b_full4's (`convert --assistant --bits 4`, which test_byte_identity hashes)."""
    lut = _dequantised(e2b_full4 / "assistant.mlpackage")
    assert sum(kind == "constexpr_lut_to_dense" for _, kind in lut.values()) >= 20
    same = copy.deepcopy(oracle.assistant)
    state = same.state_dict()
    for name in [n for n, t in state.items() if t.ndim == 2 and n.replace(".", "_") in lut]:
        state[name] = torch.from_numpy(lut.pop(name.replace(".", "_"))[0])
    assert not lut, sorted(lut)  # every linear weight of the program has its transformers counterpart
    same.load_state_dict(state)
    drafter, host = _open(e2b_full4)
    exact = 0
    for P, proposal, carry, logits, ref_carry in bursts(drafter, oracle, host, assistant=same):
        # Measured: carry within 1.6 % of its largest value (fp32 executor: 1.1 %, the inputs' fp16 rounding
        # through the 4-bit weights), logits within 0.15; the argmax differs once, where transformers' top two
        # are 0.025 apart
        assert np.abs(carry - ref_carry).max() <= 0.03 * np.abs(ref_carry).max(), P
        np.testing.assert_allclose(expand(proposal), logits, atol=0.25, err_msg=f"P={P}")
        # the same choice, or one of a near-tie (top two within 2 x 0.25, the logits' bound just above)
        exact += assert_argmax(proposal.argmax(), logits, 0.25, f"P={P}")
    assert exact >= len(POSITIONS), exact  # of the 2 x len(POSITIONS) steps, enough had a clear choice
    control = next(bursts(drafter, oracle, host))  # against the unquantised drafter: far off
    assert np.abs(control[2] - control[4]).max() > 0.1 * np.abs(control[4]).max()


# -- convert --assistant --------------------------------------------------------------------------------------


def test_convert_writes_the_package_sidecars_manifest_and_config(bundle16, pair, plan):
    config = read_model_config(bundle16)
    assert config["assistant"] == {
        "draft_tokens": K,
        "hidden_size": 32,
        "backbone_hidden_size": H,
        "num_centroids": 32,
        "centroid_top_k": 4,
        "producers": {SLIDING: 8, FULL: 9},
    }
    package = Package.open(bundle16 / "assistant.mlpackage")
    assert package.function_names == ["draft"] and package.default_function == "draft"
    io = package.interface("draft")
    assert io["states"] == {} and list(io["outputs"]) == ["carry_out", "centroid_scores", "hidden_out"]
    chunk2 = Package.open(bundle16 / "chunk_2.mlpackage").interface("infer")["outputs"]
    for name in ("kv8_k", "kv8_v", "kv9_k", "kv9_v"):  # exactly what chunk_2 returns
        assert io["inputs"][name] == chunk2[name], name
    assert io["inputs"]["causal_mask_sliding"]["shape"] == [1, 1, 1, 48]
    manifest = json.loads((bundle16 / "manifest.json").read_text())
    assert manifest["assistant"]["functions"]["draft"] == {k: io[k] for k in ("inputs", "outputs")}
    assert manifest["options"]["assistant"] == str(pair[1]) and manifest["options"]["draft_tokens"] == K
    assert manifest["plan"]["draft_tokens"] == K and "verify_b4" in manifest["plan"]["chunks"][0]["functions"]
    for f in ("assistant_embed_q8.bin", "assistant_embed_scales.bin", "assistant_token_ordering.bin"):
        assert f in manifest["files"], f
    assert any(f.startswith("assistant.mlpackage/") for f in manifest["files"])
    # the sidecars: the drafter's embedding as int8 rows in cluster order, row j = token ordering[j]
    w = load_file(pair[1] / "model.safetensors")
    order = np.fromfile(bundle16 / "assistant_token_ordering.bin", "<i4")
    assert np.array_equal(order, w["masked_embedding.token_ordering"])
    q, scales = quantize_rows(w["model.embed_tokens.weight"][order])
    assert np.array_equal(np.fromfile(bundle16 / "assistant_embed_q8.bin", np.int8).reshape(V, 32), q)
    assert np.array_equal(np.fromfile(bundle16 / "assistant_embed_scales.bin", "<f2"), scales)
    assert "drafts checked per `verify_b4` call" in (bundle16 / "README.md").read_text()
    assert check_bundle(bundle16) == []


def test_check_reports_a_missing_assistant_package_or_sidecar(bundle16, tmp_path):
    root = tmp_path / "b"
    shutil.copytree(bundle16, root)
    (root / "manifest.json").unlink()  # what model_config.json implies, not what a manifest lists
    shutil.rmtree(root / "assistant.mlpackage")
    (root / "assistant_token_ordering.bin").unlink()
    assert check_bundle(root, sha256=False) == [
        f"{root / 'assistant.mlpackage'}: missing",
        f"{root / 'assistant_token_ordering.bin'}: missing",
    ]
    config = read_model_config(root)
    with pytest.raises(BundleError, match=r"assistant.mlpackage: missing \(model_config.json states an assistant"):
        open_drafter(stated(root, config), Device.of("mil"), load_host(root, config))
    del config["assistant"]
    assert open_drafter(stated(root, config), Device.of("mil"), None) is None


def _model_config(tmp_path, **assistant):
    entry = {"draft_tokens": 3, "hidden_size": 32, "backbone_hidden_size": H, "num_centroids": 32}
    entry.update(centroid_top_k=4, producers={SLIDING: 8, FULL: 9})
    config = dict(vocab_size=V, hidden_size=H, num_hidden_layers=15, per_layer_dim=16, embed_scale=8.0)
    config.update(per_layer_embed_scale=4.0, sliding_window=W, assistant={**entry, **assistant})
    (tmp_path / "model_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "edit, needle",
    [
        (dict(draft_tokens=0), "assistant.draft_tokens=0: expected an integer in [1, 31]"),
        (dict(draft_tokens=32), "assistant.draft_tokens=32"),
        (dict(backbone_hidden_size=48), "assistant.backbone_hidden_size=48: expected the hidden_size"),
        (dict(num_centroids=24), "assistant.num_centroids=24: expected 0 (a plain head) or a divisor of vocab_size"),
        (dict(centroid_top_k=33), "assistant.centroid_top_k=33"),
        (dict(num_centroids=0), "assistant.centroid_top_k=4"),  # a plain head scores every token
        (dict(producers={SLIDING: 8}), "assistant.producers={'sliding_attention': 8}"),
        (dict(producers={SLIDING: 15, FULL: 9}), "assistant.producers="),
        (dict(hidden_size=None), "assistant.hidden_size=None: expected a positive integer"),
    ],
)
def test_a_bad_assistant_entry_is_refused_in_one_line(tmp_path, edit, needle):
    with pytest.raises(BundleError) as e:
        read_model_config(_model_config(tmp_path, **edit))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_good_assistant_entry_reads_back(tmp_path):
    assert read_model_config(_model_config(tmp_path))["assistant"]["producers"] == {SLIDING: 8, FULL: 9}
    config = json.loads((tmp_path / "model_config.json").read_text())
    del config["sliding_window"]
    (tmp_path / "model_config.json").write_text(json.dumps(config))
    with pytest.raises(BundleError, match="sliding_window: missing"):
        read_model_config(tmp_path)


@pytest.fixture(scope="module")
def gqa_assistant(tmp_path_factory):
    d = tmp_path_factory.mktemp("gqa")
    write_tiny(d / "ckpt", preset="gqa-mini", assistant=d / "asst")
    return d / "asst"


def _damaged(pair, tmp_path):
    """The drafter without one of its tensors."""
    bad = tmp_path / "damaged"
    shutil.copytree(pair[1], bad)
    w = load_file(bad / "model.safetensors")
    del w["model.layers.2.self_attn.q_proj.weight"]
    save_file(w, bad / "model.safetensors")
    return bad


@pytest.mark.parametrize(
    "case, needles",
    [
        ("gqa", ["backbone_hidden_size=48: the target's is 64"]),
        ("damaged", ["tensor model.layers.2.self_attn.q_proj.weight missing"]),
        ("nowhere", ["--assistant:", "no such file or directory"]),
        ("published", ["--assistant: the published layout has no drafter"]),
        ("k0", ["--draft-tokens 0: choose 1 to 31"]),
        ("k32", ["--draft-tokens 32: choose 1 to 31"]),
    ],
)
def test_a_bad_assistant_is_refused_in_one_line_with_nothing_written(
    pair, gqa_assistant, tmp_path, capsys, case, needles
):
    assistant = {
        "gqa": gqa_assistant,
        "damaged": _damaged(pair, tmp_path) if case == "damaged" else None,
        "nowhere": tmp_path / "nowhere",
    }.get(case, pair[1])
    extra = {"published": ["--layout", "published"], "k0": ["--draft-tokens", "0"], "k32": ["--draft-tokens", "32"]}
    out = tmp_path / "out"
    argv = [
        "convert",
        str(pair[0]),
        str(out),
        "--assistant",
        str(assistant),
        "--context",
        str(CONTEXT),
        "--no-vision",
        "--quiet",
    ]
    assert main([*argv, *extra.get(case, [])]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("gemma-ane convert: error: "), err
    for needle in needles:
        assert needle in err[0], (needle, err[0])
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] in ([], ["damaged"])


# -- Core ML -------------------------------------------------------------------------------------------------


def test_core_ml_loads_the_drafter_on_first_use_or_says_it_cannot(bundle16, oracle, tmp_path):
    """A device whose Neural Engine refuses `draft` raises FunctionUnavailable at load (the runtime then decodes
    without drafts); on the CPU it runs, and proposes what the executor does."""
    from coreml_standin import install
    from coremltools.models.utils import compile_model

    mil, host = _open(bundle16)
    P, token, carry = 30, oracle.ids[30], oracle.normed[29].numpy()
    kv = caches(oracle, P, mil.widths)
    want, want_carry = mil.step(token, carry, P, kv)
    with install(refuse={"draft"}) as standin:
        refused, _ = _open(bundle16, backend="coreml")
        assert standin.loads == []  # nothing is loaded before it is asked for
        with warnings.catch_warnings(), pytest.raises(FunctionUnavailable, match=r"assistant: 'draft' cannot be"):
            warnings.simplefilter("error")  # refused in our one line, not coremltools' warning beside it
            refused.step(token, carry, P, kv)  # the first step loads `draft`
        cpu, _ = _open(bundle16, backend="coreml", compute_units="cpu_only")
        got = cpu.step(token, carry, P, kv)
        # compiled: the interface comes from manifest.json, which states the package's
        root = tmp_path / "compiled"
        shutil.copytree(bundle16, root)
        compile_model(str(root / "assistant.mlpackage"), str(root / "assistant.mlmodelc"))
        shutil.rmtree(root / "assistant.mlpackage")
        compiled, _ = _open(root, backend="coreml", compute_units="cpu_only")
        compiled_got = compiled.step(token, carry, P, kv)
        (root / "manifest.json").unlink()
        _open(root, backend="coreml")  # without manifest.json: the compiled model's own metadata.json states it
        (root / "assistant.mlmodelc" / "metadata.json").unlink()
        with pytest.raises(BundleError, match="compiled, and manifest.json states no interface for its 'draft'"):
            _open(root, backend="coreml")
    for proposal, c in (got, compiled_got):
        np.testing.assert_array_equal(proposal.ids, want.ids)
        np.testing.assert_array_equal(proposal.logits, want.logits)
        np.testing.assert_array_equal(c, want_carry)


def test_a_device_that_refuses_the_drafter_decodes_without_drafts_after_one_warning(bundle16):
    """Through the runtime on Core ML (the stand-in): the Neural Engine refuses `draft`; the generation that asked
    for drafts says so once and answers as plain decoding does, and later ones say nothing more."""
    from coreml_standin import install

    import gemma_ane

    kw = dict(raw=True, temperature=0, max_tokens=8)
    with install(refuse={"draft"}):
        model = gemma_ane.load(bundle16, backend="coreml")
        plain = model.generate("the cat sat", **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            drafted = model.generate("the cat sat", draft_tokens=K, **kw)
            again = model.generate("the cat sat", draft_tokens=K, **kw)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert re.fullmatch(
        r"assistant: 'draft' cannot be loaded on cpu_and_ne \(.*FAILED.*\); decoding without drafts",
        str(caught[0].message),
    )
    assert drafted.tokens == again.tokens == plain.tokens and drafted.acceptance_rate == 0.0


# -- the runtime with drafts, against transformers at every step ---------------------------------------------------


def _verified_rows(engine, ids, tokens):
    """Our logits rows for each of `tokens` after the prompt `ids`, computed as drafted decoding computes them:
    verify calls of verify_batch tokens wherever one fits, single steps elsewhere (teacher-forced: every row kept)."""
    engine.reset()
    rows, seq = [engine.feed(ids)[-1]], list(ids) + list(tokens)
    while len(rows) < len(tokens):
        p, t = engine.position, engine.verify_batch
        if engine.can_verify() and p + t <= len(seq):
            got, hidden = engine.verify(seq[p : p + t])
            engine.accept(p + t, hidden[-1])
            rows += list(got)
        else:
            rows += engine.feed([seq[p]])
    return np.stack(rows[: len(tokens)])


def test_drafted_greedy_equals_transformers_at_every_step(bundle16, pair):
    """The bundle's runtime with its converted drafter, 3 drafts a verify call, and without it, against the target
    in transformers: 40 new tokens after a 14-token prompt, across the window three times and the ring once
    (positions 0-53 of a ring of 48). Each step of each run is checked against transformers' forward pass over that
    run's own tokens (greedy, penalised as generate does), so a near-tie taken the other way changes what follows
    without ending the check: every token must be transformers' choice, or one of its near-tied ones, for the
    error measured for that run's own computation (our rows along its tokens: single steps for plain decoding,
    verify calls for drafted decoding)."""
    import gemma_ane
    from gemma_ane.oracle.verify import oracle_model, run_engine
    from gemma_ane.runtime.backend import open_engine

    model = gemma_ane.load(bundle16, backend="mil")
    prompt = "the cat sat on the mat and then"
    r = model.generate(prompt, raw=True, temperature=0, max_tokens=40, repetition_penalty=2.0, draft_tokens=K)
    plain = model.generate(prompt, raw=True, temperature=0, max_tokens=40, repetition_penalty=2.0)
    ids = model.prompt_ids(prompt, raw=True)
    assert plain.tokens_per_verify == 0.0 and r.tokens_per_verify >= 1.0
    assert r.finish_reason == "length" and len(ids) + len(r.tokens) > 3 * W + 5
    tables = {k: np.asarray(getattr(model.engine.host, k)) for k in ("embed_q", "embed_scales", "ple_q", "ple_scales")}
    target = oracle_model(Checkpoint(pair[0]), tables)
    engine = open_engine(open_bundle(bundle16, check=False), Device.of("mil", "fp16"))  # gemma_ane.load's precision
    for name, tokens, ours in (
        ("plain", plain.tokens, run_engine(engine, np.asarray(ids + plain.tokens), len(ids), "last")),
        ("drafted", r.tokens, _verified_rows(engine, ids, r.tokens)),
    ):
        with torch.no_grad():
            logits = target(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].numpy()
        ref_rows = repetition_penalised(logits, ids, tokens, 2.0)
        err = float(np.abs(repetition_penalised(ours[: len(tokens)], ids, tokens, 2.0) - ref_rows).max())
        clear = sum(assert_argmax(t, row, err, f"{name} step {i}") for i, (t, row) in enumerate(zip(tokens, ref_rows)))
        # measured: plain err 0.11, 37 of 40 steps clear; drafted err 0.17, 34 clear
        assert clear >= 30, f"{name}: only {clear} of {len(tokens)} steps had a clear margin (err {err:.3g})"


def test_the_command_line_drafts_and_reports_it(bundle16, capsys):
    argv = ["generate", str(bundle16), "-p", "the cat sat", "--raw", "--temperature", "0", "--max-tokens", "12"]
    assert main([*argv, "--backend", "mil", "--draft", str(K)]) == 0
    drafted = capsys.readouterr()
    assert re.search(r"\| drafts: \d+% accepted, \d\.\d\d tokens a verify call \|", drafted.err), drafted.err
    assert main([*argv, "--backend", "mil"]) == 0
    plain = capsys.readouterr()
    assert plain.out == drafted.out and "drafts:" not in plain.err
    assert main([*argv, "--backend", "mil", "--draft", str(K + 1)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gemma-ane generate: error: --draft {K + 1}: this bundle verifies at most {K} drafts a call"]


def test_draft_options_without_a_drafter_are_refused_in_one_line(pair, tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["convert", str(pair[0]), str(out), "--draft-tokens", "2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--draft-tokens: needs --assistant" in err[0] and not out.exists()


def test_the_server_drafts_for_every_request(bundle16, monkeypatch):
    """`serve --draft K` (a startup option): every completion decodes with drafts, answers as without them."""
    from starlette.testclient import TestClient

    import gemma_ane
    from gemma_ane.server.app import build_app

    model = gemma_ane.load(bundle16, backend="mil")
    body = {"model": "m", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 10, "temperature": 0}
    answers, steps = [], []
    verify = model.engine.verify
    monkeypatch.setattr(model.engine, "verify", lambda ids: steps.append(len(ids)) or verify(ids))
    for k in (0, K):
        model.use_drafts(k)
        with TestClient(build_app(model, model_name="m")) as http:
            answers.append(http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"])
    assert answers[0] == answers[1] and steps and set(steps) == {K + 1}
    r = subprocess.run(
        [sys.executable, "-m", "gemma_ane.server.app", str(bundle16), "--backend", "mil", "--draft", str(K + 1)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"--draft {K + 1}: this bundle verifies at most {K} drafts a call" in r.stderr  # the flag typed


def test_a_prompt_cache_file_is_reused_with_a_drafter(e2b_full16, tmp_path):
    """The rings' newest write travels with a prompt cache file: loaded into a drafter's bundle, the cached prompt is
    reused but its last token (was 0: restore assumed a verify batch of rejected drafts past the prompt, which
    `reuse` could not rewind into), and the answer is the one computed from scratch."""
    from gemma_ane.runtime.model import load

    prompt = "the cat sat on the mat and the dog sat on the rug"
    model = load(e2b_full16, backend="mil")
    first = model.generate(prompt, raw=True, max_tokens=6, temperature=0, draft_tokens=3)
    assert model.engine.verify_batch is not None and first.tokens_per_verify >= 1  # the drafter ran
    path = tmp_path / "cache.npz"
    model.save_prompt_cache(path, first.prompt_tokens)
    other = load(e2b_full16, backend="mil")
    assert other.load_prompt_cache(path) == first.prompt_tokens
    again = other.generate(prompt, raw=True, max_tokens=6, temperature=0, draft_tokens=3)
    assert again.reused_tokens == first.prompt_tokens - 1 and again.tokens == first.tokens
