"""gemma-ane: Gemma 4 E2B-it for the Apple Neural Engine."""

import logging

__version__ = "0.1.0"

# coremltools logs, at import, every native proxy it cannot load off macOS and every untested
# torch / scikit-learn version: noise for our users, who get a one-line note where it matters.
logging.getLogger("coremltools").setLevel(logging.ERROR)


def load(
    bundle,
    backend="auto",
    compute_units="cpu_and_ne",
    verify=False,
    precision="fp16",
    exact_rope=True,
    max_image_pixels=None,
):
    """Open a bundle: see gemma_ane.runtime.model.load (max_image_pixels None: its default, images.MAX_PIXELS)."""
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


def generate(model, prompt=None, messages=None, **kw):
    return model.generate(prompt, messages, **kw)


def stream_generate(model, prompt=None, messages=None, **kw):
    return model.stream_generate(prompt, messages, **kw)
