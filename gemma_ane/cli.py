"""`gemma-ane`: a thin shell over the Python API. Every failure the user can cause is one line
on stderr and exit status 2 (`check` and `inspect --ane` findings: 1; an unverifiable bundle: 3;
a signal: 128+N; a closed pipe ends quietly); nothing here computes anything itself."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

from . import files
from .bundle.plan import ChunkPlan, parse_split, split_for_budget
from .bundle.spec import ConfigError, ModelSpec
from .errors import GemmaAneError
from .files import write_json
from .runtime.grammar import GrammarError, response_grammar
from .runtime.images import MAX_PIXELS
from .runtime.sampling import FIELDS, SamplingParams
from .runtime.tools import MAX_DEPTH


def _plan_table(plan: ChunkPlan, bits: int) -> str:
    head = f"context {plan.context}, window {plan.window}, prefill batch {plan.prefill_batch}"
    lines = [f"{head}, split {','.join(map(str, plan.split))}"]
    for c, role in zip(plan.chunks, plan.describe(bits)):
        layers = f"layers {c.layers[0]}-{c.layers[-1]}" if c.layers else "no layers"
        lines.append(
            f"\n{c.name}: {layers}, {role['weight_mb']} MB at {bits} bits"
            + ("" if c.stateful else ", stateless")
            + ("  (+ final norm, LM head, softcap)" if c.has_head else "")
        )
        if role["reads"] or role["hands_on"]:
            lines.append(f"  takes {', '.join(role['reads']) or '-'}; hands on {', '.join(role['hands_on']) or '-'}")
        for name, t in c.states.items():
            lines.append(f"  state  {name:<24} {str(list(t.shape)):<22} {t.dtype}")
        for fname, io in c.functions.items():
            lines.append(f"  {fname}")
            for kind in ("inputs", "outputs"):
                for name, t in io[kind].items():
                    lines.append(f"    {kind[:-1]:<6} {name:<24} {str(list(t.shape)):<22} {t.dtype}")
    return "\n".join(lines)


def _split_of(a, spec: ModelSpec) -> tuple[int, ...] | None:
    """--split, or the boundaries --max-chunk-mb chooses at --bits (ConfigError names what cannot fit)."""
    if a.max_chunk_mb is None:
        return parse_split(a.split)
    if a.split is not None:
        raise ConfigError("--split and --max-chunk-mb: give one (the budget chooses the boundaries)")
    return split_for_budget(spec, a.max_chunk_mb, a.bits)


def cmd_plan(a):
    spec = ModelSpec.from_pretrained(a.src)
    plan = ChunkPlan.build(spec, a.context, a.prefill_batch, _split_of(a, spec))
    if a.json:  # the plan, and each chunk's role and weights at --bits
        roles = {r["name"]: r for r in plan.describe(a.bits)}
        data = plan.to_json()
        data["bits"] = a.bits
        data["chunks"] = [{**roles[c["name"]], **c} for c in data["chunks"]]
        print(json.dumps(data, indent=2))
    else:
        print(_plan_table(plan, a.bits))


def cmd_tiny(a):
    from .oracle.tiny import write_tiny

    out = write_tiny(
        a.out, preset=a.preset, seed=a.seed, dtype=a.dtype, shards=a.shards, force=a.force, assistant=a.assistant
    )
    drafter = f", its assistant to {a.assistant}" if a.assistant else ""
    print(f"wrote {a.preset} (seed {a.seed}, {a.dtype}) to {out}{drafter}")


def cmd_verify(a):
    from .oracle.verify import verify_bundle, verify_graph

    if a.image and not a.bundle:
        raise ValueError("--image: needs --bundle (the images go through the bundle's vision model)")
    if a.audio and not a.bundle:
        raise ValueError("--audio: needs --bundle (the clips go through the bundle's audio model)")
    if a.bundle:
        report = verify_bundle(
            a.src,
            a.bundle,
            tokens=a.tokens,
            precision=a.precision or "fp16",
            seed=a.seed,
            prompt_len=a.prompt_tokens,
            images=a.image or (),
            max_image_pixels=a.max_image_pixels,
            audio=a.audio or (),
        )
    else:
        report = verify_graph(
            a.src,
            tokens=a.tokens,
            precision=a.precision or "fp32",
            seed=a.seed,
            prompt_len=a.prompt_tokens,
            prefill_batch=a.prefill_batch,
        )
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{report['mode']} ({report['precision']}) vs transformers over {report['positions']} positions"
            + (f" ({report['image_tokens']} of images)" if report.get("image_tokens") else "")
            + (f" ({report['audio_tokens']} of audio)" if report.get("audio_tokens") else "")
            + ": "
            f"top-1 {report['top1_agreement']:.4f}, min cosine {report['min_cosine']:.6f}, "
            f"max |logit diff| {report['max_abs_logit_diff']:.4g}"
            + (
                f"; judged on the text positions: top-1 {report['text_positions']['top1_agreement']:.4f}, "
                f"min cosine {report['text_positions']['min_cosine']:.6f}"
                if report.get("audio_tokens")
                else ""
            )
            + f" -> {'PASS' if report['passed'] else 'FAIL'}"
        )
    return 0 if report["passed"] else 1


def cmd_eval(a):
    from .oracle.evaluate import evaluate

    report = evaluate(
        a.src, a.bundle, a.text, context=a.context, stride=a.stride, precision=a.precision, progress=not a.quiet
    )
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{report['tokens']} tokens (context {report['context']}, stride {report['stride']},"
            f" {report['precision']}):"
            f" KLD mean {report['kld_mean']:.6f}, p99 {report['kld_p99']:.6f}, max {report['kld_max']:.6f};"
            f" top-1 {report['top1_agreement']:.4f}; perplexity {report['ppl_reference']:.4f} (transformers)"
            f" -> {report['ppl_bundle']:.4f} (bundle)"
        )
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse prints the whole usage block on a bad flag; we keep errors to one line."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _batches(text):
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--kv-prefill-batches {text!r}: expected comma-separated batch sizes, e.g. 64,8") from None


def cmd_convert(a):
    from .convert import ConvertOptions, StageTimer, convert, resolve_source

    if a.draft_tokens is not None and not a.assistant:
        raise ValueError("--draft-tokens: needs --assistant (the drafter whose tokens the verify calls check)")
    # the budget's boundaries are chosen before anything is written; the manifest records them as the split
    split = (
        parse_split(a.split)
        if a.max_chunk_mb is None
        else _split_of(a, ModelSpec.from_pretrained(resolve_source(a.src)))
    )
    opts = ConvertOptions(
        context=a.context,
        bits=a.bits,
        group_size=a.group_size,
        prefill_batch=a.prefill_batch,
        split=split,
        compile=a.compile,
        force=a.force,
        layout=a.layout,
        kv_prefill_batches=_batches(a.kv_prefill_batches),
        assistant=a.assistant,
        draft_tokens=3 if a.draft_tokens is None else a.draft_tokens,
        vision=a.vision,
        image_tokens=a.image_tokens,
        vision_bits=a.vision_bits,
        quant=a.quant,
        keep=tuple(a.keep),
        audio=a.audio,
        audio_bits=a.audio_bits,
    )
    timer = StageTimer()
    seconds = convert(a.src, a.out, opts, progress=not a.quiet, timer=timer)
    total = sum(seconds.values())
    print("  ".join(f"{k} {v:.1f}s" for k, v in seconds.items()) + f"  total {total:.1f}s")
    if timer.peak_rss:
        print("peak memory: " + "  ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in timer.peak_rss.items()))
    if a.stats:
        write_json(a.stats, {"seconds": seconds, "peak_rss_bytes": timer.peak_rss})
    print(f"wrote {a.out}")


def cmd_inspect(a):
    from .bundle import ONE_FUNCTION_MODELS, inspect_bundle

    if a.ane:
        from .runtime.audit import audit_bundle, format_audit

        audit = audit_bundle(a.bundle)
        print(json.dumps(audit, indent=2) if a.json else format_audit(audit))
        return 0 if audit["verdict"] == "pass" else 1
    report = inspect_bundle(a.bundle, sha256=not a.no_sha)
    if a.json:
        print(json.dumps(report, indent=2))
        return 0 if report["manifest"]["verified"] else 1
    for c in [*report["chunks"], *(report[name] for name in ONE_FUNCTION_MODELS if name in report)]:
        layers = f"layers {c['layers'][0]}-{c['layers'][-1]}, " if "layers" in c else ""
        print(f"{c['name']} ({c['path']}): {layers}{c['size_bytes'] / 1e6:.2f} MB on disk")
        if "weights" in c:  # a compiled model cannot be read back
            w = c["weights"]
            kinds = ", ".join(f"{n} {kind}" for kind, n in w["formats"].items())
            kept = f"; fp16 (>= 2048 values): {', '.join(w['fp16'])}" if w["fp16"] else ""
            print(f"  linear weights: {kinds}{kept}")
        for name, t in c["states"].items():
            print(f"  state  {name:<24} {str(t['shape']):<22} {t['dtype']}")
        per = "image" if c["name"] == "vision" else "token"  # encode's cost is one image's
        for fname, f in c["functions"].items():
            costs = (
                "costs unknown (compiled)"
                if f["macs_per_token"] is None
                else f"weights {f['weight_bytes'] / 1e6:.2f} MB, {f['macs_per_token'] / 1e6:.2f} M MACs/{per}"
            )
            print(f"  {fname}: T={f['tokens_per_call']}, {costs}")
            for kind in ("inputs", "outputs"):
                for name, t in f[kind].items():
                    print(f"    {kind[:-1]:<6} {name:<24} {str(t['shape']):<22} {t['dtype']}")
    for name, path in report["prompt_paths"].items():
        print(
            f"prompt path {name}: {path['macs_per_prompt_token'] / 1e6:.2f} M MACs and "
            f"{path['weight_bytes_per_prompt_token'] / 1e6:.2f} MB of weights per prompt token"
        )
    m = report["manifest"]
    print("manifest: " + ("verified" if m["verified"] else "; ".join(m["problems"])))
    return 0 if m["verified"] else 1


def _sampling(a) -> dict:
    """The sampling flags given (sampling.FIELDS), as stream_generate's keyword arguments."""
    out = {f.name: getattr(a, f.name) for f in FIELDS if getattr(a, f.name) is not None}
    if "logit_bias" in out:
        out["logit_bias"] = dict(out["logit_bias"])
    SamplingParams(**out).validate()  # a value out of range is refused before the bundle loads
    return out


def _bias(text: str) -> tuple[int, float]:
    """--logit-bias's ID=BIAS; the ranges are checked where every caller's are (SamplingParams)."""
    token, sep, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ID=BIAS, e.g. 106=-100") from None


def cmd_generate(a):
    import dataclasses

    from . import load

    kw = dict(max_tokens=a.max_tokens, raw=a.raw, enable_thinking=a.think, system=a.system, **_sampling(a))
    if a.json_schema is not None:
        kw["response_format"] = _response_format(a.json_schema)
    if a.image:
        if a.raw:
            raise ValueError("--image: a raw prompt has no chat template to place the image in; drop --raw")
        content = [{"type": "image", "image": path} for path in a.image] + [{"type": "text", "text": a.prompt}]
        system = [{"role": "system", "content": kw.pop("system")}] if a.system else []
        kw["messages"] = [*system, {"role": "user", "content": content}]
    model = load(a.bundle, backend=a.backend, max_image_pixels=a.max_image_pixels)
    model.use_drafts(a.draft)
    _load_cache(model, a.prompt_cache)
    prompt = None if a.image else a.prompt
    if a.json:
        result = model.generate(prompt, **kw)
        _save_cache(model, a.prompt_cache, result.prompt_tokens, a.system, a.prompt, a.think)
        print(json.dumps(dataclasses.asdict(result)))
        return 0
    for ev in model.stream_generate(prompt, **kw):
        if ev.reasoning:
            sys.stderr.write(ev.reasoning)
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(_summary(ev), file=sys.stderr)
    _save_cache(model, a.prompt_cache, ev.prompt_tokens, a.system, a.prompt, a.think)
    return 0


def _response_format(text: str) -> dict:
    """--json-schema's value, inline JSON or a file holding it, as OpenAI's response_format."""
    source = "--json-schema"
    if not text.lstrip().startswith(("{", "[")):
        try:
            text, source = Path(text).read_text(), text
        except OSError as e:
            raise ValueError(f"--json-schema {text}: cannot read ({e.strerror or e})") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:  # the decoder recurses a level at a time: some thousand levels exhaust the stack
        raise ValueError(f"{source}: nested more than {MAX_DEPTH} deep") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{source}: a JSON schema is an object, not {type(schema).__name__}")
    fmt = {"type": "json_schema", "json_schema": {"name": "cli", "schema": schema}}
    fmt = fmt if schema else {"type": "json_object"}
    try:
        response_grammar(fmt)  # a schema the grammar engine refuses is refused here, before loading anything
    except GrammarError as e:
        problem = str(e).removeprefix(f"{e.param}: ") if e.param else str(e)
        raise ValueError(f"{source}: {problem}") from None
    return fmt


def _load_cache(model, path) -> None:
    if path and os.path.exists(path):
        print(f"prompt cache {path}: {model.load_prompt_cache(path)} tokens", file=sys.stderr)


def _save_cache(model, path, prompt_tokens: int, system, prompt, think: bool) -> None:
    """Save the caches of the system turn (without one, of the whole prompt) for the next run."""
    if not path:
        return
    ends = []
    if system:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        ends = model.turn_ends(messages, model.prompt_ids(messages=messages, enable_thinking=think), think)
    position = model.save_prompt_cache(path, ends[0] if ends else prompt_tokens)
    print(f"prompt cache {path}: saved {position} tokens", file=sys.stderr)


def _summary(last) -> str:
    """One line from the last event's Stats, as mlx-lm's generate prints them."""
    return (
        f"prompt: {last.prompt_tokens} tokens ({last.reused_tokens} reused), {last.prefill_tokens_per_s:.1f} tok/s"
        f" | generation: {last.generated_tokens} tokens, {last.decode_tokens_per_s:.1f} tok/s"
        + (
            f" | drafts: {last.acceptance_rate:.0%} accepted, {last.tokens_per_verify:.2f} tokens a verify call"
            if last.tokens_per_verify
            else ""
        )
        + f" | finish: {last.finish_reason}"
    )


def _fit_context(model, head: list, messages: list, think: bool, max_tokens: int) -> list | None:
    """`messages` (after the system turn `head`) if their prompt leaves room for the answer (max_tokens,
    at most half the context). If not, the oldest exchanges go, with a note on stderr, until the prompt
    fills at most half the context, as llama.cpp's context shift does: the turns that follow then reuse
    the cached prompt instead of reprocessing it after a drop each. None, and a note, if even the last
    message alone does not fit."""
    ctx, room, sizes = model.context, min(max_tokens, model.context // 2), {}
    for k in range(0, len(messages), 2):  # whole exchanges, so what is kept starts with a user turn
        sizes[k] = len(model.prompt_ids(messages=head + messages[k:], enable_thinking=think))
        if sizes[k] + room <= ctx and (k == 0 or sizes[k] <= ctx // 2):
            break
    else:  # no half-context cut: the smallest that fits
        k = next((k for k, n in sizes.items() if n + room <= ctx), None)
        if k is None:
            print(
                f"(not sent: this message needs {sizes[len(messages) - 1]} prompt tokens and {room} "
                f"for the answer, more than the context of {ctx}; the conversation is unchanged)",
                file=sys.stderr,
            )
            return None
    if k:
        print(f"(dropped the {k} oldest turns to fit the context of {ctx})", file=sys.stderr)
    return messages[k:]


def cmd_chat(a):
    from . import load

    model = load(a.bundle, backend=a.backend)
    model.use_drafts(a.draft)
    _load_cache(model, a.prompt_cache)
    system, think, messages = a.system, a.think, []
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # undecodable bytes arrive as surrogates, refused per line
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line == "/reset":
            messages = []
            model.reset()
            print("(conversation cleared)")
            continue
        if line.startswith("/system"):
            system = line[len("/system") :].strip() or None
            messages = []
            print(f"(system prompt {'set' if system else 'cleared'}; conversation cleared)")
            continue
        if line.startswith("/think"):
            arg = line[len("/think") :].strip()
            if arg not in ("on", "off"):
                print("usage: /think on|off")
                continue
            think = arg == "on"
            print(f"(thinking {arg})")
            continue
        head = [{"role": "system", "content": system}] if system else []
        try:
            fitted = _fit_context(model, head, [*messages, {"role": "user", "content": line}], think, a.max_tokens)
            if fitted is None:
                continue
            answer, last = _answer(model, head + fitted, think, a)
        except ValueError as e:  # text that is not text, a failing template: this turn only, never the chat
            print(f"gemma-ane chat: error: {e}", file=sys.stderr)
            continue
        if not messages:  # the first turn of a conversation: its system turn is what recurs
            _save_cache(model, a.prompt_cache, last.prompt_tokens, system, line, think)
        messages = [*fitted, {"role": "assistant", "content": answer}]
    return 0


def _answer(model, convo: list[dict], think: bool, a):
    """Stream one answer (thinking to stderr, so stdout holds only the answers); (text, last event)."""
    answer = ""
    for ev in model.stream_generate(messages=convo, max_tokens=a.max_tokens, enable_thinking=think, **_sampling(a)):
        if ev.reasoning:
            sys.stderr.write(ev.reasoning)
            sys.stderr.flush()
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        answer += ev.text
    sys.stdout.write("\n")
    return answer, ev


def cmd_check(a):
    from .bundle import check_bundle, is_published

    problems = check_bundle(a.bundle, sha256=True)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        return 1
    if is_published(a.bundle):  # check_bundle lets only the published layout go without a manifest
        print(f"{a.bundle}: not verifiable: no manifest (the published layout has none); required files present")
        return 3
    print(f"{a.bundle}: ok (the manifest lists every file; sizes and sha256 match)")
    return 0


DRAFT_HELP = "speculative decoding: the bundle's drafter proposes K tokens a verify call (convert --assistant)"


def _add_max_image_pixels(s):
    s.add_argument(
        "--max-image-pixels",
        type=int,
        default=MAX_PIXELS,
        metavar="N",
        help=f"largest width*height of an image, read from its header before decoding (default {MAX_PIXELS})",
    )


def _add_sampling(s):
    s.add_argument("--backend", default="auto", choices=["auto", "coreml", "mil"])
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--system")
    s.add_argument("--think", action="store_true", help="thinking mode: reasoning goes to stderr")
    for f in FIELDS:  # one flag a sampling field, as the server takes them
        flag = "--" + f.name.replace("_", "-")
        if f.kind is dict:
            s.add_argument(flag, type=_bias, action="append", metavar="ID=BIAS", help=f.help)
        else:
            s.add_argument(flag, type=f.kind, metavar="N" if f.kind is int else "X", help=f.help)
    s.add_argument("--draft", type=int, default=0, metavar="K", help=DRAFT_HELP)
    s.add_argument(
        "--prompt-cache",
        metavar="FILE",
        help="start from the caches saved in FILE (if it exists); save the system turn's (or the prompt's) there",
    )


def _add_split(s):
    s.add_argument("--split", help="a,b[,c...]: chunk_2 starts at layer a, chunk_3 at b, ... (N-1 boundaries)")
    s.add_argument(
        "--max-chunk-mb",
        type=float,
        metavar="MB",
        help="choose the boundaries so every chunk's weights at --bits fit MB (instead of --split)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gemma-ane", description="Gemma 4 E2B for the Apple Neural Engine")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("plan", help="show how the model splits into Core ML chunks")
    s.add_argument("src", help="config.json or checkpoint directory")
    s.add_argument("--context", type=int, default=2048)
    s.add_argument("--prefill-batch", type=int, default=8)
    _add_split(s)
    s.add_argument("--bits", type=int, default=4, help="the weights' bits, for the sizes (16: fp16)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_plan)

    s = sub.add_parser("tiny", help="write a random tiny Gemma 4 checkpoint (needs transformers)")
    s.add_argument("out")
    s.add_argument("--preset", default="e2b-mini")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    s.add_argument("--shards", type=int, default=1)
    s.add_argument("--assistant", metavar="DIR", help="also write a matched drafter (Gemma4AssistantForCausalLM) here")
    s.add_argument("--force", action="store_true")
    s.set_defaults(fn=cmd_tiny)

    s = sub.add_parser("convert", help="convert a checkpoint into the Core ML bundle")
    s.add_argument("src", help="Hugging Face checkpoint directory (or Hub id, when online)")
    s.add_argument("out", help="bundle directory to create")
    s.add_argument("--context", type=int, default=2048)
    s.add_argument("--bits", type=int, default=4, help="4, 6, 8, or 16 for no palettization")
    s.add_argument(
        "--group-size",
        type=int,
        default=32,
        help="lut: output channels per LUT; block: input channels per scale (default 32, q4_0's block)",
    )
    s.add_argument(
        "--quant",
        default="lut",
        choices=["lut", "block"],
        help="lut: k-means LUT palettization (default); block: int4/int8 with one scale per --group-size inputs, "
        "exact for a checkpoint trained onto q4_0's grid (e.g. gemma-4-E2B-it-qat-q4_0-unquantized)",
    )
    s.add_argument(
        "--keep",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave linear weights at fp16 where this regular expression is found in their name, as the checkpoint "
        "spells it (layers.0.self_attn.o_proj) or as inspect shows it (layers_0_self_attn_o_proj); repeatable",
    )
    s.add_argument("--prefill-batch", type=int, default=8)
    _add_split(s)
    s.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile to .mlmodelc (default: on macOS only)",
    )
    s.add_argument("--force", action="store_true", help="replace an existing OUT")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument("--stats", help="also write {seconds, peak_rss_bytes} per stage to this JSON file")
    s.add_argument(
        "--kv-prefill-batches",
        help="KV-only prefill batch sizes, e.g. 64,8 (default: those of 64,8 that divide the window; empty disables)",
    )
    s.add_argument(
        "--layout",
        default="ours",
        choices=["ours", "published"],
        help="published: reproduce the published layout (argmax head, fp32 norm file, all-pairs RoPE)",
    )
    s.add_argument(
        "--assistant",
        metavar="DIR",
        help="also convert this Gemma 4 drafter (Gemma4AssistantForCausalLM) for speculative decoding",
    )
    s.add_argument(
        "--draft-tokens",
        type=int,
        default=None,
        metavar="K",
        help="with --assistant: drafts checked per verify call (verify_b{K+1} functions; default 3)",
    )
    s.add_argument(
        "--vision",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="convert the checkpoint's vision tower to vision.mlpackage, when it has one (default: yes)",
    )
    s.add_argument(
        "--image-tokens",
        type=int,
        default=280,
        metavar="N",
        help="soft tokens per image, one of 70, 140, 280, 560, 1120 (default 280, E2B's own)",
    )
    s.add_argument(
        "--vision-bits",
        type=int,
        default=None,
        help="the vision model's weights: 4, 6, 8 or 16 (default: 8, or --bits when that is higher)",
    )
    s.add_argument(
        "--audio",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="convert the checkpoint's audio tower to audio.mlpackage, when it has one (default: yes)",
    )
    s.add_argument("--audio-bits", type=int, default=8, help="the audio model's weights: 4, 6, 8 or 16 (default 8)")
    s.set_defaults(fn=cmd_convert)

    s = sub.add_parser("inspect", help="functions, I/O, states, sizes and costs of a converted bundle")
    s.add_argument("bundle")
    s.add_argument("--json", action="store_true")
    s.add_argument("--no-sha", action="store_true", help="check manifest sizes only, not sha256")
    s.add_argument(
        "--ane",
        action="store_true",
        help="audit each program against the Neural Engine's published rules (exit 1 unless it passes)",
    )
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("generate", help="generate text from a prompt")
    s.add_argument("bundle")
    s.add_argument("-p", "--prompt", required=True)
    s.add_argument(
        "--image",
        action="append",
        metavar="PATH",
        help="an image the prompt is about, placed before its text (repeat for more; needs a bundle with vision)",
    )
    _add_max_image_pixels(s)
    s.add_argument("--raw", action="store_true", help="no chat template: <bos> + the text")
    s.add_argument("--json", action="store_true", help="print one JSON object with the whole result")
    s.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        help="constrain the answer to JSON following SCHEMA (a JSON schema, inline or a file; '{}': any object)",
    )
    _add_sampling(s)
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("chat", help="multi-turn chat (reads stdin; /reset, /system TEXT, /think on|off)")
    s.add_argument("bundle")
    _add_sampling(s)
    s.set_defaults(fn=cmd_chat)

    s = sub.add_parser(
        "check", help="validate a bundle: every file listed, sizes and sha256 (exit 1: problems, 3: no manifest)"
    )
    s.add_argument("bundle")
    s.set_defaults(fn=cmd_check)

    from .server import app as server  # its web stack is imported only when `serve` runs

    server.add_parser(sub)

    s = sub.add_parser("verify", help="compare our chunks with transformers at every position")
    s.add_argument("src", help="Hugging Face checkpoint directory")
    s.add_argument("--tokens", type=int, default=64)
    s.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default tokens/4)")
    s.add_argument("--bundle", help="verify this converted bundle (run by the MIL executor) instead of the graph")
    s.add_argument(
        "--image",
        action="append",
        metavar="PATH",
        help="with --bundle: put this image in the prompt (repeat for more), against Gemma4ForConditionalGeneration",
    )
    _add_max_image_pixels(s)
    s.add_argument(
        "--audio",
        action="append",
        metavar="FILE",
        help="with --bundle: put this clip in the prompt (repeat for more), against Gemma4ForConditionalGeneration",
    )
    s.add_argument(
        "--precision",
        choices=["fp32", "fp16"],
        help="arithmetic of our side (default: fp32 for the graph, fp16 for a bundle)",
    )
    s.add_argument("--prefill-batch", type=int, default=8)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser(
        "eval",
        help="what a bundle costs in quality: KL divergence, top-1 agreement and perplexity against transformers",
        description="Run a text through transformers (fp32, the checkpoint's own weights) and through the bundle (the"
        " MIL executor) and compare their next-token distributions at every scored token: KL(reference || bundle)"
        " (mean, p99, max, in nats), top-1 agreement, and both perplexities. Windows: each is BOS and CONTEXT-1"
        " tokens of the text, windows start STRIDE tokens apart, and each scores its last STRIDE tokens, i.e. those"
        " after its first CONTEXT-STRIDE positions (the first window scores all of its tokens, a last window ending"
        " at the text's end those not yet scored): every token is scored once.",
    )
    s.add_argument("src", help="Hugging Face checkpoint directory the bundle was converted from")
    s.add_argument("--bundle", required=True, help="the converted bundle")
    s.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to score (at least one window long)")
    s.add_argument("--context", type=int, help="positions a window holds, BOS included (default: the bundle's)")
    s.add_argument("--stride", type=int, help="tokens between window starts, and scored a window (default: context/2)")
    s.add_argument("--precision", choices=["fp32", "fp16"], default="fp16", help="the bundle's arithmetic")
    s.add_argument("--json", action="store_true")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=cmd_eval)
    return p


# modules behind an extra, and the extra that brings them
_OPTIONAL = {
    "torch": "convert",
    "safetensors": "convert",
    "transformers": "dev",
    "starlette": "serve",
    "uvicorn": "serve",
    "sklearn": "dev",
}


STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stop(signum, frame):
    for s in STOPPING:  # a second signal must not interrupt the cleanup
        signal.signal(s, signal.SIG_IGN)
    files.stop(signum, frame)


@contextmanager
def _stoppable():
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield
        return
    saved = {s: signal.signal(s, _stop) for s in STOPPING}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # warnings (a function the device refuses, a bundle's RoPE tables) as one line, not a source dump
    warnings.formatwarning = lambda message, *_, **__: f"gemma-ane {args.command}: warning: {message}\n"
    try:
        with _stoppable():
            try:
                rc = args.fn(args) or 0
            except Exception:
                files.stop_point()  # a failure that follows a swallowed signal is the signal's doing
                raise
            sys.stdout.flush()  # a reader that left shows here, not in the flush at exit
        return rc
    except BrokenPipeError:
        # `gemma-ane plan | head`: the reader has what it wanted; end quietly as Unix tools do, and
        # point stdout at devnull so the interpreter's last flush does not complain either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (KeyboardInterrupt, files.Stopped) as e:
        signum = e.args[0] if isinstance(e, files.Stopped) else signal.SIGINT
        print(f"gemma-ane {args.command}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    except (GemmaAneError, ValueError, OSError) as e:  # ValueError, OSError: numpy's, the file system's
        print(f"gemma-ane {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code if isinstance(e, GemmaAneError) else 2
    except ImportError as e:
        if (e.name or "").split(".")[0] not in _OPTIONAL:
            raise
        print(
            f"gemma-ane {args.command}: error: {e.name} is not installed "
            f"(pip install 'gemma-ane[{_OPTIONAL[e.name.split('.')[0]]}]')",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
