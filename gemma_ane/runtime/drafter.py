"""The drafter at run time: one `draft` call of assistant.mlpackage per proposed token, and its centroid head.

A draft at position P (the last token's; the caches hold rows up to P-1, and perhaps rows of rejected drafts past
it, which the masks hide): the package attends to the target's producer caches as chunk_2 returned them, its
sliding layers to the W+1 newest positions P-1-W .. P-1 (one more than the target's own layers, as transformers
feeds the drafter) and its full layers to 0 .. P-1. Within a burst the position stays P and the carry is the
previous step's `carry_out`.

The centroid head runs here, on the host: the graph gives the cluster scores and the final-norm hidden state; the
best `centroid_top_k` clusters' tokens get real logits (their int8 rows of the drafter's embedding dotted with the
hidden state) and every other token the scored minimum minus one, as transformers does. The sidecar rows are in
cluster order, so a cluster is one contiguous read (E2B: 32 reads of 32 KB, against 4,096 reads of one row).

Torch-free: this is the runtime side.
"""

from __future__ import annotations

import os

import numpy as np

from ..bundle import BundleError, layout
from ..bundle.host import full_mask, sliding_mask
from ..bundle.opened import Bundle
from ..bundle.plan import kv_name
from ..bundle.spec import FULL, SLIDING
from ..bundle.tables import HostTables, RowTable, read_small
from .backend import open_one_function
from .device import Device
from .sampling import Proposal

FUNCTION = "draft"
SHORT = {SLIDING: "s", FULL: "f"}
MASKS = {SLIDING: "causal_mask_sliding", FULL: "causal_mask_full"}


class CentroidHead:
    """Gemma 4's ordered-embedding head over the sidecars: `rows` holds the drafter's embedding in cluster order
    (row j is token ordering[j], so cluster c is rows [c n, (c+1) n)), `factors` each row's value per unit."""

    def __init__(self, rows: RowTable, factors: np.ndarray, ordering: np.ndarray, num_centroids: int, top_k: int):
        self.rows, self.top_k, self.vocab = rows, top_k, len(ordering)
        self.clusters = np.asarray(ordering, np.int64).reshape(num_centroids, -1)  # cluster -> its token ids
        self.factors = np.asarray(factors, np.float32).reshape(num_centroids, -1)

    def best(self, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The top_k clusters by score, and their tokens' int8 rows (top_k * cluster size, Ha): one read a cluster."""
        top = np.argpartition(-np.asarray(scores, np.float32), self.top_k - 1)[: self.top_k]
        t, n = self.rows, self.clusters.shape[1]
        size = n * t.row_bytes
        data = b"".join(os.pread(t.fd, size, int(c) * size) for c in top)
        return top, np.frombuffer(data, t.dtype).reshape(len(top) * n, t.shape[1])

    def __call__(self, scores: np.ndarray, hidden: np.ndarray) -> Proposal:
        """scores (num_centroids,), hidden (Ha,) -> real logits for the best clusters' tokens, min - 1 for the rest."""
        top, q = self.best(scores)
        # The row factors after the dot product: one multiply per token, not per weight. einsum reads the int8 rows
        # as they are, and is no BLAS call: BLAS threads gain nothing on 4,096 x 256 (bench/drafter_head.py) and
        # contend with the rest of the process on a busy machine.
        logits = np.einsum("ij,j->i", q, np.asarray(hidden, np.float32)) * self.factors[top].ravel()
        return Proposal(self.clusters[top].ravel(), logits, float(logits.min()) - 1.0, self.vocab)


class Drafter:
    """assistant.mlpackage's `draft` function and its head, fed from the host's tables and chunk_2's caches."""

    def __init__(self, package, host: HostTables, config: dict, head: CentroidHead | None):
        self.package, self.host, self.head = package, host, head
        self.window, self.vocab = config.get("sliding_window"), config["vocab_size"]
        self.producers = config["assistant"]["producers"]
        io = package.interfaces[FUNCTION]
        self.kv_names = [kv_name(p, w) for p in self.producers.values() for w in ("k", "v")]
        need = [*self.kv_names, *(MASKS[t] for t in self.producers), "embedding", "carry"]
        need += ["carry_out", *(("centroid_scores", "hidden_out") if head else ("logits",))]
        missing = [n for n in need if n not in io["inputs"] and n not in io["outputs"]]
        if missing:
            raise BundleError(f"{package.name}: {FUNCTION} has no {missing[0]!r}, which {layout.MODEL_CONFIG} implies")
        self.widths = {t: io["inputs"][MASKS[t]]["shape"][-1] for t in self.producers}  # ring slots, context
        self.kv_rows = {n: io["inputs"][n]["shape"][2] for n in self.kv_names}

    def step(self, token: int, carry: np.ndarray, position: int, kv: dict) -> tuple[Proposal, np.ndarray]:
        """One draft for the token at `position`: carry is the target's final-norm hidden state at position - 1
        (or the previous step's carry); kv is chunk_2's output dict. Returns the proposal and the next carry (Hb,)."""
        P = position
        if not 1 <= P < self.widths[FULL]:
            # internal: the runtime drafts after the prompt (P >= 1) and only where a verify call fits (P < context)
            raise ValueError(f"draft position {P}: must lie in [1, context {self.widths[FULL]})")
        x = {"embedding": self.host.embed([token])[0], "carry": np.asarray(carry, np.float32).reshape(1, 1, -1)}
        for n in self.kv_names:
            # a context ladder's smaller rung hands on shorter full caches: `draft` takes the top rung's, whose
            # rows past the rung's end (zeros here) the mask hides
            a, rows = np.asarray(kv[n]), self.kv_rows[n]
            x[n] = a if a.shape[2] == rows else np.pad(a, ((0, 0), (0, 0), (0, rows - a.shape[2]), (0, 0)))
        for t in self.producers:
            if t == SLIDING:  # the W+1 newest positions up to P-1, in a ring of `widths` slots
                x[MASKS[t]] = sliding_mask(P - 1, 1, self.window + 1, np.float32, ring=self.widths[t])
            else:
                x[MASKS[t]] = full_mask(P - 1, 1, self.widths[t], np.float32)
            x[f"cos_{SHORT[t]}"], x[f"sin_{SHORT[t]}"] = self.host.rope_rows(t, P, 1)
        out = self.package.predict(FUNCTION, x, None)
        carry = np.asarray(out["carry_out"], np.float32).reshape(-1)
        if self.head is not None:
            return self.head(out["centroid_scores"].reshape(-1), out["hidden_out"].reshape(-1)), carry
        logits = np.asarray(out["logits"], np.float32).reshape(-1)
        return Proposal(np.arange(self.vocab), logits, None, self.vocab), carry


def open_drafter(bundle: Bundle, device: Device, host: HostTables) -> Drafter | None:
    """The bundle's drafter, or None when model_config.json states no assistant. `draft` loads at the first step
    (FunctionUnavailable there when the device refuses it: the runtime then decodes without drafts)."""
    a, root = bundle.config.assistant, bundle.root
    if a is None:
        return None
    package = open_one_function(bundle, "assistant", FUNCTION, "an assistant", device)
    head = None
    if a.num_centroids:
        V, Ha = bundle.config.text.vocab_size, a.hidden_size
        ordering = read_small(root / layout.ASSISTANT_TOKEN_ORDERING, "<i4", (V,))
        if not np.array_equal(np.sort(ordering), np.arange(V)):
            raise BundleError(f"{root / layout.ASSISTANT_TOKEN_ORDERING}: not a permutation of the {V} token ids")
        scales = read_small(root / layout.ASSISTANT_EMBED_SCALES, "<f2", (V,)).astype(np.float32) / 127
        rows = RowTable(root / layout.ASSISTANT_EMBED_Q8, np.int8, (V, Ha))
        head = CentroidHead(rows, scales, ordering, a.num_centroids, a.centroid_top_k)
    return Drafter(package, host, bundle.config.raw, head)
