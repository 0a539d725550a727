"""Choosing the next token from chunk_3's logits (fp32, numpy).

Order, as in transformers and llama.cpp: penalties on the raw logits, then temperature, then the
truncations (top-k, top-p, min-p), then a draw. Logprobs are reported from the model's own
distribution (log-softmax of the raw logits), which is what OpenAI-style clients expect.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


class SamplingError(ValueError):
    """An invalid sampling parameter; the message names it and `param` holds its name."""

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # None: no logprobs (a log-sum-exp over the whole vocabulary per token is not free);
    # n >= 0: the chosen token's logprob and n alternatives
    logprobs: int | None = None

    def validate(self) -> SamplingParams:
        def num(name, lo=None, hi=None, lo_open=False, integer=False):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or (integer and not float(v).is_integer())
                or not np.isfinite(v)
            ):
                raise SamplingError(f"{name}={v!r}: expected {'an integer' if integer else 'a number'}", param=name)
            if lo is not None and (v <= lo if lo_open else v < lo):
                raise SamplingError(f"{name}={v!r}: must be {'>' if lo_open else '>='} {lo}", param=name)
            if hi is not None and v > hi:
                raise SamplingError(f"{name}={v!r}: must be <= {hi}", param=name)

        num("temperature", 0.0)
        num("top_k", 0, integer=True)
        num("top_p", 0.0, 1.0, lo_open=True)
        num("min_p", 0.0, 1.0)
        num("repetition_penalty", 0.0, lo_open=True)
        num("presence_penalty", -2.0, 2.0)
        num("frequency_penalty", -2.0, 2.0)
        if self.logprobs is not None:
            num("logprobs", 0, 20, integer=True)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise SamplingError(f"seed={self.seed!r}: expected a non-negative integer", param="seed")
        return self

    @classmethod
    def from_generation_config(cls, config: dict, **overrides) -> SamplingParams:
        """Defaults from generation_config.json (do_sample=false means greedy), then the caller's."""
        base = {}
        if config.get("do_sample") is False:
            base["temperature"] = 0.0
        for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
            if config.get(name) is not None:
                base[name] = config[name]
        base.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(base) - known)
        if unknown:
            raise SamplingError(f"unknown sampling parameter {unknown[0]!r}", param=unknown[0])
        return cls(**base).validate()


class Sampler:
    """Holds the random stream and the token counts: one Sampler per generation, so a seed
    reproduces a whole run and penalties cost O(distinct tokens seen) per step."""

    def __init__(self, params: SamplingParams, history=()):
        self.p = params.validate()
        self.rng = np.random.default_rng(params.seed)
        self.counts: dict[int, int] = {}
        self._arrays = None
        for t in history:
            self.observe(t)

    def observe(self, token: int) -> None:
        self.counts[int(token)] = self.counts.get(int(token), 0) + 1
        self._arrays = None

    def _penalized(self, vocab: int):
        """(ids, counts) of the tokens the penalties touch, or None when no penalty is active."""
        p = self.p
        if not self.counts or (p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty):
            return None
        if self._arrays is None:
            ids = np.fromiter(self.counts, np.int64, len(self.counts))
            counts = np.fromiter(self.counts.values(), np.float32, len(self.counts))
            keep = ids < vocab
            self._arrays = ids[keep], counts[keep]
        return self._arrays

    def _apply(self, seen: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Repetition (transformers' rule: divide positive logits, multiply negative ones), then
        presence and frequency penalties, on the fp32 logits of the tokens seen so far."""
        p = self.p
        if p.repetition_penalty != 1.0:
            seen = np.where(seen > 0, seen / np.float32(p.repetition_penalty), seen * np.float32(p.repetition_penalty))
        if p.presence_penalty or p.frequency_penalty:
            seen = seen - (np.float32(p.presence_penalty) + np.float32(p.frequency_penalty) * counts)
        return seen.astype(np.float32)

    def penalize(self, logits: np.ndarray) -> np.ndarray:
        """The penalties over every token seen so far, on fp32 logits. Modifies and returns `logits`."""
        pen = self._penalized(len(logits))
        if pen is not None:
            ids, counts = pen
            logits[ids] = self._apply(logits[ids], counts)
        return logits

    @property
    def greedy(self) -> bool:
        return self.p.temperature == 0.0 or self.p.top_k == 1

    def sample(self, logits: np.ndarray) -> int:
        """The next token id from chunk_3's raw logits (fp16 or fp32; not modified).

        fp16 logits with greedy or top-k decoding never get converted whole: candidates are picked
        on an integer key that orders fp16 values exactly, and only they and the penalised tokens
        are converted to fp32. The result is the one the fp32 path gives, draw for draw."""
        p = self.p
        if logits.dtype != np.float16 or not (self.greedy or p.top_k) or p.top_k + len(self.counts) >= len(logits):
            return self.choose(self.penalize(np.array(logits, np.float32)))
        key = _order_key(logits)
        pen = self._penalized(len(logits))
        k = 1 if self.greedy else p.top_k
        if pen is not None:
            key[pen[0]] = np.iinfo(np.int16).min  # judged below on their penalised fp32 values
        cand = top_indices(key, k)
        vals = logits[cand].astype(np.float32)
        if pen is not None:
            ids, counts = pen
            cand = np.concatenate([cand, ids])
            vals = np.concatenate([vals, self._apply(logits[ids].astype(np.float32), counts)])
            order = np.lexsort((cand, -vals))[:k]
            cand, vals = cand[order], vals[order]
        return int(cand[0]) if self.greedy else self._pick(*self._top_k(cand, vals))

    def choose(self, logits: np.ndarray) -> int:
        """The next token id from (already penalised) float32 logits: a draw from `distribution`."""
        ids, probs = self.distribution(logits)
        return int(ids[0]) if self.greedy else self._pick(ids, probs)

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, probabilities) the next token is drawn from, given (already penalised) float32
        logits: temperature, then top-k, top-p and min-p. Greedy decoding gives the argmax alone."""
        p = self.p
        if self.greedy:
            return np.array([np.argmax(logits)]), np.ones(1)
        if p.top_k:  # as transformers: top-p and min-p then act on the renormalised top-k
            cand = top_indices(logits, min(p.top_k, len(logits)))
            return self._top_k(cand, logits[cand])
        t = np.float32(p.temperature)
        m = logits.max()
        if p.top_p < 1.0 or p.min_p > 0:
            # Never sort the whole vocabulary: both truncations only keep tokens near the top, so
            # grow the candidate set until it holds the top-p mass or reaches below the min-p floor.
            total = np.exp(((logits - m) / t).astype(np.float64)).sum()
            n = 64
            while True:
                cand = top_indices(logits, min(n, len(logits)))
                probs = np.exp(((logits[cand] - m) / t).astype(np.float64)) / total
                done_p = p.top_p < 1.0 and probs.sum() >= p.top_p
                done_min = p.min_p > 0 and probs[-1] < p.min_p * probs[0]
                if done_p or done_min or len(cand) == len(logits):
                    break
                n *= 4
            return self._truncate(cand, probs)
        probs = np.exp(((logits - m) / t).astype(np.float64))
        return np.arange(len(logits)), probs / probs.sum()

    def _top_k(self, cand: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The distribution over the top-k candidates (largest first) and their fp32 logits."""
        t = np.float32(self.p.temperature)
        probs = np.exp(((vals - vals[0]) / t).astype(np.float64))
        return self._truncate(cand, probs / probs.sum())

    def _truncate(self, cand: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Top-p, then min-p, over candidates largest first; the survivors' probabilities renormalised."""
        p = self.p
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            cand, probs = cand[:keep], probs[:keep]
        if p.min_p > 0:
            keep = probs >= p.min_p * probs[0]
            cand, probs = cand[keep], probs[keep]
        return cand, probs / probs.sum()

    def _pick(self, ids: np.ndarray, probs: np.ndarray) -> int:
        return int(ids[self.rng.choice(len(ids), p=probs)])

    def logprobs(self, logits: np.ndarray, token: int) -> tuple[float, list[tuple[int, float]]]:
        """(logprob of token, top-n alternatives) under the model's distribution."""
        logits = np.asarray(logits, np.float32)
        m = float(logits.max())
        lse = m + float(np.log(np.exp(logits - m, dtype=np.float32).sum(dtype=np.float64)))
        top = []
        if self.p.logprobs:
            top = [(int(i), float(logits[i]) - lse) for i in top_indices(logits, self.p.logprobs)]
        return float(logits[token]) - lse, top


def _order_key(x16: np.ndarray) -> np.ndarray:
    """int16 keys ordered exactly as the fp16 values (IEEE sign-magnitude -> two's complement,
    -0 = +0): an integer partition is several times cheaper than converting 262,144 values."""
    s = x16.view(np.int16)
    key = s ^ ((s >> 15) & np.int16(0x7FFF))
    key[key == -1] = 0
    return key


def top_indices(x: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest values, largest first, ties by lower index (so any dtype that
    orders the same values alike gives the same answer). A strided sample gives a threshold that
    keeps a few hundred candidates, checked to hold n, so the full vocabulary is never sorted."""
    N = len(x)
    cand = None
    if n >= N:
        cand = np.arange(N)
    elif N > 16384:
        sample = x[::64]
        k = min(len(sample) - 1, n // 64 + 8)
        threshold = np.partition(sample, len(sample) - 1 - k)[len(sample) - 1 - k]
        cand = np.flatnonzero(x >= threshold)
        if not n <= len(cand) <= 64 * n + 4096:
            cand = None
    if cand is None:
        cand = np.flatnonzero(x >= np.partition(x, N - n)[N - n])
    v = x[cand].astype(np.float64)
    if len(cand) > 4 * n:
        keep = v >= np.partition(v, len(v) - n)[len(v) - n]
        cand, v = cand[keep], v[keep]
    return cand[np.lexsort((cand, -v))[:n]]
