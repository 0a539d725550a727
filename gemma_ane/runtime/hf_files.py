"""The checkpoint's files a bundle carries in hf_model/ (CONTRACT §2), read for `load` with one-line errors naming
the file: the tokenizer, the generation config (its sampling defaults checked by the sampling rules) and the chat
template (chat_template.jinja, else tokenizer_config.json's)."""

from __future__ import annotations

from pathlib import Path

from ..bundle import BundleError
from ..bundle.schema import is_token, read_bundle_json
from .chat import ChatTemplate
from .sampling import FIELDS, GENERATION_CONFIG_FIELDS, SamplingError


def read_tokenizer(path: Path):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception for any file it cannot parse
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BundleError(f"{path}: unreadable tokenizer ({reason})") from None


def read_generation_config(path: Path) -> dict:
    """hf_model/generation_config.json (or {} without one), its fields checked here: used at every generation as
    defaults under the caller's, a bad one would be blamed on a sampling parameter the caller never gave."""
    if not path.is_file():
        return {}
    generation = read_bundle_json(path)
    rules = {f.name: f for f in FIELDS if f.name in GENERATION_CONFIG_FIELDS}
    for name, value in generation.items():
        if name in rules and value is not None:
            try:
                rules[name].check(value)
            except SamplingError as e:
                raise BundleError(f"{path}: {e}") from None
    eos = generation.get("eos_token_id", [])
    if not all(is_token(e) for e in (eos if isinstance(eos, list) else [eos])):
        raise BundleError(f"{path}: eos_token_id={eos!r:.40}: expected a token id or a list of token ids")
    return generation


def read_template(hf: Path) -> ChatTemplate:
    source = None
    path = hf / "chat_template.jinja"
    if path.is_file():
        try:
            source = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BundleError(f"{path}: unreadable chat template ({e})") from None
    cfg = {}
    if (hf / "tokenizer_config.json").is_file():
        cfg = read_bundle_json(hf / "tokenizer_config.json")
        if source is None and isinstance(cfg.get("chat_template"), str):
            source = cfg["chat_template"]
    bos, eos = cfg.get("bos_token"), cfg.get("eos_token")
    return ChatTemplate(
        source, bos_token=bos if isinstance(bos, str) else "<bos>", eos_token=eos if isinstance(eos, str) else "<eos>"
    )
