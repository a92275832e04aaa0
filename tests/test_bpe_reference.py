"""attnlib's byte-level BPE against Hugging Face ``tokenizers`` (an outside reference), on a corpus built here.

Always runs: no data file, no download. The corpus is generated from a fixed seed: English-like
sentences with punctuation, digits, newlines and multi-byte characters, so merges cross every
kind of byte. Issue 11, part 5.
"""
import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from attnlib.tokenizers import BPETokenizer

WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but "
    "what all were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very after words called just "
    "where most know attention heads queries keys values softmax transformer token café naïve Ünïcödé 日本語 😀"
).split()


def build_corpus(n_sentences: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    sentences = []
    for _ in range(n_sentences):
        words = rng.choices(WORDS, k=rng.randint(3, 14))
        words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2026)))
        sentence = " ".join(words) + rng.choice([".", ".", ".", "?", "!", ",", ";"])
        sentences.append(sentence + ("\n" if rng.random() < 0.15 else " "))
    return "".join(sentences)


def hf_byte_level_bpe(text: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained by Hugging Face with no pre-tokenizer regex: the same model attnlib trains."""
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    hf.train_from_iterator([text], trainer)
    return hf


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(600)


@pytest.fixture(scope="module")
def hf(corpus):
    return hf_byte_level_bpe(corpus[:20_000], vocab_size=400)


def test_corpus_is_built_not_read(corpus):
    assert corpus == build_corpus(600) and len(corpus) > 20_000
    assert any(ord(c) > 0xFFFF for c in corpus) and "\n" in corpus  # 4-byte characters and newlines


def test_from_hf_encodes_to_the_same_ids(corpus, hf):
    ours = BPETokenizer.from_hf(hf)
    assert ours.vocab_size == hf.get_vocab_size() == 400
    expected = hf.encode(corpus).ids
    assert ours.encode(corpus) == expected
    assert ours.decode(expected) == hf.decode(expected) == corpus
    for s in ["Ünïcödé 日本語 😀, not in the corpus", "", " ", "\n\n", "zzzz qqqq 12345", "😀😀😀"]:
        assert ours.encode(s) == hf.encode(s).ids, s


def test_from_hf_accepts_the_json_dict(corpus, hf):
    ours = BPETokenizer.from_hf(json.loads(hf.to_str()))
    assert ours.encode(corpus[:10_000]) == hf.encode(corpus[:10_000]).ids


def test_own_training_agrees_with_hf_training(corpus, hf):
    """Same pair counts; ties may be broken differently (HF orders its alphabet by character, not byte),
    so the first merges must agree and nearly all merges must be shared."""
    ours = BPETokenizer().train(corpus[:20_000], vocab_size=400)
    theirs = BPETokenizer.from_hf(hf)
    as_bytes = lambda tok: [(tok.vocab[a], tok.vocab[b]) for (a, b), _ in tok.merges]  # noqa: E731
    ours_m, hf_m = as_bytes(ours), as_bytes(theirs)
    same_prefix = next((i for i, (x, y) in enumerate(zip(ours_m, hf_m)) if x != y), len(ours_m))
    shared = len(set(ours_m) & set(hf_m))
    print(f"first {same_prefix} of {len(ours_m)} merges identical; {shared} shared in all")
    assert same_prefix >= 50
    assert shared >= 0.9 * len(ours_m)
