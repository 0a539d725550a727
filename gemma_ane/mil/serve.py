"""`python -m gemma_ane.mil.serve PACKAGE...`: a bundle's chunk packages (chunk_1.mlpackage ... in order) run by the
MIL executor for another process (the Swift package's PipeRunner on Linux), over stdin and stdout. The client names
the packages (it has read the bundle): this module stands on the saved programs alone, as the executor does.

The protocol, one request and one reply at a time. A frame is a little-endian u32 byte count, that many bytes of a
JSON object (the header), then the raw bytes of every tensor the header lists under "tensors" ({name, shape, dtype},
row-major, packed, little-endian), in that order. Requests name an "op":

- "hello": the chunks, each {name, functions (the default first), interfaces: function -> {inputs, outputs, states},
  each a list of {name, shape, dtype}};
- "load" {chunk, function}; "make_state" {chunk, function?} -> {state: an id, or null for a stateless chunk}; the
  function (default: the chunk's default) sizes the state: a context ladder's rung `ctx{C}_infer` (CONTRACT §3a);
- "predict" {chunk, function, state} with the inputs as tensors -> the outputs as tensors;
- "read_state" {chunk, state, name} -> one tensor; "write_state" {chunk, state, name} with one tensor;
- any request may carry "release": state ids the client no longer holds.

A reply is {"ok": true, ...} or {"error": one line, "kind": "bundle" | "input" | "device"}. Every read is bounded:
a header past MAX_HEADER bytes, a tensor whose shape or dtype is not the one the chunk declares, or a stream that
ends inside a frame ends the server with one line on stderr and exit 1. stdout carries only frames: anything the
executor prints goes to stderr.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np

from ..errors import BundleError, GemmaAneError, InputError
from .executor import MILPackage

MAX_HEADER = 1 << 20  # a header lists names and shapes: a megabyte is far past any chunk's
DTYPES = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4"), "int32": np.dtype("<i4")}


class ProtocolError(InputError):
    """A frame the server cannot read: the stream is out of step, so the server stops."""


def read_exact(stream, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise ProtocolError(f"stdin: the stream ended inside a frame ({len(data)} of {n} bytes)")
    return data


def read_frame(stream, declared) -> tuple[dict, dict] | None:
    """(header, tensors by name), or None at a clean end of stream. `declared(header)`: name -> (shape, dtype) of
    the tensors the request may carry; one it does not declare, or of another shape or dtype, is refused."""
    head = stream.read(4)
    if not head:
        return None
    (size,) = struct.unpack("<I", read_exact(stream, 4 - len(head)) if len(head) < 4 else head)
    if size > MAX_HEADER:
        raise ProtocolError(f"stdin: a header of {size} bytes, at most {MAX_HEADER}")
    try:
        header = json.loads(read_exact(stream, size))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"stdin: header is no JSON ({e})") from None
    if not isinstance(header, dict) or not isinstance(header.get("tensors", []), list):
        raise ProtocolError("stdin: header is no object with a list of tensors")
    allowed, tensors = declared(header), {}
    for t in header.get("tensors", []):
        name = t.get("name") if isinstance(t, dict) else None
        if name not in allowed or [t.get("shape"), t.get("dtype")] != list(allowed[name]):
            raise ProtocolError(f"stdin: tensor {str(name)[:40]!r} is not one this request takes, as declared")
        shape, dtype = allowed[name]
        count = int(np.prod(shape, dtype=np.int64))
        tensors[name] = np.frombuffer(read_exact(stream, count * DTYPES[dtype].itemsize), DTYPES[dtype]).reshape(shape)
    return header, tensors


def write_frame(stream, header: dict, tensors: dict | None = None) -> None:
    arrays = []
    if tensors:
        header["tensors"] = []
        for name, a in tensors.items():
            header["tensors"].append({"name": name, "shape": list(a.shape), "dtype": a.dtype.name})
            arrays.append(np.ascontiguousarray(a, a.dtype.newbyteorder("<")))
    body = json.dumps(header).encode()
    stream.write(struct.pack("<I", len(body)) + body)
    for a in arrays:
        stream.write(a.tobytes())
    stream.flush()


def _specs(io: dict) -> list[dict]:
    return [{"name": n, "shape": list(t["shape"]), "dtype": t["dtype"]} for n, t in io.items()]


class Chunk:
    """One package: its functions loaded together (one state serves them all), their interfaces, default first."""

    def __init__(self, path: Path):
        self.package = MILPackage(path)
        self.name = Path(path).name.split(".")[0]
        default = self.package.package.default_function
        names = [default] + [f for f in self.package.functions if f != default]
        self.interfaces = {f: self.package.functions[f].interface for f in names}

    def function(self, name) -> dict:
        if name not in self.interfaces:
            raise BundleError(f"{self.name}: no function {str(name)[:40]!r} (has {', '.join(self.interfaces)})")
        return self.interfaces[name]

    def state_types(self, function: str | None = None) -> dict:
        """The states `function` (default: the default function) declares: a ladder's rungs size them apart."""
        return self.interfaces[function or next(iter(self.interfaces))]["states"]


class Server:
    """The chunks of one bundle and the states handed out by id."""

    def __init__(self, paths: list[Path]):
        self.chunks = {c.name: c for c in map(Chunk, paths)}
        self.states: dict[int, tuple[str, object, str]] = {}  # id -> (chunk, state, the function that made it)
        self.next_state = 0

    def chunk(self, header: dict):
        name = header.get("chunk")
        if name not in self.chunks:
            raise BundleError(f"no chunk {str(name)[:40]!r} (has {', '.join(self.chunks)})")
        return self.chunks[name]

    def state(self, header: dict, chunk):
        sid = header.get("state")
        if sid is None:
            return None
        if sid not in self.states or self.states[sid][0] != chunk.name:
            raise BundleError(f"{chunk.name}: no state {str(sid)[:20]} of this chunk")
        return self.states[sid][1]

    def made_by(self, header: dict) -> str | None:
        """The function whose states a request's state id holds (None when it names no state of its chunk)."""
        held = self.states.get(header.get("state"))
        return held[2] if held is not None and held[0] == header.get("chunk") else None

    def declared(self, header: dict) -> dict:
        """The tensors a request may carry: a predict's inputs, a write_state's state."""
        try:
            chunk = self.chunk(header)
            if header.get("op") == "predict":
                io = chunk.function(header.get("function"))["inputs"]
            elif header.get("op") == "write_state":
                io = {k: v for k, v in chunk.state_types(self.made_by(header)).items() if k == header.get("name")}
            else:
                return {}
        except (BundleError, TypeError):
            return {}  # the request itself is answered with the error
        return {n: (list(t["shape"]), t["dtype"]) for n, t in io.items()}

    def handle(self, header: dict, tensors: dict) -> tuple[dict, dict | None]:
        for sid in header.get("release", []):
            self.states.pop(sid, None)
        op = header.get("op")
        if op == "hello":
            chunks = [
                {
                    "name": c.name,
                    "functions": list(c.interfaces),
                    "interfaces": {
                        f: {k: _specs(io[k]) for k in ("inputs", "outputs", "states")} for f, io in c.interfaces.items()
                    },
                }
                for c in self.chunks.values()
            ]
            return {"ok": True, "chunks": chunks}, None
        chunk = self.chunk(header)
        if op == "load":  # the executor loaded every function with the package
            chunk.function(header.get("function"))
            return {"ok": True}, None
        if op == "make_state":
            function = header.get("function") or next(iter(chunk.interfaces))
            if not chunk.function(function)["states"]:
                return {"ok": True, "state": None}, None
            state = chunk.package.functions[function].make_state()
            self.next_state += 1
            self.states[self.next_state] = (chunk.name, state, function)
            return {"ok": True, "state": self.next_state}, None
        if op == "predict":
            function = header.get("function")
            io = chunk.function(function)
            missing = [n for n in io["inputs"] if n not in tensors]
            if missing:
                raise InputError(f"{chunk.name}.{function}: input {missing[0]!r} missing")
            outputs = io["outputs"]
            out = chunk.package.functions[function].predict(tensors, state=self.state(header, chunk))
            return {"ok": True}, {n: np.asarray(out[n]).astype(t["dtype"], copy=False) for n, t in outputs.items()}
        if op in ("read_state", "write_state"):
            state, name = self.state(header, chunk), header.get("name")
            declared = chunk.state_types(self.made_by(header))
            if state is None or name not in declared:
                raise BundleError(f"{chunk.name}: no state {str(name)[:40]!r}")
            if op == "read_state":
                return {"ok": True}, {name: state.arrays[name].astype(declared[name]["dtype"])}
            state.arrays[name][...] = tensors[name]
            return {"ok": True}, None
        raise BundleError(f"op {str(op)[:40]!r}: expected hello, load, make_state, predict, read_state or write_state")


def serve(paths: list[Path], stdin, stdout) -> None:
    server = Server(paths)
    while True:
        frame = read_frame(stdin, server.declared)
        if frame is None:
            return
        try:
            reply, tensors = server.handle(*frame)
        except BundleError as e:
            reply, tensors = {"error": str(e), "kind": "bundle"}, None
        except InputError as e:
            reply, tensors = {"error": str(e), "kind": "input"}, None
        except GemmaAneError as e:
            reply, tensors = {"error": str(e), "kind": "device"}, None
        write_frame(stdout, reply, tensors)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m gemma_ane.mil.serve PACKAGE [PACKAGE ...]", file=sys.stderr)
        return 2
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # frames only on the protocol's stream
    try:
        serve([Path(a) for a in argv], stdin, stdout)
    except (ProtocolError, GemmaAneError, BrokenPipeError) as e:
        print(f"gemma_ane.mil.serve: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
