"""Load a bundle and generate: `load()`, and `Model.stream_generate` (the loop everything wraps).

Torch-free: runs from a plain `pip install gemma-ane`. The backend is Core ML on macOS or the MIL
executor anywhere; the chunk I/O is read from the models themselves, so bundles converted
elsewhere (the published layout included) run too.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..bundle import BundleError, layout, open_bundle
from ..errors import InputError
from . import grammar, prompt_cache
from .audio import AudioError
from .backend import open_engine
from .chat import (
    ChatTemplate,
    OutputParser,
    check_nesting,
    check_stop,
    check_text,
    escape_content,
    escape_strings,
    unused_mark,
)
from .device import Device
from .drafter import open_drafter
from .encoder import expand_media, media_sources, open_audio_encoder, open_image_encoder
from .engine import MAX_SNAPSHOTS, Cancelled, ContextOverflow, Engine, FunctionUnavailable
from .events import Event, Result, Stats
from .hf_files import read_generation_config, read_template, read_tokenizer
from .images import MAX_PIXELS, ImageError
from .request import Capabilities, GenerationRequest, Prepared, Rule, check_argmax_head, choice_seed
from .sampling import Sampler, SamplingParams
from .tokens import (
    BOS,
    EOS,
    STOP_IDS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    TURN_CLOSE,
    ControlTokens,
)
from .tools import check_tool_choice, check_tools, parallel_calls, prepare_messages


class Step(NamedTuple):
    """What both step generators yield (Model._generate_step, Model._speculative_generate_step): a token, and the
    logits it was drawn from (its logprobs are read from them)."""

    token: int
    logits: np.ndarray


@dataclass
class _Speculation:
    """Counts of one generation's verify calls."""

    calls: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    def add(self, drafted: int, emitted: int) -> None:
        # a call emits the accepted drafts and one token of the target's own (a correction, or the bonus after all)
        self.calls, self.drafted, self.emitted = self.calls + 1, self.drafted + drafted, self.emitted + emitted
        self.accepted += emitted - 1


# tokens after a conversation's last turn end that are only the generation prompt ("<|turn>model\n", a thought
# channel's opening): no later conversation parts there that would not part at the prompt's end
_GENERATION_PROMPT = 8


def _check(cancelled) -> None:
    if cancelled is not None and cancelled():
        raise Cancelled("cancelled before the prompt was processed")


class Model:
    audio = None  # the bundle's encoder.AudioEncoder, if it has one (load opens it)

    def __init__(
        self,
        root: Path,
        engine: Engine,
        tokenizer,
        template: ChatTemplate,
        generation: dict,
        config: dict,
        backend: str,
        drafter=None,
        images=None,
    ):
        self.root, self.engine, self.tokenizer, self.template = root, engine, tokenizer, template
        self.generation, self.config, self.backend = generation, config, backend
        self.drafter, self.images = drafter, images  # images: the bundle's encoder.ImageEncoder, if it has one
        eos = generation.get("eos_token_id", [])
        eos = eos if isinstance(eos, list) else [eos]
        # <|tool_response> too: after its calls the model would go on to write the tool's answer itself
        self.stop_ids = (
            set(STOP_IDS) | {TOOL_RESPONSE_OPEN} | {int(e) for e in eos} | {int(config.get("eos_token_id", EOS))}
        )

    @property
    def encoders(self) -> dict:
        """The bundle's media encoders by the content-part type they take."""
        return {e.kind: e for e in (self.images, self.audio) if e is not None}

    @property
    def context(self) -> int:
        return self.engine.context

    @property
    def head(self) -> str:
        """ "logits", or "token_id" for the published layout's argmax head (greedy only)."""
        return self.engine.head

    # Drafts per verify call when a generation does not say (`draft_tokens`): 0 decodes one token per call.
    draft_tokens: int = 0
    # The drafter or the verify function could not load on this device (one warning): every generation decodes
    # without drafts, whatever it asks for.
    drafts_unavailable: bool = False

    @property
    def max_draft_tokens(self) -> int:
        """The most drafts one verify call of this bundle checks (0: it has no drafter)."""
        return self.engine.verify_batch - 1 if self.drafter is not None and self.engine.verify_batch else 0

    # Whether the text of user and tool messages may spell control tokens that count as such: off, a user
    # who types "<turn|>" or "<|turn>system" cannot end their turn or open a system turn (a server's option).
    allow_special_tokens: bool = False

    def encode(self, text: str, what: str = "text") -> list[int]:
        """`text`'s ids, every control token it spells counted as one."""
        check_text(text, what)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _control(self) -> ControlTokens:
        return ControlTokens(self.tokenizer)

    def prompt_ids(
        self,
        prompt=None,
        messages=None,
        raw: bool = False,
        enable_thinking: bool = False,
        system: str | None = None,
        tools: list | None = None,
    ) -> list[int]:
        """The prompt's ids. A raw prompt is the caller's own formatting, control tokens included."""
        return self._prompt_ids(prompt, messages, raw, enable_thinking, system, check_tools(tools) if tools else tools)

    def _prompt_ids(self, prompt, messages, raw: bool, enable_thinking: bool, system, tools) -> list[int]:
        """prompt_ids with `tools` checked already (prepare checks them once)."""
        if messages is None and raw:
            if prompt is None:
                raise InputError("give a prompt or messages")
            if system or tools:
                raise InputError("a raw prompt has no chat template, so it cannot take a system prompt or tools")
            if isinstance(prompt, list):  # token ids (OpenAI's completions take them): the prompt as given, no <bos>
                return self._token_ids(prompt)
            return [self.config.get("bos_token_id", BOS)] + self.encode(prompt, "prompt")
        check_text(prompt, "prompt")
        check_text(system, "system")
        return self._chat_ids(_conversation(prompt, messages, system), True, enable_thinking, tools)

    def _token_ids(self, ids: list) -> list[int]:
        vocab = self.config["vocab_size"]
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if not ids or bad is not None:
            found = "an empty list" if not ids else repr(bad)
            raise InputError(f"prompt: token ids must be integers from 0 to {vocab - 1}, found {found}")
        return list(ids)

    def chat_ids(
        self, messages: list, add_generation_prompt: bool = True, enable_thinking: bool = False, tools=None
    ) -> list[int]:
        """The ids of `messages` (and the declarations of `tools`) rendered by the chat template. The
        template's control tokens count; the text of user and tool messages, of tool declarations and
        of call arguments stays text, whatever it spells, unless allow_special_tokens is set."""
        tools = check_tools(tools) if tools is not None else None
        return self._chat_ids(messages, add_generation_prompt, enable_thinking, tools)

    def _chat_ids(self, messages: list, add_generation_prompt: bool, enable_thinking: bool, tools) -> list[int]:
        """chat_ids with `tools` checked already."""
        check_text(messages, "messages")
        check_text(tools, "tools")
        check_nesting(messages)
        messages = prepare_messages(messages)
        if self.allow_special_tokens:
            text = self.template.render(messages, add_generation_prompt, enable_thinking, tools)
            return self.encode(text, "the chat template's output")
        mark, control = unused_mark(messages, tools, self.template.source), self._control

        def escape(text):
            return control.escape(text, mark)

        messages, tools = escape_content(messages, escape), escape_strings(tools, escape)
        text = self.template.render(messages, add_generation_prompt, enable_thinking, tools)
        check_text(text, "the chat template's output")
        return control.encode(text, mark)

    def turn_ends(self, messages: list[dict], ids: list[int], enable_thinking: bool = False, tools=None) -> list[int]:
        """Where the messages end in `ids` (the prompt for `messages`): after each <turn|> and its newline, after
        a message's calls (<tool_call|><|tool_response>) and after each result (<tool_response|>), found in the ids
        themselves, without rendering again. Where a later conversation may part from this one (an edited
        last message, an answer re-rendered without its thinking), so the engine snapshots its rings there and
        reuse survives the part. The newest MAX_SNAPSHOTS, the engine keeping no more, before the last message's
        own end when only the generation prompt follows it (the prompt's end is snapshotted anyway). `messages`,
        `enable_thinking` and `tools` are what `ids` were rendered from: the ids alone now say where turns end."""
        newline = self.encode("\n")
        ends = []
        for i, t in enumerate(ids):
            if t == TURN_CLOSE:
                end = i + 1 + len(newline) * (ids[i + 1 : i + 1 + len(newline)] == newline)
            elif t == TOOL_RESPONSE_CLOSE or (t == TOOL_RESPONSE_OPEN and i and ids[i - 1] == TOOL_CALL_CLOSE):
                end = i + 1  # a message of calls ends in their turn, awaiting results; a tool message, after its own
            else:
                continue
            if end < len(ids):
                ends.append(end)
        if ends and len(ids) - ends[-1] <= _GENERATION_PROMPT:
            ends.pop()
        return ends[-MAX_SNAPSHOTS:]

    def reset(self) -> None:
        self.engine.reset()

    def save_prompt_cache(self, path, position: int | None = None) -> int:
        """Save the caches of the first `position` cached tokens (default: all of them; otherwise a
        prompt's end or turn end, where the rings were snapshotted) to `path`; returns `position`."""
        position = self.engine.position if position is None else position
        prompt_cache.save(path, self.engine, position, prompt_cache.fingerprint(self.root))
        return position

    def load_prompt_cache(self, path) -> int:
        """Start from a file save_prompt_cache wrote for this bundle; returns the tokens it holds."""
        return prompt_cache.load(path, self.engine, prompt_cache.fingerprint(self.root))

    @property
    def capabilities(self) -> Capabilities:
        """What this bundle can do, asked in one place (prepare) for every generation."""
        return Capabilities(self.head == "logits", self.images is not None, self.max_draft_tokens)

    def prepare(self, request=None, messages=None, **kw) -> Prepared:
        """One generation checked and tokenized, every check made once, the template rendered once and the grammar
        compiled once: what stream_generate runs. `request`: a GenerationRequest, or the prompt, with `messages`
        and the keywords of stream_generate (see there). The server prepares a request before it queues, so the
        worker only runs it. Errors: SamplingError, StopError, ToolError, GrammarError, ChatError, ImageError and
        AudioError (media for a bundle without their model), ValueError. A prompt longer than the context is
        refused when it runs, once its media are expanded (len(ids) counts one placeholder a picture or clip)."""
        if not isinstance(request, GenerationRequest):
            request = GenerationRequest.of(request, messages, **kw)
        elif messages is not None or kw:
            raise InputError("give a GenerationRequest or a prompt and its options, not both")
        r, caps = request, self.capabilities
        params = SamplingParams.from_generation_config(
            self.generation, vocab_size=self.config["vocab_size"], **r.sampling
        )
        stop = check_stop(r.stop)
        tools = check_tools(r.tools) if r.tools is not None else None
        # a named choice is one call; required and auto follow parallel_tool_calls (tools.parallel_calls)
        r = replace(
            r, parallel_tool_calls=parallel_calls(check_tool_choice(r.tool_choice, tools), r.parallel_tool_calls)
        )
        text, rule = self._rule(tools, r, params, caps)  # a grammar the argmax head cannot follow: named first
        if not caps.logits:
            check_argmax_head(params)
        drafts = self._drafts(r.draft_tokens, rule.constraint, caps)
        if isinstance(r.max_tokens, bool) or not isinstance(r.max_tokens, int) or r.max_tokens < 0:
            raise InputError(f"max_tokens={r.max_tokens!r}: expected a non-negative integer")
        ids = self._prompt_ids(r.prompt, r.messages, r.raw, r.enable_thinking, r.system, tools)
        conversation = [] if r.raw and r.messages is None else _conversation(r.prompt, r.messages, r.system)
        marks = self.turn_ends(conversation, ids) if conversation else []
        sources = media_sources(conversation)
        for kind, where, _ in sources:  # refused here, before a server queues it, not once it runs
            if kind == "image" and not caps.vision:
                raise ImageError(f"{where}: this bundle has no vision model (converted without one)")
            if kind == "audio" and self.audio is None:
                raise AudioError(f"{where}: this bundle has no audio model (converted without one)")
        return Prepared(
            ids, marks, sources, params, stop, tools, r.parallel_tool_calls, rule, drafts, r.max_tokens, text, r
        )

    def choice(self, prepared: Prepared, index: int) -> Prepared:
        """Choice `index` of a request of n: the same prompt and checks, the seed after the request's
        (choice_seed), and a grammar state of its own (compiled again from the first's text)."""
        if index == 0:
            return prepared
        rule = prepared.rule
        if rule.constraint is not None:
            rule = Rule(self._compile(prepared.grammar_text), rule.logit_bias, rule.choice, rule.vocab, rule.bans)
        return prepared.with_choice(choice_seed(prepared.params.seed, index), rule)

    def stream_generate(
        self, prompt=None, messages=None, *, request: Prepared | None = None, cancelled=None, **kw
    ) -> Iterator[Event]:
        """Generate from a prompt or messages, one Event per token, then a last Event with the Stats.

        max_tokens, stop, raw, enable_thinking, system: as their names say. tools: OpenAI-style function
        declarations, rendered by the chat template; the calls the model makes come back on Event.tool_calls,
        and a turn that ends in calls finishes with "tool_calls". tool_choice: "auto", "none" (the model cannot
        open a call), "required" or a function's name (the output is forced to be calls, by constrained
        decoding; a named function is called once, "required" and "auto" follow parallel_tool_calls).
        response_format: OpenAI's {"type": "json_object"} or {"type": "json_schema", ...}, also enforced by
        constrained decoding. prompt: text, or with raw=True a list of token ids (as given). draft_tokens:
        speculative decoding with the bundle's drafter, K drafts per verify call (default: `self.draft_tokens`;
        0 off). Greedy output is the plain greedy output token for token; sampled output follows the same
        distribution. Constrained generations decode one token at a time.
        The sampling fields (sampling.FIELDS) as keywords. request: one `prepare` made, instead of all these.
        cancelled: a callable asked during the prompt's processing (between its steps and prefill batches); once
        it returns true, Cancelled is raised, so a caller that has gone stops costing host time before the first
        token."""
        if request is None:
            request = self.prepare(prompt, messages, **kw)
        elif prompt is not None or messages is not None or kw:
            raise InputError("give a prepared request or a prompt and its options, not both")
        yield from self._run(request, cancelled)

    def _run(self, request: Prepared, cancelled) -> Iterator[Event]:
        """The generation `request` describes: its media encoded, the prompt processed, then the layers: the steps
        of plain or speculative decoding (sibling generators of Steps), detokenized and parsed here into Events,
        with the Stats last (as mlx-lm's generate_step / speculative_generate_step under stream_generate, under
        generate)."""
        params, max_tokens, parser = request.params, request.max_tokens, None
        t0 = time.perf_counter()  # the images' encoding counts as prompt time
        _check(cancelled)
        ids, marks, self.engine.soft_tokens = expand_media(
            request.ids, request.marks, self.encoders, request.sources, self.context
        )
        _check(cancelled)
        if len(ids) > self.context:
            raise ContextOverflow(f"prompt of {len(ids)} tokens exceeds the context of {self.context}")
        parser = OutputParser(self.tokenizer, request.stop, tools=request.tools)
        climbed = len(self.engine.crossings)
        # a seeded answer must not depend on what ran before: its prompt reuses only what a fresh run computes alike
        reused, logits = self.engine.prompt(ids, marks, cancelled=cancelled, exact=params.seed is not None)
        # the penalties count text tokens (an image's keys are no vocabulary ids)
        rule, history = request.rule, [t for t in ids if t >= 0]
        sampler, spec = Sampler(params, history, bans=rule.bans, grammar=rule.grammar()), _Speculation()
        steps = (
            self._speculative_generate_step(logits, sampler, request.drafts, max_tokens, spec)
            if request.drafts
            else self._generate_step(logits, sampler)
        )
        generated, finish, t_first = 0, None, None
        report = params.logprobs is not None  # prepare refused it for the published head (no distribution)
        try:
            for token, logits in steps if max_tokens else ():
                t_first = t_first or time.perf_counter()
                lp, top = sampler.logprobs(logits, token) if report else (None, [])
                generated += 1
                if token in self.stop_ids:
                    finish = "tool_calls" if parser.tool_calls else "stop"
                    end = parser.finish()
                    yield Event(token=token, text=end.content, tool_calls=end.tool_calls, logprob=lp, top_logprobs=top)
                    break
                delta = parser.add(token)
                yield Event(
                    token=token,
                    text=delta.content,
                    reasoning=delta.reasoning,
                    tool_calls=delta.tool_calls,
                    logprob=lp,
                    top_logprobs=top,
                )
                if parser.stopped:
                    finish = "stop"
                    break
                if delta.tool_calls and not request.parallel_tool_calls:
                    finish = "tool_calls"  # one call asked for: its response comes before anything else
                    break
                # the context holds the prompt and every token but this one, which is not fed: no chunk runs for it
                if generated >= max_tokens or len(ids) + generated > self.context:
                    finish = "length"
                    break
        finally:
            steps.close()  # a speculative step rewinds the caches to the tokens emitted
        finish = finish or "length"  # max_tokens=0
        end = time.perf_counter()
        tail = parser.finish().content if finish == "length" else ""
        ttft, decode_s = (t_first or end) - t0, end - (t_first or end)
        yield Event(
            text=tail,
            finish_reason=finish,
            prompt_tokens=len(ids),
            reused_tokens=reused,
            generated_tokens=generated,
            time_to_first_token=ttft if t_first else 0.0,
            prefill_tokens_per_s=(len(ids) - reused) / ttft if t_first and ttft else 0.0,
            decode_tokens_per_s=(generated - 1) / decode_s if generated > 1 and decode_s else 0.0,
            acceptance_rate=spec.accepted / spec.drafted if spec.drafted else 0.0,
            tokens_per_verify=spec.emitted / spec.calls if spec.calls else 0.0,
            crossings=[c.describe() for c in self.engine.crossings[climbed:]],
        )

    def _generate_step(self, logits, sampler: Sampler) -> Iterator[Step]:
        """Plain decoding's steps: a token and the logits it was drawn from, one chunk call per token."""
        while True:
            token = self._pick(sampler, logits)
            sampler.observe(token)  # the grammar's state follows it too
            yield Step(token, logits)
            logits = self.engine.feed([token])[-1]

    def _speculative_generate_step(self, logits, sampler: Sampler, k: int, budget: int, spec) -> Iterator[Step]:
        """As _generate_step, but the drafter proposes up to k tokens after the last one and one verify call checks
        them all: each emitted token is the one the target's own sampling gives (Sampler.verify). Where no
        verify call fits (the context's end, the ring's edge) or fewer than two tokens remain: one plain step."""
        engine = self.engine
        token = sampler.sample(logits)
        sampler.observe(token)
        yield Step(token, logits)
        emitted = 1
        while True:
            n = min(k, budget - emitted - 1)
            batch = self._verify(token, n, sampler, spec) if n >= 1 and engine.can_verify() and self.drafter else None
            verified = batch is not None
            if batch is None:
                logits = engine.feed([token])[-1]
                token = sampler.sample(logits)
                sampler.observe(token)
                batch = [(token, logits)]
            start = engine.position - len(batch)  # where the last token before this batch is cached
            for i, (token, row) in enumerate(batch):
                try:
                    yield Step(token, row)
                except GeneratorExit:
                    engine.rewind(start + i + 1)  # as plain decoding: every token taken but the last is cached
                    if verified:  # a stop inside the batch: what followed it was never emitted
                        spec.emitted -= len(batch) - i - 1
                    raise
            emitted += len(batch)

    def _verify(self, token: int, n: int, sampler: Sampler, spec) -> list[tuple[int, object]] | None:
        """One speculative step from `token` (not cached yet): n drafts, one verify call, the tokens it emits
        with the rows they were drawn from; the caches keep `token` and the accepted drafts. None when the
        drafter or the verify function cannot run on this device: decoding goes on without drafts."""
        engine, P = self.engine, self.engine.position
        try:
            drafts, proposals, x, carry = [], [], token, engine.final_hidden
            for _ in range(n):
                proposal, carry = self.drafter.step(x, carry, P, engine.shared_kv)
                x = sampler.draft(proposal)
                drafts.append(x)
                proposals.append(proposal)
            rows, hidden = engine.verify([token, *drafts] + [0] * (engine.verify_batch - 1 - n))
        except FunctionUnavailable as e:
            # the caller's line: past this, the step generator, _run and stream_generate
            warnings.warn(f"{e}; decoding without drafts", RuntimeWarning, stacklevel=5)
            self.drafter, self.drafts_unavailable = None, True
            return None
        out = []
        for row, draft, proposal in zip(rows, drafts, proposals):
            t, accepted = sampler.verify(row, draft, proposal)
            sampler.observe(t)
            out.append((t, row))
            if not accepted:
                break
        else:  # every draft held: the last row gives one more token
            t = sampler.sample(rows[n])
            sampler.observe(t)
            out.append((t, rows[n]))
        engine.accept(P + len(out), hidden[len(out) - 1])
        spec.add(n, len(out))
        return out

    def prompt_logprobs(self, ids: list[int], top: int = 0, cancelled=None) -> list[tuple[float, list] | None]:
        """Each token of `ids` scored by the tokens before it: (its logprob, the `top` most likely tokens there
        with theirs), None for the first, which nothing predicts (echo's logprobs, as a loglikelihood evaluation
        reads them). Every position's logits come from one feed, so the caches start over; a generation from
        the same prompt then reuses them."""
        if not self.capabilities.logits:
            raise InputError("this bundle's chunk_3 returns only the argmax token (published layout): no logprobs")
        _check(cancelled)
        self.engine.reset()
        rows = self.engine.feed(ids, logits="all", cancelled=cancelled) if len(ids) > 1 else []
        scorer = Sampler(SamplingParams(logprobs=top))
        return [None] + [scorer.logprobs(row, token) for row, token in zip(rows, ids[1:])]

    def use_drafts(self, k: int) -> None:
        """Speculative decoding with k drafts a verify call for every generation that does not say otherwise
        (the CLI's and the server's --draft); 0 turns it off. A ValueError when this bundle cannot."""
        self._drafts(k, None, self.capabilities)
        self.draft_tokens = k

    def _drafts(self, draft_tokens, constraint, caps: Capabilities) -> int:
        """Drafts per verify call for this generation (0: plain decoding)."""
        k = self.draft_tokens if draft_tokens is None else draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise InputError(f"draft_tokens={k!r}: expected a non-negative integer")
        most = caps.max_draft_tokens
        if k and not most and not self.drafts_unavailable:
            if self.drafter is not None:  # converted with --functions (or --profile) leaving verify out
                raise InputError(f"draft_tokens={k}: this bundle's chunks carry no verify function to check drafts")
            raise InputError(f"draft_tokens={k}: this bundle has no drafter (convert with --assistant)")
        if k > most and not self.drafts_unavailable:
            raise InputError(f"draft_tokens={k}: this bundle verifies at most {most} drafts a call")
        # constrained decoding masks each draw by the grammar's state, which drafts would have to roll back
        return 0 if constraint is not None or self.drafter is None else k

    def _constraint(self, tools, choice, parallel: bool, response_format, thinking: bool, logits: bool):
        """The grammar this generation must follow, if any (forced calls, or the response format): (its text, its
        Constraint), or (None, None)."""
        field = "response_format" if choice in ("auto", "none") else "tool_choice"  # what asked for a grammar
        try:
            text = grammar.request_grammar(tools, choice, parallel, response_format, thinking=thinking)
        except grammar.GrammarError as e:  # without a param: llguidance is missing, and what asked for it is named
            raise grammar.GrammarError(str(e), param=e.param or field) from None
        if text is None:
            return None, None
        if not logits:
            why = "constrained decoding needs logits; this bundle's head returns only the chosen token"
            raise grammar.GrammarError(f"{field}: {why}", param=field)
        return text, self._compile(text)

    def _compile(self, text: str):
        tokenizer = self.root / layout.HF_TOKENIZER
        return grammar.Constraint(text, tokenizer, self.config["vocab_size"], sorted(self.stop_ids))

    def _rule(self, tools, r: GenerationRequest, params: SamplingParams, caps: Capabilities) -> tuple:
        """(the grammar's text, what this generation may draw) (`tools` already checked): its grammar compiled,
        tool_choice "none"'s ban, logit_bias's; refused (see Rule.check_start) when that leaves no first token."""
        choice = check_tool_choice(r.tool_choice, tools)
        text, constraint = self._constraint(
            tools, choice, r.parallel_tool_calls, r.response_format, r.enable_thinking, caps.logits
        )
        bans = [TOOL_CALL_OPEN] if choice == "none" else []  # the model cannot open a call
        rule = Rule(constraint, params.logit_bias, choice, self.config["vocab_size"], bans)
        rule.check_start()
        return text, rule

    def _pick(self, sampler: Sampler, logits) -> int:
        if self.head != "logits":
            return int(logits[0])  # published head: chunk_3 already chose
        return sampler.sample(logits)

    def generate(self, prompt=None, messages=None, **kw) -> Result:
        r = Result()
        for ev in self.stream_generate(prompt, messages, **kw):
            r.text += ev.text
            r.reasoning += ev.reasoning
            r.tool_calls += ev.tool_calls
            if ev.token is not None:
                r.tokens.append(ev.token)
                r.logprobs.append(ev.logprob)
                r.top_logprobs.append(ev.top_logprobs)
        r.finish_reason = ev.finish_reason
        for f in fields(Stats):
            setattr(r, f.name, getattr(ev, f.name))
        return r


def _conversation(prompt, messages, system) -> list[dict]:
    if messages is not None:
        return messages
    if prompt is None:
        raise InputError("give a prompt or messages")
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def load(
    bundle,
    backend: str = "auto",
    compute_units: str = "cpu_and_ne",
    verify: bool = False,
    precision: str = "fp16",
    exact_rope: bool = True,
    max_image_pixels: int = MAX_PIXELS,
) -> Model:
    """Open and validate a bundle. `verify=True` also checks every file's sha256 against the manifest;
    `max_image_pixels`: the largest width * height of an image in a prompt, checked before it is decoded."""
    root = Path(bundle)
    if not root.is_dir():
        raise BundleError(f"{root}: not a bundle directory")
    opened = open_bundle(root, verify)  # checked, and model_config.json parsed, once
    device = Device.of(backend, precision, compute_units)
    # logits_dtype=None: the sampler reads the head chunk's fp16 logits directly
    engine = open_engine(opened, device, logits_dtype=None, exact_rope=exact_rope)
    tokenizer = read_tokenizer(opened.tokenizer)
    generation = read_generation_config(opened.generation_config)
    drafter = open_drafter(opened, device, engine.host)
    images = open_image_encoder(opened, device, max_image_pixels)
    template = read_template(opened.hf_dir)
    model = Model(root, engine, tokenizer, template, generation, opened.config.raw, device.backend, drafter, images)
    model.audio = open_audio_encoder(opened, device)
    return model


def bundle_tokenizer(bundle) -> object:
    """A bundle's tokenizer alone (`gemma-ane tokenize`), without loading its models."""
    root = Path(bundle)
    layout.chunk_paths(root)  # not a directory, a checkpoint: said as load says it
    return read_tokenizer(root / layout.HF_TOKENIZER)
