"""Commands that measure a bundle against transformers, the oracle: `verify` and `eval`."""

from __future__ import annotations

import json

from ..bundle.plan import check_prefill_batch
from ..bundle.spec import ModelSpec
from ..errors import InputError
from .run import add_image_pixels
from .steps import add_quiet, shown, step


def cmd_verify(a):
    from ..oracle.verify import verify_bundle, verify_graph

    if a.image and not a.bundle:
        raise InputError("--image: needs --bundle (the images go through the bundle's vision model)")
    if a.audio and not a.bundle:
        raise InputError("--audio: needs --bundle (the clips go through the bundle's audio model)")
    ours = f"the bundle {a.bundle}" if a.bundle else "our chunk graph"
    with step(a, f"running transformers and {ours} over {a.tokens} positions"):
        if a.bundle:
            # the graph's plan refuses a bad --prefill-batch; a bundle runs its own batches, so it is refused here
            check_prefill_batch(ModelSpec.from_pretrained(a.src), a.prefill_batch)
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
        for crossing in report.get("crossings", ()):
            print(f"  climbed: {crossing}")
    return 0 if report["passed"] else 1


def cmd_eval(a):
    from ..oracle.evaluate import evaluate

    report = evaluate(
        a.src, a.bundle, a.text, context=a.context, stride=a.stride, precision=a.precision, progress=shown(a)
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


def add_commands(sub) -> None:
    s = sub.add_parser("verify", help="compare our chunks with transformers at every position")
    s.add_argument("src", help="Hugging Face checkpoint directory")
    s.add_argument("--tokens", type=int, default=64, help="positions compared, prompt included")
    s.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default tokens/4)")
    s.add_argument("--bundle", help="verify this converted bundle (run by the MIL executor) instead of the graph")
    s.add_argument(
        "--image",
        action="append",
        metavar="PATH",
        help="with --bundle: put this image in the prompt (repeat for more), against Gemma4ForConditionalGeneration",
    )
    add_image_pixels(s)
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
    s.add_argument("--prefill-batch", type=int, default=8, help="tokens a prefill call takes, as convert's")
    s.add_argument("--seed", type=int, default=0, help="seed of the random token ids compared")
    s.add_argument("--json", action="store_true", help="print the comparison as JSON")
    add_quiet(s)
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
    s.add_argument("--json", action="store_true", help="print the scores as JSON")
    s.add_argument("--quiet", action="store_true", help="no progress bar (shown only on a terminal)")
    s.set_defaults(fn=cmd_eval)
