"""Choosing the next token from chunk_3's logits (fp32, numpy).

Order, as in transformers and llama.cpp: the logits processors (make_logits_processors: penalties on the raw
logits, then OpenAI's logit bias, then the runtime's bans, then the grammar mask), then the sampler chain
(make_sampler: temperature, then the truncations top-k, top-p, min-p), then a draw: mlx-lm's make_logits_processors /
make_sampler shape, over numpy and chunk_3's fp16 logits (Sampler keeps the fast path that never converts the whole
row). Logprobs are reported from the model's own distribution (log-softmax of the raw logits), which is what
OpenAI-style clients expect.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field, fields

import numpy as np

from ..errors import BundleError, InputError


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
        # an integer is finite, and past int64 np.isfinite refuses it (TypeError) rather than answering
        if isinstance(value, bool) or not isinstance(value, kinds) or not (integer or np.isfinite(value)):
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
    # OpenAI's seed is a signed 64-bit integer (clients send -1)
    Field("seed", int, "seed of the random stream: the same seed draws the same tokens", -(2**63), 2**63 - 1),
    Field("logprobs", int, "report each token's logprob and this many most likely alternatives", 0, 20),
    Field("logit_bias", dict, "add BIAS in [-100, 100] to token ID's logit (-100 bans it); as ID=BIAS, repeatable"),
)

# the fields a bundle's generation_config.json may set (its defaults, under the caller's)
GENERATION_CONFIG_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


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
        for name in GENERATION_CONFIG_FIELDS:
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
            raise BundleError(  # drafter.py makes every Proposal: its outputs do not fit the bundle's vocabulary
                f"the drafter's proposal: {len(self.ids)} ids, {len(self.logits)} logits, fill {self.fill}, "
                f"for a vocabulary of {self.vocab}"
            )
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


# -- logits processors: the chain make_logits_processors builds, applied before the sampler chain ------------------


class Processor(abc.ABC):
    """One logits processor of the chain: it changes the fp32 logits of some tokens only, `ids` (sorted) or, when
    `seen` is set, the tokens seen so far, given each one's count; `__call__(ids, x, counts)` returns the logits `x`
    of the tokens `ids` (a superset of its own) changed. Sparse, so the fp16 fast path converts only the tokens some
    processor touches. A `dense` one (the grammar mask) may change any token: `row` applies it to a whole row."""

    seen = False
    dense = False
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


class GrammarMask(Processor):
    """Constrained decoding's mask (a grammar.Constraint's): every token the grammar does not take now at -inf, and
    `banned` (logit_bias's bans, the runtime's) never allowed, so that a step with no token left is seen here and
    refused by `no_token(steps)`'s error, never drawn. Its state follows the output: `advance` consumes each token
    emitted, `refuse` drops one llguidance's mask holds but its parser then refuses (the sampler draws again)."""

    dense = True

    def __init__(self, constraint, banned, no_token):
        self.constraint, self.banned, self.no_token = constraint, np.asarray(banned, np.int64), no_token
        self.steps, self._allowed = 0, None

    @property
    def allowed(self) -> np.ndarray:
        """A bool per token: may the next draw take it? Computed once a step (the mask is most of a step's cost)."""
        if self._allowed is None:
            self._allowed = self.constraint.allowed(self.banned)
        return self._allowed

    def __call__(self, ids, x, counts):
        return np.where(self.allowed[ids], x, np.float32(-np.inf)).astype(np.float32)

    def row(self, logits: np.ndarray) -> np.ndarray:
        """A masked copy of a whole row, fp16 or fp32 (the caller's stays the model's distribution)."""
        return self.constraint.mask(logits, self.allowed)

    def takes(self, token: int) -> bool:
        """Does the grammar take `token` now? If not, it is masked out of this step's draws."""
        if self.allowed[token] and self.constraint.legal(token):
            return True
        self.allowed[token] = False
        return False

    def advance(self, token: int) -> None:
        self.constraint.advance(token)
        self.steps += 1
        self._allowed = None


def make_logits_processors(params: SamplingParams, bans=(), grammar: GrammarMask | None = None) -> list[Processor]:
    """The processors `params` ask for, in order: repetition penalty, presence and frequency penalties, logit bias,
    then the runtime's own: `bans` (tool_choice "none"), then `grammar`'s mask. Empty when nothing changes a logit:
    the fast path's case."""
    p, out = params, []
    if p.repetition_penalty != 1.0:
        out.append(RepetitionPenalty(p.repetition_penalty))
    if p.presence_penalty or p.frequency_penalty:
        out.append(OccurrencePenalty(p.presence_penalty, p.frequency_penalty))
    if p.logit_bias:
        out.append(LogitBias(p.logit_bias))
    if len(bans):
        out.append(Ban(bans))
    if grammar is not None:
        out.append(grammar)
    return out


# -- the sampler chain: make_sampler builds it, each step narrowing the distribution the draw is made from ----------


class Candidates:
    """The distribution a draw is made from, as the sampler chain narrows it: the fp32 logits `x` of the tokens `ids`
    (None: of every token, by id; else of the candidates, most likely first) at `temperature`. `p`, computed when a
    step asks for it: the candidates' probabilities under the distribution they were cut from (top-k's renormalised
    one, or the whole vocabulary's), which the cuts after it keep as they are (transformers' warpers cut the same
    ranking) and the draw renormalises."""

    def __init__(self, x: np.ndarray, ids: np.ndarray | None = None, temperature: float = 1.0, p=None):
        # past fp32's largest, a temperature is as flat as that one (the cast would overflow to inf, with a warning)
        self.x, self.ids, self._p = x, ids, p
        self.temperature = np.float32(min(temperature, float(np.finfo(np.float32).max)))

    @property
    def p(self) -> np.ndarray:
        if self._p is None:
            top = self.x.max() if self.ids is None else self.x[0]
            w = np.exp(((self.x - top) / self.temperature).astype(np.float64))
            self._p = w / w.sum()
        return self._p

    def cut(self, keep) -> Candidates:
        """The candidates `keep` (a slice or a mask) selects, their probabilities as they were."""
        return Candidates(self.x[keep], self.ids[keep], self.temperature, self.p[keep])

    def head(self, enough) -> Candidates:
        """The most likely tokens of the whole vocabulary, as many as `enough(probs)` (shown their probabilities,
        largest first) needs: the candidate set grows until it says so, so the vocabulary is never sorted."""
        x, t = self.x, self.temperature
        m = x.max()
        total = np.exp(((x - m) / t).astype(np.float64)).sum()
        n = 64
        while True:
            cand = top_indices(x, min(n, len(x)))
            probs = np.exp(((x[cand] - m) / t).astype(np.float64)) / total
            if enough(probs) or len(cand) == len(x):
                return Candidates(x[cand], cand, t, probs)
            n *= 4

    def distribution(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, probabilities) of the draw."""
        if self.ids is None:  # nothing cut: one normalisation over the vocabulary
            return np.arange(len(self.x)), self.p
        return self.ids, self.p / self.p.sum()


class Temperature:
    """Divides the logits by t: the probabilities every cut after it sees are softmax(x / t)'s."""

    def __init__(self, t: float):
        self.t = t

    def __call__(self, c: Candidates) -> Candidates:
        return Candidates(c.x, c.ids, self.t)


class TopK:
    """The k most likely tokens, ties by lower id; the distribution renormalised over them (as transformers)."""

    def __init__(self, k: int):
        self.k = k

    def __call__(self, c: Candidates) -> Candidates:
        if c.ids is None:
            cand = top_indices(c.x, min(self.k, len(c.x)))
            return Candidates(c.x[cand], cand, c.temperature)
        return Candidates(c.x[: self.k], c.ids[: self.k], c.temperature)


class TopP:
    """The fewest most likely tokens whose probability reaches top_p."""

    def __init__(self, top_p: float):
        self.top_p = top_p

    def __call__(self, c: Candidates) -> Candidates:
        if c.ids is None:
            c = c.head(lambda probs: probs.sum() >= self.top_p)
        return c.cut(slice(int(np.searchsorted(np.cumsum(c.p), self.top_p)) + 1))


class MinP:
    """The tokens at least min_p times as likely as the most likely one."""

    def __init__(self, min_p: float):
        self.min_p = min_p

    def __call__(self, c: Candidates) -> Candidates:
        if c.ids is None:
            c = c.head(lambda probs: probs[-1] < self.min_p * probs[0])
        return c.cut(c.p >= self.min_p * c.p[0])


def make_sampler(params: SamplingParams) -> list:
    """The sampler chain `params` ask for, in transformers' order: temperature, then the cuts, top-k, top-p and min-p,
    each on the distribution the steps before it leave. Only the steps that change it; greedy decoding (temperature
    0 or top-k 1) is top-k 1 alone, the argmax."""
    p = params
    if p.temperature == 0.0 or p.top_k == 1:
        return [TopK(1)]
    out = [Temperature(p.temperature)] if p.temperature != 1.0 else []
    if p.top_k:
        out.append(TopK(p.top_k))
    if p.top_p < 1.0:
        out.append(TopP(p.top_p))
    if p.min_p > 0:
        out.append(MinP(p.min_p))
    return out


class Sampler:
    """One generation's draws: the logits processors (make_logits_processors) then the sampler chain (make_sampler)
    on chunk_3's logits, and a draw. Holds the random stream and the token counts: one Sampler per generation, so a
    seed reproduces a whole run, and penalties and bias cost O(distinct tokens they touch) per step."""

    def __init__(self, params: SamplingParams, history=(), bans=(), grammar: GrammarMask | None = None):
        self.p = params.validate()
        # numpy takes non-negative seeds only: a signed one maps to its 64-bit two's complement, one to one
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        self.counts: dict[int, int] = {}
        self.processors = make_logits_processors(self.p, bans, grammar)
        sparse = [q for q in self.processors if not q.dense]
        self._dense = [q for q in self.processors if q.dense]
        self.grammar = next((q for q in self._dense if isinstance(q, GrammarMask)), None)
        self._penalties = any(q.seen for q in sparse)
        fixed = [q.ids for q in sparse if not q.seen]
        self._fixed = np.unique(np.concatenate(fixed)) if fixed else np.zeros(0, np.int64)
        self._arrays = None
        self.steps = make_sampler(self.p)
        # The fp16 fast path's top-k: when the chain's first cut is top-k (the steps before it only rescale, which
        # keeps the ranking), its candidates are found on the raw fp16 row; 0 when it is not.
        first = next((i for i, s in enumerate(self.steps) if not isinstance(s, Temperature)), len(self.steps))
        self._k = self.steps[first].k if first < len(self.steps) and isinstance(self.steps[first], TopK) else 0
        self._rescale, self._after = self.steps[:first], self.steps[first + 1 :]
        for t in history:
            self._count(t)

    def _count(self, token: int) -> None:
        self.counts[int(token)] = self.counts.get(int(token), 0) + 1
        if self._penalties:
            self._arrays = None

    def observe(self, token: int) -> None:
        """`token` was emitted: counted for the penalties, consumed by the grammar."""
        self._count(token)
        if self.grammar is not None:
            self.grammar.advance(token)

    def _touched(self, vocab: int):
        """(ids, counts) of the tokens whose logits the sparse processors change (counts 0: biased or banned but
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
        """The processors in turn, on the fp32 logits `x` of the tokens `ids`."""
        for processor in self.processors:
            x = processor(ids, x, counts)
        return x.astype(np.float32)

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        """The processors (penalties over every token seen so far, logit bias, bans, the grammar mask) on fp32
        logits, `logits` modified in place unless a dense processor copies it; returns the result."""
        touched = self._touched(len(logits))
        if touched is not None:
            ids, counts = touched
            logits[ids] = self._apply(ids, logits[ids], counts)
        for processor in self._dense:  # the rest of the row, which only they change
            logits = processor.row(logits)
        return logits

    @property
    def greedy(self) -> bool:
        return self.p.temperature == 0.0 or self.p.top_k == 1

    def sample(self, logits: np.ndarray) -> int:
        """The next token id from chunk_3's raw logits (fp16 or fp32; not modified). With a grammar, a token its
        mask holds but its parser refuses is masked out and the draw repeated; none left is its `no_token` error."""
        grammar = self.grammar
        if grammar is None:
            return self._sample(logits)
        while grammar.allowed.any():
            token = self._sample(logits)
            if grammar.takes(token):
                return token
        raise grammar.no_token(grammar.steps)

    def _sample(self, logits: np.ndarray) -> int:
        """One draw through the processors and the sampler chain.

        fp16 logits with greedy or top-k decoding never get converted whole: candidates are picked
        on an integer key that orders fp16 values exactly, and only they and the penalised or
        biased tokens are converted to fp32. The result is the one the fp32 path gives, draw for draw."""
        touched = self._touched(len(logits))
        k, n_touched = self._k, (0 if touched is None else len(touched[0]))
        if logits.dtype != np.float16 or not k or k + n_touched >= len(logits):
            return self.choose(self.adjust(np.array(logits, np.float32)))
        for processor in self._dense:  # first: -inf is a fixed point of every other processor, so as if last
            logits = processor.row(logits)
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
        if self.greedy:
            return int(cand[0])
        c = Candidates(vals, cand)
        for step in self._rescale + self._after:  # top-k's own work done above
            c = step(c)
        return self._pick(*c.distribution())

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
        logits: the sampler chain's. Greedy decoding gives the argmax alone."""
        c = Candidates(logits)
        for step in self.steps:
            c = step(c)
        return c.distribution()

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
