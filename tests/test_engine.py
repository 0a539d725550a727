"""The step driver and its cache rules, observed through a recording backend: which function runs
at which position, and what a new prompt may reuse. Backend-agnostic, so these hold for all."""

import warnings

import numpy as np
import pytest

from gemma_ane.engine import ContextOverflow, Engine, FunctionUnavailable


class Recorder:
    def __init__(self, name, log, outputs, functions=("infer",)):
        self.name, self.log, self.outputs = name, log, outputs
        types = {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in outputs(1).items()}
        self.interfaces = {f: {"inputs": {}, "outputs": types, "states": {}} for f in functions}
        self.refuse, self.loads = set(), []

    def load(self, function):
        self.loads.append(function)
        if function in self.refuse:
            raise FunctionUnavailable(f"{self.name}: function {function!r} cannot be loaded on cpu_and_ne")

    def make_state(self):
        return None

    def predict(self, function, inputs, state):
        T = inputs["hidden_states"].shape[1]
        self.log.append((self.name, function, int(inputs.get("current_pos", [-1])[0]), T))
        return self.outputs(T)


def recording_engine(window=16, context=64, batch=8, kv=()):
    log, V, H, PL = [], 10, 4, 6
    outs = {
        "chunk_1": lambda T: {"hidden_states_out": np.zeros((1, T, H)), "per_layer_combined_out": np.zeros((1, T, PL))},
        "chunk_2": lambda T: {"hidden_states_out": np.zeros((1, T, H))},
        "chunk_3": lambda T: {"logits": np.zeros((1, 1, V))},
    }
    prompt = (f"prefill_b{batch}",) * bool(batch) + tuple(f"prefill_kv_b{T}" for T in kv)
    chunks = [Recorder(n, log, f, ("infer",) + prompt * (n != "chunk_3")) for n, f in outs.items()]

    class Host:
        rope = {}

        def embed(self, ids):
            return np.zeros((1, len(ids), H)), np.zeros((1, len(ids), PL))

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


def test_reuse_keeps_the_steps_a_fresh_run_would_take():
    engine, log = recording_engine(window=16, context=64)
    engine.feed(np.arange(12))  # prefill_b8 at 0, then infer at 8-11
    fresh = engine.plan(0, 12)
    assert engine.history == [(p, f, T) for p, (f, T) in zip(np.cumsum([0] + [T for _, T in fresh])[:-1], fresh)]
    # the same prompt again: every step but the last token's is kept, and only it runs again
    log.clear()
    assert engine.reuse(list(range(12))) == 11
    assert engine.position == 11 and engine.tokens == list(range(11))
    engine.feed([11])
    assert [(f, p) for n, f, p, _ in log if n == "chunk_1"] == [("infer", 11)]


def test_reuse_stops_at_the_first_different_token_and_where_the_steps_differ():
    engine, _ = recording_engine(window=16, context=64)
    engine.feed(np.arange(10))  # prefill_b8 at 0, infer at 8 and 9
    assert engine.reuse([0, 1, 2, 3, 4, 5, 6, 7, 8, 99, 100, 101]) == 9  # first difference at index 9
    engine.reset()
    engine.feed(np.arange(4))  # infer x4: a fresh run of a longer prompt batches 0-7 instead
    assert engine.reuse(list(range(12))) == 0
    assert engine.position == 0 and engine.tokens == [] and engine.history == []


def test_reuse_refuses_a_rewind_over_a_wrapped_ring():
    engine, _ = recording_engine(window=16, context=64)
    ids = list(range(20))
    engine.feed(ids)  # position 19 overwrote ring slot 3: a prefix of 10 needs slots 0-9 intact
    assert engine.reuse(ids[:10] + [99] * 5) == 0
    engine.reset()
    engine.feed(ids[:15])  # nothing wrapped: rewinding to 10 is exact
    assert engine.reuse(ids[:10] + [99] * 5) == 10
    assert engine.tokens == ids[:10] and engine.position == 10


def test_a_failed_step_resets_the_caches():
    engine, _ = recording_engine()
    engine.feed(np.arange(5))
    chunk2 = engine.chunks[1]
    chunk2.outputs, outputs = None, chunk2.outputs  # the next call fails inside the backend
    with pytest.raises(TypeError):
        engine.feed([5, 6])
    chunk2.outputs = outputs
    assert engine.position == 0 and engine.tokens == [] and engine.history == []


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

    from gemma_ane.backend import ChunkBackend, CoreMLBackend, MILBackend
    from gemma_ane.graph import TorchChunk

    for name in ("load", "make_state", "predict"):
        want = list(inspect.signature(getattr(ChunkBackend, name)).parameters)
        for backend in (CoreMLBackend, MILBackend, TorchChunk):
            assert list(inspect.signature(getattr(backend, name)).parameters) == want, (backend.__name__, name)
