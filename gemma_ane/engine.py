"""The step driver: feeds token ids through the chunks exactly as SPEC §3 prescribes.

It is backend-agnostic and torch-free. A backend is one object per chunk with
`predict(function_name, inputs) -> outputs` that keeps its own state (the KV caches); the same
driver runs the PyTorch graph, the MIL executor and Core ML, so what the tests prove about the
scheduling holds for every backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .host import batch_is_exact, dequantize_rows, full_mask, kv_sliding_mask, sliding_mask
from .spec import FULL, SLIDING


class ContextOverflow(ValueError):
    pass


@dataclass
class HostTables:
    """Everything the host contributes to a step: int8 tables (arrays or row readers) and RoPE rows."""

    embed_q: np.ndarray  # int8 [V, H]
    embed_scales: np.ndarray  # fp16 [V]
    ple_q: np.ndarray  # int8 [V, L*P]
    ple_scales: np.ndarray  # fp16 [V]
    embed_scale: float
    per_layer_embed_scale: float
    rope: dict  # layer type -> (cos [rows, D], sin [rows, D])

    def embed(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(hidden_states (1,T,H), per_layer_raw (1,T,L*P)) in float32; only these rows are read."""
        ids = np.asarray(ids, dtype=np.int64)
        h = dequantize_rows(self.embed_q[ids], self.embed_scales[ids], self.embed_scale)
        ple = dequantize_rows(self.ple_q[ids], self.ple_scales[ids], self.per_layer_embed_scale)
        return h[None], ple[None]

    def rope_rows(self, layer_type: str, p0: int, T: int) -> tuple[np.ndarray, np.ndarray]:
        cos, sin = self.rope[layer_type]
        return (np.asarray(cos[p0:p0 + T], np.float32)[None, None],
                np.asarray(sin[p0:p0 + T], np.float32)[None, None])


class Engine:
    """Owns the position and drives chunk backends. Chunks are named chunk_1..chunk_3 in order."""

    def __init__(self, chunks: list, host: HostTables, *, context: int, window: int, prefill_batch: int | None,
                 kv_batches: tuple[int, ...] = (), kv_ple_width: int | None = None):
        self.chunks, self.host = chunks, host
        self.context, self.window, self.prefill_batch = context, window, prefill_batch
        # KV-only prefill functions (prefill_kv_b{T}), largest first, and their PLE width
        self.kv_batches, self.kv_ple_width = tuple(sorted(kv_batches, reverse=True)), kv_ple_width
        self.position = 0
        self.history: list[tuple[int, str, int]] = []  # (position, function, tokens) of every step run
        # Logits come back as chunk_3 gives them (fp16) when None: the sampler reads fp16 without
        # converting all 262,144 values, which costs more than the rest of a step's host work.
        self.logits_dtype = np.float32

    def reset(self) -> None:
        for c in self.chunks:
            c.reset_state()
        self.position = 0
        self.history = []

    def _inputs(self, ids: np.ndarray, p0: int) -> dict:
        T = len(ids)
        h, ple = self.host.embed(ids)
        x = {
            "hidden_states": h,
            "per_layer_raw": ple,
            "causal_mask_full": full_mask(p0, T, self.context, np.float32),
            "causal_mask_sliding": sliding_mask(p0, T, self.window, np.float32),
            "current_pos": np.array([p0], np.int32),
            "ring_pos": np.array([p0 % self.window], np.int32),
        }
        for t, (c, s) in ((SLIDING, ("cos_s", "sin_s")), (FULL, ("cos_f", "sin_f"))):
            if t in self.host.rope:
                x[c], x[s] = self.host.rope_rows(t, p0, len(ids))
        return x

    def _head(self, x: dict, kv: dict, row: int | None) -> np.ndarray:
        """chunk_3 for one row (the last one by default): returns logits (vocab,) in logits_dtype."""
        c3 = self.chunks[2]
        if row is None:
            feed = {**x, **kv}
        else:  # one row of a batch: its own mask row hides the batch's later rows
            feed = {k: (v[:, row:row + 1] if k in ("hidden_states", "per_layer_combined") else
                        v[:, :, row:row + 1] if k.startswith(("causal_mask", "cos_", "sin_")) else v)
                    for k, v in {**x, **kv}.items()}
        return np.asarray(c3.predict("infer", feed)["logits"], self.logits_dtype).reshape(-1)

    def _run(self, ids: np.ndarray, function: str, want: str) -> list[np.ndarray]:
        """One call of chunk_1, chunk_2 and (if logits are wanted) chunk_3 on ids at self.position."""
        p0, T = self.position, len(ids)
        x = self._inputs(ids, p0)
        out1 = self.chunks[0].predict(function, x)
        x["hidden_states"] = out1["hidden_states_out"]
        x["per_layer_combined"] = out1["per_layer_combined_out"]
        out2 = self.chunks[1].predict(function, x)
        x["hidden_states"] = out2["hidden_states_out"]
        kv = {k: v for k, v in out2.items() if k.startswith("kv")}
        self.position += T
        if want == "none":
            return []
        if T == 1:
            return [self._head(x, kv, None)]
        rows = range(T) if want == "all" else [T - 1]
        return [self._head(x, kv, r) for r in rows]

    def _run_kv(self, ids: np.ndarray) -> None:
        """A KV-only prefill batch: chunk_1 and chunk_2 up to the last cache-owning layer, no head."""
        p0, T = self.position, len(ids)
        x = self._inputs(ids, p0)
        x["causal_mask_sliding"] = kv_sliding_mask(p0, T, self.window, np.float32)
        x["per_layer_raw"] = x["per_layer_raw"][..., :self.kv_ple_width]
        function = f"prefill_kv_b{T}"
        out1 = self.chunks[0].predict(function, x)
        x["hidden_states"] = out1["hidden_states_out"]
        x["per_layer_combined"] = out1["per_layer_combined_out"]
        self.chunks[1].predict(function, x)
        self.position += T

    def plan(self, p0: int, n: int, logits: str = "last") -> list[tuple[str, int]]:
        """The steps (function, tokens) that feed() runs for n tokens starting at position p0.

        KV-only batches produce no logits: prompt tokens before the last one go through the
        largest one that starts aligned at the position and fits (T divides the window, so an
        aligned batch never wraps the ring), never when every position's logits are wanted.
        Otherwise batches of `prefill_batch` run only where they are exactly causal (inside the
        first pass of the ring). Everything else, and always the last token, goes through `infer`.
        """
        steps, p, i, B = [], p0, 0, self.prefill_batch
        while i < n:
            kv = next((T for T in self.kv_batches if p % T == 0 and T <= n - i - 1 and p + T <= self.context),
                      None) if logits != "all" else None
            if kv:
                steps.append((f"prefill_kv_b{kv}", kv))
            elif B and B > 1 and batch_is_exact(p, B, self.window, self.context) and (
                    n - i - 1 >= B or logits == "all" and n - i >= B):
                steps.append((f"prefill_b{B}", B))
            else:
                steps.append(("infer", 1))
            p += steps[-1][1]
            i += steps[-1][1]
        return steps

    def rewind(self, position: int) -> None:
        """Forget everything from `position` on (the caller knows the ring still holds the rest)."""
        self.position = position
        self.history = [(p, f, T) for p, f, T in self.history if p + T <= position]

    def feed(self, ids, *, logits: str = "last") -> list[np.ndarray]:
        """Process `ids` from the current position, as planned by plan().

        logits="last": only the last token's logits (what generation needs; chunk_3 runs once);
        logits="all": every position's logits (for verification; chunk_3 runs per row);
        logits="none": just fill the caches.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if self.position + len(ids) > self.context:
            raise ContextOverflow(
                f"{self.position + len(ids)} tokens exceed the context of {self.context}"
            )
        results, i, n = [], 0, len(ids)
        for function, T in self.plan(self.position, n, logits):
            p = self.position
            if function.startswith("prefill_kv"):
                self._run_kv(ids[i:i + T])
            elif T > 1:
                results += self._run(ids[i:i + T], function, "all" if logits == "all" else "none")
            else:
                want = logits if (logits == "all" or i == n - 1) else "none"
                results += self._run(ids[i:i + 1], "infer", "last" if want != "none" else "none")
            self.history.append((p, function, T))
            i += T
        return results
