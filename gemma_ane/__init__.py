"""gemma-ane: Gemma 4 E2B-it for the Apple Neural Engine.

    import gemma_ane
    model = gemma_ane.load("bundle")
    print(gemma_ane.generate(model, "What is the capital of France?", temperature=0).text)

The library reports through `logging` (the "gemma_ane" logger: which backend `auto` picked, at INFO) and
`warnings` (a prompt path the device refuses), never by printing; the `gemma-ane` command shows both on stderr.
"""

import logging as _logging

__version__ = "0.1.0"

# coremltools logs, at import, every native proxy it cannot load off macOS and every untested
# torch / scikit-learn version: noise for our users, who get a one-line note where it matters.
_logging.getLogger("coremltools").setLevel(_logging.ERROR)
_logging.getLogger(__name__).addHandler(_logging.NullHandler())  # a library stays quiet unless the app asks


def load(
    bundle,
    backend="auto",
    compute_units="cpu_and_ne",
    verify=False,
    precision="fp16",
    exact_rope=True,
    max_image_pixels=None,
):
    """Open a bundle directory (as `gemma-ane convert` writes it) and return a `Model`.

    Args:
        bundle: the bundle's directory.
        backend: "coreml" (Core ML; macOS), "mil" (the MIL executor, any OS, slower) or "auto" (Core ML where it
            runs, else mil; the choice is logged on the "gemma_ane" logger).
        compute_units: Core ML's units: "cpu_and_ne" (the Neural Engine), "cpu_only", "cpu_and_gpu" or "all".
        verify: check every file's sha256 against the bundle's manifest first.
        precision: the MIL executor's arithmetic, "fp16" (as the device) or "fp32".
        exact_rope: the RoPE rows from the bundle's tables as stored (False: recomputed in fp32).
        max_image_pixels: the largest width * height of an image in a prompt (default: runtime.images.MAX_PIXELS).

    Raises a `gemma_ane.errors.GemmaAneError` naming the file and field for a bundle it cannot run."""
    from .runtime.images import MAX_PIXELS
    from .runtime.model import load as _load

    return _load(
        bundle,
        backend=backend,
        compute_units=compute_units,
        verify=verify,
        precision=precision,
        exact_rope=exact_rope,
        max_image_pixels=MAX_PIXELS if max_image_pixels is None else max_image_pixels,
    )


def generate(model, prompt=None, messages=None, **options):
    """Generate one answer, whole: a `Result` (text, reasoning, tool_calls, tokens, logprobs, finish_reason and
    the Stats: prompt / reused / generated tokens, speeds). Takes what `stream_generate` takes."""
    return model.generate(prompt, messages, **options)


def stream_generate(model, prompt=None, messages=None, **options):
    """Generate one answer as it is made: an iterator of `Event`s, one per token (its text, reasoning, tool calls,
    token id and logprob), the last carrying the Stats and finish_reason ("stop", "length" or "tool_calls").

    Args:
        model: what `load` returned.
        prompt: the user's message (a str), or
        messages: a conversation, OpenAI-style dicts: {"role": "system" | "user" | "assistant" | "tool",
            "content": str or parts ({"type": "text" | "image" | "audio", ...})}, with "tool_calls" on an
            assistant turn.
        options (keywords):
            max_tokens (256), stop (a string or list of strings; the text ends before one), system (a system turn
            before `prompt`), raw (no chat template: <bos> + prompt), enable_thinking (the reasoning comes
            apart, on Event.reasoning);
            tools (OpenAI function declarations), tool_choice ("auto", "none", "required" or a function's name),
            parallel_tool_calls (True), response_format ({"type": "json_object"} or {"type": "json_schema", ...},
            enforced by constrained decoding);
            sampling: temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty,
            seed, logit_bias ({token id: bias}), logprobs (n alternatives per token); unset ones come from the
            bundle's generation_config.json;
            draft_tokens: speculative decoding with the bundle's drafter (K drafts a verify call; 0 off).

    A bad option raises a `GemmaAneError` naming it before anything runs."""
    return model.stream_generate(prompt, messages, **options)
