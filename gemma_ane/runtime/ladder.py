"""A bundle's context ladder at run time (bundle/ladder.py, CONTRACT §3a): each rung's functions presented by
their plain names, so the engine drives any rung as it drives a single-context bundle, and climbs by swapping
one rung's chunks for the next's.

Torch-free: this is the runtime side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..bundle.ladder import rungs_of, split_rung


@dataclass(frozen=True)
class Crossing:
    """One climb: from the rung of `before` to that of `after` at `position`, and what it cost (seconds)."""

    before: int
    after: int
    position: int
    load_s: float  # loading the new rung's infer functions
    copy_s: float  # making its states and copying the written prefix of every context-sized one

    def describe(self) -> str:
        return (
            f"context {self.before} -> {self.after} at position {self.position} "
            f"(load {self.load_s * 1e3:.0f} ms, copy {self.copy_s * 1e3:.0f} ms)"
        )


class RungChunk:
    """One chunk (a backend.ChunkBackend) as one rung presents it: the rung's functions under their plain names
    (infer, prefill_b8, ...), its own states; reads and writes of states pass through."""

    def __init__(self, chunk, context: int, top: int):
        self.chunk, self.name, self.context = chunk, chunk.name, context
        self.names = {}
        for full in chunk.interfaces:
            rung, plain = split_rung(full)
            if (rung or top) == context:
                self.names[plain] = full
        self.interfaces = {plain: chunk.interfaces[full] for plain, full in self.names.items()}

    def load(self, function: str) -> None:
        self.chunk.load(self.names.get(function, function))

    def make_state(self):
        return self.chunk.make_state(self.names["infer"])

    def predict(self, function: str, inputs: dict, state) -> dict:
        return self.chunk.predict(self.names.get(function, function), inputs, state)

    def read_state(self, state, name: str) -> np.ndarray:
        return self.chunk.read_state(state, name)

    def write_state(self, state, name: str, array: np.ndarray) -> None:
        self.chunk.write_state(state, name, array)

    def release(self) -> None:
        self.chunk.release(list(self.names.values()))


class Ladder:
    """A bundle's chunks and the rungs their functions carry (the top one under plain names)."""

    def __init__(self, chunks: list):
        self.raw, self.contexts = chunks, rungs_of(chunks[0].interfaces)
        self.top = self.contexts[-1]

    def rung_for(self, positions: int) -> int:
        """The smallest rung that holds `positions` (the top one when none does: the caller refuses past it)."""
        return next((c for c in self.contexts if c >= positions), self.top)

    def chunks(self, context: int) -> list[RungChunk]:
        """The chunks as the rung of `context` presents them, its infer functions loaded."""
        rung = [RungChunk(c, context, self.top) for c in self.raw]
        for c in rung:
            c.load("infer")
        return rung


def ladder_of(chunks: list) -> Ladder | None:
    """The ladder of a bundle's chunks (backends), or None when they carry one context."""
    return Ladder(chunks) if len(rungs_of(chunks[0].interfaces)) > 1 else None
