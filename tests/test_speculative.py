"""Speculative decoding through the runtime's own loop, on the PyTorch graph of a bundle that verifies drafts
(fp32 chunks: every row a verify call scores is the logit plain decoding computes). The drafter is scripted: it
proposes the target's known greedy continuation with mistakes at chosen positions, so every branch (accept all,
accept none, accept some, a rejection where the ring wraps) is driven deliberately; a random drafter would be
rejected nearly always. Against transformers' drafter and the converted assistant: tests/test_drafter.py."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from gemma_ane.bundle.plan import ChunkPlan, ring_slots
from gemma_ane.bundle.spec import ConfigError
from gemma_ane.convert.checkpoint import Checkpoint
from gemma_ane.convert.models.text import TorchChunk, build_chunks
from gemma_ane.oracle.verify import host_from_checkpoint
from gemma_ane.runtime.engine import Engine, FunctionUnavailable
from gemma_ane.runtime.hf_files import read_template
from gemma_ane.runtime.model import Model
from gemma_ane.runtime.sampling import BAN, Proposal

pytestmark = pytest.mark.slow  # the graph runs every position in fp32 torch (about a minute)

CONTEXT, K = 96, 3  # e2b-mini: window 16; the rings hold 16 + 32 = 48 slots
RING = 48
PROMPT = "the cat sat on the mat and"  # 12 tokens with <bos>: 4-token verify calls end at slot 48 from 44


@pytest.fixture(scope="module")
def graph(tiny_e2b):
    ckpt = Checkpoint(tiny_e2b)
    plan = ChunkPlan.build(ckpt.spec, CONTEXT, 8, kv_batches=(8,), draft_tokens=K)
    assert plan.ring == RING
    return tiny_e2b, ckpt, plan, [TorchChunk(m) for m in build_chunks(plan, ckpt, torch.float32)]


class ScriptedDrafter:
    """Proposes truth[q] for the position q each draft fills (a burst at P drafts P+1, P+2, ...), another token
    where q is in `wrong`."""

    def __init__(self, vocab: int, truth: dict[int, int], wrong=()):
        self.vocab, self.truth, self.wrong = vocab, truth, set(wrong)
        self.at, self.n, self.bursts = None, 0, []

    def step(self, token, carry, position, kv):
        assert carry is not None and kv, "a draft reads the target's final hidden state and its K/V"
        self.n = self.n + 1 if self.at == position else 0
        if self.n == 0:
            self.bursts.append(position)
        self.at, q = position, position + 1 + self.n
        tok = (self.truth[q] + (q in self.wrong)) % self.vocab
        return Proposal(ids=np.array([tok]), logits=np.zeros(1, np.float32), fill=-30.0, vocab=self.vocab), carry


def make_model(graph, drafter=None, draft_tokens=0) -> Model:
    root, ckpt, plan, chunks = graph
    engine = Engine.from_chunks(chunks, host_from_checkpoint(ckpt, CONTEXT), window=plan.window)
    tokenizer = Tokenizer.from_file(str(Path(root) / "tokenizer.json"))
    config = {"vocab_size": ckpt.spec.vocab_size, "eos_token_id": 1}
    model = Model(root, engine, tokenizer, read_template(Path(root)), {}, config, "torch", drafter=drafter)
    model.draft_tokens = draft_tokens
    return model


def run(model, **kw):
    # every stop token banned (the same logit bias on both paths): greedy runs to the end of the context
    kw.setdefault("max_tokens", CONTEXT)
    return model.generate(PROMPT, raw=True, temperature=0, logit_bias={t: BAN for t in model.stop_ids}, **kw)


@pytest.fixture(scope="module")
def reference(graph):
    """Plain greedy decoding to the context's end (the window wraps five times, the ring once), and every
    position's token."""
    r = run(make_model(graph))
    assert r.finish_reason == "length" and r.prompt_tokens == 12 and r.prompt_tokens + len(r.tokens) == CONTEXT + 1
    ids = make_model(graph).prompt_ids(PROMPT, raw=True)
    return r, dict(enumerate(ids + r.tokens))


def drafted(graph, reference, wrong=(), **kw):
    drafter = ScriptedDrafter(512, reference[1], wrong)
    model = make_model(graph, drafter, draft_tokens=K)
    return run(model, **kw), drafter, model


@pytest.mark.parametrize(
    "wrong, rate",
    [
        ((), 1.0),  # every draft accepted: 4 tokens a call
        (range(CONTEXT + 4), 0.0),  # every draft rejected: the target's own token, 1 a call (to 60 tokens)
        (range(13, CONTEXT + 4, 3), None),  # some: rejections at each offset within a burst
    ],
)
def test_greedy_with_drafts_is_plain_greedy(graph, reference, wrong, rate):
    n = 60 if rate == 0.0 else CONTEXT
    r, drafter, _ = drafted(graph, reference, wrong, max_tokens=n)
    assert r.tokens == reference[0].tokens[:n] and r.finish_reason == "length"
    assert len(drafter.bursts) > 10
    if rate is not None:
        assert r.acceptance_rate == rate and r.tokens_per_verify == 1 + K * rate
    else:
        assert 0.2 < r.acceptance_rate < 0.8 and 1 < r.tokens_per_verify < 1 + K


def test_a_rejection_where_the_ring_wraps(graph, reference):
    """Bursts at 12, 16, ..., 44: the call at 44 writes the ring's last slots (44-47), its draft for 46 is
    rejected; 46 and 47 cannot verify without wrapping (one plain step each), and 48 verifies from slot 0.
    Every later position still attends to rows the rejected ones never overwrote."""
    r, drafter, _ = drafted(graph, reference, wrong={46})
    assert r.tokens == reference[0].tokens
    assert {44, 48} <= set(drafter.bursts) and not {46, 47} & set(drafter.bursts)
    assert 44 % RING + K + 1 == RING


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 6, 7])
def test_max_tokens_holds_when_a_call_emits_several(graph, reference, max_tokens):
    r, _, model = drafted(graph, reference, max_tokens=max_tokens)
    assert r.tokens == reference[0].tokens[:max_tokens] and r.finish_reason == "length"
    # the caches hold what plain decoding leaves: the prompt and every token emitted but the last
    assert model.engine.tokens == list(reference[1].values())[: 12 + max_tokens - 1]


def test_a_stop_string_inside_a_verified_batch(graph, reference):
    plain = reference[0]
    stop = plain.text[len(plain.text) // 3 : len(plain.text) // 3 + 4]
    r, _, model = drafted(graph, reference, stop=stop)
    expect = run(make_model(graph), stop=stop)
    assert r.text == expect.text and r.tokens == expect.tokens and r.finish_reason == "stop"
    assert (
        len(r.tokens) < len(plain.tokens) - K
        and model.engine.tokens == list(reference[1].values())[: 12 + len(r.tokens) - 1]
    )
    # every draft held, so each call emitted K + 1 tokens, but the last only those up to the stop
    after_first = len(r.tokens) - 1  # the first token comes from the prompt's logits
    assert after_first % (K + 1) and r.acceptance_rate == 1.0
    assert r.tokens_per_verify == after_first / math.ceil(after_first / (K + 1))


def test_prefix_reuse_after_drafting(graph, reference):
    """A follow-up prompt sharing the drafted conversation reuses its caches (rows of rejected drafts and all)
    and gives the logits a fresh engine gives."""
    _, _, model = drafted(graph, reference, wrong=range(13, CONTEXT, 5), max_tokens=70)
    ids = list(reference[1].values())[:75] + [7, 8, 9]
    reused, logits = model.engine.prompt(ids)
    fresh = make_model(graph).engine.prompt(ids)[1]
    assert reused == 75 and np.allclose(logits, fresh, atol=1e-4)


def test_a_verify_function_the_device_refuses_leaves_plain_decoding(graph, reference, monkeypatch):
    r0, drafter, model = drafted(graph, reference, max_tokens=3)
    chunk = model.engine.chunks[1]

    def refuse(function):
        if function.startswith("verify"):
            raise FunctionUnavailable(f"{chunk.name}: {function} does not compile for the Neural Engine")

    monkeypatch.setattr(chunk, "load", refuse)
    model.engine.loaded.discard(f"verify_b{K + 1}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = run(model, max_tokens=12)
        again = run(model, draft_tokens=K, max_tokens=12)
    assert r.tokens == again.tokens == reference[0].tokens[:12] and r.acceptance_rate == 0.0
    assert [str(w.message) for w in caught] == [
        f"chunk_2: verify_b{K + 1} does not compile for the Neural Engine; decoding without drafts"
    ]


def test_draft_tokens_is_checked(graph, reference):
    with pytest.raises(ValueError, match="draft_tokens=2: this bundle has no drafter"):
        run(make_model(graph), draft_tokens=2)
    model = make_model(graph, ScriptedDrafter(512, reference[1]))
    with pytest.raises(ValueError, match=f"draft_tokens=4: this bundle verifies at most {K} drafts a call"):
        run(model, draft_tokens=4)
    with pytest.raises(ValueError, match="draft_tokens=-1"):
        run(model, draft_tokens=-1)
    assert run(model, draft_tokens=2, max_tokens=9).tokens == reference[0].tokens[:9]  # fewer drafts than K


def test_without_the_ring_pad_rejected_rows_evict_what_later_positions_read(graph, reference, monkeypatch):
    """The control for the pad: rings of exactly the window (16 slots, as the published layout's), the same drafts
    and rejections. A verify call's rows then overwrite positions the next accepted ones still attend to, and the
    output departs from plain decoding's; with the pad it keeps its tokens and their log-probabilities."""
    import gemma_ane.bundle.plan

    root, ckpt, _, _ = graph
    wrong = range(13, CONTEXT + 4, 3)
    padded = drafted(graph, reference, wrong, logprobs=0)[0]
    monkeypatch.setattr(gemma_ane.bundle.plan, "ring_slots", lambda window, draft_tokens=0, kv_batches=(): window)
    plan = ChunkPlan.build(ckpt.spec, CONTEXT, 8, kv_batches=(8,), draft_tokens=K)
    assert plan.ring == 16
    unpadded = (root, ckpt, plan, [TorchChunk(m) for m in build_chunks(plan, ckpt, torch.float32)])
    plain = run(make_model(graph), logprobs=0)
    assert padded.tokens == plain.tokens and np.allclose(padded.logprobs, plain.logprobs, atol=1e-4)
    assert drafted(unpadded, reference, wrong)[0].tokens != plain.tokens  # measured: log-probabilities 0.8 apart


def test_the_ring_pad_is_what_makes_rejections_exact():
    assert ring_slots(512) == 512 and ring_slots(512, 3, (64, 8)) == 576 and ring_slots(16, 31, (8,)) == 48
    assert ring_slots(16, 3) == 48 and ring_slots(512, 31) == 544
    with pytest.raises(ConfigError, match="draft_tokens=32"):
        ChunkPlan.build(_spec(), 128, 8, draft_tokens=32)


def _spec():
    from gemma_ane.bundle.spec import ModelSpec
    from gemma_ane.oracle.tiny import text_config

    return ModelSpec.from_config({"text_config": text_config("e2b-mini")})
