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

import torch
import torch.nn.functional as F
from torch import nn

from attnlib._checks import positive_int
from attnlib.attention.masks import combined_mask, masked_softmax
from attnlib.attention.multi_head import MultiHeadAttention, refuse_options

__all__ = ["BiasedTalkingHeadsAttention", "TalkingHeadsAttention"]


class TalkingHeadsAttention(MultiHeadAttention):
    """Talking-heads attention (registry name ``"talking_heads"``): :class:`MultiHeadAttention` whose
    ``attend`` step mixes the heads' logits and weights.

    Args:
        d_model, n_heads, **options: as :class:`MultiHeadAttention` (``block_size``, ``dropout``, ``bias``,
            ``causal``, ``sliding_window``, ``chunk_size``): one key/value head per query head and the eager
            computation, which yields the weights. What mixing the heads' raw scores excludes is refused,
            named: grouped K/V heads, another attention function, RoPE, QK-norm, a ``score_mod``.

    Attributes:
        qkv, out_proj: as :class:`MultiHeadAttention`.
        mix_logits: ``(n_heads, n_heads)`` parameter ``P_l``; head ``g``'s logits are
            ``sum_h mix_logits[g, h] · logits_h``. Starts as the identity (plain multi-head attention).
        mix_weights: ``(n_heads, n_heads)`` parameter ``P_w``, applied to the softmax
            weights the same way; no bias. Starts as the identity.

    Shapes:
        ``(B, T, d_model)`` → ``(B, T, d_model)``; weights ``(B, n_heads, T, T)``
        (after mixing, a row need not sum to 1).

    Raises:
        As :class:`MultiHeadAttention`; in ``forward``, a per-head mask (mixing would carry weight
        from a head where a key is visible into one where it is masked).
    """

    post_softmax_bias = False
    per_head_masks = False

    def __init__(self, d_model: int, n_heads: int, **options) -> None:
        positive_int("d_model", d_model)
        positive_int("n_heads", n_heads)
        fixed = {"n_kv_heads": n_heads, "attn_fn": "eager", "kv_sharing": "fold", "head_dim": d_model // n_heads,
                 "rope": None, "qk_norm": False, "score_mod": None}
        refuse_options(type(self).__name__, options, fixed)
        options = {name: value for name, value in options.items() if name not in fixed}
        super().__init__(d_model, n_heads, attn_fn="eager", **options)
        # nn.Parameter, not nn.Linear: the GPT's N(0, 0.02) init must not turn the identity into noise.
        self.mix_logits = nn.Parameter(torch.eye(n_heads))
        self.mix_weights = nn.Parameter(torch.eye(n_heads))
        if self.post_softmax_bias:
            self.mix_weights_bias = nn.Parameter(torch.zeros(n_heads))

    def attend(self, q, k, v, mask, is_causal, need_weights):
        logits = (q * self.scale) @ k.transpose(-2, -1)  # (B, nh, T_q, hd) @ (B, nh, hd, T_k) -> (B, nh, T_q, T_k)
        logits = torch.einsum("bhqk,gh->bgqk", logits, self.mix_logits)  # mix heads before the softmax
        # Mask after mixing (no -inf enters a sum); rows with nothing to attend to get zeros, not NaN.
        weights = masked_softmax(logits, combined_mask(mask, is_causal, q.shape[-2], k.shape[-2], q.device))
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

    def __init__(self, d_model: int, n_heads: int, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        with torch.no_grad():
            self.mix_weights_bias.fill_(0.01)  # any non-zero bias leaks; nn.Linear's default init is never 0
