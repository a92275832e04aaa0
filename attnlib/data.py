"""Tiny Shakespeare: finding it, checking it, and cutting it into training batches (chapter 12).

Where :func:`load_tiny_shakespeare` looks, in order:

1. the ``data_dir`` argument;
2. the directory in the environment variable ``ATTNLIB_DATA_DIR``;
3. the cache directory: ``ATTNLIB_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnlib``, else ``~/.cache/attnlib``;
4. otherwise it downloads the file from :data:`TINY_SHAKESPEARE_URL` into the cache.

Every file is checked against :data:`TINY_SHAKESPEARE_SHA256` before use.
"""
from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from attnlib._checks import generator_or_none, positive_int
from attnlib._device import check_device
from attnlib.tokenizers.char import CharTokenizer

__all__ = [
    "TINY_SHAKESPEARE_URL",
    "TINY_SHAKESPEARE_SHA256",
    "DataNotFoundError",
    "ChecksumError",
    "CharTokenizer",
    "CharCorpus",
    "cache_dir",
    "load_tiny_shakespeare",
    "load_char_corpus",
    "train_val_split",
    "get_batch",
    "token_tensor",
]

FILENAME = "tinyshakespeare.txt"
TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


class DataNotFoundError(FileNotFoundError):
    """The data file is in none of the places searched and could not be downloaded."""


class ChecksumError(ValueError):
    """A data file's sha256 differs from the expected one (a truncated or altered file)."""


def cache_dir() -> Path:
    """The directory where downloaded data is kept (see the module docstring)."""
    if os.environ.get("ATTNLIB_CACHE_DIR"):
        return Path(os.environ["ATTNLIB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnlib"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_verified(path: Path) -> str:
    data = path.read_bytes()
    digest = _sha256(data)
    if digest != TINY_SHAKESPEARE_SHA256:
        raise ChecksumError(
            f"{path} has sha256 {digest}, expected {TINY_SHAKESPEARE_SHA256}: the file is damaged or not "
            f"Tiny Shakespeare. Delete it and load again to re-download it, or replace it with the file from "
            f"{TINY_SHAKESPEARE_URL}"
        )
    return data.decode("utf-8")


def load_tiny_shakespeare(data_dir: str | os.PathLike | None = None, download: bool = True) -> str:
    """The Tiny Shakespeare text (1,115,394 characters), verified by sha256.

    Args:
        data_dir: a directory holding ``tinyshakespeare.txt``; searched first.
        download: whether to fetch the file into the cache when it is found nowhere.

    Returns:
        The whole text as a ``str``.

    Raises:
        TypeError: ``data_dir`` is not a str / PathLike / None, or ``download`` not a bool.
        ChecksumError: a file was found (or downloaded) but its sha256 is wrong (a file that is
            not the text, binary or not, fails here).
        DataNotFoundError: no file found and the download was disabled or failed;
            the message lists where it looked and how to fix it.
    """
    if data_dir is not None and not isinstance(data_dir, (str, os.PathLike)):
        raise TypeError(f"data_dir must be a str, an os.PathLike or None; got {data_dir!r} ({type(data_dir).__name__})")
    if not isinstance(download, bool):
        raise TypeError(f"download must be a bool; got {download!r} ({type(download).__name__})")
    candidates: list[tuple[str, Path]] = []
    if data_dir is not None:
        candidates.append(("data_dir argument", Path(data_dir) / FILENAME))
    if os.environ.get("ATTNLIB_DATA_DIR"):
        candidates.append(("ATTNLIB_DATA_DIR", Path(os.environ["ATTNLIB_DATA_DIR"]) / FILENAME))
    cached = cache_dir() / FILENAME
    candidates.append(("cache", cached))
    for _, path in candidates:
        if path.is_file():
            return _read_verified(path)

    looked = "\n".join(f"  - {path} ({where})" for where, path in candidates)
    fix = (
        f"Fix: set ATTNLIB_DATA_DIR to a directory holding {FILENAME}, or download\n  {TINY_SHAKESPEARE_URL}\n"
        f"to {cached}"
    )
    if not download:
        raise DataNotFoundError(f"Tiny Shakespeare not found (download=False). Looked in:\n{looked}\n{fix}")
    try:
        with urllib.request.urlopen(TINY_SHAKESPEARE_URL, timeout=30) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as e:
        raise DataNotFoundError(
            f"Tiny Shakespeare not found and the download failed ({e}). Looked in:\n{looked}\n{fix}"
        ) from e
    digest = _sha256(data)
    if digest != TINY_SHAKESPEARE_SHA256:
        raise ChecksumError(
            f"the download from {TINY_SHAKESPEARE_URL} has sha256 {digest}, expected {TINY_SHAKESPEARE_SHA256}; "
            f"nothing was saved. {fix}"
        )
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(cached)  # atomic: a half-written file is never found later
    return data.decode("utf-8")


def _check_fraction(train_fraction: object) -> None:
    if isinstance(train_fraction, bool) or not isinstance(train_fraction, (int, float)):
        raise TypeError(f"train_fraction must be a float in (0, 1); got {train_fraction!r} ({type(train_fraction).__name__})")
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction={train_fraction} must be in (0, 1)")


def token_tensor(name: str, data: object) -> None:
    """Raise ``TypeError`` naming ``name`` unless ``data`` is a tensor of integer token ids (a corpus, 1-D)."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D torch.Tensor of token ids; got {type(data).__name__}")
    if data.dtype == torch.bool or data.is_floating_point() or data.is_complex():
        raise TypeError(f"{name} must hold integer token ids (e.g. torch.long); got dtype {data.dtype}")


def train_val_split(data: torch.Tensor, train_fraction: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D token tensor into its first ``train_fraction`` (train) and the rest (validation).

    The split is by position, not shuffled, so validation text is text the model never saw.

    Raises:
        TypeError: ``data`` is not an integer tensor, or ``train_fraction`` not a number.
        ValueError: ``train_fraction`` not in (0, 1), or ``data`` not 1-D.
    """
    _check_fraction(train_fraction)
    token_tensor("data", data)
    if data.dim() != 1:
        raise ValueError(f"data must be a 1-D tensor of token ids; got shape {tuple(data.shape)}")
    n = int(train_fraction * len(data))
    return data[:n], data[n:]


def get_batch(
    data: torch.Tensor,
    batch_size: int,
    block_size: int,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``batch_size`` random windows of ``block_size`` tokens, and the same windows shifted by one.

    Args:
        data: 1-D int64 token ids, longer than ``block_size``.
        batch_size, block_size: batch shape.
        generator: a CPU ``torch.Generator`` so the data order is reproducible.
        device: where to put the batch.

    Returns:
        ``(x, y)``, each ``(batch_size, block_size)`` int64; ``y[b, t] == data[start_b + t + 1]``.

    Raises:
        TypeError: ``data`` not an integer tensor, a size not an int, ``generator`` not a
            ``torch.Generator``, ``device`` not a str / ``torch.device``.
        ValueError: sizes < 1, ``data`` not 1-D or too short for one window, or a ``device``
            this machine lacks (e.g. ``"cuda"`` without CUDA).
    """
    token_tensor("data", data)
    positive_int("batch_size", batch_size)
    positive_int("block_size", block_size)
    generator_or_none(generator)
    if device is not None:
        check_device("device", device)
    if data.dim() != 1 or len(data) <= block_size:
        raise ValueError(f"data must be 1-D and longer than block_size={block_size}; got shape {tuple(data.shape)}")
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    offsets = torch.arange(block_size)
    x = data[starts[:, None] + offsets]  # (batch_size, block_size)
    y = data[starts[:, None] + offsets + 1]
    return x.to(device), y.to(device)


@dataclass
class CharCorpus:
    """A text tokenized by characters, with its 90/10 train/validation split."""

    text: str
    tokenizer: CharTokenizer
    train: torch.Tensor
    val: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def load_char_corpus(data_dir: str | os.PathLike | None = None, train_fraction: float = 0.9) -> CharCorpus:
    """Tiny Shakespeare, character-tokenized (65 ids) and split 90/10: the data of chapter 12.

    Raises:
        TypeError, ValueError: a bad ``train_fraction`` (checked before the text is looked for) or ``data_dir``.
        ChecksumError, DataNotFoundError: see :func:`load_tiny_shakespeare`.
    """
    _check_fraction(train_fraction)
    text = load_tiny_shakespeare(data_dir)
    tokenizer = CharTokenizer(text)
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    train, val = train_val_split(ids, train_fraction)
    return CharCorpus(text, tokenizer, train, val)
