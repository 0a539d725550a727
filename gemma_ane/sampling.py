"""Choosing the next token from chunk_3's logits (fp32, numpy).

Order, as in transformers and llama.cpp: penalties on the raw logits, then temperature, then the
truncations (top-k, top-p, min-p), then a draw. Logprobs are reported from the model's own
distribution (log-softmax of the raw logits), which is what OpenAI-style clients expect.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


class SamplingError(ValueError):
    """An invalid sampling parameter; the message names it."""


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
    logprobs: int = 0  # alternatives to report per token (0 = only the chosen token's logprob)

    def validate(self) -> "SamplingParams":
        def num(name, lo=None, hi=None, lo_open=False, integer=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()) \
                    or not np.isfinite(v):
                raise SamplingError(f"{name}={v!r}: expected {'an integer' if integer else 'a number'}")
            if lo is not None and (v <= lo if lo_open else v < lo):
                raise SamplingError(f"{name}={v!r}: must be {'>' if lo_open else '>='} {lo}")
            if hi is not None and v > hi:
                raise SamplingError(f"{name}={v!r}: must be <= {hi}")

        num("temperature", 0.0)
        num("top_k", 0, integer=True)
        num("top_p", 0.0, 1.0, lo_open=True)
        num("min_p", 0.0, 1.0)
        num("repetition_penalty", 0.0, lo_open=True)
        num("presence_penalty", -2.0, 2.0)
        num("frequency_penalty", -2.0, 2.0)
        num("logprobs", 0, 20, integer=True)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise SamplingError(f"seed={self.seed!r}: expected a non-negative integer")
        return self

    @classmethod
    def from_generation_config(cls, config: dict, **overrides) -> "SamplingParams":
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
            raise SamplingError(f"unknown sampling parameter {unknown[0]!r}")
        return cls(**base).validate()


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


class Sampler:
    """Holds the random stream: one Sampler per generation, so a seed reproduces a whole run."""

    def __init__(self, params: SamplingParams):
        self.p = params.validate()
        self.rng = np.random.default_rng(params.seed)

    def penalize(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        p = self.p
        if not len(history) or (p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty):
            return logits
        logits = logits.copy()
        ids, counts = np.unique(np.asarray(history, np.int64), return_counts=True)
        ids_ok = ids < len(logits)
        ids, counts = ids[ids_ok], counts[ids_ok]
        if p.repetition_penalty != 1.0:
            seen = logits[ids]
            logits[ids] = np.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts
        return logits

    def choose(self, logits: np.ndarray) -> int:
        """The next token id from (already penalised) logits."""
        p = self.p
        if p.temperature == 0.0 or p.top_k == 1:
            return int(np.argmax(logits))
        x = logits.astype(np.float32) / np.float32(p.temperature)
        m = x.max()
        if p.top_k:  # as transformers: top-p and min-p then act on the renormalised top-k
            cand = self._top(x, min(p.top_k, len(x)))
            probs = np.exp((x[cand] - m).astype(np.float64))
            probs /= probs.sum()
        elif p.top_p < 1.0 or p.min_p > 0:
            # Never sort the whole vocabulary: both truncations only keep tokens near the top, so
            # grow a partition until it holds the top-p mass or reaches below the min-p floor.
            total = np.exp((x - m).astype(np.float64)).sum()
            n = 64
            while True:
                cand = self._top(x, min(n, len(x)))
                probs = np.exp((x[cand] - m).astype(np.float64)) / total
                done_p = p.top_p < 1.0 and probs.sum() >= p.top_p
                done_min = p.min_p > 0 and probs[-1] < p.min_p * probs[0]
                if done_p or done_min or len(cand) == len(x):
                    break
                n *= 4
        else:
            probs = np.exp((x - m).astype(np.float64))
            probs /= probs.sum()
            return int(self.rng.choice(len(x), p=probs))
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            cand, probs = cand[:keep], probs[:keep]
        if p.min_p > 0:
            keep = probs >= p.min_p * probs[0]
            cand, probs = cand[keep], probs[keep]
        return int(cand[self.rng.choice(len(cand), p=probs / probs.sum())])

    @staticmethod
    def _top(x: np.ndarray, n: int) -> np.ndarray:
        """Indices of the n largest values, largest first."""
        cand = np.argpartition(-x, n - 1)[:n] if n < len(x) else np.arange(len(x))
        return cand[np.argsort(-x[cand], kind="stable")]

    def logprobs(self, logits: np.ndarray, token: int) -> tuple[float, list[tuple[int, float]]]:
        """(logprob of token, top-n alternatives) under the model's distribution."""
        lp = log_softmax(logits.astype(np.float64))
        top = []
        if self.p.logprobs:
            idx = np.argpartition(-lp, self.p.logprobs - 1)[:self.p.logprobs]
            idx = idx[np.argsort(-lp[idx], kind="stable")]
            top = [(int(i), float(lp[i])) for i in idx]
        return float(lp[token]), top
