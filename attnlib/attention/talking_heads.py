"""Talking-heads attention (Shazeer et al. 2020): heads exchange information before and after the softmax.

Multi-head attention keeps its ``n_heads`` attention patterns apart. Talking heads
mixes them with two small ``(n_heads, n_heads)`` matrices: ``P_l`` on the logits
before the softmax and ``P_w`` on the weights after it (paper, §3, eq. 2). Chapter 05.

Where the mask goes decides whether the layer is causal:

* logits are mixed *before* masking (mixing ``-inf`` would give ``inf - inf = NaN``);
* after the softmax the weights of future keys are exactly 0 in every head, and a
  mixing *without bias* keeps them 0 (this needs the same mask in every head, as a
  causal or padding mask is: a per-head mask could receive weight mixed in from a
  head where that key is visible). A bias adds the same number to every weight,
  future ones included: the future leaks in. :class:`BiasedTalkingHeadsAttention`
  keeps that broken layer (the source notebook's) so chapters 05 and 13 can show it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnlib.attention.multi_head import MultiHeadAttention
from attnlib.config import GPTConfig

__all__ = ["BiasedTalkingHeadsAttention", "TalkingHeadsAttention"]


class TalkingHeadsAttention(MultiHeadAttention):
    """Causal talking-heads attention (registry name ``"talking_heads"``).

    Args:
        config: uses ``d_model, n_heads, block_size, dropout, bias``.

    Attributes:
        qkv, out_proj: as :class:`MultiHeadAttention`.
        mix_logits: ``(n_heads, n_heads)`` parameter ``P_l``; head ``g``'s logits are
            ``sum_h mix_logits[g, h] · logits_h``. Starts as the identity (plain multi-head attention).
        mix_weights: ``(n_heads, n_heads)`` parameter ``P_w``, applied to the softmax
            weights the same way; no bias. Starts as the identity.

    Shapes:
        ``(B, T, d_model)`` → ``(B, T, d_model)``; weights ``(B, n_heads, T, T)``
        (after mixing, a row need not sum to 1).
    """

    post_softmax_bias = False

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(
            config.d_model, config.n_heads, config.block_size, config.dropout, config.bias, causal=True, backend="eager"
        )
        # nn.Parameter, not nn.Linear: the GPT's N(0, 0.02) init must not turn the identity into noise.
        self.mix_logits = nn.Parameter(torch.eye(config.n_heads))
        self.mix_weights = nn.Parameter(torch.eye(config.n_heads))
        if self.post_softmax_bias:
            self.mix_weights_bias = nn.Parameter(torch.zeros(config.n_heads))

    def attend(self, q, k, v, mask, need_weights):
        T_q, T_k = q.shape[-2], k.shape[-2]
        logits = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, nh, T_q, hd) @ (B, nh, hd, T_k)
        logits = torch.einsum("bhqk,gh->bgqk", logits, self.mix_logits)  # mix heads before the softmax
        full = self.full_mask(mask, T_q, T_k, q.device)
        if full is not None:
            logits = logits.masked_fill(~full, float("-inf"))  # mask after mixing: no -inf enters a sum
        weights = torch.softmax(logits, dim=-1)
        if full is not None:
            weights = weights.masked_fill(~full, 0.0)  # rows with nothing to attend to: zeros, not NaN
        weights = torch.einsum("bhqk,gh->bgqk", weights, self.mix_weights)  # mix after; masked weights stay 0
        if self.post_softmax_bias:
            weights = weights + self.mix_weights_bias.view(1, -1, 1, 1)  # every key, future ones too
        weights = F.dropout(weights, p=self.dropout if self.training else 0.0)
        return weights @ v, weights  # (B, nh, T_q, T_k) @ (B, nh, T_k, hd) -> (B, nh, T_q, hd)


class BiasedTalkingHeadsAttention(TalkingHeadsAttention):
    """**Broken on purpose**: talking heads with a bias after the softmax, as in the source notebook.

    The bias gives weight to masked (future) positions, so the layer is not causal
    and a language model trained with it reads the next token. Not in the registry;
    chapter 05 shows the leak test failing on it, chapter 13 what it does to the loss.
    """

    post_softmax_bias = True

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        with torch.no_grad():
            self.mix_weights_bias.fill_(0.01)  # any non-zero bias leaks; nn.Linear's default init is never 0
