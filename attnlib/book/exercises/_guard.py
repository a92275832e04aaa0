"""The checks' integrity: the check helpers and the torch / Python functions they use, as imported.

A learner's cell can replace ``expect``, ``torch.allclose`` or ``builtins.isinstance``; a check
would then pass anything, in that exercise and every later one of the kernel. :func:`record` notes
those functions as each check is registered (while a chapter's checks are imported, before any
answer runs); :func:`attnlib.book.exercises._core.grade` calls :func:`restore` before each check,
and :func:`attnlib.book.exercises._run.run` calls :func:`tampered` after each call of an answer.
"""
from __future__ import annotations

import builtins
import copy
import gc
import inspect
import math
import sys
import threading
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch._dynamo.mutation_guard
import torch.nn.functional as F

# torch._dynamo wraps nn.Module.__init__ on its first use (FlexAttention, torch.compile): done now, not in an answer
torch._dynamo.mutation_guard.install_generation_tagging_init()

__all__ = ["frozen", "record", "restore", "settings", "settings_changed", "tampered"]

_GUARDED_NAMESPACES = (builtins, math, torch, F, torch.nn.init, torch.linalg, torch.testing)
_GUARDED_CLASSES = (torch.Tensor, torch._C.TensorBase, torch.nn.Module)
_snapshot_of_guarded: dict[tuple[str, str], tuple[Any, Any]] | None = None
_TORCH_DIR = str(Path(torch.__file__).parent)


def _guarded() -> Iterable[tuple[str, Any]]:
    for namespace in _GUARDED_NAMESPACES:
        yield namespace.__name__, namespace
    for klass in _GUARDED_CLASSES:
        yield klass.__qualname__, klass
    for name, module in list(sys.modules.items()):
        if name.startswith("attnlib.book.exercises") and module is not None:
            yield name, module


def _entries(owner: Any) -> dict[str, Any]:
    names = vars(owner)
    return {k: v for k, v in list(names.items()) if callable(v) and not (k.startswith("__") and k.endswith("__"))
            or k in ("__eq__", "__bool__", "__float__", "__int__", "__index__")}


def _fingerprint(value: Any) -> Any:
    func = getattr(value, "__func__", value)
    return getattr(func, "__code__", None)


def tampered() -> list[str]:
    """The check helpers and torch / Python functions replaced since the checks were loaded (names)."""
    if _snapshot_of_guarded is None:
        record()
        return []
    owners = dict(_guarded())
    changed = []
    for (owner_name, name), (value, code) in _snapshot_of_guarded.items():
        owner = owners.get(owner_name)
        if owner is None:
            continue
        now = vars(owner).get(name)
        if (now is value or type(now) is types.MethodType and now == value) and _fingerprint(now) is code:
            continue  # the same function (a bound method is made anew: ipykernel re-binds builtins.input)
        if _torch_wrapper_of(now, value):  # torch wraps some of its functions when torch._dynamo loads
            _snapshot_of_guarded[(owner_name, name)] = (now, _fingerprint(now))
            continue
        changed.append(f"{owner_name}.{name}")
    return changed


def _torch_wrapper_of(now: Any, value: Any) -> bool:
    """Whether ``now`` is torch's own wrapper (code in torch's package) around ``value``."""
    code = _fingerprint(now)
    return (code is not None and code.co_filename.startswith(_TORCH_DIR)
            and inspect.unwrap(getattr(now, "__func__", now)) is inspect.unwrap(getattr(value, "__func__", value)))


def record() -> None:
    """Note the check helpers and torch functions as they are now (called as each check is registered,
    while a chapter's checks are imported, before any answer has run); later calls add new names only."""
    global _snapshot_of_guarded
    if _snapshot_of_guarded is None:
        _snapshot_of_guarded = {}
    for owner_name, owner in _guarded():
        for name, value in _entries(owner).items():
            _snapshot_of_guarded.setdefault((owner_name, name), (value, _fingerprint(value)))


def restore() -> None:
    """Put back whatever :func:`tampered` reports, and record the check modules loaded since."""
    if _snapshot_of_guarded is None:
        record()
        return
    tampered()  # takes torch's own wrappers (torch._dynamo's) as the new originals
    owners = dict(_guarded())
    for (owner_name, name), (value, code) in _snapshot_of_guarded.items():
        owner = owners.get(owner_name)
        if owner is None:
            continue
        func = getattr(value, "__func__", value)
        if code is not None and getattr(func, "__code__", code) is not code:
            func.__code__ = code
        if vars(owner).get(name) is not value:
            setattr(owner, name, value)
    record()  # check modules imported after the first snapshot


_MORE_NAMESPACES = (sys, threading, copy, inspect, gc, threading.Thread)


def frozen() -> Any:
    """Note, before an answer runs, every name it could replace to pass; return ``changed()`` for after it ran.

    The namespaces of :func:`tampered` (and ``sys``, ``threading``, ``inspect``, ``gc``, ``copy``), every
    ``attnlib`` module (a check's reference lives there), each name's value and each Python function's code.
    ``changed()`` puts back what the answer replaced, added or rewrote (a helper's ``__code__``, a module
    global that shadows a builtin, ``torch.Tensor.double``) and returns the names; it reads nothing from a
    module at call time (everything it needs is bound now), so an answer cannot replace what it compares with.
    Names torch adds itself (a submodule imported, a helper of its own) are not changes.
    """
    owners = [o for _, o in _guarded()] + list(_MORE_NAMESPACES)
    owners += [m for n, m in list(sys.modules.items()) if n.startswith("attnlib") and m is not None]
    saved, shadowing = [], frozenset(vars(builtins))
    for owner in owners:
        names = dict(vars(owner))
        codes = {k: v.__code__ for k, v in names.items() if type(v) is types.FunctionType}
        saved.append((owner, names, codes, isinstance(owner, type), getattr(owner, "__name__", "?")))

    def changed(_saved=saved, _vars=vars, _isinstance=isinstance, _setattr=setattr, _delattr=delattr,
                _module=types.ModuleType, _list=list, _builtins=shadowing, _getattr=getattr,
                _str=str, _torchs=_torch_wrapper_of) -> list[str]:
        found = []
        for owner, names, codes, is_class, label in _saved:
            now = _vars(owner)
            for key in _list(now.keys()):
                value = now[key]
                if key not in names:
                    if key not in _builtins and (_isinstance(value, _module) or (
                            label.startswith("torch") and not is_class
                            and _str(_getattr(value, "__module__", "")).startswith("torch"))):
                        continue  # torch importing its own submodules or helpers
                    found.append(f"{label}.{key}")
                    _delattr(owner, key)
                elif value is not names[key] and not _isinstance(names[key], _module):
                    if _torchs(value, names[key]):
                        continue  # torch._dynamo wrapping torch.manual_seed as it loads: torch's own doing
                    found.append(f"{label}.{key}")
                    _setattr(owner, key, names[key])
            for key, code in codes.items():
                if names[key].__code__ is not code:
                    found.append(f"{label}.{key}.__code__")
                    names[key].__code__ = code
        return found

    return changed


def settings() -> tuple:
    return torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()


def settings_changed(before: tuple) -> list[str]:
    """Torch's global settings the answer changed (put back): a default dtype of float64 can hide a wrong one."""
    if settings() == before:
        return []
    torch.set_default_dtype(before[0])
    torch.use_deterministic_algorithms(before[1], warn_only=before[2])
    return ["global settings (torch.set_default_dtype / use_deterministic_algorithms)"]
