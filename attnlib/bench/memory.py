"""``python -m attnlib.bench memory``: peak memory and time of naive, SDPA and tiled attention as T grows.

Chapter 15. Causal attention of ``q, k, v`` of shape ``(B, n_heads, T, head_dim)``,
under ``torch.no_grad``:

* ``naive``: :func:`attnlib.attention.attention` with ``is_causal=True``:
  materialises the ``(B, n_heads, T, T)`` scores (and weights);
* ``sdpa``: ``F.scaled_dot_product_attention(..., is_causal=True)``;
* ``tiled``: :func:`attnlib.attention.tiled_attention`.

How the peak is measured (the output says which was used):

* CUDA: ``torch.cuda.max_memory_allocated`` during one call, minus what was allocated
  before it (the inputs).
* CPU (Linux): each method runs in a **fresh Python process**, with glibc told to serve
  every block of 64 KiB or more by ``mmap`` (``MALLOC_MMAP_THRESHOLD_=65536``) so that
  freed tensors go back to the system at once. Before each call the process's
  peak-RSS counter is reset (``/proc/self/clear_refs``); the figure is the peak RSS
  during the call minus the RSS just before it. It counts everything the call
  touches, the kernels' scratch buffers included, and the output.
* CPU elsewhere: one fresh process per case, ``ru_maxrss`` after minus before (a lower
  bound if starting the process peaked higher).

``isolate=False`` (``--no-isolate``) measures in the calling process instead: quicker, but
memory freed earlier and kept by the allocator can hide part of a peak.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from attnlib.attention import attention, tiled_attention
from attnlib.bench._common import format_table, resolve_device, time_calls
from attnlib.bench._common import threads as using_threads

__all__ = ["METHODS", "format_memory", "memory_rows"]

METHODS = ("naive", "sdpa", "tiled")
MiB = 2**20


def _attention_fn(method: str, tile_size: int, causal: bool):
    if method == "naive":
        return lambda q, k, v: attention(q, k, v, is_causal=causal)[0]
    if method == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if method == "tiled":
        return lambda q, k, v: tiled_attention(q, k, v, is_causal=causal, tile_size=tile_size)[0]
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux ``clear_refs``); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    hwm, rss = _status_kib("VmHWM"), _status_kib("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + 64  # the reset took effect


def _maxrss_bytes() -> int:
    import resource  # POSIX only

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _make_inputs(case: dict, T: int, device: torch.device, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(T)
    shape = (case["batch"], case["n_heads"], T, case["head_dim"])
    return [torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(3)]


def _measure_cases(spec: dict, in_fresh_process: bool) -> tuple[list[dict], bool]:
    """Measure as many of ``spec["seq_lens"]`` as can be measured honestly here; return the rows and
    whether every case was measured."""
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    fn = _attention_fn(spec["method"], spec["tile_size"], spec["causal"])
    rows = []
    with torch.no_grad():
        fn(*_make_inputs(spec, 16, device, dtype))  # load the code paths and thread pools before measuring
        for i, T in enumerate(spec["seq_lens"]):
            q, k, v = _make_inputs(spec, T, device, dtype)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
                fn(q, k, v)
                torch.cuda.synchronize(device)
                peak, how = torch.cuda.max_memory_allocated(device) - before, "torch.cuda.max_memory_allocated"
            elif _reset_peak_rss():
                before = 1024 * _status_kib("VmRSS")
                out = fn(q, k, v)
                where = "a fresh process" if in_fresh_process else "this process"
                peak, how = 1024 * _status_kib("VmHWM") - before, f"peak RSS in {where} (clear_refs)"
                del out
            elif not in_fresh_process or i == 0:
                before = _maxrss_bytes()
                out = fn(q, k, v)
                where = "a fresh process" if in_fresh_process else "this process"
                peak, how = _maxrss_bytes() - before, f"ru_maxrss increase in {where} (a lower bound)"
                del out
            else:
                return rows, False  # one case per process: the parent starts another
            seconds = time_calls({"call": lambda q=q, k=k, v=v: fn(q, k, v)}, spec["repeats"], warmup=1)["call"]
            rows.append(
                dict(
                    method=spec["method"],
                    seq_len=T,
                    peak_mib=peak / MiB,
                    time_ms=1e3 * seconds,
                    scores_mib=spec["batch"] * spec["n_heads"] * T * T * dtype.itemsize / MiB,
                    output_mib=spec["batch"] * spec["n_heads"] * T * spec["head_dim"] * dtype.itemsize / MiB,
                    memory_method=how,
                )
            )
            del q, k, v
    return rows, True


def _child_main() -> None:
    """Entry point of the measuring process: a JSON spec on stdin, a JSON answer on the last stdout line."""
    spec = json.loads(sys.stdin.read())
    torch.set_num_threads(spec["threads"])
    rows, _ = _measure_cases(spec, in_fresh_process=True)
    print(json.dumps(rows))


def _run_in_fresh_process(spec: dict) -> list[dict]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    # The child searches the parent's import path, so it imports the attnlib this process runs (a wheel
    # in site-packages, an editable install or a checkout on PYTHONPATH alike), whatever its working directory.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run(
        [sys.executable, "-c", "from attnlib.bench.memory import _child_main; _child_main()"],
        input=json.dumps(spec), capture_output=True, text=True, env=env, check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the measuring process failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory_rows(
    seq_lens: tuple[int, ...] | list[int] = (256, 512, 1024, 2048, 4096),
    methods: tuple[str, ...] | list[str] = METHODS,
    batch: int = 1,
    n_heads: int = 12,
    head_dim: int = 64,
    causal: bool = True,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    repeats: int = 3,
    tile_size: int = 128,
    isolate: bool = True,
    threads: int | None = None,
) -> list[dict]:
    """Peak extra memory and time of one attention call, per method and sequence length.

    Args:
        seq_lens: the lengths ``T`` to try.
        methods: some of :data:`METHODS`.
        batch, n_heads, head_dim: the other sizes of ``q, k, v``.
        causal: causal attention (bottom-right aligned; ``T_q == T_k`` here).
        device: where to run (``None``: :func:`attnlib.device`).
        dtype: of ``q, k, v``.
        repeats: timed calls per case (the median is reported), after one warm-up call.
        tile_size: tile size of the tiled attention.
        isolate: on the CPU, measure each method in a fresh Python process (clean heap, as
            described in the module docstring); ``False`` measures in this process (faster,
            but memory freed earlier and kept by the allocator can hide part of a peak).
        threads: ``torch.set_num_threads`` for the run (``None``: as it is).

    Returns:
        Dicts with ``method, seq_len, peak_mib`` (peak memory during the call above what was
        held before it, output included), ``time_ms``, ``scores_mib`` (the size one ``(B,
        n_heads, T, T)`` tensor would have), ``output_mib`` and ``memory_method`` (how the
        peak was measured; see the module docstring).

    Raises:
        ValueError: an unknown method, or a device other than CPU and CUDA.
    """
    with using_threads(threads):
        return _memory_rows(seq_lens, methods, batch, n_heads, head_dim, causal, device, dtype, repeats, tile_size,
                            isolate)


def _memory_rows(seq_lens, methods, batch, n_heads, head_dim, causal, device, dtype, repeats, tile_size, isolate):
    device = resolve_device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"peak memory is measured on cpu or cuda; got device {device}")
    for method in methods:
        _attention_fn(method, tile_size, causal)  # unknown names fail before any work
    rows = []
    for method in methods:
        spec = dict(
            method=method, seq_lens=sorted(seq_lens), batch=batch, n_heads=n_heads, head_dim=head_dim, causal=causal,
            device=str(device), dtype=str(dtype).removeprefix("torch."), repeats=repeats, tile_size=tile_size,
            threads=torch.get_num_threads(),
        )
        if device.type == "cuda" or not isolate:
            rows += _measure_cases(spec, in_fresh_process=False)[0]
            continue
        remaining = spec["seq_lens"]
        while remaining:  # a process measures all its cases if it can reset its peak, else one
            measured = _run_in_fresh_process(dict(spec, seq_lens=remaining))
            if not measured:
                raise RuntimeError(f"the measuring process returned no rows for {method} at T={remaining}")
            rows += measured
            remaining = remaining[len(measured) :]
    return sorted(rows, key=lambda r: (r["seq_len"], methods.index(r["method"])))


COLUMNS = [
    ("method", "method", "s"),
    ("seq_len", "T", "d"),
    ("scores_mib", "one TxT tensor MiB", ".1f"),
    ("peak_mib", "peak extra MiB", ".1f"),
    ("output_mib", "output MiB", ".1f"),
    ("time_ms", "time ms", ".2f"),
]


def format_memory(rows: list[dict], settings: dict | None = None) -> str:
    """The table, with the method of measurement."""
    parts = []
    if settings:
        s = settings
        parts.append(
            f"B={s['batch']}, n_heads={s['n_heads']}, head_dim={s['head_dim']}, causal={s['causal']}, {s['dtype']}, "
            f"tiles of {s['tile_size']}; time: median of {s['repeats']} calls after a warm-up, under torch.no_grad."
        )
    methods = sorted({row["memory_method"] for row in rows})
    parts.append("peak extra = peak memory during one call minus memory held before it (output included); "
                 f"measured by: {'; '.join(methods)}.")
    parts.append(format_table(rows, COLUMNS))
    return "\n".join(parts)
