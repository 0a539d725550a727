"""Choosing the next token from chunk_3's logits (fp32, numpy).

Order, as in transformers and llama.cpp: the logits processors (make_logits_processors: penalties on the raw
logits, then OpenAI's logit bias, then the runtime's bans), then temperature, then the truncations (top-k, top-p,
min-p), then a draw. Logprobs are reported from the model's own distribution (log-softmax of the raw logits), which
is what OpenAI-style clients expect.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field, fields

import numpy as np

from ..errors import InputError


class SamplingError(InputError):
    """An invalid sampling parameter; the message names it and `param` holds its name."""

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Field:
    """One sampling parameter, declared once: SamplingParams checks it by this, the CLI makes its flag from it
    (`--top-k`, with `help`) and the server its JSON field's type check."""

    name: str
    kind: type  # float, int, or dict (logit_bias)
    help: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is out of range

    def check(self, value) -> None:
        """A SamplingError naming the field unless `value` is of its kind and within its bounds (not None)."""
        name, integer = self.name, self.kind is int
        kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
        if isinstance(value, bool) or not isinstance(value, kinds) or not np.isfinite(value):
            raise SamplingError(f"{name}={value!r}: expected {'an integer' if integer else 'a number'}", param=name)
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            raise SamplingError(f"{name}={value!r}: must be {'>' if self.lo_open else '>='} {self.lo}", param=name)
        if self.hi is not None and value > self.hi:
            raise SamplingError(f"{name}={value!r}: must be <= {self.hi}", param=name)


FIELDS = (
    Field("temperature", float, "0 decodes greedily (default: the bundle's generation config)", 0.0),
    Field("top_k", int, "draw from the k most likely tokens only (0: all)", 0),
    Field("top_p", float, "draw from the fewest most likely tokens holding this probability", 0.0, 1.0, True),
    Field("min_p", float, "drop tokens less likely than this fraction of the most likely one", 0.0, 1.0),
    Field("repetition_penalty", float, "divide positive, multiply negative logits of tokens seen", 0.0, None, True),
    Field("presence_penalty", float, "subtract this from the logit of every token seen", -2.0, 2.0),
    Field("frequency_penalty", float, "subtract this times its count from the logit of every token seen", -2.0, 2.0),
    Field("seed", int, "seed of the random stream: the same seed draws the same tokens", 0),
    Field("logprobs", int, "report each token's logprob and this many most likely alternatives", 0, 20),
    Field("logit_bias", dict, "add BIAS in [-100, 100] to token ID's logit (-100 bans it); as ID=BIAS, repeatable"),
)


@dataclass
class SamplingParams:
    """The sampling fields (their bounds and help: FIELDS)."""

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
    # OpenAI's logit_bias: token id -> bias in [-100, 100] added to the logit; -100 bans the token
    # outright (-inf: no temperature brings it back), +100 all but forces it. JSON's string keys
    # are accepted; validate() leaves {int: float}.
    logit_bias: dict[int, float] | None = None

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Check every field (and the logit bias's ids against `vocab_size` when given); returns self."""
        for f in FIELDS:
            value = getattr(self, f.name)
            if f.kind is dict:
                self.logit_bias = None if value is None else _logit_bias(value, vocab_size)
            elif value is not None or f.name not in ("seed", "logprobs"):  # the optional ones
                f.check(value)
        return self

    @classmethod
    def from_generation_config(cls, config: dict, *, vocab_size: int | None = None, **overrides) -> SamplingParams:
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
        return cls(**base).validate(vocab_size)


BAN = -100  # OpenAI: "values like -100 or 100 should result in a ban or exclusive selection"


def _logit_bias(bias, vocab_size: int | None) -> dict[int, float]:
    """{token id: bias} from OpenAI's map (JSON keys are strings), each id and bias checked."""

    def fail(why: str):
        raise SamplingError(f"logit_bias: {why}", param="logit_bias")

    if not isinstance(bias, dict):
        fail(f"expected a map of token ids to biases, got {type(bias).__name__}")
    out = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token = int(key)
        elif isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            token = int(key)
        else:
            fail(f"{key!r} is not a token id")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            fail(f"token {token} is not in the vocabulary" + (f" of {vocab_size}" if vocab_size else ""))
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float, np.integer, np.floating))
            or not -100 <= value <= 100
        ):
            fail(f"{key!r}: {value!r}: expected a number in [-100, 100]")
        out[token] = float(value)
    if vocab_size is not None and sum(v == BAN for v in out.values()) >= vocab_size:
        fail("it bans every token")
    return out


@dataclass
class Proposal:
    """A drafter's distribution over the vocabulary for one position, as Gemma 4's centroid head gives it:
    real logits for the tokens `ids` and one `fill` logit shared by every other token (transformers: the
    scored minimum minus one), or fill None when `ids` cover the vocabulary. Never expanded to vocab size."""

    ids: np.ndarray  # int64 (n,), distinct
    logits: np.ndarray  # float32 (n,)
    fill: float | None
    vocab: int
    _sorted: np.ndarray = field(init=False, repr=False)
    _order: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        self.ids, self.logits = np.asarray(self.ids, np.int64), np.asarray(self.logits, np.float32)
        if self.ids.shape != self.logits.shape or (self.fill is None and len(self.ids) != self.vocab):
            raise ValueError(f"proposal: {len(self.ids)} ids, {len(self.logits)} logits, fill {self.fill}")
        self._order = np.argsort(self.ids)
        self._sorted = self.ids[self._order]

    def _unscored(self, k: int) -> int:
        """The k-th smallest id outside `ids`: below sorted[i] lie sorted[i] - i unscored ids."""
        return k + int(np.searchsorted(self._sorted - np.arange(len(self._sorted)), k, side="right"))

    def argmax(self) -> int:
        """The most likely token, ties by lowest id (as an argmax over the full logit vector)."""
        best = self.logits.max()
        top = int(self.ids[self.logits == best].min())
        if self.fill is None or len(self.ids) == self.vocab or self.fill < best:
            return top
        lowest = self._unscored(0)
        return lowest if self.fill > best else min(top, lowest)

    def _weights(self, temperature: float) -> tuple[np.ndarray, float]:
        """Unnormalised softmax(logits / T) of the scored tokens, and the total of the unscored ones."""
        x = self.logits.astype(np.float64)  # and the fill with it: float32 - float would round it to float32
        m = x.max() if self.fill is None else max(x.max(), self.fill)
        w = np.exp((x - m) / temperature)
        rest = 0.0 if self.fill is None else (self.vocab - len(self.ids)) * np.exp((self.fill - m) / temperature)
        return w, float(rest)

    def probs(self, tokens: np.ndarray, temperature: float) -> np.ndarray:
        """q(token) for each of `tokens` under softmax(logits / T) over the whole vocabulary (float64)."""
        w, rest = self._weights(temperature)
        tokens = np.asarray(tokens, np.int64)
        pos = np.minimum(np.searchsorted(self._sorted, tokens), len(self._sorted) - 1)
        hit = self._sorted[pos] == tokens
        each = rest / max(self.vocab - len(self.ids), 1)
        return np.where(hit, w[self._order[pos]], each) / (w.sum() + rest)

    def draw(self, rng: np.random.Generator, temperature: float) -> int:
        """One exact draw: scored against unscored by their total mass, an unscored token uniformly."""
        w, rest = self._weights(temperature)
        c = np.cumsum(w)
        u = rng.random() * (c[-1] + rest)
        if rest and u >= c[-1]:
            return self._unscored(int(rng.integers(self.vocab - len(self.ids))))
        return int(self.ids[min(int(np.searchsorted(c, u, side="right")), len(c) - 1)])


# -- logits processors: the chain make_logits_processors builds, applied before the sampler draws -------------------


class Processor(abc.ABC):
    """One logits processor of the chain: it changes the fp32 logits of some tokens only, `ids` (sorted) or, when
    `seen` is set, the tokens seen so far, given each one's count; `__call__(ids, x, counts)` returns the logits `x`
    of the tokens `ids` (a superset of its own) changed. Sparse, so the fp16 fast path converts only the tokens some
    processor touches."""

    seen = False
    ids = np.zeros(0, np.int64)

    @abc.abstractmethod
    def __call__(self, ids: np.ndarray, x: np.ndarray, counts: np.ndarray) -> np.ndarray: ...


class RepetitionPenalty(Processor):
    """transformers' rule: a seen token's positive logit divided by the penalty, its negative one multiplied."""

    seen = True

    def __init__(self, penalty: float):
        self.penalty = np.float32(penalty)

    def __call__(self, ids, x, counts):
        r = self.penalty
        return np.where(counts > 0, np.where(x > 0, x / r, x * r), x)


class OccurrencePenalty(Processor):
    """OpenAI's presence and frequency penalties, in its one formula: a seen token's logit less presence plus
    frequency times its count."""

    seen = True

    def __init__(self, presence: float, frequency: float):
        self.presence, self.frequency = np.float32(presence), np.float32(frequency)

    def __call__(self, ids, x, counts):
        return x - (self.presence * (counts > 0) + self.frequency * counts)


class LogitBias(Processor):
    """OpenAI's logit_bias: each token's bias added; BAN (-100) bans it (-inf: no temperature brings it back)."""

    def __init__(self, bias: dict[int, float]):
        ids = np.fromiter(bias, np.int64, len(bias))
        add = np.array([-np.inf if b == BAN else b for b in bias.values()], np.float32)
        order = np.argsort(ids)
        self.ids, self.add = ids[order], add[order]

    def __call__(self, ids, x, counts):
        out = np.array(x, np.float32)
        out[np.searchsorted(ids, self.ids)] += self.add
        return out


class Ban(LogitBias):
    """Tokens no draw may take whatever the request's logit_bias says: tool_choice "none" bans <|tool_call>."""

    def __init__(self, tokens):
        super().__init__({int(t): BAN for t in tokens})


def make_logits_processors(params: SamplingParams, bans=()) -> list[Processor]:
    """The processors `params` ask for, in order: repetition penalty, presence and frequency penalties, logit bias,
    then `bans` (the runtime's own: tool_choice "none"). None when nothing changes a logit: the fast path's case."""
    p, out = params, []
    if p.repetition_penalty != 1.0:
        out.append(RepetitionPenalty(p.repetition_penalty))
    if p.presence_penalty or p.frequency_penalty:
        out.append(OccurrencePenalty(p.presence_penalty, p.frequency_penalty))
    if p.logit_bias:
        out.append(LogitBias(p.logit_bias))
    if len(bans):
        out.append(Ban(bans))
    return out


class Sampler:
    """Holds the random stream and the token counts: one Sampler per generation, so a seed
    reproduces a whole run, and penalties and bias cost O(distinct tokens they touch) per step."""

    def __init__(self, params: SamplingParams, history=(), bans=()):
        self.p = params.validate()
        self.rng = np.random.default_rng(params.seed)
        self.counts: dict[int, int] = {}
        self.processors = make_logits_processors(self.p, bans)
        self._penalties = any(q.seen for q in self.processors)
        fixed = [q.ids for q in self.processors if not q.seen]
        self._fixed = np.unique(np.concatenate(fixed)) if fixed else np.zeros(0, np.int64)
        self._arrays = None
        for t in history:
            self.observe(t)

    def observe(self, token: int) -> None:
        self.counts[int(token)] = self.counts.get(int(token), 0) + 1
        if self._penalties:
            self._arrays = None

    def _touched(self, vocab: int):
        """(ids, counts) of the tokens whose logits the processors change (counts 0: biased or banned but
        unseen), or None when they change none."""
        fixed = self._fixed
        if len(fixed) and fixed[-1] >= vocab:
            why = f"logit_bias: token {fixed[-1]} is not in the vocabulary of {vocab}"
            raise SamplingError(why, param="logit_bias")
        seen = self.counts if self._penalties else {}
        if not seen and not len(fixed):
            return None
        if self._arrays is None:
            seen_ids = np.fromiter(seen, np.int64, len(seen))
            ids = np.union1d(seen_ids, fixed)
            counts = np.zeros(len(ids), np.float32)
            counts[np.searchsorted(ids, seen_ids)] = np.fromiter(seen.values(), np.float32, len(seen))
            keep = ids < vocab
            self._arrays = ids[keep], counts[keep]
        return self._arrays

    def _apply(self, ids: np.ndarray, x: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """The processors in turn, on the fp32 logits `x` of the touched tokens `ids`."""
        for processor in self.processors:
            x = processor(ids, x, counts)
        return x.astype(np.float32)

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        """The processors (penalties over every token seen so far, logit bias, bans) on fp32 logits.
        Modifies and returns `logits`."""
        touched = self._touched(len(logits))
        if touched is not None:
            ids, counts = touched
            logits[ids] = self._apply(ids, logits[ids], counts)
        return logits

    @property
    def greedy(self) -> bool:
        return self.p.temperature == 0.0 or self.p.top_k == 1

    def sample(self, logits: np.ndarray) -> int:
        """The next token id from chunk_3's raw logits (fp16 or fp32; not modified).

        fp16 logits with greedy or top-k decoding never get converted whole: candidates are picked
        on an integer key that orders fp16 values exactly, and only they and the penalised or
        biased tokens are converted to fp32. The result is the one the fp32 path gives, draw for draw."""
        p = self.p
        touched = self._touched(len(logits))
        k, n_touched = (1 if self.greedy else p.top_k), (0 if touched is None else len(touched[0]))
        if logits.dtype != np.float16 or not k or k + n_touched >= len(logits):
            return self.choose(self.adjust(np.array(logits, np.float32)))
        key = _order_key(logits)
        if touched is not None:
            key[touched[0]] = np.iinfo(np.int16).min  # judged below on their adjusted fp32 values
        cand = top_indices(key, k)
        vals = logits[cand].astype(np.float32)
        if touched is not None:
            ids, counts = touched
            cand = np.concatenate([cand, ids])
            vals = np.concatenate([vals, self._apply(ids, logits[ids].astype(np.float32), counts)])
            order = np.lexsort((cand, -vals))[:k]
            cand, vals = cand[order], vals[order]
        return int(cand[0]) if self.greedy else self._pick(*self._top_k(cand, vals))

    def choose(self, logits: np.ndarray) -> int:
        """The next token id from (already adjusted) float32 logits: a draw from `distribution`."""
        ids, probs = self.distribution(logits)
        return int(ids[0]) if self.greedy else self._pick(ids, probs)

    def draft(self, proposal: Proposal) -> int:
        """A drafter's token: its argmax when decoding greedily, else a draw from q at our temperature
        (no truncations: speculative sampling is exact for any q that `verify` is given too)."""
        return proposal.argmax() if self.greedy else proposal.draw(self.rng, self.p.temperature)

    def verify(self, logits: np.ndarray, draft: int, proposal: Proposal) -> tuple[int, bool]:
        """(token, accepted) for the position `draft` fills, from chunk_3's raw logits there: speculative
        sampling (Leviathan et al. 2023), so the token is distributed exactly as `sample(logits)`'s. Greedy
        keeps the target's own token. Does not observe(): the caller observes each token it emits, in order."""
        if self.greedy:
            t = self.sample(logits)
            return t, t == int(draft)
        ids, p = self.distribution(self.adjust(np.array(logits, np.float32)))
        at = np.flatnonzero(ids == draft)
        p_draft = p[at[0]] if len(at) else 0.0
        q_draft = proposal.probs(np.array([draft]), self.p.temperature)[0]
        if self.rng.random() * q_draft < p_draft:  # probability min(1, p/q); q > 0 for a draft drawn from q
            return int(draft), True
        # Rejected: draw from normalise(max(0, p - q)), which lives on p's support.
        residual = np.maximum(p - proposal.probs(ids, self.p.temperature), 0.0)
        total = residual.sum()
        # p <= q everywhere only by rounding (p == q): the rejection itself then has probability ~0.
        return self._pick(ids, p if total < 1e-12 else residual / total), False

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, probabilities) the next token is drawn from, given (already adjusted) float32
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
        if threshold == x.min():
            # a constrained draw: most of the vocabulary is masked to -inf, so the sample's threshold is the
            # mask itself; keep what is above it and the lowest-index ties, never the whole masked sea
            cand = np.flatnonzero(x > threshold)
            if len(cand) < n:
                cand = np.concatenate([cand, np.flatnonzero(x == threshold)[: n - len(cand)]])
        else:
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
