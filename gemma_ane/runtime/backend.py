"""Chunk backends: the one contract every way of running a chunk meets.

The engine drives three chunks and never knows what runs them: Core ML on macOS, the MIL executor
anywhere, or (for verification) the PyTorch graph in `graph.TorchChunk`. Each is a `ChunkBackend`:
it states its functions and their I/O, makes fresh states, and predicts. The state lives outside
the backend, as Core ML's `MLState` does, so the engine owns the caches it drives (and can reset
or, later, snapshot them) whatever the backend.

Torch-free: this is the runtime side.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..bundle import layout
from ..bundle.errors import BundleError
from ..bundle.interfaces import Interface, one_function_interfaces, read_interfaces
from ..bundle.ladder import rung_function, rungs_of, split_rung
from ..bundle.opened import Bundle
from ..bundle.tables import check_norm_sidecar, check_rope, load_host
from .device import COMPUTE_UNITS, BackendError, Device
from .engine import Engine, FunctionUnavailable
from .ladder import ladder_of


class ChunkBackend(Protocol):
    """One chunk package, as every backend presents it.

    - `name`: the chunk's name (`chunk_1`, ...), for messages;
    - `interfaces`: function name -> Interface, read from the model itself (never from our plan),
      the default function first;
    - `load(function)`: make a function ready to run. `infer` is ready once the backend is open;
      the others (CONTRACT §3: optional) may be loaded on first use, and a device that cannot load
      one raises FunctionUnavailable;
    - `make_state(function)`: a fresh, zeroed state that every function of the chunk shares (Core ML lets
      `infer` and `prefill_b8` write one KV cache), or None for a stateless chunk; `function` ("infer" unless
      a context ladder's rung is meant: `ctx{C}_infer`) decides its shapes;
    - `predict(function, inputs, state)`: run one function; inputs are numpy arrays by name in any
      float/int dtype (the backend casts them to the declared ones); returns numpy arrays by name;
    - `read_state(state, name)` / `write_state(state, name, array)`: one state's contents as a
      numpy array of its declared dtype, and back (Core ML: `MLState.read_state/write_state`,
      coremltools >= 9), for snapshots of the caches;
    - `release(functions)`: forget those loaded functions (a ladder's rung left behind), whose wired weights
      a device then frees.
    """

    name: str
    interfaces: dict[str, Interface]

    def load(self, function: str) -> None: ...

    def make_state(self, function: str = "infer") -> Any: ...

    def predict(self, function: str, inputs: dict[str, np.ndarray], state: Any) -> dict[str, np.ndarray]: ...

    def read_state(self, state: Any, name: str) -> np.ndarray: ...

    def write_state(self, state: Any, name: str, array: np.ndarray) -> None: ...

    def release(self, functions: list[str]) -> None: ...


def cast_inputs(interface: Interface, inputs: dict) -> dict:
    """The declared inputs, each cast to its declared dtype (extra keys are not passed on)."""
    return {n: np.asarray(inputs[n]).astype(t["dtype"], copy=False) for n, t in interface["inputs"].items()}


def function_of(chunk: ChunkBackend, function: str) -> Interface:
    if function not in chunk.interfaces:
        raise BackendError(f"{chunk.name}: no function {function!r} (has {', '.join(chunk.interfaces)})")
    return chunk.interfaces[function]


class MILBackend:
    """A package run by our MIL executor: its functions loaded together, sharing weights."""

    def __init__(self, path: Path, precision: str = "fp16"):
        from ..mil.executor import MILPackage

        self.package = MILPackage(path, precision)
        self.name = Path(path).name.split(".")[0]
        self.interfaces = {f: m.interface for f, m in self.package.functions.items()}

    def load(self, function: str) -> None:
        function_of(self, function)  # the executor loaded every function with the package

    def make_state(self, function: str = "infer"):
        return self.package.functions[function].make_state() if function_of(self, function)["states"] else None

    def predict(self, function: str, inputs: dict, state) -> dict:
        io = function_of(self, function)
        return self.package.functions[function].predict(cast_inputs(io, inputs), state=state)

    def read_state(self, state, name: str) -> np.ndarray:
        return state.arrays[name].copy()

    def write_state(self, state, name: str, array: np.ndarray) -> None:
        state.arrays[name][...] = array

    def release(self, functions: list[str]) -> None:
        """Nothing to free: the executor's functions share one copy of the weights, loaded with the package."""


def smallest_infer(interfaces: dict[str, Interface]) -> str:
    """The infer function of a chunk's smallest rung (bundle.ladder): `infer` itself unless it carries a ladder."""
    rungs = rungs_of(interfaces)
    return rung_function("infer", rungs[0], rungs[-1]) if rungs else "infer"


def open_mlmodel(path: Path, units, function: str):
    """(MLModel, None), or (None, the framework's error) when the device refuses the function. coremltools also
    warns then ("You will not be able to run predict()"); the caller says it in one line of its own instead."""
    import coremltools as ct

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You will not be able to run predict", RuntimeWarning)
        model = ct.models.MLModel(str(path), compute_units=units, function_name=function)
    return (model, None) if model.__proxy__ is not None else (None, model._framework_error)


class CoreMLBackend:
    """A package run by Core ML (macOS): one model per function, sharing one MLState.

    Only `infer` is loaded up front. Every other function is loaded on first use (`load`): each
    load compiles for the device, and a device may refuse one (CoreML-LLM reports the Neural Engine
    compiler failing every stateful function with T > 1 on A19 Pro), which must cost that prompt
    path, not the model.
    """

    def __init__(self, path: Path, compute_units: str = "cpu_and_ne"):
        import coremltools as ct

        if compute_units not in COMPUTE_UNITS:
            raise BackendError(f"compute_units={compute_units!r}: choose one of {', '.join(COMPUTE_UNITS)}")
        path = Path(path)
        self.name, self.compute_units = path.name.split(".")[0], compute_units
        self.interfaces = read_interfaces(path)
        self.units = getattr(ct.ComputeUnit, COMPUTE_UNITS[compute_units])
        # a context ladder starts on its smallest rung: only that rung's infer is loaded (each loaded function
        # wires its own copy of the weights)
        first = smallest_infer(self.interfaces)
        if path.suffix == ".mlpackage":
            # Opening an .mlpackage compiles it. Compile once (loading `first`), then open every other
            # function from that one compiled model, so they share one state as in a multifunction
            # model, and nothing is compiled twice.
            model, error = open_mlmodel(path, self.units, first)
            if error is not None:
                raise BackendError(f"{path}: function {first!r} cannot be loaded on {compute_units}: {error}")
            # the compiled model lives in a directory that goes with this first model: kept for the backend's
            # life (`opened`), even once a ladder's climb releases its function
            self.compiled, self.models, self.opened = model.get_compiled_model_path(), {first: model}, model
        else:
            self.compiled, self.models = str(path), {}
            try:
                self.load(first)
            except FunctionUnavailable as e:
                raise BackendError(str(e)) from None

    def load(self, function: str) -> None:
        import coremltools as ct

        function_of(self, function)
        if function not in self.models:
            try:
                model = ct.models.CompiledMLModel(self.compiled, compute_units=self.units, function_name=function)
            except RuntimeError as e:
                raise FunctionUnavailable(
                    f"{self.name}: function {function!r} cannot be loaded on {self.compute_units} ({e})"
                ) from None
            self.models[function] = model

    def make_state(self, function: str = "infer"):
        if not function_of(self, function)["states"]:
            return None
        self.load(function)
        return self.models[function].make_state()

    def predict(self, function: str, inputs: dict, state) -> dict:
        feed = cast_inputs(function_of(self, function), inputs)
        self.load(function)
        model = self.models[function]
        return model.predict(feed, state=state) if state is not None else model.predict(feed)

    def read_state(self, state, name: str) -> np.ndarray:
        return np.asarray(state.read_state(name)).astype(self.interfaces["infer"]["states"][name]["dtype"])

    def write_state(self, state, name: str, array: np.ndarray) -> None:
        state.write_state(name, np.asarray(array, np.float32))  # the bridge takes no fp16 arrays

    def release(self, functions: list[str]) -> None:
        for function in functions:
            self.models.pop(function, None)


class CoreMLFunction:
    """A stateless package of one function (the drafter's `draft`, the vision model's `encode`) under Core ML.
    Not CoreMLBackend, which loads `infer` when it opens: this one loads its function on first use (`load`), and a
    device may refuse it (FunctionUnavailable: the caller then goes on without this model)."""

    def __init__(self, path: Path, name: str, compute_units: str, interfaces: dict):
        import coremltools as ct

        self.path, self.name, self.compute_units, self.interfaces = path, name, compute_units, interfaces
        self.units = getattr(ct.ComputeUnit, COMPUTE_UNITS[compute_units])
        self.model = None

    def load(self, function: str) -> None:
        import coremltools as ct

        if self.model is not None:
            return
        error = None
        try:
            if self.path.suffix == ".mlpackage":
                self.model, error = open_mlmodel(self.path, self.units, function)
            else:
                self.model = ct.models.CompiledMLModel(str(self.path), compute_units=self.units, function_name=function)
        except RuntimeError as e:
            error = e
        if error is not None:
            self.model = None
            raise FunctionUnavailable(f"{self.name}: {function!r} cannot be loaded on {self.compute_units} ({error})")

    def predict(self, function: str, inputs: dict, state=None) -> dict:
        self.load(function)
        return self.model.predict(cast_inputs(self.interfaces[function], inputs))


def open_one_function(bundle: Bundle, name: str, function: str, what: str, device: Device):
    """A bundle's one-function model `name` (assistant, vision, audio), as its .mlpackage or compiled .mlmodelc, run
    by the MIL executor or Core ML (loaded on first use there). `what` says who states it, for the message."""
    found = layout.model_paths(bundle.root, name)
    if not found:
        raise BundleError(f"{layout.package_path(bundle.root, name)}: missing ({layout.MODEL_CONFIG} states {what})")
    if device.backend == "mil":
        return MILBackend(found[0], device.precision)
    return CoreMLFunction(found[0], name, device.compute_units, one_function_interfaces(found[0], name, function))


def open_chunks(paths: list[Path], device: Device) -> list[ChunkBackend]:
    """One backend per chunk package, in order, on `device`."""
    if device.backend == "mil":
        return [MILBackend(p, device.precision) for p in paths]
    return [CoreMLBackend(p, device.compute_units) for p in paths]


def carried_together(chunks: list[ChunkBackend]) -> None:
    """Keep only the functions every chunk that needs them carries, with one warning for the rest: a prompt function
    (`prefill_b{T}`, `prefill_kv_b{T}`) runs through every stateful chunk, a `verify_b{T}` through every chunk, so one
    some of them lack (a bundle converted elsewhere, or a chunk swapped for another's) would fail mid-prompt.
    Its prompt path degrades to the next (prefill_b8 -> infer one token at a time), never to an error. A bundle
    that carries no batched prompt function at all (`--profile phone`) says so once too: its prompts are slow."""
    stateful = [c for c in chunks if c.interfaces["infer"]["states"]]
    optional = dict.fromkeys(f for c in chunks for f in c.interfaces if f != "infer")
    for function in optional:
        needs = chunks if split_rung(function)[1].startswith("verify_b") else stateful
        lacking = [c.name for c in needs if function not in c.interfaces]
        if not lacking:
            continue
        for c in chunks:
            c.interfaces = {f: io for f, io in c.interfaces.items() if f != function}
        path = "decoding runs without drafts" if function.startswith("verify_b") else "prompts run without it"
        warnings.warn(f"{', '.join(lacking)}: no function {function!r}; {path}", RuntimeWarning, stacklevel=3)
    if stateful and not any(f.startswith("prefill_") for f in stateful[0].interfaces):
        warnings.warn(
            f"{stateful[0].name}: no batched prompt function (prefill_b*, prefill_kv_b*); prompts run through infer "
            "one token at a time",
            RuntimeWarning,
            stacklevel=3,
        )


def open_engine(bundle: Bundle, device: Device, logits_dtype=np.float32, exact_rope: bool = True) -> Engine:
    """The step driver over an opened bundle: its chunks run on `device`, its sidecars read by the host. Everything
    about the chunks (context, window, prompt paths, head) is read off the models themselves, so bundles converted
    elsewhere open too."""
    root, config = bundle.root, bundle.config.raw
    check_norm_sidecar(root, config)
    # model_config.json states the chunks of any other layout than the published three (schema.TextConfig.of)
    expected = len(bundle.config.text.chunks or ()) or 3
    if len(bundle.chunks) != expected:
        last = layout.chunk_name(expected - 1)
        raise BundleError(
            f"{root}: expected chunk_1..{last} ({layout.MODEL_CONFIG}), found {len(bundle.chunks)} chunks"
        )
    chunks = open_chunks(bundle.chunks, device)
    carried_together(chunks)
    # a context ladder's engine starts on its smallest rung (runtime.ladder)
    ladder = ladder_of(chunks)
    if ladder is not None:
        chunks = ladder.chunks(ladder.contexts[0])
    # a ring padded for verify batches is wider than the window, which only the config states
    window = bundle.config.text.sliding_window
    try:
        engine = Engine.from_chunks(chunks, load_host(root, config), logits_dtype, window=window, ladder=ladder)
    except ValueError as e:  # chunks wired in an order the engine cannot drive
        raise BundleError(f"{root}: {e}") from None
    check_rope(root, engine.host, engine.context, exact_rope)
    return engine
