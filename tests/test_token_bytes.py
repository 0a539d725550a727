"""One reading of token bytes for any Hugging Face tokenizer (tokens.TokenBytes / token_bytes): the grammar's
vocabulary and the server's logprobs use it, so a tokenizer whose decoder is Metaspace (common on the Hub) takes a
response_format like any other."""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from gemma_ane.runtime.grammar import Constraint, response_grammar
from gemma_ane.runtime.tokens import TokenBytes, token_bytes

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
PIECES = ["▁", "{", "}", '"', ":", ",", "▁{", '▁"', "1", "2", "a", "b", "▁a", "ab", "é"]


def metaspace_tokenizer(path: Path) -> Path:
    """A SentencePiece-style tokenizer without byte fallback: ▁ for a space, read back by a Metaspace decoder."""
    vocab = {piece: i for i, piece in enumerate(SPECIAL + PIECES)}
    merges = [("▁", "{"), ("▁", '"'), ("▁", "a"), ("a", "b")]
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    t.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL])
    t.save(str(path))
    return path


def test_metaspace_pieces_read_as_text_with_spaces(tmp_path):
    tok = Tokenizer.from_file(str(metaspace_tokenizer(tmp_path / "ms.json")))
    read = TokenBytes(tok)
    assert [read(tok.token_to_id(p)) for p in ("▁", "▁a", "ab", "é")] == [b" ", b" a", b"ab", "é".encode()]
    tokens, special = token_bytes(tok)
    assert special == [0, 1, 2, 3] and tokens[:2] == [b"<pad>", b"<eos>"] and tokens[4] == b" "


def test_response_format_with_a_metaspace_tokenizer(tmp_path):
    path = metaspace_tokenizer(tmp_path / "ms.json")
    tok = Tokenizer.from_file(str(path))
    n = tok.get_vocab_size(with_added_tokens=True)
    c = Constraint(response_grammar({"type": "json_object"}), path, n, [1])
    ids = [tok.token_to_id(p) for p in ["{", '"', "ab", '"', ":", "1", ",", '▁"', "a", '"', ":", "2", "}"]]
    for token in ids:
        assert c.allowed()[token], tok.id_to_token(token)
        c.advance(token)
    assert c.done and c.allowed()[1] and not c.allowed()[tok.token_to_id("a")]


def test_any_other_decoder_is_asked_what_a_piece_adds():
    vocab = {"[UNK]": 0, "ab": 1, "##cd": 2}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    read = TokenBytes(tok)
    assert (read(1), read(2)) == (b" ab", b"cd")  # a word after another gets its space; a continuation does not


def metaspace_model(root: Path):
    """The scripted model (flat logits, the real template) over a bundle directory whose tokenizer is Metaspace's;
    its vocabulary larger than the tokenizer's, as a model's may be."""
    from scripted import TEMPLATE, ScriptedEngine

    from gemma_ane.runtime.chat import ChatTemplate
    from gemma_ane.runtime.model import Model

    (root / "hf_model").mkdir()
    tok = Tokenizer.from_file(str(metaspace_tokenizer(root / "hf_model" / "tokenizer.json")))
    return Model(root, ScriptedEngine(1024), tok, ChatTemplate(TEMPLATE), {}, {"vocab_size": 1024}, "none")


def test_the_server_takes_a_response_format_with_a_metaspace_tokenizer(tmp_path):
    """Issue 28: every response_format request to such a bundle was a 400 ("cannot read the token bytes of a
    tokenizer with decoder ['Metaspace']")."""
    import json

    from starlette.testclient import TestClient

    from gemma_ane.server.app import build_app

    body = {"messages": [{"role": "user", "content": "ab"}], "response_format": {"type": "json_object"}}
    with TestClient(build_app(metaspace_model(tmp_path), model_name="m")) as http:
        r = http.post("/v1/chat/completions", json={**body, "temperature": 0, "max_tokens": 30})
    assert r.status_code == 200, r.json()
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {}
