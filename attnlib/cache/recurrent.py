"""The state of a recurrent layer (linear attention, gated DeltaNet): fixed size, whatever the length. Chapter 18.

Softmax attention must keep every key and value (its cache grows with the sequence); a
linear-attention layer folds them into a state of fixed size (``S`` and ``z`` for
Katharopoulos et al.'s linear attention, ``S`` for the delta rule) and needs nothing else. A
:class:`RecurrentState` holds that state for one layer and honours the same protocol as the layer
caches where it can: ``length``, ``reorder`` (beam search), ``reset``, ``nbytes``; ``crop`` only
to the current length (a state cannot forget the last tokens it folded in) or to 0.
"""
from __future__ import annotations

import torch

from attnlib._checks import batch_rows, non_negative_int, positive_int

__all__ = ["RecurrentState"]


class RecurrentState:
    """One recurrent layer's state and the number of positions folded into it.

    Args:
        block_size: the most positions a sequence may reach (the model's ``block_size``).

    Raises:
        TypeError / ValueError: ``block_size`` not an int >= 1; see the methods.
    """

    renumbers = False

    def __init__(self, block_size: int) -> None:
        positive_int("block_size", block_size)
        self.block_size = block_size
        self.length = 0
        self.state: tuple[torch.Tensor, ...] | None = None

    def read(self) -> tuple[torch.Tensor, ...] | None:
        """The state after :attr:`length` positions, or ``None`` before the first (a layer starts from zeros)."""
        return None if self.length == 0 else self.state

    def write(self, state: tuple[torch.Tensor, ...], T_new: int) -> None:
        """Replace the state by ``state`` (detached), which folds in ``T_new`` more positions.

        Raises:
            TypeError: ``state`` not a tuple of tensors. ValueError: past ``block_size``, or tensors of
                another number or shape than the state they replace.
        """
        if not isinstance(state, tuple) or not all(isinstance(s, torch.Tensor) for s in state):
            raise TypeError(f"state must be a tuple of tensors; got {type(state).__name__}")
        positive_int("T_new", T_new)
        if self.length + T_new > self.block_size:
            raise ValueError(f"the state holds {self.length} positions and block_size={self.block_size}; "
                             f"cannot add {T_new} more")
        if self.length and [s.shape for s in state] != [s.shape for s in self.state]:
            raise ValueError(f"this state holds tensors of shapes {[tuple(s.shape) for s in self.state]}; "
                             f"got {[tuple(s.shape) for s in state]} (filled by another layer?)")
        self.state = tuple(s.detach() for s in state)  # replaced, not appended: fixed size
        self.length += T_new

    def check_layer(self, layer, masked: bool) -> None:
        """A recurrent layer sees every position it folded in: nothing to refuse here."""

    def check_crop(self, length: int) -> None:
        """Raise as :meth:`crop` would, changing nothing."""
        non_negative_int("length", length)
        if 0 < length < self.length:
            raise ValueError(f"a recurrent state cannot crop to length={length}: the last {self.length - length} "
                             "positions are folded into it (crop to 0, or keep them)")

    def crop(self, length: int) -> None:
        """Forget everything (``length=0``); a length >= :attr:`length` changes nothing.

        Raises:
            TypeError / ValueError: ``length`` not an int >= 0, or between 0 and :attr:`length`.
        """
        self.check_crop(length)
        if length == 0:
            self.reset()

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` of the state.

        Raises:
            TypeError: ``index`` not an integer tensor. ValueError: not 1-D, or a row outside the batch.
        """
        batch_rows(index, self.state[0].shape[0] if self.state else None)
        if self.state is not None:
            self.state = tuple(s.index_select(0, index.to(s.device)) for s in self.state)

    def reset(self) -> None:
        """Forget every position (the next :meth:`read` is ``None``)."""
        self.length = 0
        self.state = None

    def bytes_per_token(self) -> int:
        """0: the state does not grow with the sequence (see :meth:`nbytes`)."""
        return 0

    def nbytes(self) -> int:
        """Bytes of the state (0 before the first write)."""
        return sum(s.numel() * s.element_size() for s in self.state or ())
