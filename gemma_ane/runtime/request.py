"""One generation, typed, on both sides of Model.prepare: a `GenerationRequest` is what a caller asks (the Python
API's keywords, or a server body parsed once), a `Prepared` is what prepare made of it after every check (the prompt
rendered, the sampling built, the grammar compiled), which `Model.stream_generate(request=...)` runs. Each check
happens in prepare, once: the server only parses the body's JSON shape into a GenerationRequest."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from . import grammar
from .sampling import BAN, FIELDS, GrammarMask, SamplingError, SamplingParams

SAMPLING = frozenset(f.name for f in FIELDS)


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """What to generate: a prompt or messages (raw: the prompt is the caller's own formatting), the limits, the
    stop strings, tools and the choice among them, a response format, drafts, media (image and audio parts inside
    the messages), and the sampling fields (sampling.FIELDS by name; None or absent: the bundle's default). Nothing
    here is checked: Model.prepare checks it all."""

    prompt: str | None = None
    messages: list | None = None
    raw: bool = False
    system: str | None = None
    enable_thinking: bool = False
    max_tokens: int = 256
    stop: str | list | None = None
    tools: list | None = None
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    response_format: dict | None = None
    draft_tokens: int | None = None
    sampling: dict = field(default_factory=dict)

    @classmethod
    def of(cls, prompt=None, messages=None, **kw) -> GenerationRequest:
        """The Python API's keywords as a request: the sampling fields (and any keyword that is no field of this
        record, which SamplingParams then refuses by name) go to `sampling`."""
        known = {f.name for f in dataclasses.fields(cls)} - {"sampling"}
        sampling = {k: v for k, v in kw.items() if k not in known}
        return cls(prompt=prompt, messages=messages, sampling=sampling, **{k: v for k, v in kw.items() if k in known})


@dataclass(frozen=True)
class Capabilities:
    """What a bundle can do, asked in one place (Model.prepare)."""

    logits: bool  # the head chunk returns logits; False: the published layout's argmax head (greedy only)
    vision: bool  # it has an image encoder
    max_draft_tokens: int  # the most drafts a verify call checks; 0: no drafter


@dataclass(frozen=True)
class Prepared:
    """One generation checked and tokenized by Model.prepare; Model.stream_generate(request=...) runs it. Its
    grammar's state follows one output: another choice of the same request runs `Model.choice(prepared, i)`."""

    ids: list[int]  # the prompt, each image or clip one placeholder (expanded when it runs)
    marks: list[int]  # turn ends: where the engine snapshots its rings
    sources: list  # the media, in their placeholders' order
    params: SamplingParams
    stop: list[str]
    tools: list | None
    parallel_tool_calls: bool
    rule: Rule  # what may be drawn: the grammar, logit_bias's bans and tool_choice "none"'s
    drafts: int  # drafts a verify call; 0: plain decoding
    max_tokens: int
    grammar_text: str | None = None  # the grammar `rule` compiled (a choice compiles its own from it)
    request: GenerationRequest | None = None  # what was asked

    def with_choice(self, seed: int | None, rule: Rule) -> Prepared:
        return dataclasses.replace(self, params=dataclasses.replace(self.params, seed=seed), rule=rule)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index`: the request's for the first, the next ones after it (wrapping within the
    signed 64-bit range), so a seeded request with n > 1 reproduces every choice; None stays None."""
    if seed is None:
        return None
    return (seed + index + 2**63) % 2**64 - 2**63


class Rule:
    """What may be drawn in one generation: the grammar's tokens (when there is one) less the tokens logit_bias and
    `bans` ban (tool_choice "none" bans <|tool_call>), checked when the request is built; the sampler's processors
    (`bans`, the `grammar()` mask) enforce it. An empty choice is refused, never a NaN or a forbidden draw."""

    def __init__(self, constraint, logit_bias: dict | None, choice: str, vocab: int, bans=()):
        self.constraint, self.vocab, self.choice = constraint, vocab, choice
        self.logit_bias = logit_bias
        self.bans = [int(t) for t in bans]
        banned = {int(t) for t, b in (logit_bias or {}).items() if b == BAN} | set(self.bans)
        self.banned = np.array(sorted(banned), np.int64)
        self.field = "response_format" if choice in ("auto", "none") else "tool_choice"  # what asked for the grammar

    def grammar(self) -> GrammarMask | None:
        """The grammar's mask, the last logits processor of this generation's sampler, or None without a grammar."""
        return None if self.constraint is None else GrammarMask(self.constraint, self.banned, self.no_token)

    def check_start(self) -> None:
        """Refuses a generation whose first draw would have no token, before anything runs."""
        if self.constraint is None:
            if len(self.banned) >= self.vocab:  # tool_choice "none" banned the one token logit_bias left
                raise SamplingError(
                    "logit_bias: it bans every token but <|tool_call>, which tool_choice 'none' bans",
                    param="logit_bias",
                )
            return
        if not any(map(self.constraint.legal, np.flatnonzero(self.constraint.allowed(self.banned)))):
            raise self.no_token()

    def no_token(self, steps: int = 0) -> ValueError:
        """The error for a draw without a token after `steps` tokens: logit_bias's when it banned them all, else the
        grammar's."""
        where = f"after {steps} token{'s' * (steps > 1)}" if steps else "at the start"
        if len(self.banned) and any(map(self.constraint.legal, np.flatnonzero(self.constraint.allowed()))):
            what = f"{self.field} {self.choice!r}" if self.field == "tool_choice" else self.field
            return SamplingError(f"logit_bias: it bans every token {what} allows {where}", param="logit_bias")
        return grammar.GrammarError(
            f"{self.field}: no token of this tokenizer can continue it {where}", param=self.field
        )


def check_argmax_head(params: SamplingParams) -> None:
    """The published layout's head chunk returns only the argmax token: no sampling, bias or logprobs."""
    why = "this bundle's head returns only the chosen token (the published layout's argmax)"
    if params.logprobs is not None:
        raise SamplingError(f"logprobs: {why}", param="logprobs")
    if params.temperature != 0.0 and params.top_k != 1 or params.logit_bias:
        field = "logit_bias" if params.logit_bias else "temperature"
        raise SamplingError(f"{field}: {why}: sampling and logit_bias are not possible; use temperature=0", param=field)
