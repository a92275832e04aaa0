"""Target attention: a candidate item attends over a user's behaviour sequence (DIN, Zhou et al. 2018).

The Deep Interest Network (Zhou et al. 2018, §4.3 and Fig. 2) pools a user's
behaviours ``v_1 … v_T`` (embeddings of the items they clicked) into one vector
that depends on the candidate item ``e`` being scored: behaviours related to the
candidate get large weights. The weight of behaviour ``j`` comes from a small
MLP, the *activation unit*, on the pair ``(e, v_j)``; there are no query/key
projections and no dot product. Chapter 09.
"""
from __future__ import annotations

import torch
from torch import nn

from attnlib._checks import positive_int
from attnlib.attention.masks import masked_softmax

__all__ = ["TARGET_ACTIVATIONS", "TARGET_MODES", "TargetAttention"]

TARGET_MODES = ("din", "softmax")
TARGET_ACTIVATIONS = ("sigmoid", "prelu")


class TargetAttention(nn.Module):
    r"""DIN's local activation unit: pool a behaviour sequence with weights that depend on a candidate.

    For a candidate embedding :math:`e` and behaviours :math:`v_1, \dots, v_T` (the real ones,
    :math:`m_j = 1`), the activation unit scores each behaviour with an MLP
    :math:`a(e, v_j) = \mathrm{MLP}([e, v_j, e \odot v_j, e - v_j]) \in \mathbb{R}`, and the two modes pool

    ======================================================  ==========================================================
    ``mode="din"`` (the paper, eq. 3)                        ``mode="softmax"`` (the authors' public code)
    ======================================================  ==========================================================
    :math:`u = \sum_j m_j\, a(e, v_j)\, v_j`                 :math:`u = \sum_j \frac{m_j \exp a(e, v_j)}{\sum_k m_k \exp a(e, v_k)}\, v_j`
    weights are raw scores: no softmax, no sum to 1          weights are positive and sum to 1 over real behaviours
    ======================================================  ==========================================================

    The paper keeps the raw scores on purpose ("the normalization with softmax is abandoned",
    §4.3), so that the size of :math:`u` can tell how strongly the user is interested in the
    candidate's kind of item. Its Fig. 2 draws the activation unit's input as the candidate, the
    behaviour and their *out product*; the authors' released code feeds
    ``[e, v, e - v, e * v]`` (element-wise product and difference) and uses sigmoid hidden
    layers. This class implements that released form, in the order ``[e, v, e*v, e-v]``, with
    sigmoid (as the code) or PReLU (as the paper's Fig. 2) between layers; the paper's Dice
    activation is not implemented. The released code also divides the scores by
    :math:`\sqrt{d}` before its softmax; here the last linear layer learns any such scale.

    Padded behaviours (``attention_mask`` False) get weight exactly 0 in both modes and their values never
    reach the output; a user with no real behaviour gets the zero vector, never NaN.

    Args:
        d_embed: width ``d`` of the candidate and behaviour embeddings.
        hidden: widths of the activation unit's hidden layers (the paper: one layer of 36;
            ``()`` gives a single linear layer).
        activation: ``"sigmoid"`` or ``"prelu"`` (one learned slope per layer), applied after each hidden layer.
        mode: ``"din"`` or ``"softmax"`` (see above).

    Attributes:
        mlp: ``nn.Sequential`` from ``4 * d_embed`` to 1.

    Raises:
        TypeError / ValueError: a non-integer or non-positive width, ``hidden`` not a tuple of widths,
            an unknown activation or mode.
    """

    def __init__(
        self, d_embed: int, hidden: tuple[int, ...] = (36,), activation: str = "sigmoid", mode: str = "din"
    ) -> None:
        super().__init__()
        positive_int("d_embed", d_embed)
        if isinstance(hidden, (str, bytes)) or not isinstance(hidden, (tuple, list)):
            raise TypeError(f"hidden must be a tuple of layer widths, e.g. (36,); got {hidden!r}")
        hidden = tuple(hidden)
        for i, width in enumerate(hidden):
            positive_int(f"hidden[{i}]", width)
        if activation not in TARGET_ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {TARGET_ACTIVATIONS}")
        if mode not in TARGET_MODES:
            raise ValueError(f"mode={mode!r} is not one of {TARGET_MODES}")
        self.d_embed, self.hidden, self.activation, self.mode = d_embed, hidden, activation, mode
        layers: list[nn.Module] = []
        width_in = 4 * d_embed
        for width in hidden:
            layers += [nn.Linear(width_in, width), nn.Sigmoid() if activation == "sigmoid" else nn.PReLU()]
            width_in = width
        layers.append(nn.Linear(width_in, 1))
        self.mlp = nn.Sequential(*layers)

    @staticmethod
    def activation_inputs(candidate: torch.Tensor, behaviours: torch.Tensor) -> torch.Tensor:
        """``[e, v, e*v, e-v]`` for every behaviour: ``(B, d)``, ``(B, T, d)`` → ``(B, T, 4d)``."""
        e = candidate.unsqueeze(1).expand_as(behaviours)  # (B, d) -> (B, 1, d) -> (B, T, d), a view, no copy
        return torch.cat([e, behaviours, e * behaviours, e - behaviours], dim=-1)  # (B, T, 4d)

    def _check(self, candidate: torch.Tensor, behaviours: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        for name, t in (("candidate", candidate), ("behaviours", behaviours)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"{name} must be floating point; got dtype {t.dtype}")
        weight = self.mlp[0].weight
        for name, t in (("candidate", candidate), ("behaviours", behaviours)):
            if t.dtype != weight.dtype and not torch.is_autocast_enabled(t.device.type):
                raise TypeError(f"{name} is {t.dtype} but the module's weights are {weight.dtype}; convert one of them")
            if t.device != weight.device:
                raise ValueError(f"{name} is on {t.device} but the module's weights are on {weight.device}")
        if candidate.dim() != 2 or candidate.shape[-1] != self.d_embed:
            raise ValueError(f"candidate must have shape (B, d_embed={self.d_embed}); got {tuple(candidate.shape)}")
        if behaviours.dim() != 3 or behaviours.shape[-1] != self.d_embed:
            raise ValueError(
                f"behaviours must have shape (B, T, d_embed={self.d_embed}); got {tuple(behaviours.shape)}"
            )
        if behaviours.shape[0] != candidate.shape[0]:
            raise ValueError(
                f"candidate and behaviours must have the same B; got {candidate.shape[0]} and {behaviours.shape[0]}"
            )
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
                got = getattr(attention_mask, "dtype", type(attention_mask).__name__)
                raise TypeError(f"attention_mask must be a boolean tensor (True = real behaviour); got {got}")
            if attention_mask.device != behaviours.device:
                raise ValueError(f"attention_mask is on {attention_mask.device} but behaviours are on {behaviours.device}")
            if tuple(attention_mask.shape) != tuple(behaviours.shape[:2]):
                raise ValueError(
                    f"attention_mask must have shape (B, T) = {tuple(behaviours.shape[:2])}; got {tuple(attention_mask.shape)}"
                )

    def scores(self, candidate: torch.Tensor, behaviours: torch.Tensor) -> torch.Tensor:
        """The activation unit's raw score ``a(e, v_j)`` for every behaviour: ``(B, T)`` (no masking)."""
        return self.mlp(self.activation_inputs(candidate, behaviours)).squeeze(-1)  # (B, T, 4d) -> (B, T, 1) -> (B, T)

    def forward(
        self,
        candidate: torch.Tensor,
        behaviours: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Pool ``behaviours`` with weights computed against ``candidate``.

        Args:
            candidate: ``(B, d_embed)`` float, the item being scored.
            behaviours: ``(B, T, d_embed)`` float, the user's behaviour sequence, padded to ``T``.
            attention_mask: optional ``(B, T)`` bool, ``True`` = a real behaviour (``None``: all real).
            return_weights: also return the weights ``(B, T)`` (0 at padded positions).

        Returns:
            The pooled interest ``(B, d_embed)`` (and the weights).

        Raises:
            TypeError / ValueError: bad shapes or dtypes (also a dtype other than the module's, both named),
                a device other than the module's, a batch mismatch, a non-boolean attention_mask.
        """
        self._check(candidate, behaviours, attention_mask)
        if attention_mask is None:
            attention_mask = torch.ones(behaviours.shape[:2], dtype=torch.bool, device=behaviours.device)
        # Zero the padded behaviours first: whatever they hold (even inf or NaN) can then reach nothing.
        behaviours = behaviours.masked_fill(~attention_mask.unsqueeze(-1), 0.0)  # (B, T, d)
        scores = self.scores(candidate, behaviours)  # (B, T)
        if self.mode == "din":
            weights = scores.masked_fill(~attention_mask, 0.0)
        else:  # a row with no real behaviour gets zero weights, not NaN
            weights = masked_softmax(scores, attention_mask)  # (B, T)
        pooled = (weights.unsqueeze(1) @ behaviours).squeeze(1)  # (B, 1, T) @ (B, T, d) -> (B, 1, d) -> (B, d)
        return (pooled, weights) if return_weights else pooled
