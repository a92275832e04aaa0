"""Bad inputs across the public core API: each gives a TypeError/ValueError whose message names the value.

Issue 11, part 4. Every case asserts the exception type and (re.escape'd) the part of the message
that names the offending argument and value; none accepts "any exception". The categories are the
parametrized tests below; ``test_case_counts`` keeps the tally honest (at least 80 distinct inputs).
"""
import re

import pytest
import torch

from attnlib import GPT, GPTConfig, LayerNorm, MultiHeadAttention, RMSNorm, RotaryEmbedding
from attnlib.attention import (
    MultiHeadLatentAttention,
    TalkingHeadsAttention,
    attention,
    causal_mask,
    flash_attention,
    get_attention_function,
    mask_from_mod,
    padding_mask,
    sdpa_attention,
    tiled_attention,
)
from attnlib.attention.mods import alibi
from attnlib.cache import KVCache, LayerCache
from attnlib.models import TargetAttention

FUNCTIONS = {"eager": attention, "sdpa": sdpa_attention, "tiled": tiled_attention, "flash": flash_attention}


def qkv(B=1, H=2, T_q=8, T_k=8, d=4, n_kv=None, dtype=torch.float32):
    return (torch.randn(B, H, T_q, d, dtype=dtype), torch.randn(B, n_kv or H, T_k, d, dtype=dtype),
            torch.randn(B, n_kv or H, T_k, d, dtype=dtype))


def q_(*shape, **kw):
    return torch.randn(*shape, **kw)


Q, K, V = qkv()
BOOL = dict(dtype=torch.bool)

# ---------------------------------------------------------------- 1. the attention functions (each case x every function)
FUNCTION_CASES = {
    "q-a-list": (lambda f: f(Q.tolist(), K, V), TypeError, "q must be a torch.Tensor; got list"),
    "q-int64": (lambda f: f(Q.long(), K, V), TypeError, "q must be a floating point tensor; got dtype torch.int64"),
    "k-bool": (lambda f: f(Q, K > 0, V), TypeError, "k must be a floating point tensor; got dtype torch.bool"),
    "v-complex": (lambda f: f(Q, K, V.to(torch.complex64)), TypeError, "v must be a floating point tensor; got dtype torch.complex64"),
    "q-1d": (lambda f: f(q_(4), q_(4), q_(4)), ValueError, "q needs at least 2 dims (..., T, head_dim); got shape (4,)"),
    "k-float64": (lambda f: f(Q, K.double(), V), TypeError, "q, k, v must share a dtype; got torch.float32, torch.float64, torch.float32"),
    "k-on-meta": (lambda f: f(Q, K.to("meta"), V), ValueError, "q, k, v must be on one device; got cpu, meta, cpu"),
    "rank-mismatch": (lambda f: f(Q, K[0], V[0]), ValueError, "q, k, v must have the same rank; got shapes (1, 2, 8, 4), (2, 8, 4), (2, 8, 4)"),
    "head-dim-mismatch": (lambda f: f(q_(1, 2, 8, 5), K, V), ValueError, "q and k must share head_dim; got q (1, 2, 8, 5) and k (1, 2, 8, 4)"),
    "head-dim-0": (lambda f: f(q_(1, 2, 8, 0), q_(1, 2, 8, 0), V), ValueError, "head_dim=0"),
    "kv-length-mismatch": (lambda f: f(Q, K, q_(1, 2, 7, 4)), ValueError, "k and v must agree in every dim but the last; got k (1, 2, 8, 4) and v (1, 2, 7, 4)"),
    "no-keys": (lambda f: f(Q, q_(1, 2, 0, 4), q_(1, 2, 0, 4)), ValueError, "k and v hold no positions (T_k=0)"),
    "batch-mismatch": (lambda f: f(q_(2, 2, 8, 4), K, V), ValueError, "q and k must have the same batch size B; got q (2, 2, 8, 4) and k (1, 2, 8, 4)"),
    "heads-not-a-multiple": (lambda f: f(q_(1, 3, 8, 4), K, V), ValueError, "q's n_heads=3 must be a multiple of k's n_kv_heads=2"),
    "zero-query-heads": (lambda f: f(q_(1, 0, 8, 4), K, V), ValueError, "q's n_heads=0 must be a multiple of k's n_kv_heads=2"),
    "3d-batch-mismatch": (lambda f: f(q_(2, 8, 4), q_(3, 8, 4), q_(3, 8, 4)), ValueError, "q and k must have the same batch dims; got q (2, 8, 4) and k (3, 8, 4)"),
    "5d-grouped-heads": (lambda f: f(q_(1, 2, 4, 8, 4), q_(1, 2, 2, 8, 4), q_(1, 2, 2, 8, 4)), ValueError, "q and k must have the same batch dims; got q (1, 2, 4, 8, 4) and k (1, 2, 2, 8, 4)"),
    "is-causal-int": (lambda f: f(Q, K, V, is_causal=1), TypeError, "is_causal must be a bool; got 1"),
    "is-causal-more-queries": (lambda f: f(q_(1, 2, 9, 4), K, V, is_causal=True), ValueError, "is_causal needs T_q <= T_k (bottom-right aligned); got T_q=9 > T_k=8"),
    "scale-str": (lambda f: f(Q, K, V, scale="0.5"), TypeError, "scale must be a float or None; got '0.5'"),
    "scale-tensor": (lambda f: f(Q, K, V, scale=torch.tensor(0.5)), TypeError, "scale must be a float or None; got tensor(0.5000)"),
    "scale-zero": (lambda f: f(Q, K, V, scale=0.0), ValueError, "scale=0.0 must be a finite number > 0"),
    "scale-negative": (lambda f: f(Q, K, V, scale=-1.0), ValueError, "scale=-1.0 must be a finite number > 0"),
    "scale-nan": (lambda f: f(Q, K, V, scale=float("nan")), ValueError, "scale=nan must be a finite number > 0"),
    "scale-inf": (lambda f: f(Q, K, V, scale=float("inf")), ValueError, "scale=inf must be a finite number > 0"),
    "dropout-one": (lambda f: f(Q, K, V, dropout_p=1.0), ValueError, "dropout_p=1.0 must be in [0, 1)"),
    "dropout-negative": (lambda f: f(Q, K, V, dropout_p=-0.1), ValueError, "dropout_p=-0.1 must be in [0, 1)"),
    "dropout-nan": (lambda f: f(Q, K, V, dropout_p=float("nan")), ValueError, "dropout_p=nan must be in [0, 1)"),
    "dropout-bool": (lambda f: f(Q, K, V, dropout_p=True), TypeError, "dropout_p must be a float; got True"),
    "score-mod-not-callable": (lambda f: f(Q, K, V, score_mod=3), TypeError, "score_mod must be callable (score, b, h, q_idx, kv_idx) -> score; got 3"),
    "mask-a-list": (lambda f: f(Q, K, V, [[True]]), TypeError, "mask must be a boolean torch.Tensor (True = may attend); got list"),
    "mask-float": (lambda f: f(Q, K, V, torch.zeros(1, 1, 8, 8)), TypeError, "mask must be a boolean tensor (True = may attend); got dtype torch.float32"),
    "mask-uint8": (lambda f: f(Q, K, V, torch.ones(1, 1, 8, 8, dtype=torch.uint8)), TypeError, "got dtype torch.uint8"),
    "mask-(B,1,T)-for-(B,1,1,T)": (lambda f: f(q_(2, 2, 8, 4), q_(2, 2, 8, 4), q_(2, 2, 8, 4), torch.ones(2, 1, 8, **BOOL)), ValueError, "mask of shape (2, 1, 8) must have the scores' rank 4"),
    "mask-(B,T)-with-B==T": (lambda f: f(q_(8, 8, 4), q_(8, 8, 4), q_(8, 8, 4), torch.ones(8, 8, **BOOL)), ValueError, "mask of shape (8, 8) must have the scores' rank 3"),
    "mask-enlarges-batch": (lambda f: f(Q, K, V, torch.ones(2, 1, 8, 8, **BOOL)), ValueError, "mask of shape (2, 1, 8, 8) must have the scores' rank 4 with each dim 1 or equal to the scores' shape (1, 2, 8, 8)"),
    "mask-enlarges-heads": (lambda f: f(Q, K, V, torch.ones(1, 4, 8, 8, **BOOL)), ValueError, "mask of shape (1, 4, 8, 8)"),
    "mask-wrong-keys": (lambda f: f(Q, K, V, torch.ones(1, 1, 8, 9, **BOOL)), ValueError, "mask of shape (1, 1, 8, 9)"),
    "mask-5d": (lambda f: f(Q, K, V, torch.ones(1, 1, 1, 8, 8, **BOOL)), ValueError, "mask of shape (1, 1, 1, 8, 8)"),
    "mask-on-meta": (lambda f: f(Q, K, V, torch.ones(1, 1, 8, 8, dtype=torch.bool, device="meta")), ValueError, "mask is on meta but q on cpu"),
}

# ---------------------------------------------------------------- 2. one function only, masks and the registry
OTHER_FUNCTION_CASES = {
    "sdpa-score-mod": (lambda: sdpa_attention(Q, K, V, score_mod=lambda s, *i: s), ValueError, "sdpa_attention cannot apply a score_mod"),
    "tiled-tile-size-0": (lambda: tiled_attention(Q, K, V, tile_size=0), ValueError, "tile_size=0 must be a positive integer"),
    "tiled-tile-size-float": (lambda: tiled_attention(Q, K, V, tile_size=2.5), TypeError, "tile_size must be an int; got 2.5"),
    "tiled-dropout": (lambda: tiled_attention(Q, K, V, dropout_p=0.5), ValueError, "dropout_p=0.5 is not supported by tiled_attention"),
    "flash-score-mod": (lambda: flash_attention(Q, K, V, score_mod=lambda s, *i: s), ValueError, "flash_attention cannot apply a score_mod"),
    "flash-tile-size-0": (lambda: flash_attention(Q, K, V, tile_size=0), ValueError, "tile_size=0 must be a positive integer"),
    "flash-tile-size-float": (lambda: flash_attention(Q, K, V, tile_size=2.5), TypeError, "tile_size must be an int; got 2.5"),
    "flash-dropout": (lambda: flash_attention(Q, K, V, dropout_p=0.5), ValueError, "dropout_p=0.5 is not supported by flash_attention"),
    "registry-unknown": (lambda: get_attention_function("xformers"), ValueError, "attn_fn='xformers' is not one of ['eager', 'flash', 'sdpa', 'tiled']"),
    "registry-list": (lambda: get_attention_function(["sdpa"]), ValueError, "attn_fn=['sdpa'] is not one of"),
    "causal-mask-negative": (lambda: causal_mask(-1), ValueError, "T_q=-1 must be an integer >= 0"),
    "causal-mask-float": (lambda: causal_mask(2.5), ValueError, "T_q=2.5 must be an integer >= 0"),
    "causal-mask-bool": (lambda: causal_mask(True), ValueError, "T_q=True must be an integer >= 0"),
    "causal-mask-more-queries": (lambda: causal_mask(4, 2), ValueError, "T_q=4 > T_k=2"),
    "padding-length-too-long": (lambda: padding_mask([1, 5], 4), ValueError, "every length must be in [0, T=4]; got [1, 5]"),
    "padding-length-negative": (lambda: padding_mask(torch.tensor([-1]), 4), ValueError, "every length must be in [0, T=4]; got [-1]"),
    "padding-float-tensor": (lambda: padding_mask(torch.tensor([1.0]), 4), TypeError, "lengths must be integers; got dtype torch.float32"),
    "padding-float-list": (lambda: padding_mask([1.5], 4), TypeError, "lengths must be integers; got 1.5 in [1.5]"),
    "padding-str": (lambda: padding_mask("ab", 4), TypeError, "lengths must be a 1-D integer tensor or a list of ints; got str"),
    "padding-2d": (lambda: padding_mask(torch.tensor([[1]]), 4), ValueError, "lengths must be 1-D of shape (B,); got shape (1, 1)"),
    "padding-T-negative": (lambda: padding_mask([1], -1), ValueError, "T=-1 must be an integer >= 0"),
    "mask-mod-not-callable": (lambda: mask_from_mod("causal", (1, 1, 4, 4)), TypeError, "mask_mod must be callable (b, h, q_idx, kv_idx) -> bool; got 'causal'"),
    "mask-mod-shape-3d": (lambda: mask_from_mod(lambda b, h, q, kv: q >= kv, (1, 4, 4)), ValueError, "shape must be (B, n_heads, T_q, T_k); got (1, 4, 4)"),
    "mask-mod-more-queries": (lambda: mask_from_mod(lambda b, h, q, kv: q >= kv, (1, 1, 5, 4)), ValueError, "T_q=5 > T_k=4 in shape (1, 1, 5, 4)"),
    "mask-mod-returns-ints": (lambda: mask_from_mod(lambda b, h, q, kv: q - kv, (1, 1, 4, 4)), TypeError, "mask_mod must return a boolean tensor; got torch.int64"),
}

# ---------------------------------------------------------------- 3. attention module constructors
CONSTRUCTOR_CASES = {
    "mha-d-model-not-divisible": (lambda: MultiHeadAttention(770, 12), ValueError, "d_model=770 is not divisible by n_heads=12"),
    "mha-zero-heads": (lambda: MultiHeadAttention(16, 0), ValueError, "n_heads=0 must be a positive integer"),
    "mha-float-d-model": (lambda: MultiHeadAttention(16.0, 4), TypeError, "d_model must be an int; got 16.0"),
    "mha-kv-heads-3": (lambda: MultiHeadAttention(16, 4, 3), ValueError, "n_heads=4 is not divisible by n_kv_heads=3"),
    "mha-more-kv-than-query-heads": (lambda: MultiHeadAttention(16, 4, 8), ValueError, "n_heads=4 is not divisible by n_kv_heads=8"),
    "mha-kv-heads-0": (lambda: MultiHeadAttention(16, 4, 0), ValueError, "n_kv_heads=0 must be a positive integer"),
    "mha-block-size-0": (lambda: MultiHeadAttention(16, 4, block_size=0), ValueError, "block_size=0 must be a positive integer"),
    "mha-dropout-one": (lambda: MultiHeadAttention(16, 4, dropout=1.0), ValueError, "dropout=1.0 must be in [0, 1)"),
    "mha-dropout-nan": (lambda: MultiHeadAttention(16, 4, dropout=float("nan")), ValueError, "dropout=nan must be in [0, 1)"),
    "mha-bias-str": (lambda: MultiHeadAttention(16, 4, bias="yes"), TypeError, "bias must be a bool; got 'yes'"),
    "mha-causal-int": (lambda: MultiHeadAttention(16, 4, causal=1), TypeError, "causal must be a bool; got 1"),
    "mha-attn-fn-unknown": (lambda: MultiHeadAttention(16, 4, attn_fn="xformers"), ValueError, "attn_fn='xformers' is not one of ['eager', 'flash', 'sdpa', 'tiled']"),
    "mha-attn-fn-list": (lambda: MultiHeadAttention(16, 4, attn_fn=["sdpa"]), ValueError, "attn_fn=['sdpa'] is not one of"),
    "mha-kv-sharing-expand": (lambda: MultiHeadAttention(16, 4, kv_sharing="expand"), ValueError, "kv_sharing='expand' is not one of ('fold', 'repeat_interleave')"),
    "mha-window-and-chunk": (lambda: MultiHeadAttention(16, 4, sliding_window=2, chunk_size=4), ValueError, "sliding_window=2 and chunk_size=4: a layer has one or the other"),
    "mha-window-not-causal": (lambda: MultiHeadAttention(16, 4, causal=False, sliding_window=2), ValueError, "sliding_window=2 / chunk_size=None need a causal layer (causal=True)"),
    "mha-chunk-not-causal": (lambda: MultiHeadAttention(16, 4, causal=False, chunk_size=2), ValueError, "sliding_window=None / chunk_size=2 need a causal layer (causal=True)"),
    "mha-chunk-0": (lambda: MultiHeadAttention(16, 4, chunk_size=0), ValueError, "chunk_size=0 must be a positive integer"),
    "mha-window-float": (lambda: MultiHeadAttention(16, 4, sliding_window=2.0), TypeError, "sliding_window must be an int; got 2.0"),
    "mha-tiled-dropout": (lambda: MultiHeadAttention(16, 4, attn_fn="tiled", dropout=0.1), ValueError,
                          "dropout=0.1 needs attn_fn='eager' or 'sdpa' ('tiled' has no dropout)"),
    "mha-rope-width": (lambda: MultiHeadAttention(16, 4, rope=RotaryEmbedding(8)), ValueError,
                       "rope must be a RotaryEmbedding of head_dim=4; got one of head_dim=8"),
    "mha-rope-other-width": (lambda: MultiHeadAttention(16, 4, rope=RotaryEmbedding(8)), ValueError, "rope must be a RotaryEmbedding of head_dim=4"),
    "mha-rope-str": (lambda: MultiHeadAttention(16, 4, rope="yes"), ValueError, "rope must be a RotaryEmbedding of head_dim=4; got 'yes'"),
    "mha-qk-norm-int": (lambda: MultiHeadAttention(16, 4, qk_norm=1), TypeError, "qk_norm must be a bool; got 1"),
    "mha-score-mod-sdpa": (lambda: MultiHeadAttention(16, 4, score_mod=alibi(4)), ValueError, "score_mod needs attn_fn='eager' or 'tiled' ('sdpa' cannot modify scores)"),
    "mha-score-mod-flash": (lambda: MultiHeadAttention(16, 4, attn_fn="flash", score_mod=alibi(4)), ValueError, "score_mod needs attn_fn='eager' or 'tiled' ('flash' cannot modify scores)"),
    "mha-score-mod-int": (lambda: MultiHeadAttention(16, 4, attn_fn="eager", score_mod=3), TypeError, "score_mod must be callable (scores, b, h, q_idx, kv_idx) -> scores; got 3"),
    "talking-heads-zero-heads": (lambda: TalkingHeadsAttention(16, 0), ValueError, "n_heads=0 must be a positive integer"),
    "talking-heads-dropout": (lambda: TalkingHeadsAttention(16, 4, dropout=1.5), ValueError, "dropout=1.5 must be in [0, 1)"),
    "mla-latent-0": (lambda: MultiHeadLatentAttention(16, 4, 0), ValueError, "kv_latent_dim=0 must be a positive integer"),
    "mla-latent-float": (lambda: MultiHeadLatentAttention(16, 4, 4.0), TypeError, "kv_latent_dim must be an int; got 4.0"),
    "mla-absorb-int": (lambda: MultiHeadLatentAttention(16, 4, 4, absorb=1), TypeError, "absorb must be a bool; got 1"),
    "mla-d-model-not-divisible": (lambda: MultiHeadLatentAttention(30, 4, 4), ValueError, "d_model=30 is not divisible by n_heads=4"),
    "target-d-embed-0": (lambda: TargetAttention(0), ValueError, "d_embed=0 must be a positive integer"),
    "target-hidden-int": (lambda: TargetAttention(8, hidden=36), TypeError, "hidden must be a tuple of layer widths, e.g. (36,); got 36"),
    "target-hidden-zero": (lambda: TargetAttention(8, hidden=(36, 0)), ValueError, "hidden[1]=0 must be a positive integer"),
    "target-mode": (lambda: TargetAttention(8, mode="mean"), ValueError, "mode='mean' is not one of ('din', 'softmax')"),
    "target-activation": (lambda: TargetAttention(8, activation="dice"), ValueError, "activation='dice' is not one of ('sigmoid', 'prelu')"),
}


# ---------------------------------------------------------------- 4. attention module forward
def mha(**kw):
    return MultiHeadAttention(16, 4, block_size=8, **kw)


def filled_cache(module, T=6):
    cache = LayerCache(8)
    with torch.no_grad():
        module(torch.randn(2, T, 16), cache=cache)
    return cache


X = torch.randn(2, 5, 16)
FORWARD_CASES = {
    "x-float64": (lambda: mha()(X.double()), TypeError, "x is torch.float64 but the module's weights are torch.float32"),
    "x-float16-talking-heads": (lambda: TalkingHeadsAttention(16, 4)(X.half()), TypeError, "x is torch.float16 but the module's weights are torch.float32"),
    "x-bfloat16-mla": (lambda: MultiHeadLatentAttention(16, 4, 4)(X.bfloat16()), TypeError, "x is torch.bfloat16 but the module's weights are torch.float32"),
    "x-int": (lambda: mha()(X.long()), TypeError, "x must be a floating point tensor; got dtype torch.int64"),
    "x-a-list": (lambda: mha()(X.tolist()), TypeError, "x must be a torch.Tensor of shape (B, T, d_model); got list"),
    "x-wrong-width": (lambda: mha()(q_(2, 5, 12)), ValueError, "x must have shape (B, T, d_model=16); got (2, 5, 12)"),
    "x-2d": (lambda: mha()(q_(5, 16)), ValueError, "x must have shape (B, T, d_model=16); got (5, 16)"),
    "x-on-meta": (lambda: mha()(X.to("meta")), ValueError, "x is on meta but the module's weights are on cpu"),
    "x-longer-than-block-size": (lambda: mha()(q_(1, 9, 16)), ValueError, "sequence length T=9 (cached 0 + new 9) exceeds block_size=8"),
    "cache-past-block-size": (lambda: (m := mha())(q_(2, 3, 16), cache=filled_cache(m)), ValueError, "sequence length T=9 (cached 6 + new 3) exceeds block_size=8"),
    "cache-a-kv-cache": (lambda: mha()(X, cache=KVCache([LayerCache(8)])), TypeError, "cache must be a layer cache (attnlib.cache.LayerCache, ...); got KVCache"),
    "x-empty-sequence": (lambda: mha()(q_(2, 0, 16)), ValueError, "x holds no positions and nothing is cached; got shape (2, 0, 16)"),
    "mask-float": (lambda: mha()(X, mask=torch.ones(2, 1, 5, 5)), TypeError, "mask must be a boolean tensor (True = may attend); got torch.float32"),
    "mask-(B,1,T)": (lambda: mha()(X, mask=torch.ones(2, 1, 5, **BOOL)), ValueError, "mask of shape (2, 1, 5) must be 4-D and broadcast to (B, n_heads, T_q, T_k) = (2, 4, 5, 5)"),
    "mask-(B,T)-with-B==T": (lambda: mha()(q_(5, 5, 16), mask=torch.ones(5, 5, **BOOL)), ValueError, "mask of shape (5, 5) must be 4-D"),
    "mask-enlarges-batch": (lambda: mha()(X, mask=torch.ones(3, 1, 5, 5, **BOOL)), ValueError, "mask of shape (3, 1, 5, 5) must be 4-D and broadcast"),
    "mask-on-meta": (lambda: mha()(X, mask=torch.ones(2, 1, 5, 5, dtype=torch.bool, device="meta")), ValueError, "mask is on meta but x is on cpu"),
    "talking-heads-per-head-mask": (lambda: TalkingHeadsAttention(16, 4)(X, mask=torch.ones(2, 4, 5, 5, **BOOL)), ValueError, "TalkingHeadsAttention mixes heads and cannot honour a per-head mask; got (2, 4, 5, 5)"),
    "context-with-causal-layer": (lambda: mha()(X, q_(2, 3, 16)), ValueError, "a causal layer attends over its own sequence; build it with causal=False"),
    "context-with-cache": (lambda: mha(causal=False)(X, q_(2, 3, 16), cache=LayerCache(8)), ValueError, "cache is for self-attention"),
    "context-batch-mismatch": (lambda: mha(causal=False)(X, q_(3, 4, 16)), ValueError, "x and context must have the same batch size; got (2, 5, 16) and (3, 4, 16)"),
    "context-wrong-width": (lambda: mha(causal=False)(X, q_(2, 4, 12)), ValueError, "context must have shape (B, T, d_model=16); got (2, 4, 12)"),
    "context-float64": (lambda: mha(causal=False)(X, q_(2, 4, 16).double()), TypeError, "context is torch.float64 but the module's weights are torch.float32"),
    "context-empty": (lambda: mha(causal=False)(X, q_(2, 0, 16)), ValueError, "context holds no positions; got shape (2, 0, 16)"),
    "attention-mask-float": (lambda: mha()(X, attention_mask=torch.ones(2, 5)), TypeError, "attention_mask must be a boolean tensor, True = a real token"),
    "attention-mask-(B,1,1,T)": (lambda: mha()(X, attention_mask=torch.ones(2, 1, 1, 5, **BOOL)), ValueError, "attention_mask must have shape (B, T_k) = (2, 5); got (2, 1, 1, 5)"),
    "attention-mask-too-long": (lambda: mha()(X, attention_mask=torch.ones(2, 6, **BOOL)), ValueError, "attention_mask must have shape (B, T_k) = (2, 5); got (2, 6)"),
    "attention-mask-new-tokens-only": (lambda: (m := mha())(q_(2, 1, 16), cache=filled_cache(m), attention_mask=torch.ones(2, 1, **BOOL)), ValueError, "attention_mask must have shape (B, T_k) = (2, 7); got (2, 1)"),
    "mask-new-keys-only": (lambda: (m := mha())(q_(2, 2, 16), cache=filled_cache(m), mask=torch.ones(2, 1, 2, 2, **BOOL)), ValueError, "mask of shape (2, 1, 2, 2) must be 4-D and broadcast to (B, n_heads, T_q, T_k) = (2, 4, 2, 8)"),
    "attention-mask-on-meta": (lambda: mha()(X, attention_mask=torch.ones(2, 5, dtype=torch.bool, device="meta")), ValueError, "attention_mask is on meta but x is on cpu"),
    "positions-float": (lambda: mha(rope=RotaryEmbedding(4))(X, positions=torch.zeros(2, 5)), TypeError, "positions must be an integer tensor (B, T); got torch.float32"),
    "positions-shape": (lambda: mha(rope=RotaryEmbedding(4))(X, positions=torch.zeros(2, 4, dtype=torch.long)), ValueError, "positions must have shape (B, T) = (2, 5); got (2, 4)"),
    "positions-negative": (lambda: mha(rope=RotaryEmbedding(4))(X, positions=-torch.ones(2, 5, dtype=torch.long)), ValueError, "positions must be >= 0; got a minimum of -1"),
    "flash-layer-dropout": (lambda: mha(attn_fn="flash", dropout=0.1), ValueError, "dropout=0.1 needs attn_fn='eager' or 'sdpa' ('flash' has no dropout)"),
    "target-candidate-float64": (lambda: TargetAttention(8)(q_(2, 8).double(), q_(2, 4, 8).double()), TypeError, "candidate is torch.float64 but the module's weights are torch.float32"),
    "target-behaviours-on-meta": (lambda: TargetAttention(8)(q_(2, 8), q_(2, 4, 8, device="meta")), ValueError, "behaviours is on meta but the module's weights are on cpu"),
    "target-mask-shape": (lambda: TargetAttention(8)(q_(2, 8), q_(2, 4, 8), torch.ones(2, 5, **BOOL)), ValueError, "mask must have shape (B, T) = (2, 4); got (2, 5)"),
}

# ---------------------------------------------------------------- 5. GPTConfig
CONFIG_CASES = {
    "mqa-with-4-kv-heads": (dict(attention="mqa", n_kv_heads=4), ValueError, "n_kv_heads=4 contradicts attention='mqa', which has 1 key/value head(s)"),
    "mha-with-2-kv-heads": (dict(attention="mha", n_kv_heads=2), ValueError, "n_kv_heads=2 contradicts attention='mha', which has 4 key/value head(s)"),
    "mla-with-kv-heads": (dict(attention="mla", n_kv_heads=2), ValueError, "n_kv_heads=2 does not apply to attention='mla'"),
    "talking-heads-with-kv-heads": (dict(attention="talking_heads", n_kv_heads=4), ValueError, "n_kv_heads=4 does not apply to attention='talking_heads'"),
    "mha-with-latent": (dict(attention="mha", kv_latent_dim=8), ValueError, "kv_latent_dim=8 applies to attention='mla' only; got 'mha'"),
    "gqa-with-latent": (dict(attention="gqa", kv_latent_dim=8), ValueError, "kv_latent_dim=8 applies to attention='mla' only; got 'gqa'"),
    "gqa-kv-heads-3": (dict(attention="gqa", n_kv_heads=3), ValueError, "n_heads=4 is not divisible by n_kv_heads=3"),
    "gqa-kv-heads-0": (dict(attention="gqa", n_kv_heads=0), ValueError, "n_kv_heads=0 must be a positive integer"),
    "mla-latent-0": (dict(attention="mla", kv_latent_dim=0), ValueError, "kv_latent_dim=0 must be a positive integer"),
    "mla-latent-float": (dict(attention="mla", kv_latent_dim=2.5), TypeError, "kv_latent_dim must be an int; got 2.5"),
    "d-model-str": (dict(d_model="64"), TypeError, "d_model must be an int; got '64'"),
    "n-heads-float": (dict(n_heads=4.0), TypeError, "n_heads must be an int; got 4.0"),
    "vocab-size-bool": (dict(vocab_size=True), TypeError, "vocab_size must be an int; got True"),
    "d-model-not-divisible": (dict(d_model=770, n_heads=12), ValueError, "d_model=770 is not divisible by n_heads=12"),
    "n-layers-0": (dict(n_layers=0), ValueError, "n_layers=0 must be a positive integer"),
    "block-size-negative": (dict(block_size=-3), ValueError, "block_size=-3 must be a positive integer"),
    "dropout-one": (dict(dropout=1.0), ValueError, "dropout=1.0 must be in [0, 1)"),
    "dropout-nan": (dict(dropout=float("nan")), ValueError, "dropout=nan must be in [0, 1)"),
    "dropout-negative": (dict(dropout=-0.1), ValueError, "dropout=-0.1 must be in [0, 1)"),
    "dropout-str": (dict(dropout="0.1"), TypeError, "dropout must be a float; got '0.1'"),
    "attention-unknown": (dict(attention="flash"), ValueError, "attention='flash' is not one of ('mha', 'talking_heads', 'mqa', 'gqa', 'mla', 'differential')"),
    "attention-none": (dict(attention=None), ValueError, "attention=None is not one of ('mha', 'talking_heads', 'mqa', 'gqa', 'mla', 'differential')"),
    "bias-str": (dict(bias="yes"), TypeError, "bias must be a bool; got 'yes'"),
    "gelu-unknown": (dict(gelu_approximate="fast"), ValueError, "gelu_approximate='fast' is not one of ('none', 'tanh')"),
}

# ---------------------------------------------------------------- 6. the GPT: token ids, targets, caches
SMALL = dict(vocab_size=20, block_size=8, n_layers=2, n_heads=4, d_model=16)


def gpt(attention="mha", **kw):
    torch.manual_seed(0)
    config = GPTConfig(**{**SMALL, **kw}, attention=attention, n_kv_heads=2 if attention == "gqa" else None)
    return GPT(config).eval()


def filled(model, B=1, T=3):
    cache = KVCache.for_model(model)
    with torch.no_grad():
        model(torch.ones(B, T, dtype=torch.long), cache=cache)
    return cache


def out_of_step():
    cache = filled(gpt())
    k = cache.layers[0].buffers[0][..., :1, :]
    cache.layers[0].update(k, k)  # one layer fed once more than the other
    return cache


ONE = torch.ones(1, 1, dtype=torch.long)
GPT_CASES = {
    "idx-float": (lambda: gpt()(torch.zeros(1, 4)), TypeError, "idx must hold integer token ids (e.g. torch.long); got dtype torch.float32"),
    "idx-bool": (lambda: gpt()(torch.ones(1, 4, **BOOL)), TypeError, "idx must hold integer token ids (e.g. torch.long); got dtype torch.bool"),
    "idx-float16": (lambda: gpt()(torch.zeros(1, 4, dtype=torch.float16)), TypeError, "got dtype torch.float16"),
    "idx-a-list": (lambda: gpt()([[1, 2, 3]]), TypeError, "idx must be a torch.Tensor of token ids; got list"),
    "idx-1d": (lambda: gpt()(torch.zeros(4, dtype=torch.long)), ValueError, "idx must have shape (B, T); got (4,)"),
    "idx-id-too-large": (lambda: gpt()(torch.tensor([[1, 2, 20]])), ValueError, "idx holds token id 20, outside the vocabulary [0, 20)"),
    "idx-id-negative": (lambda: gpt()(torch.tensor([[-1, 2]])), ValueError, "idx holds token id -1, outside the vocabulary [0, 20)"),
    "idx-uint8-id-too-large": (lambda: gpt()(torch.tensor([[255]], dtype=torch.uint8)), ValueError, "idx holds token id 255"),
    "idx-longer-than-block-size": (lambda: gpt()(torch.zeros(1, 9, dtype=torch.long)), ValueError, "sequence length T=9 exceeds block_size=8"),
    "idx-empty-sequence": (lambda: gpt()(torch.zeros(2, 0, dtype=torch.long)), ValueError, "idx must hold at least one token per row; got shape (2, 0)"),
    "targets-float": (lambda: gpt()(ONE, torch.zeros(1, 1)), TypeError, "targets must hold integer token ids (e.g. torch.long); got dtype torch.float32"),
    "targets-shape": (lambda: gpt()(torch.ones(2, 4, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)), ValueError, "targets must have the shape of idx (2, 4); got (2, 3)"),
    "targets-id-too-large": (lambda: gpt()(ONE, torch.tensor([[20]])), ValueError, "targets holds token id 20"),
    "last-only-with-targets": (lambda: gpt()(ONE, ONE, last_only=True), ValueError, "last_only=True computes no loss"),
    "config-a-dict": (lambda: GPT(dict(SMALL)), TypeError, "config must be an attnlib.DecoderConfig; got dict"),
    "gpt2-size": (lambda: GPTConfig.gpt2("huge"), ValueError, "size='huge' is not one of"),
    "cache-of-mla-in-mha": (lambda: gpt("mha")(ONE, cache=filled(gpt("mla"))), ValueError, "this cache holds 1 tensors (filled by another attention variant?); cannot append 2"),
    "cache-of-mha-in-mla": (lambda: gpt("mla")(ONE, cache=filled(gpt("mha"))), ValueError, "this cache holds 2 tensors (filled by another attention variant?); cannot append 1"),
    "cache-of-gqa-in-mha": (lambda: gpt("mha")(ONE, cache=filled(gpt("gqa"))), ValueError, "cached tensor 0 has shape (1, 2, 8, 4); cannot append (1, 4, 1, 4)"),
    "cache-of-wider-mla": (lambda: gpt("mla", kv_latent_dim=8)(ONE, cache=filled(gpt("mla"))), ValueError, "cached tensor 0 has shape (1, 8, 4); cannot append (1, 1, 8)"),
    "cache-of-3-layers": (lambda: gpt()(ONE, cache=KVCache([LayerCache(8) for _ in range(3)])), ValueError, "cache has 3 layers; this model has n_layers=2"),
    "cache-shorter-than-the-sequence": (lambda: gpt()(torch.ones(1, 5, dtype=torch.long), cache=KVCache([LayerCache(4), LayerCache(4)])), ValueError, "the cache holds 0 positions and block_size=4; cannot add 5 more"),
    "cache-layers-out-of-step": (lambda: gpt()(ONE, cache=out_of_step()), ValueError, "the cache's layers hold different numbers of positions [3, 4]; reset it"),
    "cache-of-other-batch": (lambda: gpt()(torch.ones(2, 1, dtype=torch.long), cache=filled(gpt())), ValueError, "cached tensor 0 has shape (1, 4, 8, 4); cannot append (2, 4, 1, 4)"),
    "cache-of-other-dtype": (lambda: gpt().double()(ONE, cache=filled(gpt())), ValueError, "cached tensor 0 is torch.float32 on cpu; cannot append torch.float64 on cpu"),
    "cache-a-dict": (lambda: gpt()(ONE, cache={}), TypeError, "cache must be an attnlib.cache.KVCache (model.new_cache()); got dict"),
    "cache-full": (lambda: gpt()(torch.ones(1, 3, dtype=torch.long), cache=filled(gpt(), T=6)), ValueError, "the cache holds 6 tokens; 3 more exceed block_size=8"),
    "layer-cache-block-size-0": (lambda: LayerCache(0), ValueError, "block_size=0 must be a positive integer"),
    "kv-cache-no-layers": (lambda: KVCache([]), TypeError, "layers must hold one per-layer cache per layer; got an empty list"),
    "layer-cache-uneven-update": (lambda: LayerCache(8).update(q_(1, 1, 4), q_(1, 2, 4)), ValueError, "all tensors must add the same number of positions; got [1, 2]"),
    "layer-cache-a-list": (lambda: LayerCache(8).update([[1.0]]), ValueError, "tensor 0 must be a tensor (B, ..., T_new, width); got list"),
}

# ---------------------------------------------------------------- 7. scales and epsilons, RoPE
NUMBER_CASES = {
    **{
        f"{norm.__name__}-eps-{name}": (lambda norm=norm, eps=eps: norm(8, eps=eps), error, message)
        for norm in (RMSNorm, LayerNorm)
        for name, eps, error, message in [
            ("zero", 0.0, ValueError, "eps=0.0 must be a finite number > 0"),
            ("negative", -1.0, ValueError, "eps=-1.0 must be a finite number > 0"),
            ("nan", float("nan"), ValueError, "eps=nan must be a finite number > 0"),
            ("inf", float("inf"), ValueError, "eps=inf must be a finite number > 0"),
            ("str", "1e-5", TypeError, "eps must be a float; got '1e-5'"),
        ]
    },
    "RMSNorm-input-a-list": (lambda: RMSNorm(4)([1.0, 2.0, 3.0, 4.0]), TypeError, "got list"),
    "LayerNorm-wrong-width": (lambda: LayerNorm(8)(q_(2, 7)), ValueError, "(..., T, d_model=8); got (2, 7)"),
    "rope-base-zero": (lambda: RotaryEmbedding(8, base=0.0), ValueError, "base=0.0 must be a finite number > 1"),
    "rope-base-negative": (lambda: RotaryEmbedding(8, base=-10.0), ValueError, "base=-10.0 must be a finite number > 1"),
    "rope-base-one": (lambda: RotaryEmbedding(8, base=1.0), ValueError, "base=1.0 must be a finite number > 1"),
    "rope-base-nan": (lambda: RotaryEmbedding(8, base=float("nan")), ValueError, "base=nan must be a finite number > 1"),
    "rope-base-inf": (lambda: RotaryEmbedding(8, base=float("inf")), ValueError, "base=inf must be a finite number > 1"),
    "rope-base-str": (lambda: RotaryEmbedding(8, base="10000"), TypeError, "base must be a float; got '10000'"),
    "rope-head-dim-odd": (lambda: RotaryEmbedding(7), ValueError, "head_dim=7 must be even"),
    "rope-wrong-width": (lambda: RotaryEmbedding(8).rotate(q_(2, 5, 6)), ValueError, "(..., T, head_dim=8); got (2, 5, 6)"),
    "rope-positions-length": (lambda: RotaryEmbedding(8).rotate(q_(2, 5, 8), torch.arange(4)), ValueError, "positions must be a tensor whose last dimension is T=5"),
}

CATEGORIES = {
    "attention functions (x eager, sdpa, tiled, flash)": FUNCTION_CASES,
    "one function, mask helpers, registry": OTHER_FUNCTION_CASES,
    "module constructors": CONSTRUCTOR_CASES,
    "module forward": FORWARD_CASES,
    "GPTConfig": CONFIG_CASES,
    "GPT ids, targets, caches": GPT_CASES,
    "scales, epsilons, RoPE": NUMBER_CASES,
}


def check(call, error, message):
    with pytest.raises(error, match=re.escape(message)) as info:
        call()
    assert type(info.value) is error  # the type itself, not a subclass of it


@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
@pytest.mark.parametrize("case", sorted(FUNCTION_CASES))
def test_attention_functions(case, fn):
    call, error, message = FUNCTION_CASES[case]
    check(lambda: call(FUNCTIONS[fn]), error, message)


@pytest.mark.parametrize("case", sorted(OTHER_FUNCTION_CASES))
def test_one_function_masks_and_registry(case):
    check(*OTHER_FUNCTION_CASES[case])


@pytest.mark.parametrize("case", sorted(CONSTRUCTOR_CASES))
def test_module_constructors(case):
    check(*CONSTRUCTOR_CASES[case])


@pytest.mark.parametrize("case", sorted(FORWARD_CASES))
def test_module_forward(case):
    check(*FORWARD_CASES[case])


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_gpt_config(case):
    kwargs, error, message = CONFIG_CASES[case]
    check(lambda: GPTConfig(**{"n_heads": 4, "d_model": 64, **kwargs}), error, message)


@pytest.mark.parametrize("case", sorted(GPT_CASES))
def test_gpt_ids_targets_and_caches(case):
    check(*GPT_CASES[case])


@pytest.mark.parametrize("case", sorted(NUMBER_CASES))
def test_scales_epsilons_and_rope(case):
    check(*NUMBER_CASES[case])


def test_case_counts():
    counts = {name: len(cases) for name, cases in CATEGORIES.items()}
    print(counts, "total", sum(counts.values()))
    assert sum(counts.values()) >= 80


def test_a_refused_cache_update_leaves_the_cache_as_it_was():
    cache = filled(gpt("gqa"))
    before = {i: (layer.length, [b.clone() for b in layer.buffers]) for i, layer in enumerate(cache.layers)}
    with pytest.raises(ValueError, match=re.escape("cached tensor 0 has shape (1, 2, 8, 4)")):
        gpt("mha")(ONE, cache=cache)
    for i, layer in enumerate(cache.layers):
        assert layer.length == before[i][0]
        assert len(layer.buffers) == len(before[i][1])
        assert all(torch.equal(buffer, b) for buffer, b in zip(layer.buffers, before[i][1]))


# ---------------------------------------------------------------- empty batches and sequences: empty outputs
@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
def test_empty_batches_and_queries_give_empty_outputs(fn):
    f = FUNCTIONS[fn]
    assert f(*qkv(B=0), is_causal=True)[0].shape == (0, 2, 8, 4)
    assert f(q_(2, 4, 0, 4), q_(2, 2, 8, 4), q_(2, 2, 8, 4), is_causal=True)[0].shape == (2, 4, 0, 4)


@pytest.mark.parametrize(
    "module",
    [MultiHeadAttention(16, 4), MultiHeadAttention(16, 4, 2, attn_fn="eager"), TalkingHeadsAttention(16, 4),
     MultiHeadLatentAttention(16, 4, 4), MultiHeadLatentAttention(16, 4, 4, absorb=True)],
    ids=["mha", "gqa-eager", "talking-heads", "mla", "mla-absorbed"],
)
def test_modules_give_empty_outputs_for_an_empty_batch(module):
    assert module(q_(0, 5, 16)).shape == (0, 5, 16)


def test_gpt_and_norms_give_empty_outputs_for_an_empty_batch():
    logits, _ = gpt()(torch.zeros(0, 5, dtype=torch.long))
    assert logits.shape == (0, 5, 20)
    assert RMSNorm(8)(q_(0, 8)).shape == (0, 8) and LayerNorm(8)(q_(0, 3, 8)).shape == (0, 3, 8)
    assert TargetAttention(8)(q_(0, 8), q_(0, 4, 8)).shape == (0, 8)


def test_gpt_loss_of_an_empty_batch_is_not_nan():
    """No target to predict: an error or a finite loss, never NaN (issue 11, part 4)."""
    empty = torch.zeros(0, 5, dtype=torch.long)
    try:
        _, loss = gpt()(empty, empty)
    except ValueError as error:
        assert "(0, 5)" in str(error)
    else:
        assert torch.isfinite(loss)
