"""Attention variants as score and mask modifications (FlexAttention's two hooks). Chapter 17.

Each function returns a callable for the attention core (:mod:`attnlib.attention.functions`):

* a ``mask_mod(b, h, q_idx, kv_idx) -> bool`` decides *whether* a query sees a key
  (:func:`sliding_window`, :func:`chunked`, :func:`causal`, :func:`document_mask`; build a mask
  with :func:`attnlib.attention.masks.mask_from_mod`);
* a ``score_mod(score, b, h, q_idx, kv_idx) -> score`` changes *how much* it sees, before the
  softmax (:func:`alibi`, :func:`softcap`); pass it as ``attention(..., score_mod=...)``.

The index arguments are broadcastable integer tensors, as in
``torch.nn.attention.flex_attention`` (whose functions take scalars under ``vmap``): the same
function serves both. Query indices count from ``T_k - T_q`` (a cached decode's queries are
the newest positions).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["alibi", "alibi_slopes", "causal", "chunked", "compose", "document_mask", "sliding_window", "softcap"]

MaskMod = Callable[..., torch.Tensor]
ScoreMod = Callable[..., torch.Tensor]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def causal(b, h, q_idx, kv_idx) -> torch.Tensor:
    """The causal mask: query ``i`` sees keys ``j <= i``."""
    return q_idx >= kv_idx


def sliding_window(window: int) -> MaskMod:
    """Causal attention to the last ``window`` positions (Mistral; Gemma's local layers).

    Query ``i`` sees key ``j`` iff ``i - window < j <= i``: itself and the ``window - 1`` keys
    before it (Mistral's ``sliding_window``; Beltagy et al. 2020's local attention, causal).
    A window ``>= T`` is the plain causal mask.

    Raises:
        ValueError: ``window`` not an int >= 1.
    """
    _positive_int("window", window)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    mask_mod.window = window
    return mask_mod


def chunked(chunk_size: int) -> MaskMod:
    """Causal attention within fixed chunks of ``chunk_size`` positions (Llama 4's ``attention_chunk_size``).

    Query ``i`` sees key ``j`` iff ``j <= i`` and both lie in the same chunk, ``i // C == j // C``:
    the first query of a chunk sees only itself, whatever came before (``transformers``'
    ``chunked_overlay``). A decoder's cache for such a layer keeps only the current chunk.

    Raises:
        ValueError: ``chunk_size`` not an int >= 1.
    """
    _positive_int("chunk_size", chunk_size)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx // chunk_size == kv_idx // chunk_size)

    mask_mod.chunk_size = chunk_size
    return mask_mod


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al. 2022, §3): ``2^(-8/n), 2^(-16/n), …`` for ``n`` heads.

    For a head count that is not a power of two, the slopes of the nearest lower power of two
    followed by every other slope of the next power of two (the paper's reference code).

    Returns:
        float32 ``(n_heads,)``, positive and decreasing from head 0.

    Raises:
        ValueError: ``n_heads`` not an int >= 1.
    """
    _positive_int("n_heads", n_heads)

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    lower = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two(lower)
    if lower < n_heads:
        slopes += power_of_two(2 * lower)[0::2][: n_heads - lower]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi(n_heads: int) -> ScoreMod:
    """ALiBi as a score modification: ``score - m_h · (i - j)`` (Press et al. 2022, §3).

    Each head ``h`` penalises a key linearly in its distance from the query, with slope
    ``m_h`` from :func:`alibi_slopes`; no position embedding is added to the tokens. Use it with
    a causal mask (keys after the query would get a bonus).

    Scores ``(B, n_heads, T_q, T_k)`` have their heads in dim 1; the attention functions' scores of
    2-D and 3-D inputs, ``(T_q, T_k)`` and ``(B, T_q, T_k)``, are one head's, which ``alibi(1)`` serves.
    Under ``flex_attention`` each score is a scalar and ``h`` picks the slope.

    Raises:
        ValueError: ``n_heads`` not an int >= 1; at call time, 4-D scores whose head dimension is
            not ``n_heads``, or scores of one head for ``n_heads > 1``.
    """
    slopes = alibi_slopes(n_heads)

    def score_mod(score, b, h, q_idx, kv_idx):
        # (B, n_heads, T_q, T_k) from the attention functions; one head's (T_q, T_k) or (B, T_q, T_k); a
        # scalar under FlexAttention's vmap, where h alone says the head
        heads = score.shape[-3] if score.dim() >= 4 else 1
        if score.dim() >= 2 and heads != n_heads:
            raise ValueError(f"alibi({n_heads}) got scores with {heads} head{'s' * (heads != 1)} (shape {tuple(score.shape)}); "
                             f"expected (B, {n_heads}, T_q, T_k)")
        m = slopes.to(score.device, score.dtype)[h] if torch.is_tensor(h) else slopes[h]
        return score - m * (q_idx - kv_idx)

    return score_mod


def softcap(cap: float) -> ScoreMod:
    """Logit soft-capping: ``cap · tanh(score / cap)`` (Gemma 2, Gemma Team 2024, §2: cap 50 for attention).

    Scores stay within ``(-cap, cap)``; small ones barely change (``tanh(x) ≈ x``).

    Raises:
        ValueError: ``cap`` not a finite number > 0.
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"cap must be a finite number > 0, got {cap!r}")

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return score_mod


def compose(*score_mods: ScoreMod) -> ScoreMod | None:
    """One score modification applying ``score_mods`` in order (``None`` for none, the mod itself for one).

    E.g. ``compose(alibi(n_heads), softcap(50.0))``: the distance penalty, then the cap.
    """
    mods = [m for m in score_mods if m is not None]
    if len(mods) <= 1:
        return mods[0] if mods else None

    def score_mod(score, b, h, q_idx, kv_idx):
        for mod in mods:
            score = mod(score, b, h, q_idx, kv_idx)
        return score

    return score_mod


def document_mask(doc_ids: torch.Tensor) -> MaskMod:
    """Attention within one document: query ``i`` sees key ``j`` iff both belong to the same document.

    For sequences packed from several documents (each token labelled by its document), so that
    no token attends across a document boundary (the "document masking" of PyTorch's
    FlexAttention examples). Combine it with :func:`causal` (``is_causal=True``, or FlexAttention's
    ``and_masks``) for a packed decoder. ``q_idx`` and ``kv_idx`` index positions of ``doc_ids``.

    Args:
        doc_ids: integer ``(T,)`` (every sequence alike) or ``(B, T)`` (one row per sequence),
            ``T`` at least the keys' length ``T_k``.

    Raises:
        TypeError: ``doc_ids`` not an integer tensor.
        ValueError: ``doc_ids`` not 1-D or 2-D; at call time, fewer positions than keys or fewer rows than the batch.
    """
    if not isinstance(doc_ids, torch.Tensor):
        raise TypeError(f"doc_ids must be an integer torch.Tensor (T,) or (B, T); got {type(doc_ids).__name__}")
    if doc_ids.dtype == torch.bool or doc_ids.is_floating_point() or doc_ids.is_complex():
        raise TypeError(f"doc_ids must hold integer document ids; got dtype {doc_ids.dtype}")
    if doc_ids.dim() not in (1, 2):
        raise ValueError(f"doc_ids must be (T,) or (B, T); got shape {tuple(doc_ids.shape)}")

    def mask_mod(b, h, q_idx, kv_idx):
        n_keys = kv_idx.shape[-1] if torch.is_tensor(kv_idx) and kv_idx.dim() else 0  # (scalars under vmap: unchecked)
        if n_keys > doc_ids.shape[-1]:
            raise ValueError(f"doc_ids labels {doc_ids.shape[-1]} positions; the scores have T_k={n_keys} keys")
        batch = b.shape[0] if torch.is_tensor(b) and b.dim() and b.dim() == kv_idx.dim() else 0
        if doc_ids.dim() == 2 and batch > doc_ids.shape[0]:
            raise ValueError(f"doc_ids has {doc_ids.shape[0]} rows; the scores have a batch of {batch}")
        if doc_ids.dim() == 1:
            return doc_ids[q_idx] == doc_ids[kv_idx]
        return doc_ids[b, q_idx] == doc_ids[b, kv_idx]

    mask_mod.doc_ids = doc_ids
    return mask_mod
