"""attnlib.data: finding and verifying Tiny Shakespeare (never over the network here), tokenizing, batching."""
import io
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from attnlib import data
from attnlib.data import (
    CharTokenizer,
    ChecksumError,
    DataNotFoundError,
    get_batch,
    load_char_corpus,
    load_tiny_shakespeare,
    train_val_split,
)


@pytest.fixture
def real_file() -> Path:
    """The real data file, from ATTNLIB_DATA_DIR (CI sets it to ../shared/data)."""
    directory = os.environ.get("ATTNLIB_DATA_DIR")
    if not directory or not (Path(directory) / data.FILENAME).is_file():
        pytest.skip("ATTNLIB_DATA_DIR does not hold tinyshakespeare.txt")
    return Path(directory) / data.FILENAME


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No data dir, an empty cache, and a network that fails if anything tries it."""
    monkeypatch.delenv("ATTNLIB_DATA_DIR", raising=False)
    monkeypatch.setenv("ATTNLIB_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def no_network(url, timeout=None):
        calls.append(url)
        raise urllib.error.URLError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    return calls


def test_loads_and_verifies_the_real_file(real_file):
    text = load_tiny_shakespeare()
    assert len(text) == 1_115_394
    assert text.startswith("First Citizen:")


def test_missing_file_offline_says_where_it_looked(offline, tmp_path):
    with pytest.raises(DataNotFoundError) as e:
        load_tiny_shakespeare(data_dir=tmp_path / "nowhere")
    message = str(e.value)
    assert str(tmp_path / "nowhere" / "tinyshakespeare.txt") in message
    assert str(tmp_path / "cache" / "tinyshakespeare.txt") in message
    assert "ATTNLIB_DATA_DIR" in message and data.TINY_SHAKESPEARE_URL in message
    assert offline == [data.TINY_SHAKESPEARE_URL]


def test_download_false_never_touches_the_network(offline):
    with pytest.raises(DataNotFoundError, match="download=False"):
        load_tiny_shakespeare(download=False)
    assert offline == []


def test_corrupt_file_gives_a_checksum_error(offline, tmp_path):
    (tmp_path / "tinyshakespeare.txt").write_text("To be, or not to be")
    with pytest.raises(ChecksumError, match="sha256") as e:
        load_tiny_shakespeare(data_dir=tmp_path)
    assert "Delete it" in str(e.value)


def test_download_is_verified_and_cached(real_file, offline, monkeypatch, tmp_path):
    payload = real_file.read_bytes()
    calls = []

    def fake_urlopen(url, timeout=None):
        calls.append(url)
        return io.BytesIO(payload)

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    assert len(load_tiny_shakespeare()) == 1_115_394
    assert (tmp_path / "cache" / "tinyshakespeare.txt").read_bytes() == payload
    load_tiny_shakespeare()  # now served from the cache
    assert calls == [data.TINY_SHAKESPEARE_URL]


def test_a_bad_download_is_rejected_and_not_saved(offline, monkeypatch, tmp_path):
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout=None: io.BytesIO(b"<html>rate limited</html>"))
    with pytest.raises(ChecksumError, match="nothing was saved"):
        load_tiny_shakespeare()
    assert not (tmp_path / "cache" / "tinyshakespeare.txt").exists()


def test_char_corpus_has_65_characters_and_a_90_10_split(real_file):
    corpus = load_char_corpus()
    assert corpus.vocab_size == 65
    assert len(corpus.train) == int(0.9 * 1_115_394) and len(corpus.train) + len(corpus.val) == 1_115_394
    assert corpus.tokenizer.decode(corpus.train[:14]) == "First Citizen:"


def test_char_tokenizer_round_trip_and_errors():
    tok = CharTokenizer("hello world")
    assert tok.vocab_size == 8 and tok.chars == sorted(set("hello world"))
    assert tok.decode(tok.encode("low held")) == "low held"
    assert tok.decode(torch.tensor(tok.encode("old"))) == "old"
    assert tok.encode("") == [] and tok.decode([]) == ""
    with pytest.raises(ValueError, match="character 'z' is not in the vocabulary"):
        tok.encode("zoo")
    with pytest.raises(ValueError, match=r"token id 8, outside the vocabulary \[0, 8\)"):
        tok.decode([1, 8])
    with pytest.raises(ValueError, match="empty text"):
        CharTokenizer("")


def test_split_and_batches():
    ids = torch.arange(1000)
    train, val = train_val_split(ids)
    assert torch.equal(train, ids[:900]) and torch.equal(val, ids[900:])
    x, y = get_batch(train, 8, 16, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.long
    assert torch.equal(y, x + 1)  # targets are the inputs shifted by one position
    x2, _ = get_batch(train, 8, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)
    with pytest.raises(ValueError, match="train_fraction=1.5"):
        train_val_split(ids, 1.5)
    with pytest.raises(ValueError, match="longer than block_size=16"):
        get_batch(ids[:10], 2, 16)
    with pytest.raises(ValueError, match="batch_size=0"):
        get_batch(ids, 0, 16)
