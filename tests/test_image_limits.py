"""The pixel limit on every way an image comes in besides the server (which checks it itself, see
test_server_images): the Python API (`load(max_image_pixels=)`, 40 MP by default), and the CLI's generate and
verify (--max-image-pixels). Each refusal is one line, made from the file's header before any pixel is decoded:
the big images here are a PNG header claiming the size, with no data behind it."""

import numpy as np
import pytest
from PIL import Image
from test_images import png_header

from gemma_ane import load
from gemma_ane.cli import main
from gemma_ane.runtime.images import ImageError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 30x20 picture: 600 pixels."""
    path = tmp_path_factory.mktemp("limits") / "small.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(path)
    return path


def ask(model, source):
    content = [{"type": "image", "image": source}, {"type": "text", "text": "What?"}]
    return model.generate(messages=[{"role": "user", "content": content}], max_tokens=1, temperature=0)


def test_the_api_has_a_pixel_limit_by_default_and_takes_another(vision_bundle, small):
    model = load(vision_bundle, backend="mil")
    with pytest.raises(ImageError, match=r"^messages\[0\].content\[0\]: 13000x13000 pixels, more than the limit of 4"):
        ask(model, png_header(13000, 13000))  # the 685 KB file of the issue took 3 GB and 48 s to decode
    assert len(ask(model, small).tokens) == 1
    model = load(vision_bundle, backend="mil", max_image_pixels=599)
    with pytest.raises(ImageError, match=r"small.png: 30x20 pixels, more than the limit of 599$"):
        ask(model, small)
    with pytest.raises(ValueError, match=r"^max_image_pixels=0: must be >= 1$"):
        load(vision_bundle, backend="mil", max_image_pixels=0)


def one_line_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_generate_and_verify_take_max_image_pixels(tiny_e2b, vision_bundle, small, capsys):
    generate = ["generate", str(vision_bundle), "--backend", "mil", "-p", "What?", "--max-tokens", "1"]
    one_line_exit_2(
        capsys,
        [*generate, "--image", str(small), "--max-image-pixels", "599"],
        f"error: messages[0].content[0] {small}: 30x20 pixels, more than the limit of 599",
    )
    assert main([*generate, "--image", str(small), "--max-image-pixels", "600", "--json"]) == 0
    verify = ["verify", str(tiny_e2b), "--bundle", str(vision_bundle), "--tokens", "12"]
    one_line_exit_2(
        capsys,
        [*verify, "--image", str(small), "--max-image-pixels", "599"],  # before transformers opens the file
        f"error: image 1 {small}: 30x20 pixels, more than the limit of 599",
    )
