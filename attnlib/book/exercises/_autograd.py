"""Gradients "by hand": what an answer may not use, and a watch for an autograd graph (02.1, 10.3, 15.5).

:data:`AUTOGRAD` lists autograd's entry points, reverse and forward mode, for a
:class:`attnlib.book.exercises._run.Refuse`; :class:`GraphWatch` (passed in ``run(..., inside=...)``)
notices a graph recorded by any other door (the engine called directly, a custom ``Function``).
"""
from __future__ import annotations

import torch
import torch.autograd.forward_ad
import torch.autograd.functional
import torch.func
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["AUTOGRAD", "GraphWatch"]

#: autograd's entry points, reverse and forward mode
AUTOGRAD = (
    torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward, torch.autograd.functional.vjp,
    torch.autograd.functional.jvp, torch.autograd.functional.jacobian, torch.autograd.functional.hessian,
    torch.func.grad, torch.func.vjp, torch.func.jvp, torch.func.jacrev, torch.func.jacfwd, torch.func.grad_and_value,
    torch.func.linearize, torch.autograd.forward_ad.make_dual, torch.autograd.graph.disable_saved_tensors_hooks,
)


class GraphWatch:
    """Notes whether the answer recorded an autograd graph (a tensor saved for a backward pass)."""

    def __init__(self) -> None:
        self.recorded = False
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.recorded = True
        return tensor

    def __enter__(self) -> GraphWatch:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
