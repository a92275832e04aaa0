"""The KV cache: what each attention layer keeps from past tokens so decoding a new one costs O(T), not O(T²).

Chapter 08. A :class:`LayerCache` holds named tensors whose time axis is ``-2``
(keys and values ``(B, heads, T, head_dim)``, or MLA's latent ``(B, T, d_c)``),
pre-allocated to ``max_len`` on first use; each attention variant decides what it
stores (multi-head attention: K and V of every head; GQA/MQA: only the
``n_kv_heads`` shared heads; MLA: only the latent). :class:`KVCache` is one
``LayerCache`` per layer of a GPT.
"""
from __future__ import annotations

import torch

from attnlib._checks import positive_int

__all__ = ["KVCache", "LayerCache"]


class LayerCache:
    """Pre-allocated storage for one attention layer.

    Args:
        max_len: the most tokens it can hold (the model's ``block_size``).

    Raises:
        ValueError: on :meth:`update` past ``max_len`` or with tensors of another
            batch or shape than the first update's.
    """

    def __init__(self, max_len: int) -> None:
        positive_int("max_len", max_len)
        self.max_len = max_len
        self.length = 0
        self.buffers: dict[str, torch.Tensor] = {}

    def update(self, **new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append ``T_new`` positions of each named tensor; return every cached position so far.

        Args:
            **new: tensors of shape ``(..., T_new, width)``, all with the same ``T_new``.

        Returns:
            One tensor ``(..., length + T_new, width)`` per name, in the order given
            (views into the buffers: no copy of the past).
        """
        if self.buffers and set(new) != set(self.buffers):
            raise ValueError(
                f"this cache holds {sorted(self.buffers)} (filled by another attention variant?); "
                f"cannot append {sorted(new)}"
            )
        for name, t in new.items():
            if not isinstance(t, torch.Tensor) or t.dim() < 2:
                raise ValueError(f"{name} must be a tensor (..., T_new, width); got {getattr(t, 'shape', type(t).__name__)}")
        T_new = {t.shape[-2] for t in new.values()}
        if len(T_new) != 1:
            raise ValueError(f"all tensors must add the same number of positions; got {sorted(T_new)}")
        T_new = T_new.pop()
        end = self.length + T_new
        if end > self.max_len:
            raise ValueError(
                f"the cache holds {self.length} positions and max_len={self.max_len}; cannot add {T_new} more"
            )
        out = []
        for name, t in new.items():
            if name not in self.buffers:
                shape = (*t.shape[:-2], self.max_len, t.shape[-1])
                self.buffers[name] = torch.zeros(shape, dtype=t.dtype, device=t.device)  # pre-allocated once
            buffer = self.buffers[name]
            if buffer.shape[:-2] != t.shape[:-2] or buffer.shape[-1] != t.shape[-1]:
                raise ValueError(f"cached {name!r} has shape {tuple(buffer.shape)}; cannot append {tuple(t.shape)}")
            if buffer.dtype != t.dtype or buffer.device != t.device:
                raise ValueError(
                    f"cached {name!r} is {buffer.dtype} on {buffer.device}; cannot append {t.dtype} on {t.device}"
                )
            buffer[..., self.length : end, :] = t
            out.append(buffer[..., :end, :])
        self.length = end
        return tuple(out)

    def reset(self) -> None:
        """Forget every position, keeping the allocated buffers for reuse."""
        self.length = 0

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (beam search: follow each surviving beam's parent)."""
        for name, buffer in self.buffers.items():
            self.buffers[name] = buffer.index_select(0, index.to(buffer.device))

    def bytes_per_token(self) -> int:
        """Bytes one position of one sequence takes, measured from the allocated buffers (0 if empty)."""
        return sum(b[:1, ..., :1, :].numel() * b.element_size() for b in self.buffers.values())

    def nbytes(self) -> int:
        """Bytes allocated (the whole ``max_len``, as pre-allocated)."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class KVCache:
    """One :class:`LayerCache` per layer of a GPT. Chapter 08.

    Args:
        n_layers: number of attention layers.
        max_len: positions each layer can hold (the model's ``block_size``).

    Example::

        cache = KVCache.for_model(model)
        logits, _ = model(prompt, cache=cache)          # prefill: the whole prompt at once
        logits, _ = model(next_token, cache=cache)      # decode: one new token against the cache
    """

    def __init__(self, n_layers: int, max_len: int) -> None:
        positive_int("n_layers", n_layers)
        self.layers = [LayerCache(max_len) for _ in range(n_layers)]
        self.max_len = max_len

    @classmethod
    def for_model(cls, model) -> KVCache:
        """An empty cache sized for ``model`` (an :class:`attnlib.GPT`)."""
        return cls(model.config.n_layers, model.config.block_size)

    @property
    def length(self) -> int:
        """Positions cached so far.

        Raises:
            ValueError: the layers hold different numbers of positions (a cache that fell out of step).
        """
        lengths = {layer.length for layer in self.layers}
        if len(lengths) != 1:
            raise ValueError(f"the cache's layers hold different numbers of positions {sorted(lengths)}; reset it")
        return lengths.pop()

    def reset(self) -> None:
        """Forget every position in every layer, keeping the buffers."""
        for layer in self.layers:
            layer.reset()

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` in every layer."""
        for layer in self.layers:
            layer.reorder(index)

    def bytes_per_token(self) -> int:
        """Bytes per cached position of one sequence, all layers, measured from the tensors."""
        return sum(layer.bytes_per_token() for layer in self.layers)

    def nbytes(self) -> int:
        """Bytes allocated by all layers."""
        return sum(layer.nbytes() for layer in self.layers)
