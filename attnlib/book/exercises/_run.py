"""Running a learner's answer inside a check: :func:`run`, :class:`Refuse` and the checks' own integrity.

Every check calls the learner's code through :func:`run`, which

* calls it in a thread of its own, so the answer cannot walk up the stack into the check's frames
  (where the expected values and the reference live);
* refuses what the exercise forbids wherever it is reached from (:class:`Refuse`): Python functions
  and classes by their code (an alias, a re-export or a name imported in the chapter's own import
  cell is the same code), torch functions through a ``TorchFunctionMode`` and ATen operators
  (``torch.ops.aten...``) through a ``TorchDispatchMode``;
* hands the answer copies and compares its arguments before and after (an answer that changes its
  input in place is told so, instead of the reference failing later on a changed tensor);
* checks the call against the answer's signature first, and reports the answer's own exception with
  the line of the answer that raised it;
* checks that the answer left the check's helpers and torch's functions as they were
  (:func:`attnlib.book.exercises._guard.tampered`), so that replacing ``expect`` or ``torch.allclose`` cannot pass an answer.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import linecache
import sys
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from attnlib.book.exercises._core import NotSolved, Wrong, _learner_code, _raised_by_learner
from attnlib.book.exercises._guard import restore, tampered

__all__ = ["Refuse", "run", "tensors_in"]


class Refuse:
    """What an answer may not call, and why: Python functions or classes, torch functions, ATen operators.

    ``Refuse("write the attention by hand", attnlib.attention.attention, F.scaled_dot_product_attention,
    aten="scaled_dot_product")`` refuses attnlib's function under any name it is reached by, SDPA
    through any of ``F``, ``torch._C._nn`` or ``torch.ops.aten`` (``aten`` is a substring of the
    operator's name). A class refuses every method it defines. Refusals add: ``a + b``.
    """

    def __init__(self, why: str, *targets: Any, aten: str | Iterable[str] = ()) -> None:
        self.why = why
        self.codes: dict[types.CodeType, str] = {}
        self.torch_functions: dict[Any, str] = {}
        self.aten = (aten,) if isinstance(aten, str) else tuple(aten)
        for target in targets:
            self._add(target)

    def _add(self, target: Any) -> None:
        name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
        module = getattr(target, "__module__", None) or ""
        label = f"{module}.{name}" if module and not module.startswith("torch._C") else name
        if inspect.isclass(target):
            for value in vars(target).values():
                func = getattr(value, "__func__", value)
                if isinstance(func, types.FunctionType):
                    self.codes[inspect.unwrap(func).__code__] = label
            return
        func = inspect.unwrap(getattr(target, "__func__", target))
        if isinstance(func, types.FunctionType):
            self.codes[func.__code__] = label
        else:  # a builtin: torch's reach a TorchFunctionMode, any other the profile hook's "c_call"
            self.torch_functions[func] = label

    def __add__(self, other: Refuse) -> Refuse:
        joined = Refuse(f"{self.why}; {other.why}")
        joined.codes = {**self.codes, **other.codes}
        joined.torch_functions = {**self.torch_functions, **other.torch_functions}
        joined.aten = self.aten + other.aten
        return joined


class _Watch(TorchFunctionMode):
    """Notes every refused torch function and ATen operator the answer reaches (and stops it)."""

    def __init__(self, refuse: Refuse, calls: list[str]) -> None:
        super().__init__()
        self.refuse, self.calls = refuse, calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        label = self.refuse.torch_functions.get(func)
        if label is None:
            label = self.refuse.torch_functions.get(getattr(func, "__wrapped__", None))
        if label is None and str(func).startswith("aten.") and any(p in str(func) for p in self.refuse.aten):
            label = str(func)  # torch.ops.aten.x(...) called directly: seen here before it decomposes
        if label is not None:
            self.calls.append(label)
            raise Wrong(f"{self.refuse.why}: your code called {label}")
        return func(*args, **(kwargs or {}))


class _WatchAten(TorchDispatchMode):
    def __init__(self, refuse: Refuse, calls: list[str]) -> None:
        super().__init__()
        self.refuse, self.calls = refuse, calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(part in name for part in self.refuse.aten):
            self.calls.append(name)
            raise Wrong(f"{self.refuse.why}: your code called {name}")
        return func(*args, **(kwargs or {}))


def _profile(refuse: Refuse, calls: list[str]) -> Callable:
    def hook(frame, event, arg):
        label = None
        if event == "call":
            label = refuse.codes.get(frame.f_code)
        elif event == "c_call":  # a C function that is no torch function (autograd's engine, say)
            try:
                label = refuse.torch_functions.get(arg)
            except TypeError:  # unhashable
                label = None
        if label is not None:
            calls.append(label)
            raise Wrong(f"{refuse.why}: your code called {label}")
    return hook


# ------------------------------------------------------------------------------ arguments


def _snapshot(value: Any) -> Any:
    """A copy of the tensors in ``value`` (a tensor, a module's state, containers of them) to compare later."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, torch.nn.Module):
        return {k: v.detach().clone() for k, v in value.state_dict().items()}
    if isinstance(value, (list, tuple)):
        return [_snapshot(v) for v in value]
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return None


def _copy(value: Any) -> Any:
    """A deep copy of an argument, or the argument itself where it cannot be copied (a non-leaf tensor)."""
    try:
        return copy.deepcopy(value)
    except (RuntimeError, TypeError):
        return value


def _changed(before: Any, value: Any) -> bool:
    if before is None:
        return False
    if isinstance(value, torch.Tensor):
        return not (before.shape == value.shape and torch.equal(before, value.detach()))
    if isinstance(value, torch.nn.Module):
        after = value.state_dict()
        return before.keys() != after.keys() or any(not torch.equal(before[k], after[k]) for k in before)
    if isinstance(value, (list, tuple)):
        return len(before) != len(value) or any(_changed(b, v) for b, v in zip(before, value))
    if isinstance(value, dict):
        return any(_changed(before[k], value.get(k)) for k in before)
    return False


def _signature_hint(fn: Any, args: tuple, kwargs: dict, what: str) -> str | None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        given = len(args) + len(kwargs)
        return (f"{what}: your function's signature is {getattr(fn, '__name__', 'answer')}{signature}, but the "
                f"check calls it with {given} argument{'s' * (given != 1)}{' (' + ', '.join(kwargs) + ')' if kwargs else ''}: "
                f"{e}")
    return None


def _learner_line(error: BaseException, answer: Any) -> str:
    """``" (line N of your code: <source>)"`` for the last frame of ``answer``'s own code on ``error``'s traceback."""
    codes = _learner_code(answer)
    tb, found = error.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            found = tb
        tb = tb.tb_next
    if found is None:
        return ""
    source = linecache.getline(found.tb_frame.f_code.co_filename, found.tb_lineno).strip()
    return f" (line {found.tb_lineno} of {found.tb_frame.f_code.co_name}: {source})" if source else ""


# ------------------------------------------------------------------------------ run


def run(fn: Any, *args: Any, what: str, refuse: Refuse | None = None, mutable: Iterable[int] = (),
        inside: Iterable[contextlib.AbstractContextManager] = (), copy_args: bool = True, learner: Any = None,
        **kwargs: Any) -> Any:
    """Call the learner's ``fn(*args, **kwargs)`` as a check must; return what it returned.

    Args:
        fn: the learner's function, class or module.
        what: how the call reads in a hint, e.g. ``"causal_mask(3, 5)"``.
        refuse: what the answer may not call (see :class:`Refuse`).
        mutable: positions of arguments the answer is meant to change in place (a cache it fills).
        inside: context managers entered around the call in the answer's thread (a memory tracker);
            torch's modes are per thread.
        copy_args: pass deep copies of the arguments (the check keeps its own); ``False`` passes them as they are.
        learner: the learner's answer when ``fn`` is the check's own wrapper around it (whose code an
            exception must come from to be the learner's); ``fn`` by default.

    Raises:
        Wrong: the signature does not take these arguments, the answer raised, changed an argument in
            place, called something refused, or replaced the check's own helpers.
        NotSolved: the answer raised ``NotImplementedError``.
    """
    hint = _signature_hint(fn, args, kwargs, what)
    if hint is not None:
        raise Wrong(hint)
    mutable = set(mutable)
    given = [_copy(a) if copy_args and i not in mutable else a for i, a in enumerate(args)]
    before = [None if i in mutable else _snapshot(a) for i, a in enumerate(given)]
    result: dict[str, Any] = {}
    calls: list[str] = []
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def call() -> None:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            if inference:
                stack.enter_context(torch.inference_mode())
            for manager in inside:
                stack.enter_context(manager)
            if refuse is not None:
                stack.enter_context(_Watch(refuse, calls))
                if refuse.aten:
                    stack.enter_context(_WatchAten(refuse, calls))
                if refuse.codes or refuse.torch_functions:
                    sys.setprofile(_profile(refuse, calls))
            try:
                result["value"] = fn(*given, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the check's thread
                result["error"] = e
            finally:
                sys.setprofile(None)

    worker = threading.Thread(target=call, name="attnlib-exercise-answer", daemon=True)
    worker.start()
    worker.join()
    changed = tampered()
    if changed:
        restore()
        raise Wrong(f"{what}: your code replaced the check's own {', '.join(changed[:3])}; the check puts them "
                    "back and grades what your code computes, so write the answer, not around the check")
    if calls:
        raise Wrong(f"{refuse.why}: your code called {calls[0]}")
    error = result.get("error")
    if error is not None:
        if isinstance(error, (Wrong, NotSolved)):
            raise error
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise error
        blamed = fn if learner is None else learner
        if not _raised_by_learner(error, blamed):
            raise error  # the check's own failure (grade reports a checker error)
        if isinstance(error, NotImplementedError):
            raise NotSolved(str(error) or "the stub still raises NotImplementedError")
        raise Wrong(f"{what}: your code raised {type(error).__name__}: {error}{_learner_line(error, blamed)}") from None
    for i, (old, new) in enumerate(zip(before, given)):
        if _changed(old, new):
            raise Wrong(f"{what}: your code changed its argument {_arg_name(fn, i)} in place; leave the "
                        "inputs as they are (work on a copy, x.clone(), or return a new tensor)")
    return result["value"]


def _arg_name(fn: Any, i: int) -> str:
    try:
        names = list(inspect.signature(fn).parameters)
        return f"{names[i]!r}" if i < len(names) else f"#{i + 1}"
    except (TypeError, ValueError):
        return f"#{i + 1}"



def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside ``value`` (nested lists, tuples, dicts)."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
