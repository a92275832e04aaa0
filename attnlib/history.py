"""`History`: what a training run measured (losses at each evaluation, speed), with a plot and JSON.

Chapter 12 plots it; :func:`attnlib.train.train` returns it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def from_json(cls, path: str | Path) -> History:
        return cls(**json.loads(Path(path).read_text()))
