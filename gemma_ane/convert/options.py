"""What a conversion is asked for (ConvertOptions), how it refuses (ConvertError), and what it costs (StageTimer)."""

from __future__ import annotations

import dataclasses
import platform
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass

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
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConvertError(f"--keep {pattern!r}: not a regular expression ({e})") from None
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
