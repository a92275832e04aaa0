"""Refusals that :class:`attnlib.book.exercises._run.Refuse` does not reach (chapters 10-12).

* :class:`RefuseOps`: a composite ATen operator called as ``torch.ops.aten.<op>`` (it is split into
  its parts before a ``TorchDispatchMode`` sees it, and ``torch.ops`` calls skip a
  ``TorchFunctionMode``);
* :class:`RefuseModules`: any call into a module (Python functions by their module, C functions and
  methods, e.g. Hugging Face ``tokenizers``' Rust classes or compiled regular expressions, by the
  module of the function or of the object it is bound to).

Both go into ``run(..., inside=(...,))``: they watch the answer's own thread, raise
:class:`Wrong` at the call and keep the calls they saw in ``calls`` (an answer that catches the
exception is still refused: the check raises :meth:`verdict` after the run).
"""
from __future__ import annotations

import sys

import torch
import torch._ops

from attnlib.book.exercises._core import Wrong

__all__ = ["RefuseOps", "RefuseModules"]


class _Hook:
    def __init__(self, why: str) -> None:
        self.why, self.calls = why, []

    def refuse(self, name: str) -> None:
        self.calls.append(name)
        raise Wrong(f"{self.why}: your code called {name}")

    def verdict(self) -> None:
        """Raise :class:`Wrong` if the answer reached a refused call (even one whose exception it caught)."""
        if self.calls:
            raise Wrong(f"{self.why}: your code called {self.calls[0]}")


class RefuseOps(_Hook):
    """Refuses ``torch.ops.<namespace>.<op>`` calls whose name contains one of ``parts`` (a trace hook)."""

    _CALLS = (torch._ops.OpOverloadPacket.__call__.__code__, torch._ops.OpOverload.__call__.__code__)

    def __init__(self, why: str, *parts: str) -> None:
        super().__init__(why)
        self.parts = parts

    def _trace(self, frame, event, arg):
        if event == "call" and frame.f_code in self._CALLS:
            name = str(frame.f_locals.get("self"))
            if any(part in name for part in self.parts):
                self.refuse(f"torch.ops.{name}")
        return None

    def __enter__(self) -> RefuseOps:
        self.calls.clear()
        self._previous = sys.gettrace()
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self._previous)


def _inside(module: str | None, prefixes: tuple[str, ...]) -> bool:
    return bool(module) and any(module == p or module.startswith(p + ".") for p in prefixes)


class RefuseModules(_Hook):
    """Refuses every call into the modules named by ``prefixes`` (``"re"`` covers ``re._compiler``), a profile hook.

    Do not pass ``run`` a :class:`Refuse` with Python targets at the same time: its profile hook
    would replace this one.
    """

    def __init__(self, why: str, *prefixes: str) -> None:
        super().__init__(why)
        self.prefixes = prefixes

    def _profile(self, frame, event, arg):
        if event == "call":
            module = frame.f_globals.get("__name__")
            if _inside(module, self.prefixes) and not _inside(frame.f_back.f_globals.get("__name__"),
                                                               self.prefixes):
                self.refuse(f"{module}.{frame.f_code.co_qualname}")
        elif event == "c_call":
            owner = getattr(arg, "__self__", None)
            for module in (getattr(arg, "__module__", None), type(owner).__module__ if owner is not None else None,
                           getattr(owner, "__name__", None) if isinstance(owner, type(sys)) else None):
                if _inside(module, self.prefixes):
                    self.refuse(f"{module}.{getattr(arg, '__qualname__', getattr(arg, '__name__', arg))}")

    def __enter__(self) -> RefuseModules:
        self.calls.clear()
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._previous)
