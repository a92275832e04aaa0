"""`History`: what a training run measured (losses at each evaluation, speed), with a plot and JSON.

Chapter 12 plots it; :func:`attnlib.train.train` returns it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from attnlib._checks import file_path, read_json

__all__ = ["History"]


@dataclass
class History:
    """What a training run measured: losses at each evaluation, time and throughput.

    Attributes:
        steps: the step of each evaluation.
        train_loss, val_loss: mean cross-entropy (nats per token) at those steps.
        step_loss: the training loss of every optimizer step (the whole batch's mean,
            across processes when distributed).
        elapsed_s: wall-clock seconds of the whole run, evaluations included.
        tokens_per_s: training tokens processed per second (evaluations excluded).
    """

    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    step_loss: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0

    def plot(self, ax=None, label: str | None = None):
        """Loss curves on a matplotlib Axes (made if not given); returns the Axes.

        Raises:
            ImportError: matplotlib is missing (it comes with ``pip install "attnlib[book]"``).
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError('History.plot needs matplotlib: pip install "attnlib[book]"') from e

        if ax is None:
            _, ax = plt.subplots(figsize=(6, 3.5))
        prefix = f"{label}: " if label else ""
        ax.plot(self.steps, self.train_loss, label=f"{prefix}train")
        ax.plot(self.steps, self.val_loss, label=f"{prefix}val", linestyle="--")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.legend()
        ax.grid(alpha=0.3)
        return ax

    def to_json(self, path: str | Path) -> None:
        """Write the history to ``path`` as JSON.

        Raises:
            TypeError: ``path`` is not a str / PathLike.
        """
        file_path("path", path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def from_json(cls, path: str | Path) -> History:
        """Read a history written by :meth:`to_json`.

        Raises:
            TypeError: ``path`` is not a str / PathLike.
            FileNotFoundError: no file at ``path``.
            ValueError: the file is not a history (the message names the path and what is wrong): not UTF-8
                text, invalid JSON (with json's line and column), not an object, a missing or unknown key, a value of the
                wrong type (``steps`` a list of ints, the losses lists of numbers, the times numbers), or
                ``steps``, ``train_loss`` and ``val_loss`` of different lengths.
        """
        path = file_path("path", path)
        data = read_json(path, f"{path} is not a history: ")
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a history: it holds a JSON {type(data).__name__}, expected an object "
                             f"with the keys {', '.join(_FIELDS)}")
        for key, value in data.items():
            if key not in _FIELDS:
                raise ValueError(f"{path} is not a history: unknown key {key!r} (expected {', '.join(_FIELDS)})")
            if not _FIELDS[key](value):
                expected = "a number" if key in ("elapsed_s", "tokens_per_s") else \
                    "a list of ints" if key == "steps" else "a list of numbers"
                raise ValueError(f"{path}: {key!r} is {_short(value)}, expected {expected}")
        missing = [key for key in _FIELDS if key not in data]
        if missing:
            raise ValueError(f"{path} is not a history: it lacks the key {missing[0]!r} "
                             f"(a history written by to_json has {', '.join(_FIELDS)})")
        lengths = {key: len(data[key]) for key in ("steps", "train_loss", "val_loss")}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"{path}: steps, train_loss and val_loss must have one entry per evaluation; "
                             f"got lengths {lengths}")
        return cls(**data)


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _numbers(x: object) -> bool:
    return isinstance(x, list) and all(_number(v) for v in x)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_FIELDS = {
    "steps": lambda x: isinstance(x, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in x),
    "train_loss": _numbers,
    "val_loss": _numbers,
    "step_loss": _numbers,
    "elapsed_s": _number,
    "tokens_per_s": _number,
}
