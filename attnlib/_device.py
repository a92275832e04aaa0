from __future__ import annotations

import os

import torch

_KINDS = "cpu, cuda, cuda:N or mps"


def check_device(name: str, value: object) -> torch.device:
    """``value`` (a str such as ``"cuda:1"`` or a ``torch.device``) as a ``torch.device`` this machine has.

    Raises:
        TypeError: ``value`` is neither a str nor a ``torch.device``.
        ValueError: it names no device, a kind attnlib does not run on (only cpu, cuda and mps),
            or a device this machine lacks (CUDA or MPS not available, a CUDA index out of range).
    """
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"{name} must be a str or a torch.device ({_KINDS}); got {value!r} ({type(value).__name__})")
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(f"{name}={value!r} is not a torch device (expected {_KINDS})") from None
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{name}={value!r}: attnlib runs on cpu, cuda or mps")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}={value!r}: this machine has no CUDA device")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{name}={value!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()):
        raise ValueError(f"{name}={value!r}: MPS is not available on this machine")
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
