from __future__ import annotations

import os

import torch


def device() -> torch.device:
    """The device heavy work should use: ``ATTNLIB_DEVICE`` if set, else CUDA, else Apple MPS, else CPU.

    The notebooks keep small examples on the CPU (their printed values must not
    depend on the machine) and send only training and benchmarks here.
    """
    if os.environ.get("ATTNLIB_DEVICE"):
        return torch.device(os.environ["ATTNLIB_DEVICE"])
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")
