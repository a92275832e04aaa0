"""Argument checks shared by the library: bad input fails early, naming the value."""
from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Container, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def positive_int(name: str, value: object) -> None:
    """Raise TypeError unless ``value`` is an int, ValueError unless it is positive."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name}={value} must be a positive integer")


def probability(name: str, value: object) -> None:
    """Raise unless ``value`` is a float in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float; got {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value} must be in [0, 1)")


def divisible(name: str, value: int, by_name: str, by: int) -> None:
    """Raise ValueError unless ``by`` divides ``value``."""
    if value % by:
        raise ValueError(f"{name}={value} is not divisible by {by_name}={by}")


def float_input(x: object, d_model: int, block_size: int | None = None, width: str = "d_model") -> None:
    """Raise unless ``x`` is a float tensor of shape ``(..., T, d_model)`` with ``T <= block_size``
    (``width``: what the last dimension is called in the message, e.g. ``"head_dim"``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor of shape (B, T, {width}); got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"expected a floating point input; got dtype {x.dtype}")
    if x.dim() < 2 or x.shape[-1] != d_model:
        raise ValueError(f"expected input of shape (..., T, {width}={d_model}); got {tuple(x.shape)}")
    if block_size is not None and x.shape[-2] > block_size:
        raise ValueError(f"sequence length T={x.shape[-2]} exceeds block_size={block_size}")


def finite_number(name: str, value: object, *, minimum: float | None = None, above: float | None = None) -> float:
    """Return ``value`` as a float; TypeError unless it is a real number (not a bool),
    ValueError if it is nan/inf, below ``minimum``, or not above ``above``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number; got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name}={value} must be a finite number")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    if above is not None and value <= above:
        raise ValueError(f"{name}={value!r} must be a finite number > {above:g}")
    return float(value)


def non_negative_int(name: str, value: object) -> int:
    """Return ``value``; TypeError unless it is an int (not a bool), ValueError if it is negative."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{name}={value} must be an int >= 0")
    return value


def batch_rows(index: object, n_rows: int | None) -> torch.Tensor:
    """Check ``index``, rows of a batch of ``n_rows`` to keep (beam search's reorder); return it.

    Raises:
        TypeError: not an integer tensor. ValueError: not 1-D, or a row outside ``[0, n_rows)``.
    """
    if not isinstance(index, torch.Tensor) or index.dtype == torch.bool or index.is_floating_point() \
            or index.is_complex():
        raise TypeError(f"index must be a 1-D integer tensor of batch rows; got {getattr(index, 'dtype', type(index).__name__)}")
    if index.dim() != 1 or (n_rows is not None and index.numel() and index.device.type != "meta"
                            and not bool(((index >= 0) & (index < n_rows)).all())):
        raise ValueError(f"index must be a 1-D tensor of rows of the cached batch of {n_rows}; got {index.tolist()}")
    return index


def _integer_dtype(name: str, ids: torch.Tensor) -> None:
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{name} must hold integer token ids (e.g. torch.long); got dtype {ids.dtype}")


def _bad_id(name: str, value: object, vocab_size: int, where: str = "") -> ValueError:
    return ValueError(f"{name} holds token id {value!r}, outside the vocabulary [0, {vocab_size}){where}")


def token_ids(
    name: str, ids: object, vocab_size: int, *, ndim: int | None = 2, ignore_index: int | None = None
) -> torch.Tensor:
    """Check a tensor of token ids and return it as int64 (the dtype ``nn.Embedding`` and ``cross_entropy`` want).

    The one token-id check of the library: :class:`attnlib.GPT`, :class:`attnlib.Transformer`,
    generation and the tokenizers use it.

    Args:
        name: the argument's name, for the messages.
        ids: a tensor of any integer dtype (int64, int32, int16, int8, uint8, ...).
        vocab_size: ids must lie in ``[0, vocab_size)``.
        ndim: the number of dimensions required (``2`` = ``(B, T)``), or ``None`` for any.
        ignore_index: a value allowed besides the ids (a loss's ignored target), or ``None``.

    Returns:
        ``ids`` itself if it is int64, else an int64 copy.

    Raises:
        TypeError: not a tensor, or a bool / floating / complex dtype (the dtype is named).
        ValueError: the wrong number of dimensions, or an id outside the vocabulary (the first one is named).
    """
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids; got {type(ids).__name__}")
    _integer_dtype(name, ids)
    if ndim is not None and ids.dim() != ndim:
        shape = "(B, T)" if ndim == 2 else f"{ndim} dimensions"
        raise ValueError(f"{name} must have shape {shape}; got {tuple(ids.shape)}")
    if ids.device.type != "meta" and ids.numel():
        bad = (ids < 0) | (ids >= vocab_size)
        if ignore_index is not None:
            bad &= ids != ignore_index
        if bad.any():
            position = tuple(bad.nonzero()[0].tolist())
            raise _bad_id(name, ids[position].item(), vocab_size, f" (at index {position})")
    return ids if ids.dtype == torch.long else ids.long()


def token_id_list(name: str, ids: object, vocab: int | Container[int]) -> list[int]:
    """Check a sequence of token ids (a list of ints or a 1-D integer tensor) and return it as a list.

    Args:
        name: the argument's name, for the messages.
        ids: ints (Python or numpy integers), or a 1-D tensor of an integer dtype.
        vocab: the vocabulary size (ids in ``[0, vocab)``) or the set of valid ids.

    Raises:
        TypeError: a str/bytes, a bool/float tensor, or an element that is not an integer.
        ValueError: a tensor that is not 1-D, or an id outside the vocabulary (named).
    """
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of ints; got {type(ids).__name__}")
    if isinstance(ids, torch.Tensor):
        _integer_dtype(name, ids)
        if ids.dim() != 1:
            raise ValueError(f"{name} must be a 1-D tensor; got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    elif isinstance(ids, Iterable):
        ids = list(ids)
    else:
        raise TypeError(f"{name} must be a sequence of ints; got {type(ids).__name__}")
    out = []
    for i, value in enumerate(ids):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}[{i}]={value!r} is not an integer token id ({type(value).__name__})")
        value = int(value)
        ok = 0 <= value < vocab if isinstance(vocab, int) else value in vocab
        if not ok:
            size = vocab if isinstance(vocab, int) else len(vocab)  # type: ignore[arg-type]
            if isinstance(vocab, int):
                raise _bad_id(name, value, size, f" (at index {i})")
            raise ValueError(f"{name} holds token id {value}, not in the vocabulary of {size} tokens (at index {i})")
        out.append(value)
    return out


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """``with eval_mode(model):`` runs the body in eval mode (no dropout), then restores every
    submodule's own training flag (even if some were in eval mode before), also after an exception.

    The one mode switch of generation, beam search and :func:`attnlib.train.estimate_loss`.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"eval_mode needs an nn.Module; got {type(module).__name__}")
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in modes:
            m.training = training


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy (nats per counted target) of ``logits`` ``(..., vocab_size)`` against ``targets`` ``(...)``.

    Targets equal to ``ignore_index`` are left out. Unlike ``F.cross_entropy``, which returns
    ``nan`` (0 / 0) when every target is ignored, this returns ``0.0`` then, with zero gradients:
    nothing to predict, nothing to learn (computed without a host sync, so a training step stays asynchronous).

    Raises:
        ValueError: ``targets``' shape is not ``logits``' without the last dimension.
    """
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets of shape {tuple(targets.shape)} do not match logits of shape {tuple(logits.shape)} "
            f"(expected {tuple(logits.shape[:-1])})"
        )
    flat = targets.reshape(-1)
    total = F.cross_entropy(logits.reshape(flat.numel(), logits.shape[-1]), flat, ignore_index=ignore_index, reduction="sum")
    counted = (flat != ignore_index).sum().clamp(min=1)  # every target ignored: 0 / 1, not 0 / 0
    return total / counted


def generator_or_none(generator: object) -> None:
    """Raise TypeError unless ``generator`` is a ``torch.Generator`` or ``None`` (sampling's random numbers)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None; got {type(generator).__name__}")


def weight_tensors(state: object, ignore: tuple[str, ...] = ()) -> None:
    """Refuse a state dict (a mapping of names to tensors) whose weights a float model cannot take as they are.

    Every entry whose name does not end with one of ``ignore`` (buffers such as masks) must be a floating point
    tensor with values: an integer or bool tensor would be cast silently (an int8 checkpoint is quantised: its
    scales live elsewhere), a meta tensor has no values.

    Raises:
        TypeError: not a mapping; an entry that is not a tensor, or not floating point (named, with its dtype).
        ValueError: an entry on the meta device (named).
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"expected a state dict (a mapping of names to tensors); got {type(state).__name__}")
    for key, value in state.items():
        if isinstance(key, str) and key.endswith(ignore):
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"the state dict's {key!r} is a {type(value).__name__}; expected a torch.Tensor")
        if not value.is_floating_point():
            raise TypeError(f"the state dict's {key!r} has dtype {value.dtype}; expected floating point weights "
                            "(a quantised checkpoint must be dequantised first)")
        if value.device.type == "meta":
            raise ValueError(f"the state dict's {key!r} is on the meta device (no values): load the weights first")


def file_path(name: str, path: object) -> Path:
    """``path`` as a ``Path``; ``TypeError`` naming ``name`` unless it is a str or an ``os.PathLike``."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike; got {path!r} ({type(path).__name__})")
    return Path(path)


def read_json(path: Path, refusal: str) -> object:
    """The JSON value in the file at ``path``; a file that is not UTF-8 JSON is refused with ``refusal`` (which
    names the file and what it should have been) followed by what is wrong.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not UTF-8 text, or invalid JSON (with json's line and column).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{refusal}not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{refusal}invalid JSON ({e})") from None
