import json

import pytest
from jinja2.exceptions import TemplateError

from gemma_ane.oracle.tokenizer_files import (
    GEMMA4_CHAT_TEMPLATE,
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    build_tokenizer,
    write_tokenizer_files,
)

transformers = pytest.importorskip("transformers")

VOCAB_SIZE = 1024
UNICODE_TEXT = "héllo 日本 🙂 wörld"


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(path, VOCAB_SIZE)
    return path


@pytest.fixture(scope="module")
def hf_tok(out_dir):
    return transformers.AutoTokenizer.from_pretrained(out_dir)


SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Hi there"}


@pytest.mark.parametrize(
    ("messages", "kwargs", "expected"),
    [
        pytest.param([USER], {}, "<bos><|turn>user\nHi there<turn|>\n<|turn>model\n", id="user"),
        pytest.param(
            [SYSTEM, USER],
            {},
            "<bos><|turn>system\nYou are terse.<turn|>\n<|turn>user\nHi there<turn|>\n<|turn>model\n",
            id="system-user",
        ),
        pytest.param(
            [SYSTEM, USER, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "  2+2?\n"}],
            {},
            "<bos><|turn>system\nYou are terse.<turn|>\n<|turn>user\nHi there<turn|>\n"
            "<|turn>model\nHello!<turn|>\n<|turn>user\n2+2?<turn|>\n<|turn>model\n",
            id="multi-turn",
        ),
        pytest.param(
            [SYSTEM, USER],
            {"enable_thinking": True},
            "<bos><|turn>system\n<|think|>\nYou are terse.<turn|>\n<|turn>user\nHi there<turn|>\n<|turn>model\n",
            id="thinking-system",
        ),
        pytest.param(
            [USER],
            {"enable_thinking": True},
            "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi there<turn|>\n<|turn>model\n",
            id="thinking-no-system",
        ),
        pytest.param(
            [USER],
            {"enable_thinking": False},
            "<bos><|turn>user\nHi there<turn|>\n<|turn>model\n",
            id="thinking-off",
        ),
        pytest.param(
            [{"role": "user", "content": [{"type": "text", "text": " Hi "}, {"type": "text", "text": "there "}]}],
            {},
            "<bos><|turn>user\nHithere<turn|>\n<|turn>model\n",  # each part trimmed, as Google's template does
            id="content-parts",
        ),
        pytest.param(
            [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": " Hi"}]}],
            {},
            "<bos><|turn>user\n<|image|>Hi<turn|>\n<|turn>model\n",
            id="image-part",
        ),
    ],
)
def test_chat_template_renders_gemma4_format(hf_tok, messages, kwargs, expected):
    assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs) == expected


def test_chat_template_without_generation_prompt(hf_tok):
    assert hf_tok.apply_chat_template([USER], tokenize=False) == "<bos><|turn>user\nHi there<turn|>\n"


def test_chat_template_rejects_unknown_role(hf_tok):
    with pytest.raises(TemplateError, match="Unknown role 'tool'"):
        hf_tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_chat_template_tokenizes_control_tokens_once(hf_tok):
    text = hf_tok.apply_chat_template([USER], tokenize=False, add_generation_prompt=True)
    ids = hf_tok.apply_chat_template([USER], add_generation_prompt=True, return_dict=False)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert ids[:2] == [2, 105]
    assert ids.count(2) == 1  # add_bos_token is off, so only the template's <bos>
    assert ids.count(105) == 2 and ids.count(106) == 1


def test_files_written(out_dir, hf_tok):
    # Also shows that no temporary file of the atomic writes was left behind.
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((out_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == GEMMA4_CHAT_TEMPLATE
    assert (out_dir / "chat_template.jinja").read_text(encoding="utf-8") == GEMMA4_CHAT_TEMPLATE
    assert config["add_bos_token"] is False
    assert (hf_tok.pad_token_id, hf_tok.eos_token_id, hf_tok.bos_token_id, hf_tok.unk_token_id) == (0, 1, 2, 3)
    assert hf_tok.chat_template == GEMMA4_CHAT_TEMPLATE


@pytest.mark.parametrize(("token_id", "token"), sorted(SPECIAL_TOKENS.items()))
def test_special_tokens_have_gemma4_ids(hf_tok, token_id, token):
    assert hf_tok.encode(token, add_special_tokens=False) == [token_id]
    assert hf_tok.convert_ids_to_tokens(token_id) == token
    assert hf_tok.decode([token_id], skip_special_tokens=False) == token


def test_special_tokens_are_cut_out_of_text(hf_tok):
    ids = hf_tok.encode("a<|turn>b<turn|><eos>", add_special_tokens=False)
    assert [i for i in ids if i < 128] == [105, 106, 1]
    assert hf_tok.decode(ids, skip_special_tokens=True) == "ab"


@pytest.mark.parametrize(
    "text", [UNICODE_TEXT, "  two  spaces, tabs\tand\nnewlines . , ! ", "\x00\x7f\u0100", "🙂" * 3]
)
def test_round_trip_is_exact(hf_tok, text):
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert not any(i < 128 for i in ids)  # no <unk>, nor any other special id
    assert hf_tok.decode(ids) == text


def test_round_trip_with_special_tokens_kept(hf_tok):
    text = "<bos><|turn>user\n" + UNICODE_TEXT + "<turn|>\n"
    assert hf_tok.decode(hf_tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_common_words_are_single_tokens(hf_tok):
    for word in ["The", " the", " answer", "user", "model", "system"]:
        assert len(hf_tok.encode(word, add_special_tokens=False)) == 1, word


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE, 512, VOCAB_SIZE, 4096])
def test_vocab_size_is_exact(vocab_size):
    tok = build_tokenizer(vocab_size)
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    assert sorted(tok.get_vocab(with_added_tokens=True).values()) == list(range(vocab_size))
    assert tok.decode(tok.encode(UNICODE_TEXT).ids) == UNICODE_TEXT


def test_vocab_size_too_small():
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(MIN_VOCAB_SIZE - 1)


def test_deterministic(tmp_path):
    assert build_tokenizer(512).to_str() == build_tokenizer(512).to_str()
    write_tokenizer_files(tmp_path / "a", 512)
    write_tokenizer_files(tmp_path / "b", 512)
    for name in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
