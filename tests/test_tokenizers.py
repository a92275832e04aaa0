"""Tokenizers (chapter 11): word-level with special tokens, byte-level BPE, and BPE against Hugging Face."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib.tokenizers import BPETokenizer, WordTokenizer, bytes_to_unicode
from attnlib.tokenizers.word import BOS_ID, EOS_ID, PAD_ID, UNK_ID

CORPUS = "The cat sat on the mat. The dog sat on the log! A cat, a dog: the end."


# --- WordTokenizer -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def words():
    return WordTokenizer.from_corpus(CORPUS)


def test_special_token_ids_are_fixed(words):
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert words.itos[:4] == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert words.stoi["the"] == 4  # the most frequent word comes first


def test_split_words_and_punctuation():
    assert WordTokenizer.split("Hi, you!  ok") == ["Hi", ",", "you", "!", "ok"]
    assert WordTokenizer.split("") == []


def test_encode_adds_bos_eos_and_decode_round_trips(words):
    ids = words.encode("the cat sat on the mat.")
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID
    assert words.decode(ids) == "the cat sat on the mat ."
    assert words.decode(ids, skip_special_tokens=False) == "<bos> the cat sat on the mat . <eos>"
    assert words.encode("the cat", add_special_tokens=False) == [words.stoi["the"], words.stoi["cat"]]


def test_unknown_words_become_unk(words):
    ids = words.encode("the zebra sat", add_special_tokens=False)
    assert ids == [words.stoi["the"], UNK_ID, words.stoi["sat"]]
    assert words.decode(ids) == "the <unk> sat"


def test_empty_string(words):
    assert words.encode("") == [BOS_ID, EOS_ID]
    assert words.encode("", add_special_tokens=False) == []
    assert words.decode([]) == ""
    assert words.decode(words.encode("")) == ""


def test_truncation_keeps_bos_and_eos(words):
    ids = words.encode("the cat sat on the mat", max_length=4)
    assert ids == [BOS_ID, words.stoi["the"], words.stoi["cat"], EOS_ID]
    assert words.encode("the cat sat", add_special_tokens=False, max_length=2) == [words.stoi["the"], words.stoi["cat"]]
    assert len(words.encode("the cat", max_length=10)) == 4
    with pytest.raises(ValueError, match="max_length=1"):
        words.encode("the cat", max_length=1)
    with pytest.raises(TypeError):
        words.encode("the cat", max_length=2.5)


def test_min_freq_and_max_size():
    tok = WordTokenizer.from_corpus(CORPUS, min_freq=2)
    assert "the" in tok.stoi and "mat" not in tok.stoi
    tok = WordTokenizer.from_corpus([CORPUS, "zebra"], max_size=6)
    assert tok.vocab_size == 6 and tok.itos[4:] == ["the", "."]
    with pytest.raises(ValueError, match="max_size"):
        WordTokenizer.from_corpus(CORPUS, max_size=3)
    with pytest.raises(ValueError, match="min_freq"):
        WordTokenizer.from_corpus(CORPUS, min_freq=0)


def test_decode_rejects_invalid_ids(words):
    with pytest.raises(ValueError, match="id 999"):
        words.decode([4, 999])
    with pytest.raises(ValueError, match="id -1"):
        words.decode([-1])
    with pytest.raises(TypeError):
        words.encode(123)
    assert words.decode(torch.tensor(words.encode("the cat"))) == "the cat"


def test_pad_batch(words):
    batch = [words.encode(s) for s in ["the cat sat", "a dog", ""]]
    ids, mask = words.pad_batch(batch)
    assert ids.dtype == torch.long and mask.dtype == torch.bool
    assert ids.shape == mask.shape == (3, 5)
    assert mask.sum(1).tolist() == [5, 4, 2]
    assert (ids[~mask] == PAD_ID).all()
    assert ids[1].tolist() == [*batch[1], PAD_ID]
    ids, mask = words.pad_batch(batch, max_length=3)
    assert ids.shape == (3, 3) and mask.sum(1).tolist() == [3, 3, 2]
    with pytest.raises(ValueError, match="empty batch"):
        words.pad_batch([])
    with pytest.raises(TypeError, match=r"batch\[0\]"):
        words.pad_batch(["abc"])


# --- BPETokenizer --------------------------------------------------------------------------------

def test_bpe_textbook_example():
    # The example of the BPE literature: aa -> Z, ab -> Y, ZY -> X turns "aaabdaaabac" into "XdXac".
    tok = BPETokenizer().train("aaabdaaabac", vocab_size=259)
    a, b, c, d = (ord(ch) for ch in "abcd")
    Z, Y, X = 256, 257, 258
    assert tok.merges == [((a, a), Z), ((a, b), Y), ((Z, Y), X)]
    assert tok.encode("aaabdaaabac") == [X, d, X, a, c]
    assert tok.vocab[X] == b"aaab"
    assert tok.decode([X, d, X, a, c]) == "aaabdaaabac"


def test_bpe_ties_pick_the_smallest_pair():
    # after aa -> Z, the pairs (Z, a) and (a, b) both occur twice: (97, 98) < (256, 97) wins
    tok = BPETokenizer().train("aaabdaaabac", vocab_size=258)
    assert tok.merges[1] == ((97, 98), 257)


def test_bpe_counts_overlapping_pairs_and_stops_without_repeats():
    tok = BPETokenizer().train("aaaaaaaa", vocab_size=300)  # aa x4, then (aa aa) x2
    assert tok.merges == [((97, 97), 256), ((256, 256), 257)]  # then (W, W) occurs once: stop
    assert tok.encode("aaaaa") == [257, 97]


@pytest.fixture(scope="module")
def small_bpe():
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé — 日本語 テキスト 😀😀 " * 5
    return BPETokenizer().train(text, vocab_size=300)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_bpe_round_trip_any_unicode(small_bpe, s):
    ids = small_bpe.encode(s)
    assert all(i in small_bpe.vocab for i in ids)
    assert small_bpe.decode(ids) == s


def test_bpe_empty_and_errors(small_bpe):
    assert small_bpe.encode("") == []
    assert small_bpe.decode([]) == ""
    with pytest.raises(ValueError, match="id 300"):
        small_bpe.decode([65, 300])
    with pytest.raises(ValueError, match="id -1"):
        small_bpe.decode([-1])
    with pytest.raises(TypeError):
        small_bpe.encode(b"bytes")
    with pytest.raises(ValueError, match="vocab_size=100"):
        BPETokenizer().train("abc", vocab_size=100)


def test_bpe_decode_replaces_invalid_utf8():
    tok = BPETokenizer()
    e_acute = "é".encode()  # two bytes
    assert tok.decode([e_acute[0]]) == "\ufffd"
    assert tok.decode(list(e_acute)) == "é"


def test_bpe_save_load_round_trip(small_bpe, tmp_path):
    path = tmp_path / "bpe.json"
    small_bpe.save(path)
    loaded = BPETokenizer.load(path)
    assert loaded.merges == small_bpe.merges and loaded.vocab == small_bpe.vocab
    s = "the lazy fox — 日本"
    assert loaded.encode(s) == small_bpe.encode(s)


def test_bpe_load_rejects_other_json(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="attnlib-bpe"):
        BPETokenizer.load(path)


def test_bpe_encode_of_training_text_matches_training():
    # encoding the training text by merge rank gives the sequence the training ended with
    text = "low lower lowest newer newest wider " * 20
    tok = BPETokenizer().train(text, vocab_size=280)
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) / 4
    assert tok.decode(ids) == text


def test_bytes_to_unicode_is_a_bijection():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256 and table[ord(" ")] == "Ġ" and table[ord("A")] == "A"


# --- outside reference: Hugging Face tokenizers --------------------------------------------------

