"""The position-wise feed-forward blocks: the GELU MLP of the GPT (chapter 12) and the encoder–decoder
Transformer (chapter 10), and the gated blocks of modern decoders (SwiGLU, GeGLU; chapter 16).

Vaswani et al. 2017, §3.3: ``FFN(x) = W_2 · act(W_1 x + b_1) + b_2``, the same two linear layers at every
position; GELU (Hendrycks & Gimpel 2016) instead of ReLU, as in GPT-2. The parameter names ``fc`` and
``proj`` are what GPT-2's weights are loaded into (``mlp.c_fc``, ``mlp.c_proj``; :mod:`attnlib.models.hf_gpt2`).
"""
from __future__ import annotations

import torch
from torch import nn

from attnlib._checks import positive_int, probability

__all__ = ["FEEDFORWARDS", "GELU_APPROXIMATIONS", "FeedForward", "GatedFeedForward", "GeGLU", "SwiGLU"]

GELU_APPROXIMATIONS = ("none", "tanh")


class FeedForward(nn.Module):
    """``dropout(proj(GELU(fc(x))))``, applied to every position alone.

    Args:
        d_model: input and output width.
        d_ff: hidden width (default ``4 * d_model``).
        dropout: dropout on the output (training only), in [0, 1).
        gelu_approximate: ``"none"`` (exact, ``x Φ(x)``) or ``"tanh"`` (the tanh approximation of GPT-2),
            as in ``nn.GELU(approximate=...)``.
        bias: biases on both linear layers.

    Attributes:
        fc: ``nn.Linear(d_model, d_ff)``; act: the GELU; proj: ``nn.Linear(d_ff, d_model)``.

    Shapes:
        ``(..., d_model)`` → ``(..., d_model)``.

    Raises:
        TypeError / ValueError: a size that is not a positive int, ``dropout`` outside [0, 1),
            an unknown approximation, a non-bool ``bias``; the message names the value.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int | None = None,
        dropout: float = 0.0,
        gelu_approximate: str = "none",
        bias: bool = True,
    ) -> None:
        super().__init__()
        positive_int("d_model", d_model)
        d_ff = 4 * d_model if d_ff is None else d_ff
        positive_int("d_ff", d_ff)
        probability("dropout", dropout)
        if gelu_approximate not in GELU_APPROXIMATIONS:
            raise ValueError(f"gelu_approximate={gelu_approximate!r} is not one of {GELU_APPROXIMATIONS}")
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool; got {bias!r}")
        self.fc = nn.Linear(d_model, d_ff, bias=bias)
        self.act = nn.GELU(approximate=gelu_approximate)
        self.proj = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))  # (..., d_model) -> (..., d_ff) -> (..., d_model)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (GPT-2's and Gemma's), ``nn.functional.gelu(x, approximate="tanh")``."""
    return nn.functional.gelu(x, approximate="tanh")


class GatedFeedForward(nn.Module):
    """A gated feed-forward block, ``down(act(gate(x)) ⊙ up(x))`` (Shazeer 2020, "GLU Variants Improve
    Transformer", §2): the activation of one projection decides what passes of the other.

    Three matrices instead of two: a hidden width of ``8/3 · d_model`` keeps the parameter count
    of a ``4 · d_model`` GELU block. Parameter names ``gate``, ``up``, ``down`` are
    ``transformers``' ``gate_proj``, ``up_proj``, ``down_proj``. :class:`SwiGLU` and :class:`GeGLU`
    choose the activation.

    Args:
        d_model: input and output width.
        d_ff: hidden width.
        activation: ``"silu"`` (Swish with β = 1: SwiGLU, eq. 6) or ``"gelu_tanh"`` (GELU's tanh form: GeGLU, eq. 5,
            as Gemma computes it).
        bias: biases on the three linear layers (Llama: none).
        dropout: dropout on the output (training only), in [0, 1).

    Shapes:
        ``(..., d_model)`` → ``(..., d_model)``.

    Raises:
        TypeError / ValueError: a size that is not a positive int, ``dropout`` outside [0, 1), a non-bool
            ``bias``, an unknown activation.
    """

    ACTIVATIONS = {"silu": nn.functional.silu, "gelu_tanh": gelu_tanh}

    def __init__(self, d_model: int, d_ff: int, activation: str = "silu", bias: bool = False,
                 dropout: float = 0.0) -> None:
        super().__init__()
        positive_int("d_model", d_model)
        positive_int("d_ff", d_ff)
        probability("dropout", dropout)
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool; got {bias!r}")
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {sorted(self.ACTIVATIONS)}")
        self.activation = activation
        self.act = self.ACTIVATIONS[activation]
        self.gate = nn.Linear(d_model, d_ff, bias=bias)
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.gate(x)) * self.up(x)  # (..., d_ff): the gate decides what passes
        return self.dropout(self.down(hidden))  # (..., d_ff) -> (..., d_model)


class SwiGLU(GatedFeedForward):
    """The gated feed-forward block of Llama, Qwen and Mistral: ``down(SiLU(gate(x)) ⊙ up(x))`` (Shazeer
    2020, eq. 6). Args as :class:`GatedFeedForward`, without ``activation``. Chapter 16."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = False, dropout: float = 0.0) -> None:
        super().__init__(d_model, d_ff, "silu", bias, dropout)


class GeGLU(GatedFeedForward):
    """Gemma's gated feed-forward block: ``down(GELU_tanh(gate(x)) ⊙ up(x))`` (Shazeer 2020, eq. 5). Args as
    :class:`GatedFeedForward`, without ``activation``."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = False, dropout: float = 0.0) -> None:
        super().__init__(d_model, d_ff, "gelu_tanh", bias, dropout)


#: The feed-forward blocks a decoder can use, by the name :class:`attnlib.DecoderConfig` gives them.
FEEDFORWARDS = {"gelu": FeedForward, "swiglu": SwiGLU, "geglu": GeGLU}
