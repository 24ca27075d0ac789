"""The word-level tokenizer of the reference backbones: open_clip's interface and id layout."""
import json

import pytest
import torch

from fewclip.backbones.tokenizer import WordTokenizer

VOCAB = ["a", "red", "star", "photo", "of", "the"]


@pytest.fixture
def tok():
    return WordTokenizer(VOCAB, context_length=8)


def test_id_layout_pad_sot_unk_then_words_then_eot(tok):
    assert (tok.pad_token_id, tok.sot_token_id, tok.unk_token_id) == (0, 1, 2)
    assert [tok.encoder[w] for w in VOCAB] == list(range(3, 3 + len(VOCAB)))
    assert tok.eot_token_id == len(VOCAB) + 3 == tok.vocab_size - 1
    assert tok.decoder[tok.eot_token_id] == "<end_of_text>"


def test_call_places_sot_eot_and_pads_with_zeros(tok):
    ids = tok(["a red star", "star"])
    assert ids.dtype == torch.long and ids.shape == (2, 8)
    assert ids[0].tolist() == [1, tok.encoder["a"], tok.encoder["red"], tok.encoder["star"], tok.eot_token_id, 0, 0, 0]
    assert ids[1].tolist() == [1, tok.encoder["star"], tok.eot_token_id, 0, 0, 0, 0, 0]
    # A single string is a batch of one, as with open_clip's tokenizers.
    assert torch.equal(tok("star"), ids[1:])


def test_eot_is_the_largest_id_so_argmax_pooling_finds_it(tok):
    texts = ["the star", "a photo of the red star", "", "zebra"]
    ids = tok(texts)
    eot_pos = [row.tolist().index(tok.eot_token_id) for row in ids]
    # open_clip's text tower pools at ids.argmax(-1): that must be the end-of-text token.
    assert ids.argmax(dim=-1).tolist() == eot_pos
    assert eot_pos == [3, 7, 1, 2]  # 7: truncated at context_length 8, see below


def test_truncation_keeps_eot_last(tok):
    long = " ".join(["red"] * 20)
    ids = tok([long])[0]
    assert ids[0] == tok.sot_token_id
    assert ids[-1] == tok.eot_token_id  # open_clip's convention: the eot survives truncation
    assert ids[1:-1].tolist() == [tok.encoder["red"]] * 6
    # context_length on the call overrides the tokenizer's own
    assert tok([long], context_length=4)[0].tolist() == [1, tok.encoder["red"], tok.encoder["red"], tok.eot_token_id]
    assert tok(["red"], context_length=12).shape == (1, 12)


def test_unknown_words_map_to_unk_and_are_reported(tok):
    assert tok.encode("a purple star") == [tok.encoder["a"], tok.unk_token_id, tok.encoder["star"]]
    assert tok.unknown_words("A Purple star, of Zebras!") == ["purple", "zebras"]
    assert tok.unknown_words("a red star") == []


def test_case_and_punctuation_are_ignored(tok):
    assert tok.encode("A RED star.") == tok.encode("a red star")


def test_decode_round_trip(tok):
    text = "a photo of the red star"
    assert tok.decode(tok(text)[0].tolist()) == text
    assert tok.decode(tok.encode("a zebra")) == "a <unk>"
    # decoding stops at the end-of-text token and skips padding
    assert tok.decode([1, tok.encoder["star"], tok.eot_token_id, tok.encoder["red"], 0]) == "star"


def test_duplicates_are_dropped_and_bad_words_refused():
    tok = WordTokenizer(["a", "A", "star", "a"])
    assert tok.words == ["a", "star"] and tok.vocab_size == 6  # pad, sot, unk, a, star, eot
    with pytest.raises(ValueError, match="two words"):
        WordTokenizer(["two words"])


def test_save_load_round_trip(tok, tmp_path):
    path = tmp_path / "vocab.json"
    tok.save(path)
    assert json.loads(path.read_text()) == {"type": "word", "context_length": 8, "vocab": VOCAB}
    back = WordTokenizer.load(path)
    assert back.encoder == tok.encoder and back.context_length == 8
    texts = ["a red star", "the zebra of a photo"]
    assert torch.equal(back(texts), tok(texts))


def test_load_refuses_other_json(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"model": "bpe"}))
    with pytest.raises(ValueError, match="not a fewclip word-tokenizer file"):
        WordTokenizer.load(path)
