"""Running a learner's answer inside a check: :func:`run`, :class:`Refuse` and the checks' own integrity.

Every check calls the learner's code through :func:`run`, which

* calls it in a thread of its own: the answer cannot walk up the stack into the check's frames;
* refuses what the exercise forbids wherever it is reached from (:class:`Refuse`): Python functions
  and classes by their code (an alias, a re-export or a name imported in the chapter's own import
  cell is the same code), torch functions through a ``TorchFunctionMode`` and ATen operators
  (``torch.ops.aten...``) through a ``TorchDispatchMode``;
* hands the answer copies and compares its arguments before and after (an answer that changes its
  input in place is told so, instead of the reference failing later on a changed tensor);
* checks the call against the answer's signature first; reports the answer's exception with its line;
* checks that the answer left the check's helpers and torch's functions as they were
  (:func:`attnlib.book.exercises._guard.tampered`), so that replacing ``expect`` or ``torch.allclose`` cannot pass an answer.
"""
from __future__ import annotations

import _thread
import contextlib
import copy
import gc
import inspect
import linecache
import sys
import sysconfig
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from attnlib.book.exercises._core import NotSolved, Wrong, _learner_code, _raised_by_learner
from attnlib.book.exercises._guard import _TORCH_DIR, frozen, restore, settings, settings_changed, tampered

__all__ = ["HF_ATTENTION", "Refuse", "run", "tensors_in"]

#: transformers' attention functions (each model's modeling file has its own copy): ``Refuse(named=...)``
HF_ATTENTION = ("eager_attention_forward", "sdpa_attention_forward", "flex_attention_forward",
                "flash_attention_forward", "paged_attention_forward")


class Refuse:
    """What an answer may not call, and why: Python functions or classes, torch functions, ATen operators.

    ``Refuse("write the attention by hand", attnlib.attention.attention, F.scaled_dot_product_attention,
    aten="scaled_dot_product")`` refuses attnlib's function under any name it is reached by, SDPA
    through any of ``F``, ``torch._C._nn`` or ``torch.ops.aten`` (``aten`` is a substring of the
    operator's name). A class refuses every method it defines. Refusals add: ``a + b``.
    """

    def __init__(self, why: str, *targets: Any, aten: str | Iterable[str] = (), named: Iterable[str] = ()) -> None:
        self.why, self.named = why, frozenset(named)  # named: functions of transformers (one copy per model)
        self.codes: dict[types.CodeType, str] = {}
        self.torch_functions: dict[Any, str] = {}
        self.aten = (aten,) if isinstance(aten, str) else tuple(aten)
        for target in targets:
            self._add(target)
        for name in torch._C._dispatch_get_all_op_names() if self.aten else ():
            if name.startswith("aten::") and any(part in name for part in self.aten):
                packet = getattr(torch.ops.aten, name[6:].split(".")[0], None)
                for overload in [] if packet is None else packet.overloads():
                    self.torch_functions[getattr(packet, overload)._op] = name  # ._op called directly

    def _add(self, target: Any) -> None:
        name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
        module = getattr(target, "__module__", None) or ""
        label = f"{module}.{name}" if module and not module.startswith("torch._C") else name
        if inspect.isclass(target):  # its methods and those of its bases in its module (a private _KeptCache)
            for klass in [k for k in target.__mro__ if k.__module__ == target.__module__]:
                for value in vars(klass).values():
                    func = getattr(value, "__func__", value)
                    if isinstance(func, types.FunctionType):
                        self.codes.setdefault(inspect.unwrap(func).__code__, f"{module}.{klass.__qualname__}")
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
        joined.aten, joined.named = self.aten + other.aten, self.named | other.named
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
            self.calls.append(f"{self.refuse.why}: your code called {label}")
            raise Wrong(self.calls[-1])
        return func(*args, **(kwargs or {}))


class _WatchAten(TorchDispatchMode):
    def __init__(self, refuse: Refuse, calls: list[str]) -> None:
        super().__init__()
        self.refuse, self.calls = refuse, calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(part in name for part in self.refuse.aten):
            self.calls.append(f"{self.refuse.why}: your code called {name}")
            raise Wrong(self.calls[-1])
        return func(*args, **(kwargs or {}))


#: What an answer may not call from its own code (torch's own code may): it would leave the check's watch
#: (another thread has no profile hook and no torch mode), switch the watch off, or reach the check's objects.
_ESCAPES = {f: f"{getattr(f, '__module__', None) or 'torch._C'}.{f.__name__}" for f in (
    sys.setprofile, sys.getprofile, sys.settrace, sys._current_frames, _thread.start_new_thread, gc.get_objects,
    gc.get_referrers, gc.get_referents, torch._C._pop_torch_function_stack, torch._C._pop_torch_dispatch_stack,
    torch._C._get_function_stack_at, torch._C._get_dispatch_stack_at)}
_ESCAPE_WHY = ("an answer computes its result in its own call: it may not start a thread, switch off the check's "
               "watch or reach into the check's objects")
_OP_CALLS = {torch._ops.OpOverload.__call__.__code__, torch._ops.OpOverloadPacket.__call__.__code__}
_STDLIB = sysconfig.get_paths()["stdlib"]


def _from_torch(frame: Any) -> bool:
    """Whether the nearest frame outside Python's standard library (from ``frame`` up) is torch's or this module's."""
    while frame is not None and frame.f_code.co_filename.startswith(_STDLIB) and "-packages" not in \
            frame.f_code.co_filename:
        frame = frame.f_back
    return frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                  or frame.f_code.co_filename == _from_torch.__code__.co_filename)


def _profile(refuse: Refuse, calls: list[str], previous: Callable | None = None) -> Callable:
    def hook(frame, event, arg):
        try:
            previous is not None and previous(frame, event, arg)
        except Wrong as e:  # the hook of inside= refused the call
            calls.append(str(e))
            raise
        label, why = None, refuse.why
        if event == "call":
            label = refuse.codes.get(frame.f_code)
            if frame.f_code.co_name in refuse.named and "transformers" in frame.f_code.co_filename:
                label = f"transformers' {frame.f_code.co_name}"
            if label is None and frame.f_code in _OP_CALLS and refuse.aten:  # torch.ops.aten.x(...), modes or not
                name = str(frame.f_locals.get("self"))
                label = name if any(part in name for part in refuse.aten) else None
        elif event == "c_call":  # a C function: a refused one, or a way out of the watch
            try:
                label = refuse.torch_functions.get(arg)
                if label is None and arg in _ESCAPES and not _from_torch(frame):
                    label, why = _ESCAPES[arg], _ESCAPE_WHY
            except TypeError:  # unhashable
                label = None
        if label is not None:
            calls.append(f"{why}: your code called {label}")
            raise Wrong(calls[-1])
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
        repeat: int = 0, **kwargs: Any) -> Any:
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
        repeat: call ``fn`` this many times on the same arguments in one run and return the list of
            results (a sampler's law is checked over thousands of calls); ``0``: once, the result itself.

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
    watched = refuse if refuse is not None else Refuse("")
    before_settings = settings()
    changed_names = frozen()  # before the answer runs: what it could replace to pass

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
            hook = _profile(watched, calls, sys.getprofile())  # after a hook of inside=, which it calls first
            sys.setprofile(hook)
            try:
                result["value"] = [fn(*given, **kwargs) for _ in range(repeat)] if repeat else fn(*given, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the check's thread
                result["error"] = e
            finally:
                if sys.getprofile() is not hook and not calls:  # switched off another way (ctypes)
                    calls.append(f"{_ESCAPE_WHY}: your code switched off the check's profile hook")
                sys.setprofile(None)

    worker = threading.Thread(target=call, name="attnlib-exercise-answer", daemon=True)
    worker.start()
    worker.join()
    changed = changed_names() + settings_changed(before_settings) + tampered()
    if changed:
        restore()
        raise Wrong(f"{what}: your code replaced the check's own {', '.join(changed[:3])}; the check puts them "
                    "back and grades what your code computes, so write the answer, not around the check")
    if calls:
        raise Wrong(calls[0])
    error = result.get("error")
    if error is not None:
        if isinstance(error, (Wrong, NotSolved)):
            raise error
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise error
        blamed = fn if learner is None else learner
        if not _raised_by_learner(error, blamed):
            raise error  # the check's own failure (grade reports a checker error)
        if isinstance(error, NotImplementedError) and _last_frame_is(error, blamed):  # not torch's deep inside
            raise NotSolved(str(error) or "the stub still raises NotImplementedError")
        raise Wrong(f"{what}: your code raised {type(error).__name__}: {error}{_learner_line(error, blamed)}") from None
    for i, (old, new) in enumerate(zip(before, given)):
        if _changed(old, new):
            raise Wrong(f"{what}: your code changed its argument {_arg_name(fn, i)} in place; leave the "
                        "inputs as they are (work on a copy, x.clone(), or return a new tensor)")
    return result["value"]


def _last_frame_is(error: BaseException, answer: Any) -> bool:
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code in _learner_code(answer)


def _arg_name(fn: Any, i: int) -> str:
    try:
        names = list(inspect.signature(fn).parameters)
        return f"{names[i]!r}" if i < len(names) else f"#{i + 1}"
    except (TypeError, ValueError):
        return f"#{i + 1}"



def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside ``value`` (nested lists, tuples, dicts)."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
