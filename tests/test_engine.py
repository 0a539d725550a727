"""The step driver and its cache rules, observed through a recording backend: which function runs
at which position, and what a new prompt may reuse. Backend-agnostic, so these hold for all."""

import warnings

import numpy as np
import pytest

from gemma_ane.runtime.engine import MAX_SNAPSHOTS, RING, ContextOverflow, Engine, FunctionUnavailable


class Recorder:
    """A chunk that logs its calls. With a `window`, it keeps a ring state as a cache does: each
    row's token id (the host embeds ids as hidden states) lands in slot position mod window."""

    def __init__(self, name, log, outputs, functions=("infer",), window=None):
        self.name, self.log, self.outputs, self.window = name, log, outputs, window
        types = {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in outputs(1).items()}
        states = {RING: {"shape": [window], "dtype": "float32"}} if window else {}
        self.interfaces = {f: {"inputs": {}, "outputs": types, "states": states} for f in functions}
        self.refuse, self.loads = set(), []

    def load(self, function):
        self.loads.append(function)
        if function in self.refuse:
            raise FunctionUnavailable(f"{self.name}: function {function!r} cannot be loaded on cpu_and_ne")

    def make_state(self):
        return {RING: np.zeros(self.window, np.float32)} if self.window else None

    def read_state(self, state, name):
        return state[name].copy()

    def write_state(self, state, name, array):
        state[name][...] = array

    def predict(self, function, inputs, state):
        T, p0 = inputs["hidden_states"].shape[1], int(inputs.get("current_pos", [-1])[0])
        self.log.append((self.name, function, p0, T))
        if state is not None:
            state[RING][(p0 + np.arange(T)) % self.window] = inputs["hidden_states"][0, :, 0]
        return self.outputs(T)


def recording_engine(window=16, context=64, batch=8, kv=()):
    log, V, H, PL = [], 10, 4, 6
    outs = {
        "chunk_1": lambda T: {"hidden_states_out": np.zeros((1, T, H)), "per_layer_combined_out": np.zeros((1, T, PL))},
        "chunk_2": lambda T: {"hidden_states_out": np.zeros((1, T, H))},
        "chunk_3": lambda T: {"logits": np.zeros((1, 1, V))},
    }
    prompt = (f"prefill_b{batch}",) * bool(batch) + tuple(f"prefill_kv_b{T}" for T in kv)
    chunks = [
        Recorder(n, log, f, ("infer",) + prompt * (n != "chunk_3"), window if n == "chunk_1" else None)
        for n, f in outs.items()
    ]

    class Host:
        rope = {}

        def embed(self, ids):
            return np.repeat(np.asarray(ids, np.float32)[None, :, None], H, axis=2), np.zeros((1, len(ids), PL))

    return Engine(chunks, Host(), context=context, window=window, prefill_batch=batch, kv_batches=kv), log


def test_schedule_prefills_only_exact_batches_and_runs_head_once():
    engine, log = recording_engine()
    logits = engine.feed(np.arange(30))
    assert len(logits) == 1
    calls = [(n, f, p) for n, f, p, _ in log if n == "chunk_1"]
    # batches at 0 and 8 stay inside the first ring pass (16); everything after is single steps
    assert calls[:2] == [("chunk_1", "prefill_b8", 0), ("chunk_1", "prefill_b8", 8)]
    assert all(f == "infer" for _, f, _ in calls[2:]) and len(calls) == 2 + 14
    assert [e for e in log if e[0] == "chunk_3"] == [("chunk_3", "infer", 29, 1)]
    # a prompt that ends exactly on a batch boundary still ends with one infer step
    engine.reset(), log.clear()
    engine.feed(np.arange(8))
    assert [(f, p) for n, f, p, _ in log if n == "chunk_1"] == [("infer", p) for p in range(8)]


def test_schedule_from_unaligned_position_and_overflow():
    engine, log = recording_engine()
    engine.feed([1, 2, 3])
    log.clear()
    engine.feed(np.arange(12))
    assert [(f, p) for n, f, p, _ in log if n == "chunk_1"][:1] == [("prefill_b8", 3)]
    with pytest.raises(ContextOverflow, match="exceed the context of 64"):
        engine.feed(np.arange(50))


# -- the cache rules -------------------------------------------------------------------------------


def ring_of(ids, window=16):
    """The ring after writing ids at positions 0, 1, ... in order: what a fresh run leaves."""
    ring = np.zeros(window, np.float32)
    for p, t in enumerate(ids):
        ring[p % window] = t
    return ring


def test_reuse_keeps_the_common_prefix_whatever_batches_produced_it():
    engine, log = recording_engine(window=16, context=64)
    engine.feed(np.arange(4))  # infer x4, where a fresh run of a longer prompt batches 0-7
    assert engine.reuse(list(range(12))) == 4 and engine.position == 4
    engine.feed(np.arange(4, 12))
    # the same prompt again: everything but the last token is kept, and only it runs again
    log.clear()
    assert engine.reuse(list(range(12))) == 11
    assert engine.position == 11 and engine.tokens == list(range(11))
    engine.feed([11])
    assert [(f, p) for n, f, p, _ in log if n == "chunk_1"] == [("infer", 11)]
    assert engine.reuse([0, 1, 2, 3, 4, 5, 6, 7, 8, 99, 100, 101]) == 9  # first difference at index 9
    assert engine.tokens == list(range(9))


def test_reuse_refuses_a_rewind_over_a_wrapped_ring():
    engine, _ = recording_engine(window=16, context=64)
    ids = list(range(1, 21))
    engine.feed(ids)  # position 19 overwrote ring slot 3: a prefix of 10 needs slots 0-9 intact
    assert engine.reuse(ids[:10] + [99] * 5) == 0
    assert engine.position == 0 and engine.tokens == [] and engine.history == []
    engine.feed(ids[:15])  # nothing wrapped: rewinding to 10 is exact
    assert engine.reuse(ids[:10] + [99] * 5) == 10
    assert engine.tokens == ids[:10] and engine.position == 10


def test_a_snapshot_at_the_prompt_end_keeps_reuse_alive_past_the_wrap():
    engine, _ = recording_engine(window=16, context=64)
    ids = list(range(1, 21))
    assert engine.prompt(ids[:10])[0] == 0  # a prompt: its end (10) is snapshotted
    engine.feed(ids[10:])  # the answer wraps the ring over slots the prompt's tokens occupied
    assert engine.states[0][RING][3] == ids[19]
    assert engine.reuse(ids[:12] + [99] * 5) == 10  # back to the snapshot, not to the common 12
    np.testing.assert_array_equal(engine.states[0][RING], ring_of(ids[:10]))
    engine.feed(ids[10:12] + [99] * 5)
    np.testing.assert_array_equal(engine.states[0][RING], ring_of(ids[:12] + [99] * 5))
    # a prompt that leaves the snapshot's tokens cannot use it; nor can one after a reset
    engine.feed(list(range(30, 40)))
    assert engine.reuse(ids[:9] + [77] * 5) == 0
    engine.prompt(ids[:10]), engine.reset()
    assert engine.snapshots == [] and engine.reuse(ids[:10] + [1]) == 0


def test_prompt_marks_add_snapshots_and_only_the_newest_are_kept():
    engine, log = recording_engine(window=16, context=64)
    ids = list(range(1, 41))
    kept, logits = engine.prompt(ids[:30], marks=(5, 12, 30, 99))
    assert kept == 0 and logits.shape == (10,)
    assert [s.position for s in engine.snapshots] == [5, 12, 30]
    assert [p for n, _, p, _ in log if n == "chunk_3"] == [29]  # the head runs for the prompt's end only
    for s in engine.snapshots:
        np.testing.assert_array_equal(s.rings[0][RING], ring_of(ids[: s.position]))
    engine.feed(ids[30:])
    assert engine.reuse(ids[:14] + [0]) == 12  # the newest snapshot inside the common prefix
    for end in (20, 24, 28, 32, 36):
        engine.prompt(ids[:end])
    assert [s.position for s in engine.snapshots] == [24, 28, 32, 36][-MAX_SNAPSHOTS:]


def test_a_failed_step_resets_the_caches():
    engine, _ = recording_engine()
    engine.feed(np.arange(5))
    chunk2 = engine.chunks[1]
    chunk2.outputs, outputs = None, chunk2.outputs  # the next call fails inside the backend
    with pytest.raises(TypeError):
        engine.feed([5, 6])
    chunk2.outputs = outputs
    assert engine.position == 0 and engine.tokens == [] and engine.history == []


def test_a_prompt_resumed_unaligned_steps_to_alignment_then_takes_kv_batches():
    engine, _ = recording_engine(window=512, context=2048, kv=(64, 8))
    fresh = engine.plan(0, 155)
    assert fresh[:2] == [("prefill_kv_b64", 64)] * 2 and fresh[-1] == ("infer", 1)
    resumed = engine.plan(155, 154)  # 155 = 8 * 19 + 3: five single steps reach 160
    assert resumed[:6] == [("infer", 1)] * 5 + [("prefill_kv_b8", 8)]
    assert ("prefill_kv_b64", 64) in resumed and sum(T for _, T in resumed) == 154
    assert engine.plan(155, 10) == [("prefill_b8", 8)] + [("infer", 1)] * 2  # no KV batch fits after aligning
    assert engine.plan(155, 154, logits="all")[0] == ("prefill_b8", 8)  # logits everywhere: no KV batches


def test_a_refused_function_leaves_the_prompt_paths_with_one_warning():
    """A device that cannot load prefill_b8 (an ANE compile failure): the prompt runs through what
    remains, the function is loaded only when first planned, and the warning comes once."""
    engine, log = recording_engine(kv=(4,))
    assert all(c.loads == [] for c in engine.chunks)  # nothing loaded before it is needed
    engine.chunks[1].refuse.add("prefill_b8")
    with pytest.warns(RuntimeWarning, match=r"chunk_2: function 'prefill_b8' cannot be loaded.*prefill_kv_b4, infer"):
        engine.feed(np.arange(14), logits="all")  # all logits: no KV-only batches, so prefill_b8 is planned
    assert [f for _, f, _ in engine.history] == ["infer"] * 14 and engine.prefill_batch is None
    assert engine.chunks[0].loads == ["prefill_b8"] and engine.chunks[2].loads == []
    engine.chunks[0].refuse.add("prefill_kv_b4")
    with pytest.warns(RuntimeWarning, match=r"'prefill_kv_b4' cannot be loaded.*\(infer one token at a time\)"):
        engine.feed(np.arange(14, 24))  # prefill_kv_b4 is planned at 16
    assert engine.kv_batches == () and [f for _, f, _ in engine.history[14:]] == ["infer"] * 10
    engine.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing more to warn about
        engine.feed(np.arange(20))
    assert {f for _, f, _ in engine.history} == {"infer"}


# -- the backend contract ---------------------------------------------------------------------------


def test_every_backend_meets_the_chunk_backend_contract():
    """Core ML, the MIL executor and the PyTorch graph present the same methods as ChunkBackend."""
    import inspect

    from gemma_ane.convert.models.text import TorchChunk
    from gemma_ane.runtime.backend import ChunkBackend, CoreMLBackend, MILBackend

    for name in ("load", "make_state", "predict"):
        want = list(inspect.signature(getattr(ChunkBackend, name)).parameters)
        for backend in (CoreMLBackend, MILBackend, TorchChunk):
            assert list(inspect.signature(getattr(backend, name)).parameters) == want, (backend.__name__, name)
