"""What a bundle costs in quality: its next-token distributions against transformers' over a real text.

The shape of llama.cpp's `perplexity --kl-divergence`: the text runs through the reference (transformers in fp32,
with the checkpoint's own weights: its original embedding tables and tied head) and through the bundle (the MIL
executor, the runtime's own scheduling and sidecars), in the same windows; at every scored token we take
KL(reference || bundle), whether the two argmaxes agree, and each side's negative log-likelihood of the token the
text has. Everything the bundle does differently (palettized weights, int8 embedding tables, fp16 arithmetic) is in
the numbers: that is the cost a user pays.

Windows: every window is BOS and `context - 1` tokens of the text, windows start `stride` tokens apart, and a window
scores its last `stride` tokens (the first window scores all of its tokens, and a last window ending at the text's
end scores those no window scored yet): every token is scored once, and all but the first window's see at least
`context - stride` positions before them.

transformers is imported here (through `verify`): this module sits on the oracle side of the walls.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..bundle import layout
from ..convert.checkpoint import Checkpoint
from ..errors import InputError
from ..files import read_regular
from ..runtime.tokens import BOS

ROWS = 64  # logit rows turned into float64 log-probabilities at a time: the real vocabulary is 262,144 wide


class EvalError(InputError):
    """An evaluation that cannot run; the message names the file, option or field."""


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl_divergence(lp: np.ndarray, lq: np.ndarray) -> np.ndarray:
    """Per row, KL(P || Q) = sum_v P(v) (log P(v) - log Q(v)) in nats, from log-probabilities: P the reference's,
    Q the bundle's."""
    return (np.exp(lp) * (lp - lq)).sum(-1)


def windows(n: int, context: int, stride: int) -> list[tuple[int, int]]:
    """(start, first scored) offsets into n text tokens: each window is BOS + text[start : start + context - 1] and
    scores the tokens from `first scored` to its end. Every token is scored exactly once."""
    span = context - 1
    out, scored = [], 0
    for start in range(0, n - span + 1, stride):
        out.append((start, scored))
        scored = start + span
    if scored < n:  # the text's tail: one more window, ending at its end
        out.append((n - span, scored))
    return out


def _bundle_logits(engine, ids: np.ndarray, skip: int) -> np.ndarray:
    """The bundle's logits at rows skip.. of `ids`; the rows before fill the caches as a prompt does (KV-only
    batches where the bundle has them), so only the scored rows hold [rows, vocab] logits."""
    engine.reset()
    if skip:
        engine.feed(ids[:skip], logits="none")
    return np.stack(engine.feed(ids[skip:], logits="all"))


def _reference_logits(model, ids: np.ndarray, rows: int) -> np.ndarray:
    """transformers' logits at the last `rows` rows of `ids` (logits_to_keep: the head runs on those alone)."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids)[None], use_cache=False, logits_to_keep=rows)
    return out.logits[0].float().numpy()


MAX_TEXT_BYTES = 1 << 26  # 64 MiB: fifty times wikitext-103's test split, days of scoring


def read_text(path) -> str:
    """The text of `path`: a regular file (a FIFO or a device is refused, never waited on or read to its end) of
    at most MAX_TEXT_BYTES, in UTF-8."""
    data = read_regular(path, MAX_TEXT_BYTES, EvalError, f"--text {path}: cannot read")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EvalError(f"--text {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise EvalError(f"--text {path}: empty text")
    return text


def tokenize(tokenizer_path: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    # the text is data: "<turn|>" in it is five characters, not the control token the tokenizer would match
    tokenizer.encode_special_tokens = True
    return tokenizer.encode(text, add_special_tokens=False).ids


def evaluate(
    src,
    bundle,
    text_path,
    context: int | None = None,
    stride: int | None = None,
    precision: str = "fp16",
    progress: bool = False,
) -> dict:
    """KL divergence, top-1 agreement and perplexities of `bundle` against transformers over the text in
    `text_path` (see the module's docstring for the windows). `context` defaults to the bundle's, `stride` to half
    of it."""
    from ..bundle import open_bundle
    from ..runtime.backend import open_engine
    from ..runtime.device import Device
    from .verify import check_pair, oracle_model

    if precision not in ("fp32", "fp16"):
        raise EvalError(f"--precision {precision!r}: choose fp32 or fp16")
    bundle = Path(bundle)
    if not bundle.is_dir():
        raise EvalError(f"--bundle {bundle}: not a bundle directory")
    ckpt = Checkpoint(src)
    ckpt.validate()
    opened = open_bundle(bundle, check=False)
    config = opened.config.raw
    check_pair(ckpt, bundle, config)
    text = read_text(text_path)
    engine = open_engine(opened, Device.of("mil", precision))
    if engine.head != "logits":
        raise EvalError(f"--bundle {bundle}: its head returns token ids, not logits (the published layout)")
    context = engine.context if context is None else context
    if not 2 <= context <= engine.context:
        raise EvalError(f"--context {context}: must be in [2, the bundle's context {engine.context}]")
    stride = max(1, context // 2) if stride is None else stride
    if not 1 <= stride <= context - 1:
        raise EvalError(f"--stride {stride}: must be in [1, --context - 1 = {context - 1}]")
    tokenizer = bundle / layout.HF_TOKENIZER
    if not tokenizer.is_file():
        tokenizer = ckpt.root / Path(layout.HF_TOKENIZER).name
    ids = tokenize(tokenizer, text)
    if len(ids) < context - 1:
        raise EvalError(
            f"--text {text_path}: {len(ids)} tokens, shorter than one window (--context {context}: BOS and "
            f"{context - 1} tokens)"
        )
    kld, agree, nll_ref, nll_ours = _score(engine, oracle_model(ckpt), ids, context, stride, progress)
    return {
        "tokens": int(kld.size),
        "context": context,
        "stride": stride,
        "precision": precision,
        "kld_mean": float(kld.mean()),
        "kld_p99": float(np.percentile(kld, 99)),
        "kld_max": float(kld.max()),
        "top1_agreement": float(agree.mean()),
        "ppl_reference": float(np.exp(nll_ref.mean())),
        "ppl_bundle": float(np.exp(nll_ours.mean())),
    }


def _score(engine, model, ids: list[int], context: int, stride: int, progress: bool) -> tuple[np.ndarray, ...]:
    """Every scored token's KL divergence, top-1 agreement and the two negative log-likelihoods, window by window."""
    from tqdm import tqdm

    kld, agree, nll_ref, nll_ours = [], [], [], []
    bar = tqdm(total=len(ids), unit="tok", disable=not progress, desc="eval", leave=False)
    try:
        for start, first in windows(len(ids), context, stride):
            window = np.asarray([BOS, *ids[start : start + context - 1]], np.int64)
            # row r predicts window[r + 1]: the last token is only a target, and the first `skip` rows (scored by the
            # window before) only fill the caches
            skip, target = first - start, window[first - start + 1 :]
            ours = _bundle_logits(engine, window[:-1], skip)
            ref = _reference_logits(model, window[:-1], len(target))
            for block in range(0, len(target), ROWS):
                r = slice(block, block + ROWS)
                lp, lq, t = log_softmax(ref[r]), log_softmax(ours[r]), target[r]
                kld.append(kl_divergence(lp, lq))
                agree.append(lp.argmax(-1) == lq.argmax(-1))
                nll_ref.append(-lp[np.arange(len(t)), t])
                nll_ours.append(-lq[np.arange(len(t)), t])
            bar.update(len(target))
    finally:
        bar.close()
    return tuple(np.concatenate(x) for x in (kld, agree, nll_ref, nll_ours))
