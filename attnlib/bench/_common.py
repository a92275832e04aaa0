"""What every benchmark shares: the environment header, timing, tables and JSON files."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch.utils import benchmark

import attnlib
from attnlib import _cli

__all__ = ["Command", "environment", "load_average", "format_environment", "format_table", "load_results", "resolve_device",
           "threads", "time_after_setup", "time_calls", "write_json"]

@dataclasses.dataclass(frozen=True)
class Command:
    """A benchmark the command line runs by name, defined next to its rows and table.

    Attributes:
        help: the one-line description in ``--help``.
        add_arguments: ``(parser) -> None``: its own flags (the common ones are added for it).
        check: ``(parser, args) -> None``: fill ``--small`` defaults, ``parser.error`` on bad combinations.
        run: ``(args, device) -> (settings, rows, text, summary)``.
        repeats, warmup: defaults of ``--repeats`` and ``--warmup``.
    """

    help: str
    add_arguments: Callable
    check: Callable
    run: Callable
    repeats: int = 3
    warmup: int = 1


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device``; ``None`` means :func:`attnlib.device` (CUDA, then MPS, then CPU)."""
    return attnlib.device() if device is None else torch.device(device)


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)`` (``None``: leave it), then restore the old number."""
    old = torch.get_num_threads()
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"threads={n!r} must be a positive int or None")
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15-minute load averages (``None`` where the OS has none): how busy it was."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def environment(device: torch.device) -> dict:
    """Versions and hardware that the numbers depend on, and the load average when asked."""
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    else:
        env["device_name"] = platform.processor() or platform.machine()
    env["cpus"] = os.cpu_count()
    env["load_average"] = load_average()
    return env


def format_environment(env: dict) -> str:
    """One line: ``torch 2.x | 2 threads | cpu (x86_64) | load 0.50, 0.40, 0.30``."""
    line = f"torch {env['torch']} | {env['threads']} threads | {env['device']} ({env['device_name']})"
    if env.get("load_average"):
        line += f" | load {', '.join(f'{x:.2f}' for x in env['load_average'])} on {env.get('cpus')} cpus"
    return line


def time_calls(fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, measured in rounds that interleave the functions.

    Each function is called ``warmup`` times untimed; then, ``repeats`` times, every
    function is timed once in turn with ``torch.utils.benchmark.Timer`` (which
    synchronises an accelerator and uses all of torch's threads here). Interleaving
    means a change in the machine's load hits every function alike. ``Timer.timeit(number=1)``
    itself calls the function twice, untimed, before the timed call: a function that changes
    state each call (a decode step on a cache) needs :func:`time_after_setup` instead.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be a positive int")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    timers = {
        name: benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        for name, fn in fns.items()
    }
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, timer in timers.items():
            times[name].append(timer.timeit(number=1).median)
    return {name: statistics.median(ts) for name, ts in times.items()}


def time_after_setup(fns: dict[str, Callable[[], object]], setups: dict[str, Callable[[], object]], repeats: int = 5,
                     warmup: int = 1, device: torch.device | str | None = None) -> dict[str, float]:
    """Median seconds per call of each function, each call made right after its own untimed setup.

    For calls that consume what their setup prepares (decoding from a restored, prefilled cache). As
    :func:`time_calls`, in ``repeats`` rounds that interleave the functions, after ``warmup`` untimed
    setup + call pairs each; every call is timed alone by ``time.perf_counter``, the accelerator of
    ``device`` synchronised before and after it.

    Raises:
        ValueError: ``repeats`` not a positive int; ``setups`` without exactly the names of ``fns``.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be a positive int")
    if set(setups) != set(fns):
        raise ValueError(f"setups names {sorted(setups)}; expected one per function {sorted(fns)}")
    device = torch.device("cpu") if device is None else torch.device(device)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type == "mps":
            torch.mps.synchronize()

    for name, fn in fns.items():
        for _ in range(warmup):
            setups[name]()
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            setups[name]()
            synchronize()
            start = time.perf_counter()
            fn()
            synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """Rows as a plain-text table; ``columns`` are ``(key, header, format spec)``, e.g. ``("time_ms", "ms", ".2f")``.

    A missing or ``None`` value prints as ``-``.
    """
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append(["-" if row.get(key) is None else format(row[key], spec) for key, _, spec in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = []
    for j, r in enumerate(cells):
        # The first column (a name) is left-aligned, numbers right-aligned.
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | Path, payload: dict) -> Path:
    """Write a benchmark's settings, environment and rows as JSON (directories created as needed).

    Atomic (:func:`attnlib._cli.write_json`): the text goes to a temporary file beside ``path``, which
    then replaces ``path`` in one step (``os.replace``), so an interrupted run never leaves a
    half-written results file; a value JSON cannot take fails before anything is written.
    """
    return _cli.write_json(path, payload, indent=1, newline=True)


def load_results(path: str | Path) -> dict:
    """Read a results file that ``python -m attnlib.bench <name> --out FILE`` wrote.

    The book's committed results are read with :func:`attnlib.book.results.load` instead.

    Raises:
        FileNotFoundError: no file at ``path`` (the message gives the command that writes one).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no results at {path}; run `python -m attnlib.bench <name> --out {path}` first")
    return json.loads(path.read_text())
