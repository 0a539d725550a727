"""What a conversion is asked for (ConvertOptions), how it refuses (ConvertError), and what it costs (StageTimer)."""

from __future__ import annotations

import dataclasses
import math
import platform
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from re import _constants as sre_constants  # the parser's tree, to judge a --keep pattern before it runs
from re import _parser as sre_parser

from ..bundle.plan import BITS, MAX_DRAFT_TOKENS, PROFILES, check_function_names
from ..bundle.spec import ConfigError
from ..errors import ConversionError
from ..files import stop_point
from ..runtime.audio import MAX_SECONDS
from ..runtime.images import SOFT_TOKEN_BUDGETS

# The audio model's buckets, in seconds of audio: a clip runs in the shortest that holds it, and the encoder's cost
# grows with the bucket's length, so each bucket about doubles the last (a clip pays at most ~2x its own length;
# 2.5 s holds a short question) up to 30 s, the feature extractor's and the processor's cap (750 soft tokens).
AUDIO_BUCKET_SECONDS = (2.5, 5.0, 10.0, 20.0, MAX_SECONDS)


class ConvertError(ConversionError):
    """A conversion that cannot proceed; the message names the option, file or value."""


QUANT_MODES = ("lut", "block")
BLOCK_BITS = (4, 8, 16)  # constexpr_blockwise_shift_scale holds int4 or int8 (16: nothing is quantized)


@dataclass(frozen=True)
class ConvertOptions:
    context: int = 2048
    bits: int = 4
    group_size: int = 32
    prefill_batch: int = 8
    split: tuple[int, ...] | None = None  # N-1 layer boundaries of N chunks
    compile: bool | None = None  # None: compile on macOS, keep .mlpackage elsewhere
    force: bool = False
    # "published" reproduces the published layout for compatibility tests: chunk_3 returns
    # token_id + token_logit, the PLE norm weight is fp32, the full-layer RoPE tables rotate every
    # pair (CONTRACT §4) with 8192 rows, and there is no manifest.
    layout: str = "ours"
    # KV-only prefill batch sizes; None = those of 64 and 8 that divide the window
    kv_prefill_batches: tuple[int, ...] | None = None
    # a Gemma 4 drafter's checkpoint directory: adds assistant.mlpackage and verify_b{draft_tokens + 1} functions
    assistant: str | None = None
    draft_tokens: int = 3
    # the vision tower (when the checkpoint has one) as vision.mlpackage, for this many soft tokens per image, its
    # weights at vision_bits (None: 8 when the chunks' bits are lower; at 4 bits its soft tokens lose too much)
    vision: bool = True
    image_tokens: int = 280
    vision_bits: int | None = None
    # how linear weights are compressed: "lut" (k-means LUT per group_size output rows) or "block" (int4/int8, one
    # scale per group_size inputs: exact for a checkpoint trained onto q4_0's grid); weights whose name matches a
    # `keep` pattern (a regular expression, searched) stay fp16
    quant: str = "lut"
    keep: tuple[str, ...] = ()
    # the audio tower (when the checkpoint has one) as audio.mlpackage, one function per bucket of clip length (the
    # longest the clips it takes), its weights at audio_bits
    audio: bool = True
    audio_bits: int = 8
    audio_seconds: tuple[float, ...] = AUDIO_BUCKET_SECONDS
    # which functions every chunk carries (bundle.plan.select_functions: names like prefill_b8, or kinds: infer,
    # prefill, prefill_kv, verify), or a named set (`profile`: phone, mac); neither: everything the options make
    functions: tuple[str, ...] | None = None
    profile: str | None = None
    # a context ladder's rungs (bundle.ladder), ascending; the largest is the bundle's context (`context` is then
    # ignored); None: one context
    contexts: tuple[int, ...] | None = None

    @property
    def carried(self) -> tuple[str, ...] | None:
        """The function list ChunkPlan.build takes: `functions`, or the profile's (None: every function)."""
        return PROFILES[self.profile] if self.profile is not None else self.functions

    def check(self) -> None:
        if self.quant not in QUANT_MODES:
            raise ConvertError(f"--quant {self.quant!r}: choose lut or block")
        if self.bits not in BITS:
            raise ConvertError(f"--bits {self.bits}: choose 4, 6, 8 or 16 (16 = no palettization)")
        if self.quant == "block" and self.bits not in BLOCK_BITS:
            raise ConvertError(f"--bits {self.bits}: --quant block stores int4 or int8; choose 4, 8 or 16")
        for pattern in self.keep:
            check_keep(pattern)
        if self.layout not in ("ours", "published"):
            raise ConvertError(f"--layout {self.layout!r}: choose ours or published")
        self._check_functions()
        if self.group_size < 1:
            raise ConvertError(f"--group-size {self.group_size}: must be >= 1")
        if self.compile and platform.system() != "Darwin":
            raise ConvertError("--compile: compiling to .mlmodelc needs macOS (coremlcompiler); use --no-compile here")
        if isinstance(self.draft_tokens, bool) or not isinstance(self.draft_tokens, int):
            raise ConvertError(f"--draft-tokens {self.draft_tokens!r}: expected an integer")
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ConvertError(f"--draft-tokens {self.draft_tokens}: choose 1 to {MAX_DRAFT_TOKENS}")
        if self.contexts is not None and self.layout == "published":
            raise ConvertError("--contexts: the published layout has one context (its functions are fixed); use ours")
        if self.assistant and self.layout == "published":
            raise ConvertError("--assistant: the published layout has no drafter (its head is an argmax); use ours")
        if self.image_tokens not in SOFT_TOKEN_BUDGETS:
            budgets = ", ".join(map(str, SOFT_TOKEN_BUDGETS))
            raise ConvertError(f"--image-tokens {self.image_tokens}: choose one of {budgets}")
        if self.vision_bits not in (None, *BITS):
            raise ConvertError(f"--vision-bits {self.vision_bits}: choose 4, 6, 8 or 16 (16 = no palettization)")
        if self.quant == "block" and self.vision_bits not in (None, *BLOCK_BITS):
            raise ConvertError(
                f"--vision-bits {self.vision_bits}: --quant block stores int4 or int8; choose 4, 8 or 16"
            )
        if self.audio_bits not in BITS:
            raise ConvertError(f"--audio-bits {self.audio_bits}: choose 4, 6, 8 or 16 (16 = no palettization)")
        seconds = self.audio_seconds
        if not seconds or any(isinstance(s, bool) or not isinstance(s, (int, float)) for s in seconds):
            raise ConvertError(f"audio_seconds={seconds!r}: expected a non-empty list of durations in seconds")
        if not all(0 < s <= MAX_SECONDS for s in seconds):
            raise ConvertError(f"audio_seconds={list(seconds)}: each must be in (0, {MAX_SECONDS:g}] seconds")

    def _check_functions(self) -> None:
        if self.functions is not None and self.profile is not None:
            raise ConvertError("--functions and --profile: give one (a profile names a function list)")
        if self.profile is not None and self.profile not in PROFILES:
            raise ConvertError(f"--profile {self.profile!r}: choose {' or '.join(PROFILES)}")
        if self.functions is not None:
            try:
                check_function_names(self.functions)
            except ConfigError as e:
                raise ConvertError(str(e)) from None
        if self.layout == "published" and (self.functions is not None or self.profile is not None):
            what = "--functions" if self.functions is not None else f"--profile {self.profile}"
            raise ConvertError(f"{what}: the published layout's functions are fixed (infer, prefill_b8); use ours")

    def check_group_size(self, spec) -> None:
        """Refuse a --group-size the decoder's compressed linear weights cannot be grouped by, where the bundle would
        not be what was asked: --quant block any weight whose inputs it does not divide (it would stay fp16: the
        block format is chosen for its exact result), --quant lut when it divides no weight's output rows (a "4-bit"
        bundle that is all 16-bit; a few odd ones stay fp16 with a note, as a tiny preset's do). Weights under 2048
        values are never compressed, and are not asked."""
        if self.bits == 16:
            return
        block = self.quant == "block"
        widths = sorted({shape[1 if block else 0] for shape in linear_shapes(spec) if shape[0] * shape[1] >= 2048})
        wrong = [w for w in widths if w % self.group_size]
        if wrong and (block or len(wrong) == len(widths)):
            grouped = "inputs" if block else "output rows"
            raise ConvertError(
                f"--group-size {self.group_size}: does not divide {wrong[0]}, the {grouped} of some of the model's "
                f"linear weights (--quant {self.quant} groups their {grouped}), which would stay fp16; choose a "
                f"divisor of {math.gcd(*widths)}"
            )

    def kept(self, name: str) -> bool:
        """Whether the weight so named stays fp16: a --keep pattern found in its name as traced (the checkpoint's
        spelling, "layers.0.self_attn.o_proj.weight_to_fp16") or as saved and shown by inspect
        ("layers_0_self_attn_o_proj_weight_to_fp16")."""
        return any(re.search(p, n) for p in self.keep for n in (name, saved_name(name)))

    def record(self) -> dict:
        """The options as the manifest states them. The quantization and audio fields are left out at their
        defaults, so a bundle converted with the defaults stays byte-identical to one converted before they
        existed."""
        record = dataclasses.asdict(self)
        for name in ("quant", "keep", "audio", "audio_bits", "audio_seconds", "functions", "profile", "contexts"):
            if record[name] == _DEFAULTS[name]:
                del record[name]
        return record

    @property
    def vision_options(self) -> ConvertOptions:
        """These options with the vision model's bits."""
        bits = self.vision_bits or (self.bits if self.bits >= 8 else 8)
        return dataclasses.replace(self, bits=bits)

    @property
    def audio_options(self) -> ConvertOptions:
        """These options with the audio model's bits."""
        return dataclasses.replace(self, bits=self.audio_bits)


def linear_shapes(spec) -> set[tuple[int, int]]:
    """(out, in) of every linear weight of a Gemma 4 decoder (ModelSpec): attention, MLP and per-layer input
    projections per layer, the per-layer embeddings' projection and the tied LM head."""
    H, P = spec.hidden_size, spec.per_layer_dim
    shapes = {(spec.num_layers * P, H), (spec.vocab_size, H)}
    for hd, kv, inter in zip(spec.head_dims, spec.kv_heads, spec.intermediate_sizes):
        q = spec.num_heads * hd
        shapes |= {(q, H), (kv * hd, H), (H, q), (inter, H), (H, inter), (P, H), (H, P)}
    return shapes


# --keep patterns run against every weight's name: bounded before Python's backtracking engine compiles them (its
# parser recurses once per nested group: 5,000 of them was a RecursionError) and refused where they could backtrack
# exponentially ('(\w|\w)*!' on a 60-character name runs for hours): a repeat holding another repeat or an alternation.
MAX_KEEP_LENGTH, MAX_KEEP_NESTING = 500, 16
_REPEATS = {sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT}


def check_keep(pattern: str) -> None:
    """A --keep pattern the converter can search every weight name with, in time linear-ish in the name."""
    if len(pattern) > MAX_KEEP_LENGTH:
        raise ConvertError(f"--keep {pattern[:40]!r}...: {len(pattern)} characters (at most {MAX_KEEP_LENGTH})")
    depth = _nesting(pattern)
    if depth > MAX_KEEP_NESTING:
        raise ConvertError(f"--keep {pattern[:40]!r}: groups nested {depth} deep (at most {MAX_KEEP_NESTING})")
    try:
        tree = sre_parser.parse(pattern)
        re.compile(pattern)
    except re.error as e:
        raise ConvertError(f"--keep {pattern!r}: not a regular expression ({e})") from None
    if _backtracks(tree, False):
        raise ConvertError(
            f"--keep {pattern!r}: a repeated group holds another repeat or an alternation, which can backtrack "
            "exponentially on a name it does not match; write it without nesting (e.g. a character class)"
        )


def _nesting(pattern: str) -> int:
    """How deep the pattern's parentheses nest (escapes and character classes skipped): counted without recursion."""
    depth = deepest = 0
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 1
        elif in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += pattern[i + 1 : i + 2] == "]"  # a ']' first in a class is a literal
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


def _backtracks(items, repeated: bool) -> bool:
    """Whether a parsed pattern has a repeat (of more than one) or an alternation inside such a repeat."""
    for op, av in items:
        if op in _REPEATS:
            low, high, body = av
            if repeated or _backtracks(body, high > 1):
                return True
        elif op is sre_constants.BRANCH:
            if repeated or any(_backtracks(b, False) for b in av[1]):
                return True
        elif op in (
            sre_constants.SUBPATTERN,
            sre_constants.ATOMIC_GROUP,
            sre_constants.ASSERT,
            sre_constants.ASSERT_NOT,
        ):
            if _backtracks(av[-1] if op is not sre_constants.ATOMIC_GROUP else av, repeated):
                return True
        elif op is sre_constants.GROUPREF_EXISTS:
            if any(_backtracks(b, repeated) for b in av[1:] if b is not None):
                return True
    return False


def saved_name(name: str) -> str:
    """A MIL op's name as a saved program holds it (coremltools turns what is not a word character into "_")."""
    return re.sub(r"\W", "_", name)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ConvertOptions)}


class StageTimer:
    """Wall time and peak resident memory per stage. The peak comes from the kernel's high-water
    mark (VmHWM), reset at each stage entry through /proc/self/clear_refs, so it is exact rather
    than sampled; where /proc is missing (macOS) only times are kept."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.peak_rss: dict[str, int] = {}

    @contextmanager
    def __call__(self, stage: str):
        stop_point()  # between stages: a signal swallowed inside the last one ends the conversion here
        _reset_peak_rss()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0
            peak = _peak_rss()
            if peak:
                self.peak_rss[stage] = max(self.peak_rss.get(stage, 0), peak)


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
