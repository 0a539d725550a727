"""Training the `demo` preset: a tiny Gemma 4 taught demo_corpus in a few CPU minutes, so that a demo bundle gives
checkable answers ("Paris.", a get_weather call, JSON, a picture's caption) with well-separated logits.

Deterministic by construction: the initial weights come from the seed, the corpus has a fixed order, every step
sees the whole corpus (no sampling), and torch runs on one thread (a multi-threaded reduction may sum in any
order), so the same seed writes the same bytes. The loss counts the model turns only: the prompts are what the
runtime feeds, not what the model has to write.
"""

from __future__ import annotations

import functools
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from ..runtime.chat import ChatTemplate
from .demo_corpus import Example, examples, picture
from .tokenizer_files import GEMMA4_CHAT_TEMPLATE, SPECIAL_TOKENS, TINY_MEDIA_TOKENS, build_tokenizer

# Full-batch AdamW over the whole corpus. 1e-2 at this width converges within STEPS; the rate decays to zero
# over the last half so the final steps settle instead of bouncing (the margins then stay where they are). 150: at
# 125 the smallest answer margin was above 6 on an AMD EPYC and 2.2 on a Xeon; at 150, 6.1 on the Xeon (the shipped
# weights; test_demo_model wants 4).
STEPS = 150
LR = 1e-2
WARMUP = 10

# The demo's language model as train() leaves it from seed 0, shipped with the package. A trained model's bytes
# depend on the CPU's float kernels (over the steps, torch's AVX-512 and AVX2 paths round differently: the margins
# above are one seed on two machines), so only shipped weights make the demo answer alike everywhere; it also spares
# the demo and the tests minutes of training. `python -m gemma_ane.oracle.tiny` trains and writes them anew.
WEIGHTS = Path(__file__).with_name("demo_language_model.safetensors")

# The attention's temperature: Gemma 4 does not scale attention, so the q/k norm weights bound the scores (transformers'
# initial 1.0: up to head_dim, 64). Trained at 1.0, the model reads a picture's many near-alike soft tokens with
# attention so sharp that fp16 rounding moves it between them (`verify --image`, text after a picture: min cosine
# 0.87). Fixed at 0.5 (scores within 16), not trained: 0.99998 there.
QK_NORM = 0.5
_TEMPERATURE = ("q_norm.weight", "k_norm.weight")

# The pictures' soft tokens: convert's default budget (--image-tokens 280), which the demo's bundle is converted at, so
# the prompts trained on are the ones the runtime builds from the same files
IMAGE_TOKENS = 280
BOI, IMAGE, EOI = TINY_MEDIA_TOKENS

_CONTROL = re.compile("|".join(re.escape(t) for t in (*SPECIAL_TOKENS.values(), *TINY_MEDIA_TOKENS.values())))


@functools.cache
def _template() -> ChatTemplate:
    return ChatTemplate(GEMMA4_CHAT_TEMPLATE)


def render(example: Example) -> str:
    """The prompt as the runtime renders it (Model.chat_ids: the bundle's template, tools through the built-in
    Gemma 4 formatter when the template declares none)."""
    with warnings.catch_warnings():
        # the template declares no tools, so conversations with tools take the built-in formatter: known here
        warnings.filterwarnings("ignore", "the chat template does not render tools")
        return _template().render(
            example.messages, add_generation_prompt=True, enable_thinking=example.enable_thinking, tools=example.tools
        )


def tokenizer_corpus() -> str:
    """The text the demo tokenizer learns its merges from: every prompt and answer, control tokens cut out (they
    have ids of their own)."""
    return "\n".join(_CONTROL.sub("\n", render(e) + "\n" + e.answer) for e in examples())


def encode(tokenizer, example: Example, soft_tokens=()) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids): the prompt encoded whole, as the runtime encodes it, each image placeholder expanded
    to begin-of-image, its picture's `soft_tokens` placeholders and end-of-image (as transformers' processor and
    the runtime's expand_media expand it; left as one placeholder without counts); the answer as its tokens."""
    prompt = tokenizer.encode(render(example), add_special_tokens=False).ids
    counts = iter(soft_tokens)
    if soft_tokens:
        prompt = [t for p in prompt for t in ([BOI, *[IMAGE] * next(counts), EOI] if p == IMAGE else [p])]
    answer = tokenizer.encode(example.answer, add_special_tokens=False).ids
    return prompt, answer


def pixels(model, names) -> dict:
    """transformers' Gemma 4 image processor (PIL backend, as verify's oracle uses it) on the PICTURES `names`, at
    IMAGE_TOKENS and the model's patch geometry: pixel_values, image_position_ids, num_soft_tokens_per_image."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    vision = model.config.vision_config
    processor = Gemma4ImageProcessorPil(
        max_soft_tokens=IMAGE_TOKENS, patch_size=vision.patch_size, pooling_kernel_size=vision.pooling_kernel_size
    )
    out = processor([picture(n) for n in names], return_tensors="pt")
    out["image_position_ids"] = out["image_position_ids"].long()
    return out


@contextmanager
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# Conversations run from ~25 to ~120 tokens: one padded batch would be mostly padding, so each step runs the corpus
# as a few batches of similar lengths (their gradients summed: the same full-corpus step, at less than half the cost).
# The picture questions (~270 tokens, their soft tokens included) are a batch of their own.
BATCHES = 4


def _padded(pairs: list[tuple[list[int], list[int]]]) -> tuple:
    """(prompt, answer) pairs right-padded into one batch: (ids, attention mask, mask of the positions whose next
    token is an answer's)."""
    T = max(len(p) + len(a) for p, a in pairs)
    ids = torch.zeros(len(pairs), T, dtype=torch.long)
    attention = torch.zeros(len(pairs), T, dtype=torch.long)
    predicts = torch.zeros(len(pairs), T - 1, dtype=torch.bool)
    for i, (p, a) in enumerate(pairs):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        attention[i, :n] = 1
        # the logits at position t predict token t + 1: an answer's tokens from one position earlier
        predicts[i, len(p) - 1 : n - 1] = True
    return ids, attention, predicts


def _batches(model, tokenizer, corpus: list[Example]) -> list[tuple]:
    """The text conversations, shortest first, cut into BATCHES batches, then the picture questions as one: each
    (ids, attention mask, answer mask, the model's other inputs)."""
    pairs = sorted((encode(tokenizer, e) for e in corpus if not e.pictures), key=lambda pa: len(pa[0]) + len(pa[1]))
    size = -(-len(pairs) // BATCHES)
    out = [(*_padded(pairs[k : k + size]), {}) for k in range(0, len(pairs), size)]
    pictured = [e for e in corpus if e.pictures]
    if pictured:
        px = pixels(model, [n for e in pictured for n in e.pictures])
        counts = iter(px["num_soft_tokens_per_image"].tolist())
        pairs = [encode(tokenizer, e, [next(counts) for _ in e.pictures]) for e in pictured]
        # The tower is not trained (its weights stay _randomize_vision's, conditioned for fp16), so its soft tokens
        # are the same every step: run once through transformers' own path (tower, then embed_vision), and handed
        # to the forward as its precomputed encoder outputs, which it merges into the prompt as it would its own
        with torch.no_grad():
            features = model.model.get_image_features(px["pixel_values"], px["image_position_ids"], return_dict=True)
        out.append((*_padded(pairs), {"mm_encoder_outputs": {"image": features}}))
    return out


def train(model, vocab_size: int, steps: int = STEPS) -> list[float]:
    """Train `model`'s language model (a Gemma4ForConditionalGeneration, transformers' own initial weights, its q/k
    norms set to QK_NORM and kept there) on the corpus, in place, the pictures seen through its (untrained) vision
    tower; the vision and audio towers are left as they are. Returns the loss of each step."""
    tokenizer = build_tokenizer(vocab_size, tokenizer_corpus())
    lm = model.model.language_model
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith(_TEMPERATURE):
                p.fill_(QK_NORM)
    params = [p for name, p in lm.named_parameters() if not name.endswith(_TEMPERATURE)]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.98), weight_decay=0.0)

    def rate(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        half = steps // 2
        return 1.0 if step < half else max(0.0, (steps - step) / (steps - half))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    losses = []
    with _one_thread():
        batches = _batches(model, tokenizer, examples())
        total = sum(int(predicts.sum()) for _, _, predicts, _ in batches)
        model.train()
        for _ in range(steps):
            optimizer.zero_grad()
            step_loss = 0.0
            for ids, attention, predicts, media in batches:
                logits = model(input_ids=ids, attention_mask=attention, **media).logits[:, :-1]
                # summed over the batch's answer tokens, divided by the corpus's: the mean over the whole corpus
                loss = torch.nn.functional.cross_entropy(logits[predicts], ids[:, 1:][predicts], reduction="sum")
                (loss / total).backward()
                step_loss += loss.item() / total
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(step_loss)
        model.eval()
    return losses


def load_trained(model) -> None:
    """Fill the demo model's language model (build_model("demo")) with the shipped weights (WEIGHTS)."""
    from safetensors.torch import load_file

    model.model.language_model.load_state_dict(load_file(WEIGHTS), strict=True)


def save_trained(model, path: Path = WEIGHTS) -> None:
    """The trained language model's weights, as load_trained reads them."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in model.model.language_model.state_dict().items()}, path)


def margins(model, tokenizer, corpus: list[Example] | None = None) -> list[float]:
    """For each example, the smallest top-1 minus top-2 logit over its answer's positions (teacher-forced), or
    negative where the answer's token is not the top-1: how far greedy decoding is from a tie."""
    out = []
    with torch.no_grad(), _one_thread():
        for example in corpus or examples():
            media, soft = {}, ()
            if example.pictures:  # through the whole vision path, pixels in: train() ran the tower once
                px = pixels(model, example.pictures)
                soft = px["num_soft_tokens_per_image"].tolist()
                media = dict(pixel_values=px["pixel_values"], image_position_ids=px["image_position_ids"])
            prompt, answer = encode(tokenizer, example, soft)
            ids = torch.tensor([prompt + answer])
            logits = model(input_ids=ids, **media).logits[0, len(prompt) - 1 : -1]
            want = torch.tensor(answer)
            others = logits.scatter(-1, want[:, None], float("-inf")).amax(-1)
            chosen = logits.gather(-1, want[:, None])[:, 0]
            # answer token's logit minus the best other one: the top-1/top-2 margin when the answer is top-1
            gap = chosen - others
            out.append(gap.min().item())
    return out
