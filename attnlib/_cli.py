"""Argument types for attnlib's command lines: a bad flag is an argparse ``error:`` line (exit 2), never a traceback.

Each function is an argparse ``type=`` callable: it returns the parsed value or raises
:class:`argparse.ArgumentTypeError` naming the value and what was expected, so argparse
prints ``prog: error: argument --flag: ...`` and exits with status 2 before anything runs.
The output-path checks create nothing that stays: they find the first existing ancestor and
make (and remove) a file in it, so a long run is never lost to an output path that could not be
written at the end (a permission check alone misses read-only file systems, and root). Results are
written with :func:`write_json`: to a temporary file beside the target, then renamed onto it, so an
interrupted run never leaves a truncated file.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from attnlib._device import check_device

__all__ = [
    "device",
    "fraction",
    "int_list",
    "name_list",
    "nonnegative_float",
    "nonnegative_int",
    "output_dir",
    "output_file",
    "positive_float",
    "positive_int",
    "seed",
    "top_p",
    "write_json",
    "write_text",
]


def _number(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _ranged(kind: type, accept, refusal: str, doc: str):
    """An argparse type: ``text`` as a ``kind`` (int or finite float) that ``accept`` holds for, else ``refusal``."""
    def parse(text: str):
        value = _number(text, kind)
        if not accept(value):
            raise argparse.ArgumentTypeError(refusal.format(value=value))
        return value

    parse.__doc__ = doc
    return parse


positive_int = _ranged(int, lambda v: v >= 1, "{value} is not a positive integer (expected >= 1)",
                       "An integer >= 1 (sizes, step counts).")
nonnegative_int = _ranged(int, lambda v: v >= 0, "{value} is negative (expected an integer >= 0)",
                          "An integer >= 0 (a number of tokens to sample, a seed).")
positive_float = _ranged(float, lambda v: v > 0, "{value} is not > 0 (expected a finite number > 0)",
                         "A finite number > 0 (a learning rate).")
nonnegative_float = _ranged(float, lambda v: v >= 0, "{value} is negative (expected a finite number >= 0)",
                            "A finite number >= 0 (a sampling temperature: 0 = greedy).")
fraction = _ranged(float, lambda v: 0 <= v < 1, "{value} is not in [0, 1)", "A number in [0, 1) (a dropout probability).")
top_p = _ranged(float, lambda v: 0 < v <= 1, "{value} is not in (0, 1]",
                "A number in (0, 1] (nucleus sampling's probability mass; 1 keeps every token).")


def seed(text: str) -> int:
    """A random seed: an integer that ``torch.manual_seed`` takes, ``0 <= seed < 2**64``."""
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative (expected a seed, 0 <= seed < 2**64)")
    if value >= 2**64:
        raise argparse.ArgumentTypeError(f"{value} is too large (expected a seed, 0 <= seed < 2**64)")
    return value


def device(text: str) -> str:
    """A torch device string that this machine has (``cpu``, ``cuda``, ``cuda:1``, ``mps``): :func:`attnlib._device.check_device`."""
    try:
        check_device(None, text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _creatable_dir(path: Path, text: str) -> None:
    """Raise unless ``path`` is a writable directory or could be created as one (nothing is created)."""
    probe = path.absolute()
    while not probe.exists():
        if probe.is_symlink():  # a dangling link
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: {probe} is a broken symbolic link")
        probe = probe.parent
    if not probe.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {probe} exists and is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the directory {probe} is not writable")
    try:  # the real test: os.access says yes to root, and on a read-only file system
        with tempfile.TemporaryFile(dir=probe, prefix=".attnlib-probe-"):
            pass
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the directory {probe} refuses a new file ({err.strerror})") from None


def output_dir(text: str) -> Path:
    """A directory to write into: it exists and is writable, or it can be created."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path (expected a directory)")
    path = Path(text)
    _creatable_dir(path, text)
    return path


def output_file(text: str) -> Path:
    """A file to write: not a directory, and its directory exists and is writable or can be created."""
    if not text or text.endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a file name (expected a path like results/run.json)")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory (expected a file name)")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not writable")
    _creatable_dir(path.parent, text)
    return path


def _split(text: str) -> list[str]:
    return [part for part in text.replace(" ", ",").split(",") if part]


def _no_repeats(items: list, text: str) -> None:
    if repeated := list(dict.fromkeys(x for i, x in enumerate(items) if x in items[:i])):
        raise argparse.ArgumentTypeError(f"{text!r} repeats {','.join(map(str, repeated))} (expected each once)")


def name_list(choices: Sequence[str], unique: bool = True) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names from ``choices``, at least one (each once, with ``unique``)."""
    def parse(text: str) -> list[str]:
        names = _split(text)
        if not names:
            raise argparse.ArgumentTypeError(f"{text!r} names nothing; choose from {','.join(choices)}")
        if unknown := [n for n in names if n not in choices]:
            raise argparse.ArgumentTypeError(f"{','.join(unknown)} not among {','.join(choices)}")
        if unique:
            _no_repeats(names, text)
        return names

    parse.__name__ = "names"  # argparse's "invalid names value" if anything else goes wrong
    return parse


def int_list(low: int = 1, unique: bool = True) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers ``>= low``, at least one (each once, with ``unique``)."""
    def parse(text: str) -> list[int]:
        parts = _split(text)
        if not parts:
            raise argparse.ArgumentTypeError(f"{text!r} holds no integers (expected e.g. 32,64)")
        values = []
        for part in parts:
            try:
                values.append(int(part))
            except ValueError:
                raise argparse.ArgumentTypeError(f"{part!r} in {text!r} is not an integer") from None
            if values[-1] < low:
                raise argparse.ArgumentTypeError(f"{values[-1]} in {text!r} must be >= {low}")
        if unique:
            _no_repeats(values, text)
        return values

    parse.__name__ = "integers"
    return parse


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (directories created as needed); return the path.

    The text goes to a temporary file beside ``path`` that then replaces it in one step
    (``os.replace``): an interrupted or failed write leaves the old file as it was, and no
    temporary file behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # same directory: os.replace stays one rename
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json(path: str | Path, payload, indent: int | None = 1, newline: bool = True) -> Path:
    """``payload`` as JSON, written atomically by :func:`write_text`; return the path.

    The text is ``json.dumps(payload, indent=indent)``, and a final newline with ``newline``.

    Serialised before anything is written: a value JSON cannot take raises ``TypeError`` and the
    old file stays as it was. Every command line of attnlib writes its results with this.
    """
    text = json.dumps(payload, indent=indent) + ("\n" if newline else "")
    return write_text(path, text)
