"""What Gemma 4 adds to a decoder outside attention: per-layer inputs and partial RoPE. Chapter 20.

* :class:`PerLayerInputs`: one input per layer for each token, ``(B, T, n_layers, d_per_layer_input)``: a
  second token embedding (scaled by ``√d_per_layer_input``) plus a projection of the scaled main embedding
  (by ``1/√d_model``, then RMSNorm), the sum times ``1/√2`` (transformers' ``get_per_layer_inputs`` and
  ``project_per_layer_inputs``);
* :class:`PerLayerInputGate`: how a block adds its input to the residual stream,
  ``x + norm(W_up(GELU_tanh(W_gate x) ⊙ input))``;
* :class:`PartialRotaryEmbedding`: RoPE on the first pairs of each head only, at the frequencies of the
  whole head (``"proportional"`` RoPE of Gemma 4's global layers).
"""
from __future__ import annotations

import torch
from torch import nn

from attnlib._checks import finite_number
from attnlib.layers.norms import RMSNorm
from attnlib.positional.rotary import RotaryEmbedding

__all__ = ["PartialRotaryEmbedding", "PerLayerInputGate", "PerLayerInputs"]


class PerLayerInputs(nn.Module):
    """Each token's input to each layer (Gemma 4's per-layer embeddings).

    Args:
        vocab_size, d_model, n_layers: the model's sizes. d_per_layer_input: the width of one layer's input.
        norm_eps: the RMSNorm's epsilon.

    Attributes:
        tok_emb: ``nn.Embedding(vocab_size, n_layers · d_per_layer_input)`` (``embed_tokens_per_layer``).
        proj: ``nn.Linear(d_model, n_layers · d_per_layer_input)``, no bias (``per_layer_model_projection``).
        norm: ``RMSNorm(d_per_layer_input)`` (``per_layer_projection_norm``).

    Shapes: ``idx (B, T)`` int64 and the scaled embeddings ``x (B, T, d_model)`` → ``(B, T, n_layers, d)``.
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, d_per_layer_input: int, norm_eps: float) -> None:
        super().__init__()
        self.n_layers, self.d = n_layers, d_per_layer_input
        self.tok_emb = nn.Embedding(vocab_size, n_layers * d_per_layer_input)
        self.proj = nn.Linear(d_model, n_layers * d_per_layer_input, bias=False)
        self.norm = RMSNorm(d_per_layer_input, norm_eps)
        self.proj_scale = d_model ** -0.5

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        tok = self.tok_emb(idx) * torch.tensor(self.d ** 0.5, dtype=x.dtype, device=x.device)  # rounded as Gemma's
        projected = self.norm((self.proj(x) * self.proj_scale).view(B, T, self.n_layers, self.d))
        return (projected + tok.view(B, T, self.n_layers, self.d)) * 2 ** -0.5  # (B, T, n_layers, d)


class PerLayerInputGate(nn.Module):
    """``x + norm(up(GELU_tanh(gate(x)) ⊙ input))``: a block's per-layer input added to its output.

    Attributes: ``gate`` ``nn.Linear(d_model, d)``, ``up`` ``nn.Linear(d, d_model)`` (no biases;
    transformers' ``per_layer_input_gate``, ``per_layer_projection``), ``norm`` ``RMSNorm(d_model)``
    (``post_per_layer_input_norm``). Shapes: ``x (B, T, d_model)``, ``input (B, T, d)`` → ``(B, T, d_model)``.
    """

    def __init__(self, d_model: int, d_per_layer_input: int, norm_eps: float) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, d_per_layer_input, bias=False)
        self.up = nn.Linear(d_per_layer_input, d_model, bias=False)
        self.norm = RMSNorm(d_model, norm_eps)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        g = nn.functional.gelu(self.gate(x), approximate="tanh") * per_layer_input  # (B, T, d)
        return x + self.norm(self.up(g))


class PartialRotaryEmbedding(RotaryEmbedding):
    """RoPE on the first ``int(partial_rotary_factor · head_dim / 2)`` pairs of each head, the others unturned;
    pair ``i`` at the frequency ``base^(-2i / head_dim)`` of the whole head (transformers' ``"proportional"``
    RoPE, Gemma 4's global layers). Args as :class:`~attnlib.positional.RotaryEmbedding`, unscaled.

    Raises:
        ValueError: ``partial_rotary_factor`` not in (0, 1]; as RotaryEmbedding.
    """

    def __init__(self, head_dim: int, base: float, partial_rotary_factor: float,
                 max_position_embeddings: int | None = None) -> None:
        if not 0 < finite_number("partial_rotary_factor", partial_rotary_factor) <= 1:
            raise ValueError(f"partial_rotary_factor={partial_rotary_factor!r} must be in (0, 1]")
        super().__init__(head_dim, base, None, max_position_embeddings)
        self.partial_rotary_factor = partial_rotary_factor
        turned = int(partial_rotary_factor * head_dim // 2)
        inv_freq = self.inv_freq.clone()
        inv_freq[turned:] = 0.0  # angle 0: cos 1, sin 0, the pair unchanged
        self.inv_freq = inv_freq
        self._inv_freq_float32 = inv_freq.float()
