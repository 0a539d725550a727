"""A stand-in for Apple's native Core ML layer, for the tests only: it never ships in the package.

There is no Mac in CI. coremltools' Python front-end (`MLModel`, `CompiledMLModel`, `MLState`,
`utils.compile_model`) runs unchanged; `install()` replaces only what that front-end calls in its
native extension `libcoremlpython` (absent off macOS), runs the programs on our MIL executor
(`gemma_ane.mil.executor`), and makes coremltools' macOS checks and our own `platform.system()` say macOS 15.

The native contract, as coremltools 9.0 uses it (models/model.py, models/_compiled_model.py,
models/utils.py; coremlpython/CoreMLPython.mm, CoreMLPythonUtils.mm, CoreMLPythonArray.mm):

- `_MLModelProxy(path, compute_units, function_name, hints, asset)`: `path` a str (a path ending in
  `.mlmodelc` loads as is; anything else is compiled to a temporary `.mlmodelc` first);
  `compute_units` the ComputeUnit's name ("ALL", "CPU_ONLY", "CPU_AND_GPU", "CPU_AND_NE");
  `function_name` "" for the package's default function; `hints` a dict of str -> str; `asset` None
  or an `_MLModelAssetProxy`. A model that cannot load raises RuntimeError: `MLModel` turns that
  into a warning and a model whose predict() re-raises it, `CompiledMLModel` lets it through.
- `proxy.predict(inputs, state)`: `inputs` a dict name -> numpy array; the front-end has already
  widened float16 arrays to float32, and the bridge takes only int32, float32 and float64 arrays
  (others: RuntimeError). Core ML casts each to the declared type. `state` is None or the object
  `newState()` returned (`MLState` holds it as `__proxy__` and hands that back). Returns a dict of
  every output of the function as fresh numpy arrays, float16 ones widened to float32.
  `batchPredict(list_of_inputs)`: a list of such dicts, without state.
- `proxy.newState()` -> a state object with `read_state(name)` (float16 comes back as float32) and
  `write_state(name, array)`; `MLState(proxy.newState())` wraps it. A state made by one function's
  model serves every function of the same package (Core ML shares a multifunction package's states).
- `proxy.get_compiled_model_path()`: where the compiled model lives.
- Statics: `compileModel(path)` -> the path of a new `.mlmodelc` in a temporary directory
  (`compile_model` moves it to its destination); `maximum_supported_specification_version()` -> int;
  `create_model_asset_from_path(path)` -> an `_MLModelAssetProxy`.
- Gates: `_is_macos()` and `_macos_version()` of coremltools.models.utils, imported by name into
  model.py and _compiled_model.py. `make_state()` needs macOS >= 15; `CPU_AND_NE` >= 13.

The stand-in's compiled form (what `compileModel` writes; only this stand-in can load it):

    NAME.mlmodelc/
        standin.json        {"standin": "gemma-ane tests", "source": "NAME.mlpackage", "source_path": ...}
        model.mil           text: one line per function with its inputs, states and outputs
        metadata.json       as Apple's compiler writes it (`metadata`): what a reader off the Mac can learn
        standin.mlpackage/  a copy of the source package, which the executor runs

Where it differs from Core ML, by choice: an int32 input given a float array (or the reverse) is an
error, not a cast; the executor loads a package on its first predict or newState (so an op it
lacks fails there, not at load), once for all the models of a package and its compiled copies;
every compute unit runs the same fp16 executor. `install(refuse={...})` makes loading the named
functions on the Neural Engine ("ALL", "CPU_AND_NE") fail, as an ANE compile failure would.
"""

from __future__ import annotations

import importlib
import json
import platform
import shutil
import sys
import tempfile
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from gemma_ane.mil.executor import MILPackage, MILState
from gemma_ane.mil.package import Package

MACOS = (15, 0)
UNITS = ("ALL", "CPU_ONLY", "CPU_AND_GPU", "CPU_AND_NE")
MARKER = "standin.json"
# our modules that ask platform.system() whether they are on a Mac
PLATFORM_MODULES = ("gemma_ane.runtime.device", "gemma_ane.convert.driver", "gemma_ane.convert.options")


@dataclass
class StandIn:
    """What an installed stand-in saw and holds: every load as (path, compute units, function),
    the functions it refuses on the Neural Engine, and the packages it has loaded."""

    tmp: Path
    refuse: set = field(default_factory=set)
    loads: list = field(default_factory=list)
    packages: dict = field(default_factory=dict)

    def package(self, path: Path) -> MILPackage:
        """One executor per package, so every function's model shares its weights and states; a
        compiled copy of a package is that package (its models share states with the source's)."""
        key = _source(path)
        if key not in self.packages:
            self.packages[key] = MILPackage(path, "fp16")
        return self.packages[key]


_active: StandIn | None = None


def _standin() -> StandIn:
    if _active is None:
        raise RuntimeError("the Core ML stand-in is not installed")
    return _active


def _program_path(path: str) -> Path:
    """The .mlpackage behind a model path: the path itself, or the copy inside our compiled form."""
    p = Path(path)
    if p.suffix != ".mlmodelc":
        return p.resolve()
    if not (p / MARKER).is_file():
        raise RuntimeError(f"{path}: not a compiled model this stand-in made (no {MARKER})")
    return (p / "standin.mlpackage").resolve()


def _source(program: Path) -> Path:
    """The package a program came from: itself, or what our compiled form records."""
    marker = program.parent / MARKER
    return Path(json.loads(marker.read_text())["source_path"]) if marker.is_file() else program


def _open(path: Path) -> Package:
    try:
        return Package.open(path)
    except Exception as e:  # Core ML's load errors arrive as RuntimeError
        raise RuntimeError(f"Error compiling model: {e}") from None


def _signatures(package: Package) -> list[str]:
    """One line per function: `func NAME(input: dtype[shape], ..., state: ...) -> (outputs)`."""
    lines = []
    for f in package.function_names:
        io = package.interface(f)
        args = ", ".join(f"{n}: {t['dtype']}{t['shape']}" for k in ("inputs", "states") for n, t in io[k].items())
        lines.append(f"func {f}({args}) -> ({', '.join(io['outputs'])})")
    return lines


# numpy's dtype names -> metadata.json's dataType
DATA_TYPES = {"float16": "Float16", "float32": "Float32", "float64": "Double", "int32": "Int32"}


def _features(features: dict, kind: str) -> list[dict]:
    """Feature entries of a metadata.json schema, field for field as coremlcompiler writes them: every value a
    string (`shape` too, "[1, 1, 64]"), `formattedType` spelled "MultiArray (Float16 1 × 1 × 64)"."""
    out = []
    for name, t in features.items():
        dtype, shape = DATA_TYPES[t["dtype"]], list(t["shape"])
        out.append(
            {
                "hasShapeFlexibility": "0",
                "isOptional": "0",
                "dataType": dtype,
                "formattedType": f"{kind} ({dtype} {' × '.join(map(str, shape))})",
                "shortDescription": "",
                "shape": json.dumps(shape),
                "name": name,
                "type": kind,
            }
        )
    return out


def _schemas(io: dict) -> dict:
    return {
        "inputSchema": _features(io["inputs"], "MultiArray"),
        "outputSchema": _features(io["outputs"], "MultiArray"),
        "stateSchema": _features(io["states"], "State"),
    }


def metadata(package: Package, name: str) -> list[dict]:
    """NAME.mlmodelc/metadata.json as Apple's compiler writes it for an ML Program: a list of one model entry
    whose inputSchema, outputSchema and stateSchema are the default function's; a multifunction model adds
    `functions` (each function's own three schemas) and `defaultFunctionName`. The op histogram and precisions
    are the compiler's own findings, which a stand-in cannot make: left empty and unknown."""
    spec, default = package.spec, package.default_function
    entry = {
        "metadataOutputVersion": "3.0",
        "storagePrecision": "",
        **_schemas(package.interface(default)),
        "modelParameters": [],
        "specificationVersion": spec.specificationVersion,
        "mlProgramOperationTypeHistogram": {},
        "computePrecision": "",
        "isUpdatable": "0",
        "availability": {"macOS": "15.0", "iOS": "18.0", "tvOS": "18.0", "visionOS": "2.0", "watchOS": "11.0"},
        "modelType": {"name": "MLModelType_mlProgram"},
        "userDefinedMetadata": dict(spec.description.metadata.userDefined),
        "generatedClassName": name.replace("-", "_"),
        "method": "predict",
    }
    if spec.description.functions:
        entry["defaultFunctionName"] = default
        entry["functions"] = [{"name": f, **_schemas(package.interface(f))} for f in package.function_names]
    return [entry]


def _to_python(a: np.ndarray) -> np.ndarray:
    """Core ML's bridge copies every array out, float16 as float32."""
    return a.astype(np.float32) if a.dtype == np.float16 else np.array(a, copy=True)


def _from_python(name: str, value, declared: dict) -> np.ndarray:
    """An array as the bridge accepts it, checked against and cast to its declared type."""
    if not isinstance(value, np.ndarray) or value.dtype not in (np.int32, np.float32, np.float64):
        kind = getattr(value, "dtype", type(value).__name__)
        raise RuntimeError(f"{name!r}: value type not convertible ({kind}; takes int32, float32, float64 arrays)")
    dtype = np.dtype(declared["dtype"])
    if tuple(value.shape) != tuple(declared["shape"]) or (value.dtype.kind == "f") != (dtype.kind == "f"):
        raise RuntimeError(
            f"{name!r}: expects {tuple(declared['shape'])} {declared['dtype']}, got {value.shape} {value.dtype}"
        )
    return value.astype(dtype)


class _State:
    """What `newState()` returns: the package's states, as the executor keeps them."""

    def __init__(self, state: MILState):
        self.state = state

    def _array(self, name: str) -> np.ndarray:
        if name not in self.state.arrays:
            raise RuntimeError(f"no state named {name!r} (has {', '.join(self.state.arrays)})")
        return self.state.arrays[name]

    def read_state(self, name: str) -> np.ndarray:
        return _to_python(self._array(name))

    def write_state(self, name: str, value) -> None:
        a = self._array(name)
        a[...] = _from_python(name, value, {"shape": a.shape, "dtype": str(a.dtype)})


class _MLModelAssetProxy:
    """A compiled model by path (Core ML's MLModelAsset; only from a path here)."""

    def __init__(self, path: str):
        self.path = path


class _MLModelProxy:
    """One function of one model, as the native `CoreML::Python::Model`. The program loads on first
    use; the path, function and compute units are checked here, as Core ML's load does."""

    def __init__(self, path: str, compute_units: str, function_name: str, hints: dict, asset=None):
        standin = _standin()
        path = asset.path if asset is not None else path
        if compute_units not in UNITS:
            raise RuntimeError(f"compute units {compute_units!r}: not one of {', '.join(UNITS)}")
        if not isinstance(function_name, str) or not isinstance(hints, dict):
            raise TypeError("_MLModelProxy(path: str, compute_units: str, function_name: str, hints: dict, asset)")
        self.path, self.compute_units = path, compute_units
        self.program_path = _program_path(path)
        package = _open(self.program_path)
        self.function = function_name or package.default_function
        if self.function not in package.function_names:
            raise RuntimeError(
                f"{path}: no function {self.function!r} in the model (has {', '.join(package.function_names)})"
            )
        if self.function in standin.refuse and compute_units in ("ALL", "CPU_AND_NE"):
            raise RuntimeError(f"{path}: function {self.function!r}: ANECCompile() FAILED (stand-in refusal)")
        self.interface = package.interface(self.function)
        self._compiled = path if Path(path).suffix == ".mlmodelc" else None
        standin.loads.append((path, compute_units, self.function))

    def _model(self):
        try:
            return _standin().package(self.program_path).functions[self.function]
        except ValueError as e:  # the executor's load errors, as Core ML's RuntimeError
            raise RuntimeError(str(e)) from None

    def predict(self, inputs: dict, state: _State | None) -> dict:
        if not isinstance(inputs, dict) or not (state is None or isinstance(state, _State)):
            raise TypeError("predict(): incompatible function arguments (dict, _State or None)")
        missing = [n for n in self.interface["inputs"] if n not in inputs]
        if missing:
            raise RuntimeError(f"{self.function}: input feature {missing[0]!r} is required but not specified")
        feed = {n: _from_python(n, inputs[n], t) for n, t in self.interface["inputs"].items()}
        if self.interface["states"] and state is None:
            raise RuntimeError(f"{self.function}: the model is stateful; predict needs a state")
        try:
            out = self._model().predict(feed, state=None if state is None else state.state)
        except ValueError as e:  # the executor's one-line errors, as Core ML's RuntimeError
            raise RuntimeError(str(e)) from None
        return {n: _to_python(a) for n, a in out.items()}

    def batchPredict(self, batch: list) -> list:
        return [self.predict(inputs, None) for inputs in batch]

    def newState(self) -> _State:
        return _State(self._model().make_state())

    def get_compiled_model_path(self) -> str:
        if self._compiled is None:  # Core ML compiled the package at load; we do it when asked
            self._compiled = _MLModelProxy.compileModel(self.path)
        return self._compiled

    @staticmethod
    def maximum_supported_specification_version() -> int:
        import coremltools as ct

        return max(v for k, v in vars(ct).items() if k.startswith("_SPECIFICATION_VERSION_IOS_"))

    @staticmethod
    def compileModel(path: str) -> str:
        source = Path(path)
        package = _open(source)
        out = Path(tempfile.mkdtemp(dir=_standin().tmp)) / f"{source.stem}.mlmodelc"
        shutil.copytree(source, out / "standin.mlpackage")
        header = f"// compiled by the gemma-ane tests' Core ML stand-in from {source.name}"
        (out / "model.mil").write_text("\n".join([header, *_signatures(package)]) + "\n")
        (out / "metadata.json").write_text(json.dumps(metadata(package, source.stem), indent=2))
        marker = {"standin": "gemma-ane tests", "source": source.name, "source_path": str(source.resolve())}
        (out / MARKER).write_text(json.dumps(marker))
        return str(out)

    @staticmethod
    def create_model_asset_from_path(path: str) -> _MLModelAssetProxy:
        _program_path(path)
        return _MLModelAssetProxy(path)


class _Darwin(types.ModuleType):
    """`platform` as a Mac sees it: system() is "Darwin"; everything else is the real module."""

    def __getattr__(self, name):
        return getattr(platform, name)

    @staticmethod
    def system() -> str:
        return "Darwin"


@contextmanager
def install(refuse=(), platform_modules=PLATFORM_MODULES):
    """Install the stand-in: coremltools' native layer, its macOS checks, and `platform` in
    `platform_modules`. Yields the StandIn; everything is restored (and its files removed) on exit."""
    global _active
    import coremltools
    from coremltools.models import _compiled_model, model, utils

    native = types.ModuleType("coremltools.libcoremlpython", "stand-in for Core ML's Python bindings (tests only)")
    native._MLModelProxy, native._MLModelAssetProxy, native._State = _MLModelProxy, _MLModelAssetProxy, _State
    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory(prefix="coreml-standin-") as tmp:
        mp.setitem(sys.modules, native.__name__, native)
        mp.setattr(coremltools, "libcoremlpython", native, raising=False)
        for module in (model, _compiled_model):
            mp.setattr(module, "_MLModelProxy", _MLModelProxy)
        mp.setattr(model, "_MLModelAssetProxy", _MLModelAssetProxy)
        # every coremltools module that imported the macOS checks by name
        real = {"_is_macos": utils._is_macos, "_macos_version": utils._macos_version}
        fake = {"_is_macos": lambda: True, "_macos_version": lambda: MACOS}
        for name, module in list(sys.modules.items()):
            if name.startswith("coremltools") and module is not None:
                for attr, fn in real.items():
                    if getattr(module, attr, None) is fn:
                        mp.setattr(module, attr, fake[attr])
        for name in platform_modules:
            mp.setattr(importlib.import_module(name), "platform", _Darwin("platform"))
        _active = StandIn(Path(tmp), set(refuse))
        try:
            yield _active
        finally:
            _active = None
