"""The step driver: feeds token ids through the chunks exactly as docs/CONTRACT.md §3 prescribes,
and owns the rules of its caches (what a new prompt may reuse, where it may rewind to).

It is backend-agnostic and torch-free: the chunks are `backend.ChunkBackend`s, and the engine keeps
their states, so the same driver runs the PyTorch graph, the MIL executor and Core ML, and what the
tests prove about the scheduling and the cache rules holds for every backend.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np

from ..bundle.host import full_mask, kv_sliding_mask, sliding_mask
from ..bundle.spec import FULL, SLIDING
from ..bundle.tables import HostTables
from ..errors import BundleError, DeviceError, GemmaAneError, InputError
from .ladder import Crossing, Ladder
from .tokens import PAD


class ContextOverflow(InputError):
    code = "context_length_exceeded"


class Cancelled(GemmaAneError):
    """The caller gave up (a client that disconnected) while its prompt was being processed."""

    status = 503  # nobody is left to read it; the server answers as for a shutdown


class FunctionUnavailable(DeviceError):
    """A chunk function this device cannot load or compile on the requested compute units (e.g. the
    Neural Engine compiler refusing a T>1 stateful function). Raised by a backend's `load`; the
    engine then runs without that prompt path."""


class NonFiniteOutput(DeviceError):
    """The head's logits hold NaN or inf: damaged weights (a greedy argmax of NaNs would silently
    pick token 0). Not a ValueError: the bundle is at fault, not the request."""


RING = "kv_cache_sliding"  # CONTRACT §3: the sliding caches, rings of `window` slots
MAX_SNAPSHOTS = 4  # ring snapshots kept: E2B's rings are 12.6 MB (fp16, both chunks)


@dataclass
class Snapshot:
    """The rings (per chunk, state name -> array) as they were at `position`: together with the
    full caches' rows below it, the caches of tokens[:position]."""

    position: int
    rings: list[dict]
    top: int  # the newest position written into these rings (rows past `position`: rejected drafts)


def batch_is_exact(p0: int, T: int, window: int, context: int, ring: int | None = None) -> bool:
    """A write-then-attend batch is exactly causal only if no row's write evicts a slot that an
    earlier row of the same batch still needs: true for T == 1, a batch inside the first ring pass,
    or a ring with T - 1 slots beyond the window (then it must also not wrap: one contiguous write)."""
    ring = ring or window
    if p0 + T > context:
        return False
    return T == 1 or p0 + T <= ring or (ring - window >= T - 1 and p0 % ring + T <= ring)


class Engine:
    """Owns the position, the chunks' states and the token ids in the caches; drives the chunks in order.

    The wiring is what the chunks declare (CONTRACT §3): the stateful chunks (those with states) come first and
    run every function on all the rows; each hands on its hidden states, the first also the combined PLE, and any
    `kv{p}_k/v` outputs (the producers' caches) go to every later chunk that takes them. The stateless chunks after
    them (KV-shared layers, the last with the head) run `infer` on the rows whose logits are wanted."""

    def __init__(
        self,
        chunks: list,
        host: HostTables,
        *,
        context: int,
        window: int,
        prefill_batch: int | None,
        kv_batches: tuple[int, ...] = (),
        kv_ple_width: int | None = None,
        logits_dtype=np.float32,
        ring: int | None = None,
        ladder: Ladder | None = None,
    ):
        self.chunks, self.host = chunks, host
        self.body = [i for i, c in enumerate(chunks) if c.interfaces["infer"]["states"]]
        self.tail = [i for i, c in enumerate(chunks) if not c.interfaces["infer"]["states"]]
        if self.body != list(range(len(self.body))) or not self.tail:
            raise BundleError(
                f"chunks {', '.join(c.name for c in chunks)}: the stateful chunks must come first and the last "
                "must be stateless (it holds the head)"
            )
        self.window, self.prefill_batch = window, prefill_batch
        # `rung`: the context the chunks run now; `context`: the most positions this engine holds, the top of a
        # context ladder (runtime.ladder), which it climbs as a session grows, never down within one
        self.ladder, self.rung = ladder, context
        self.context = ladder.top if ladder else context
        self.crossings: list[Crossing] = []  # every climb so far, oldest first
        # slots of the sliding caches: the window, or more in bundles that verify drafts (spec.ring_slots)
        self.ring = ring or window
        verify = [f for f in chunks[0].interfaces if f.startswith("verify_b")]
        self.verify_batch = int(verify[0][len("verify_b") :]) if verify else None  # 1 + the drafts a call checks
        # KV-only prefill functions (prefill_kv_b{T}), largest first, and their PLE width
        self.kv_batches, self.kv_ple_width = tuple(sorted(kv_batches, reverse=True)), kv_ple_width
        # None: logits come back as chunk_3 gives them (fp16). The sampler reads fp16 without
        # converting all 262,144 values, which costs more than the rest of a step's host work.
        self.logits_dtype = logits_dtype
        # The published head returns the argmax token (token_id) instead of logits.
        self.head = "logits" if "logits" in chunks[-1].interfaces["infer"]["outputs"] else "token_id"
        self.loaded = {"infer"}  # functions every chunk that has them has loaded (infer: at open)
        # Soft tokens (an image's rows, encoder.py): a negative id in a prompt is a key here. Set by the caller
        # for the prompt it feeds; the caches compare keys as they compare ids.
        self.soft_tokens: dict[int, np.ndarray] = {}
        self.reset()

    @classmethod
    def from_chunks(
        cls,
        chunks: list,
        host: HostTables,
        logits_dtype=np.float32,
        window: int | None = None,
        ladder: Ladder | None = None,
    ) -> Engine:
        """An engine whose geometry (context, ring, prompt paths) is read off chunk_1's functions; the
        window is the ring unless given (model_config.json's sliding_window: a padded ring is wider).
        With a `ladder`, `chunks` are one of its rungs'."""
        functions = chunks[0].interfaces
        first = functions["infer"]["inputs"]
        ring = first["causal_mask_sliding"]["shape"][-1]
        batches = sorted(int(f[len("prefill_b") :]) for f in functions if f.startswith("prefill_b") and f[9:].isdigit())
        kv = sorted(int(f[len("prefill_kv_b") :]) for f in functions if f.startswith("prefill_kv_b"))
        return cls(
            chunks,
            host,
            context=first["causal_mask_full"]["shape"][-1],
            window=min(window or ring, ring),
            ring=ring,
            prefill_batch=batches[-1] if batches else None,
            kv_batches=tuple(kv),
            kv_ple_width=functions[f"prefill_kv_b{kv[0]}"]["inputs"]["per_layer_raw"]["shape"][-1] if kv else None,
            logits_dtype=logits_dtype,
            ladder=ladder,
        )

    def reset(self) -> None:
        """Fresh, zeroed states: nothing cached."""
        self.states = [c.make_state() for c in self.chunks]
        self.position = 0
        self.tokens: list[int] = []  # the ids whose K/V the caches hold, in position order
        self.history: list[tuple[int, str, int]] = []  # (position, function, tokens) of every step run
        self.snapshots: list[Snapshot] = []  # the rings at earlier prompt ends, oldest first
        self.ring_top = -1  # the newest position written into the rings (past the position: rejected drafts)
        self.shared_kv: dict[str, np.ndarray] = {}  # the producers' caches after the last call (the drafter's)
        self.final_hidden = None  # the head's final-norm hidden state of the last token it ran (the drafter's)

    # -- the context ladder ---------------------------------------------------------------------------
    def _climb(self, positions: int) -> None:
        """Before a call that fills the caches up to `positions`: onto the smallest rung that holds them, when
        the current one does not (CONTRACT §3a), carrying the caches over."""
        if self.ladder is not None and self.rung < positions <= self.context:
            self._switch(self.ladder.rung_for(positions), carry=True)

    def _start(self, positions: int) -> None:
        """Before fresh caches are filled with `positions` tokens (a new session): the smallest rung that holds
        them, up or down; the caches are empty, so nothing is carried."""
        if self.ladder is not None and self.ladder.rung_for(positions) != self.rung:
            self._switch(self.ladder.rung_for(positions), carry=False)

    def _switch(self, context: int, carry: bool) -> None:
        """Run the rung of `context` from now on: load its infer functions, make its states and (carry) copy in
        the written prefix of every context-sized cache and the rings as they are, then release the rung left.
        Nothing changes if any of it fails."""
        t0 = time.perf_counter()
        chunks = self.ladder.chunks(context)
        t1 = time.perf_counter()
        states = [c.make_state() for c in chunks]
        if carry:
            for old, new, was, now in zip(self.chunks, chunks, self.states, states):
                for name in new.interfaces["infer"]["states"] if now is not None else ():
                    a = old.read_state(was, name)
                    if name != RING:  # slot = position: rows past the position are masked, never read
                        b = new.read_state(now, name)
                        b[:, :, : self.position] = a[:, :, : self.position]
                        a = b
                    new.write_state(now, name, a)
        t2 = time.perf_counter()
        for c in self.chunks:
            c.release()
        if carry:
            self.crossings.append(Crossing(self.rung, context, self.position, t1 - t0, t2 - t1))
        self.chunks, self.states, self.rung = chunks, states, context
        self.loaded = {"infer"}

    def _predict(self, i: int, function: str, inputs: dict) -> dict:
        return self.chunks[i].predict(function, inputs, self.states[i])

    def _embed(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """host.embed, with each soft token's row as its hidden state and the pad token's per-layer embedding
        (as transformers: the per-layer lookup sees multimodal ids as the pad id)."""
        soft = ids < 0
        if not soft.any():
            return self.host.embed(ids)
        missing = {int(t) for t in ids[soft]} - self.soft_tokens.keys()
        if missing:
            raise InputError(f"soft token {min(missing)}: no row for it (encode its image first)")
        h, ple = self.host.embed(np.where(soft, PAD, ids))
        h[0, soft] = np.stack([self.soft_tokens[int(t)] for t in ids[soft]])
        return h, ple

    def _inputs(self, ids: np.ndarray, p0: int) -> dict:
        T = len(ids)
        h, ple = self._embed(ids)
        x = {
            "hidden_states": h,
            "per_layer_raw": ple,
            "causal_mask_full": full_mask(p0, T, self.rung, np.float32),
            "causal_mask_sliding": sliding_mask(p0, T, self.window, np.float32, ring=self.ring),
            "current_pos": np.array([p0], np.int32),
            "ring_pos": np.array([p0 % self.ring], np.int32),
        }
        for t, (c, s) in ((SLIDING, ("cos_s", "sin_s")), (FULL, ("cos_f", "sin_f"))):
            if t in self.host.rope:
                x[c], x[s] = self.host.rope_rows(t, p0, len(ids))
        return x

    def _body(self, function: str, x: dict) -> list[tuple[int, dict]]:
        """The stateful chunks' `function` on x, in order: x then holds the last one's hidden states (and the
        combined PLE), self.shared_kv every producer cache they returned. Returns what each chunk returned."""
        outs, self.shared_kv = [], {}
        for i in self.body:
            out = self._predict(i, function, {**x, **self.shared_kv})
            x["hidden_states"] = out["hidden_states_out"]
            if "per_layer_combined_out" in out:
                x["per_layer_combined"] = out["per_layer_combined_out"]
            self.shared_kv.update({k: v for k, v in out.items() if k.startswith("kv")})
            outs.append((i, out))
        return outs

    def _head(self, x: dict, held: list, row: int | None) -> np.ndarray:
        """The stateless chunks for one row (the last one by default): logits (vocab,) in logits_dtype, or
        the published head's chosen token id (1,)."""
        if row is None:
            feed = dict(x)
        else:  # one row of a batch: its own mask row hides the batch's later rows
            feed = {
                k: (
                    v[:, row : row + 1]
                    if k in ("hidden_states", "per_layer_combined")
                    else v[:, :, row : row + 1]
                    if k.startswith(("causal_mask", "cos_", "sin_"))
                    else v
                )
                for k, v in x.items()
            }
        out = self._tail("infer", feed, held)
        if self.head == "token_id":  # the chosen id, as an array the caller reads element 0 of
            return np.asarray(out["token_id"]).reshape(-1)
        if "final_hidden" in out:
            self.final_hidden = np.asarray(out["final_hidden"]).reshape(-1)
        return np.asarray(out["logits"], self.logits_dtype).reshape(-1)

    def _tail(self, function: str, feed: dict, held: list) -> dict:
        """The stateless chunks in order on feed (which they may overwrite); the head's outputs, checked finite.
        `held`: what the stateful chunks returned for these rows (to name the first damaged chunk)."""
        held = list(held)
        for i in self.tail:
            out = self._predict(i, function, {**feed, **self.shared_kv})
            if i != self.tail[-1]:
                feed["hidden_states"] = out["hidden_states_out"]
                held.append((i, out))
        # Damaged weights give NaN logits, whose argmax is silently token 0. The published head
        # returns only the chosen id: its logit (token_logit) is all there is to check there.
        a = np.asarray(out.get("token_logit", []) if self.head == "token_id" else out["logits"]).reshape(-1)
        # NaN or inf = all exponent bits set: ~60 us on the uint16 view of 262,144 fp16 values (isfinite: ~500 us)
        finite = (a.view(np.uint16) & 0x7FFF).max() < 0x7C00 if a.dtype == np.float16 else np.isfinite(a).all()
        if not finite:
            # the first chunk whose outputs were already non-finite
            bad = [i for i, o in held if not all(np.isfinite(v).all() for v in o.values())]
            head = self.chunks[-1].name
            where = f"{self.chunks[bad[0]].name} or before it" if bad else head
            raise NonFiniteOutput(
                f"{head}: logits hold NaN or inf (damaged weights in {where}); run gemma-ane check, or re-convert"
            )
        return out

    def _run(self, ids: np.ndarray, function: str, want: str) -> list[np.ndarray]:
        """One call of the stateful chunks and (if logits are wanted) the stateless ones on ids at self.position."""
        p0, T = self.position, len(ids)
        x = self._inputs(ids, p0)
        held = self._body(function, x)
        self.position += T
        self.ring_top = max(self.ring_top, self.position - 1)
        if want == "none":
            return []
        if T == 1:
            return [self._head(x, held, None)]
        rows = range(T) if want == "all" else [T - 1]
        return [self._head(x, held, r) for r in rows]

    def _run_kv(self, ids: np.ndarray) -> None:
        """A KV-only prefill batch: the stateful chunks up to the last cache-owning layer, no head."""
        p0, T = self.position, len(ids)
        x = self._inputs(ids, p0)
        x["causal_mask_sliding"] = kv_sliding_mask(p0, T, self.window, np.float32, ring=self.ring)
        x["per_layer_raw"] = x["per_layer_raw"][..., : self.kv_ple_width]
        self._body(f"prefill_kv_b{T}", x)  # returns no caches: the next infer step gives them again
        self.position += T
        self.ring_top = max(self.ring_top, self.position - 1)

    def verify(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """Run the last token and its drafts (`verify_batch` ids) in one call at the position: every
        row's logits (T, vocab) and final-norm hidden states (T, hidden). The caches then hold all T
        rows; the caller rewinds to the ones it accepts (`rewind`): the rows of rejected drafts stay
        in slots the position masks hide until accepted tokens overwrite them (spec.ring_slots)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not self.can_verify():
            # internal: the runtime drafts only where can_verify holds
            raise ValueError(f"no verify call fits at position {self.position} (see can_verify)")
        if len(ids) != self.verify_batch:
            # internal: the runtime pads its drafts to verify_batch ids
            raise ValueError(f"verify_b{self.verify_batch} takes {self.verify_batch} ids, got {len(ids)}")
        function, p = f"verify_b{self.verify_batch}", self.position
        self._climb(p + len(ids))
        try:
            if function not in self.loaded:
                for chunk in self.chunks:
                    chunk.load(function)
                self.loaded.add(function)
            x = self._inputs(ids, p)
            out = self._tail(function, x, self._body(function, x))
        except FunctionUnavailable:
            raise  # nothing was written: the caller decodes without drafts
        except BaseException:
            self.reset()
            raise
        self.position += len(ids)
        self.ring_top = max(self.ring_top, self.position - 1)
        self.history.append((p, function, len(ids)))
        self.tokens += ids.tolist()
        logits = np.asarray(out["logits"], self.logits_dtype).reshape(len(ids), -1)
        return logits, np.asarray(out["final_hidden"], np.float32).reshape(len(ids), -1)

    def accept(self, position: int, hidden: np.ndarray) -> None:
        """Keep the rows of the last verify call up to `position`; `hidden` is the final-norm state of the
        last one kept (the drafter's next carry)."""
        self.rewind(position)
        self.final_hidden = hidden

    def can_verify(self) -> bool:
        """Whether a verify call fits here: inside the context, and one contiguous write into the rings."""
        T, p = self.verify_batch, self.position
        return bool(T) and p + T <= self.context and p % self.ring + T <= self.ring

    def plan(self, p0: int, n: int, logits: str = "last") -> list[tuple[str, int]]:
        """The steps (function, tokens) that feed() runs for n tokens starting at position p0.

        KV-only batches produce no logits: prompt tokens before the last one go through the
        largest one that starts aligned at the position and fits (T divides the window, so an
        aligned batch never wraps the ring), never when every position's logits are wanted. A
        prompt resumed at an unaligned position (after prefix reuse) first takes `infer` steps to
        the next multiple of the smallest, when a batch still fits after them: a few single steps
        cost less than running every layer on the rest. Otherwise batches of `prefill_batch` run
        only where they are exactly causal (inside the first pass of the ring). Everything else,
        and always the last token, goes through `infer`.
        """
        steps, p, i, B = [], p0, 0, self.prefill_batch
        small = min(self.kv_batches, default=0)
        while i < n:
            kv = (
                next(
                    (
                        T
                        for T in self.kv_batches
                        if p % T == 0 and T <= n - i - 1 and p + T <= self.rung and p % self.ring + T <= self.ring
                    ),
                    None,
                )
                if logits != "all"
                else None
            )
            if kv:
                steps.append((f"prefill_kv_b{kv}", kv))
            elif small and logits != "all" and p % small and n - i - 1 - (-p % small) >= small:
                steps.append(("infer", 1))  # toward alignment
            elif (
                B
                and B > 1
                and batch_is_exact(p, B, self.window, self.rung, self.ring)
                and (n - i - 1 >= B or logits == "all" and n - i >= B)
            ):
                steps.append((f"prefill_b{B}", B))
            else:
                steps.append(("infer", 1))
            p += steps[-1][1]
            i += steps[-1][1]
        return steps

    def _ready_plan(self, n: int, logits: str) -> list[tuple[str, int]]:
        """plan(), once every function it uses is loaded. A function a chunk cannot load (CONTRACT
        §3: every prompt function is optional) leaves the prompt paths with one warning, and the
        plan is made again without it: the prompt then runs through the paths that remain."""
        while True:
            steps = self.plan(self.position, n, logits)
            missing = [f for f in dict.fromkeys(f for f, _ in steps) if f not in self.loaded]
            if not missing:
                return steps
            function = missing[0]
            try:
                for chunk in self.chunks:
                    if function in chunk.interfaces:
                        chunk.load(function)
                self.loaded.add(function)
            except FunctionUnavailable as e:
                self._drop(function)
                warnings.warn(f"{e}; prompts run without it ({self._paths()})", RuntimeWarning, stacklevel=4)

    def _drop(self, function: str) -> None:
        if function == f"prefill_b{self.prefill_batch}":
            self.prefill_batch = None
        elif function.startswith("prefill_kv_b"):
            self.kv_batches = tuple(T for T in self.kv_batches if f"prefill_kv_b{T}" != function)
        else:  # infer is loaded when the backend opens; nothing else is planned
            # internal: _ready_plan drops only a function plan() chose that was not loaded, never infer
            raise AssertionError(f"{function} is not a prompt path")

    def _paths(self) -> str:
        batched = [f"prefill_kv_b{T}" for T in self.kv_batches] + [f"prefill_b{self.prefill_batch}"] * bool(
            self.prefill_batch
        )
        return ", ".join(batched + ["infer" + (" one token at a time" if not batched else "")])

    # -- the cache rules ---------------------------------------------------------------------------
    def reuse(self, ids, limit: int | None = None) -> int:
        """Rewind the caches to the longest prefix of `ids` they hold exactly (at most `limit` tokens), and return
        its length (0: they start over). The caller then feeds ids[kept:].

        The full caches are indexed by position: any cached prefix of `ids` is exact there, whatever
        batches computed it (fp16 batched and single-step results differ within the verified
        bounds; the same calls always give the same results). The last token always runs again (it
        must give logits). The rings are the limit: every position q written into them (discarded, or
        a rejected draft) overwrote the slot of q - ring; the kept prefix still needs those above
        kept - window (kept - window - 1 with a drafter, which reads one row more), so the rings
        survive only while q < ring + kept - window (- 1). Otherwise a snapshot of the rings taken at a
        prompt end inside the common prefix takes their place (see `prompt`).
        """
        ids = [int(t) for t in ids]
        common = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1, len(ids) if limit is None else limit)
        if self._rings_hold(common, self.ring_top):
            kept = common
        else:
            snaps = [s for s in self.snapshots if s.position <= common and self._rings_hold(s.position, s.top)]
            snap = max(snaps, key=lambda s: s.position, default=None)
            kept = snap.position if snap else 0
            if snap:
                self._write_rings(snap.rings)
                self.ring_top = snap.top
        if kept == 0:
            self.reset()
        else:
            self.rewind(kept)
        return kept

    def fresh_steps(self, n: int, marks=()) -> list[tuple[int, str, int]]:
        """The steps (position, function, tokens) that `prompt` runs for a prompt of n tokens from empty caches."""
        steps, p = [], 0
        for stop in sorted({m for m in marks if 0 < m < n} | {n}):
            for function, T in self.plan(p, stop - p, "last" if stop == n else "none"):
                steps.append((p, function, T))
                p += T
        return steps

    def fresh_prefix(self, ids: list[int], marks=()) -> int:
        """How many of the cached positions the same steps computed on the same tokens as a fresh run of the prompt
        `ids` would: a batch and single steps round fp16 differently, so a position another path computed (a shorter
        prompt's tail, decoded tokens, a verify call, a restored file) gives other logits after it, and a seeded
        draw reads other tokens from them. It ends where a fresh step ends, so the steps after it are the fresh
        run's too (plan depends only on where a step starts and how many tokens remain)."""
        kept = 0
        for ran, fresh in zip(self.history, self.fresh_steps(len(ids), marks)):
            p, _, T = ran
            if ran != fresh or self.tokens[p : p + T] != ids[p : p + T]:
                break
            kept = p + T
        return kept

    def _rings_hold(self, kept: int, top: int) -> bool:
        """Whether rings whose newest write is `top` still hold every row a prefix of `kept` tokens needs."""
        reach = self.window + (self.verify_batch is not None)  # the drafter reads W + 1 rows
        return top < self.ring or top < kept + self.ring - reach + 1

    def prompt(self, ids, marks=(), cancelled=None, exact: bool = False) -> tuple[int, np.ndarray]:
        """Process a prompt: reuse what the caches hold, feed the rest, and snapshot the rings at
        its end and at each mark (a position inside it where a later prompt may diverge, e.g. the
        end of a system turn). Returns (tokens reused, the last token's logits). `cancelled`: asked
        before each batch; once true, Cancelled is raised with the caches holding the batches run.
        `exact`: the logits are bit for bit a fresh run's, whatever ran before (a seeded request's): only the
        prefix that the very steps of a fresh run computed is reused (`fresh_prefix`)."""
        ids = [int(t) for t in ids]
        kept = self.reuse(ids, self.fresh_prefix(ids, marks) if exact else None)
        if kept == 0:
            self._start(len(ids))
        stops = sorted({m for m in marks if kept < m < len(ids)} | {len(ids)})
        for stop in stops:
            logits = self.feed(
                ids[self.position : stop], logits="last" if stop == len(ids) else "none", cancelled=cancelled
            )
            self._snapshot()
        return kept, logits[-1]

    def _snapshot(self) -> None:
        """Keep the rings as they are now (the newest MAX_SNAPSHOTS positions); the full caches need
        no copy: their rows below the position stay valid while the tokens there do."""
        position = self.position
        if position == 0 or any(s.position == position for s in self.snapshots):
            return
        snapshot = Snapshot(position, self._read_rings(), self.ring_top)
        self.snapshots = sorted(self.snapshots + [snapshot], key=lambda s: s.position)
        self.snapshots = self.snapshots[-MAX_SNAPSHOTS:]

    def caches(self, position: int) -> list[dict[str, np.ndarray]]:
        """What the caches hold of tokens[:position], per chunk: each full cache's first `position`
        slots (axis 2 is the slot axis, CONTRACT §3) and the rings as they were at `position` (a
        snapshot's, or the current ones at the current position)."""
        rings, _ = self._rings_at(position)
        return [
            {**r, **{n: c.read_state(s, n)[:, :, :position] for n in c.interfaces["infer"]["states"] if n != RING}}
            for c, s, r in zip(self.chunks, self.states, rings)
        ]

    def ring_top_at(self, position: int) -> int:
        """The newest position written into the rings that `caches(position)` returns (see ring_top)."""
        return self.ring_top if position == self.position else self._rings_at(position)[1]  # no ring read for it

    def _rings_at(self, position: int) -> tuple[list[dict], int]:
        """The rings as they were at `position` and their newest write: the current ones, or a snapshot's."""
        if position == self.position:
            return self._read_rings(), self.ring_top
        snap = next((s for s in self.snapshots if s.position == position), None)
        if snap is None or not 0 < position <= self.position:
            raise InputError(f"no caches of exactly {position} tokens here (position {self.position})")
        return snap.rings, snap.top

    def restore(self, tokens: list[int], caches: list[dict[str, np.ndarray]], top: int | None = None) -> None:
        """Start over from what `caches(len(tokens))` returned for these tokens (e.g. in another
        process): fresh states with those rows and rings written in, and a snapshot at their end.
        `top`: what `ring_top_at` said of those rings; unknown, the worst case is assumed (a verify
        batch's rejected drafts past the position), which with a drafter keeps `reuse` from
        rewinding into them: the cached prompt itself would be reused from 0."""
        self._start(len(tokens))
        self.reset()
        for chunk, state, arrays in zip(self.chunks, self.states, caches):
            for name, a in arrays.items():
                if name != RING:  # the first len(tokens) slots; the rest stay zero (masked anyway)
                    a = np.concatenate([a, chunk.read_state(state, name)[:, :, a.shape[2] :]], axis=2)
                chunk.write_state(state, name, a)
        self.position, self.tokens = len(tokens), [int(t) for t in tokens]
        self.ring_top = self.position - 1 + (self.ring - self.window) if top is None else top
        self._snapshot()

    def _read_rings(self) -> list[dict]:
        return [
            {n: c.read_state(s, n) for n in c.interfaces["infer"]["states"] if n == RING} if s is not None else {}
            for c, s in zip(self.chunks, self.states)
        ]

    def _write_rings(self, rings: list[dict]) -> None:
        for chunk, state, arrays in zip(self.chunks, self.states, rings):
            for name, a in arrays.items():
                chunk.write_state(state, name, a)

    def rewind(self, position: int) -> None:
        """Forget everything from `position` on (the caller knows the rings hold the rest)."""
        self.position = position
        self.tokens = self.tokens[:position]
        self.history = [(p, f, T) for p, f, T in self.history if p + T <= position]
        self.snapshots = [s for s in self.snapshots if s.position <= position]

    # -- running ------------------------------------------------------------------------------------
    def feed(self, ids, *, logits: str = "last", cancelled=None) -> list[np.ndarray]:
        """Process `ids` from the current position, as planned by plan().

        logits="last": only the last token's logits (what generation needs; chunk_3 runs once);
        logits="all": every position's logits (for verification; chunk_3 runs per row);
        logits="none": just fill the caches.
        A failure midway resets the caches: half-written caches are never reused.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if self.position + len(ids) > self.context:
            raise ContextOverflow(f"{self.position + len(ids)} tokens exceed the context of {self.context}")
        self._climb(self.position + len(ids))
        try:
            return self._feed(ids, logits, cancelled)
        except Cancelled:  # raised between batches: the caches hold exactly the tokens fed
            raise
        except BaseException:
            self.reset()
            raise

    def _feed(self, ids: np.ndarray, logits: str, cancelled=None) -> list[np.ndarray]:
        results, i, n = [], 0, len(ids)
        for function, T in self._ready_plan(n, logits):
            if cancelled is not None and cancelled():
                raise Cancelled(f"cancelled after {self.position} of the prompt's tokens")
            p = self.position
            if function.startswith("prefill_kv"):
                self._run_kv(ids[i : i + T])
            elif T > 1:
                results += self._run(ids[i : i + T], function, "all" if logits == "all" else "none")
            else:
                want = logits if (logits == "all" or i == n - 1) else "none"
                results += self._run(ids[i : i + 1], "infer", "last" if want != "none" else "none")
            self.history.append((p, function, T))
            self.tokens += ids[i : i + T].tolist()
            i += T
        return results
