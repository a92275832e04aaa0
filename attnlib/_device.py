from __future__ import annotations

import os

import torch

_KINDS = "cpu, cuda, cuda:N or mps"


def check_device(name: str | None, value: object, *, available: bool = True) -> torch.device:
    """``value`` (a str such as ``"cuda:1"`` or a ``torch.device``) as a ``torch.device`` this machine has.

    The one device check of the library and its command lines. ``name`` starts the messages
    (``name='gpu' ...``; ``None``: the value alone, for argparse, which names the flag itself).
    ``available=False`` checks only that it names a kind attnlib runs on (a config made on one machine
    for another).

    Raises:
        TypeError: ``value`` is neither a str nor a ``torch.device``.
        ValueError: it names no device, a kind attnlib does not run on (only cpu, cuda and mps),
            or (``available``) a device this machine lacks (CUDA or MPS not available, a CUDA index out of range).
    """
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"{name or 'device'} must be a str or a torch.device ({_KINDS}); got {value!r} "
                        f"({type(value).__name__})")
    said = repr(value) if name is None else f"{name}={value!r}"
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(f"{said} is not a torch device (expected {_KINDS})") from None
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{said}: attnlib runs on cpu, cuda or mps")
    if not available:
        return dev
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{said}: this machine has no CUDA device")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{said}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()):
        raise ValueError(f"{said}: MPS is not available on this machine")
    return dev


def device() -> torch.device:
    """The device heavy work should use: ``ATTNLIB_DEVICE`` if set, else CUDA, else Apple MPS, else CPU.

    The notebooks keep small examples on the CPU (their printed values must not
    depend on the machine) and send only training and benchmarks here.

    Raises:
        ValueError: ``ATTNLIB_DEVICE`` names no device (e.g. ``"gpu"``), a kind attnlib does not run on,
            or one this machine lacks (``"cuda"`` without CUDA); the message names the variable and its value.
    """
    if os.environ.get("ATTNLIB_DEVICE"):
        return check_device("ATTNLIB_DEVICE", os.environ["ATTNLIB_DEVICE"])
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")
