"""What a generation returns: an Event per token (stream_generate), a Result for the whole (generate), and the
Stats both carry. gemma_ane.runtime.model exports them as it always has."""

from __future__ import annotations

from dataclasses import dataclass, field

from .tools import ToolCall


@dataclass
class Stats:
    """How a generation went; carried on the last Event and on the Result (as mlx-lm's
    GenerationResponse carries its timings)."""

    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose K/V were already cached: not processed again
    generated_tokens: int = 0
    time_to_first_token: float = 0.0  # seconds: prompt processing plus the first draw
    prefill_tokens_per_s: float = 0.0  # prompt tokens processed (not reused) per second
    decode_tokens_per_s: float = 0.0  # tokens after the first, per second
    # speculative decoding (draft_tokens): drafts the target accepted / drafts proposed, and tokens emitted per
    # verify call (accepted drafts plus the target's own token, less any a stop cut off); 0.0 when no draft was
    # verified
    acceptance_rate: float = 0.0
    tokens_per_verify: float = 0.0
    # a context ladder's climbs during this generation (runtime.ladder.Crossing.describe): rung, position, cost
    crossings: list[str] = field(default_factory=list)


@dataclass
class Result(Stats):
    text: str = ""
    reasoning: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "tool_calls"


@dataclass
class Event(Stats):
    """One streamed step: the token, the text it released (answer and/or reasoning). The last
    event has no token; it carries why generation ended and the Stats."""

    token: int | None = None
    text: str = ""
    reasoning: str = ""
    logprob: float | None = None
    top_logprobs: list = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)  # the calls this token completed
    finish_reason: str | None = None
