"""``python -m attnlib.bench flash``: training-time attention, forward + backward, as T grows.

Chapter 15. For ``q, k, v`` of shape ``(B, n_heads, T, head_dim)`` that require grad, each
method computes the output and then ``dQ, dK, dV`` for a fixed random ``dO``:

* ``naive``: :func:`attnlib.attention.attention` under autograd: saves the ``(T, T)`` weights;
* ``sdpa``: ``F.scaled_dot_product_attention`` (torch's fused kernel for the device);
* ``flash``: :func:`attnlib.attention.flash_attention`: saves ``Q, K, V, O`` and the
  log-sum-exp, recomputes the weights block by block in backward;
* ``tiled``: :func:`attnlib.attention.tiled_attention` differentiated by plain autograd: the
  forward is tiled, but autograd keeps every tile it computed for the backward pass.

Per method and ``T``: the median time of one forward + backward (all methods interleaved
in each round, so that the machine's load hits them alike) and its ratio to SDPA's; the
bytes the autograd graph keeps for backward, counted with
``torch.autograd.graph.saved_tensors_hooks`` (distinct storages, so a tensor saved twice or
a view of another counts once), in all and beyond the inputs ``q, k, v``, and its ratio
to ``flash``'s; the largest difference of the output and gradients from SDPA's.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from attnlib.attention import attention, flash_attention, tiled_attention
from attnlib.bench._common import DTYPES, Command, format_table, resolve_device, time_calls
from attnlib.bench._common import threads as using_threads

__all__ = ["COMMAND", "FLASH_METHODS", "flash_rows", "format_flash", "saved_bytes"]

FLASH_METHODS = ("naive", "sdpa", "flash", "tiled")
#: Sizes of the command line's default and ``--small`` runs.
FLASH_DEFAULTS = dict(seq_lens=[256, 512, 1024, 2048], n_heads=8, head_dim=64, tile_size=128)
FLASH_SMALL = dict(seq_lens=[32, 64], n_heads=2, head_dim=16, tile_size=16)
MiB = 2**20


def _method(name: str, causal: bool, tile_size: int) -> Callable[..., torch.Tensor]:
    if name == "naive":
        return lambda q, k, v: attention(q, k, v, is_causal=causal)[0]
    if name == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if name == "flash":
        return lambda q, k, v: flash_attention(q, k, v, is_causal=causal, tile_size=tile_size)[0]
    if name == "tiled":
        return lambda q, k, v: tiled_attention(q, k, v, is_causal=causal, tile_size=tile_size)[0]
    raise ValueError(f"unknown method {name!r}; choose from {FLASH_METHODS}")


def saved_bytes(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> tuple[int, int]:
    """Bytes the autograd graph of ``fn(*inputs)`` keeps for backward: ``(all, beyond the inputs)``.

    Every tensor saved for backward passes through a ``saved_tensors_hooks`` pack hook; the
    distinct storages are summed (a view of a saved tensor, or an input saved by several
    nodes, counts once). The second number leaves out the inputs' own storages (the caller
    holds them anyway). The graph is freed on return.
    """
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    mine = {t.untyped_storage().data_ptr() for t in inputs}
    total = sum(storages.values())
    return total, total - sum(n for ptr, n in storages.items() if ptr in mine)


def flash_rows(
    seq_lens: tuple[int, ...] | list[int] = (256, 512, 1024, 2048),
    methods: tuple[str, ...] | list[str] = FLASH_METHODS,
    batch: int = 1,
    n_heads: int = 8,
    head_dim: int = 64,
    causal: bool = True,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    repeats: int = 3,
    warmup: int = 1,
    tile_size: int = 128,
    seed: int = 0,
    threads: int | None = None,
) -> list[dict]:
    """Forward + backward time and saved-for-backward bytes of each method, per sequence length.

    Args:
        seq_lens: the lengths ``T`` (``T_q == T_k``).
        methods: some of :data:`FLASH_METHODS` (``"sdpa"`` is always run: the time reference).
        batch, n_heads, head_dim: the other sizes of ``q, k, v``.
        causal: causal attention.
        device: where to run (``None``: :func:`attnlib.device`).
        dtype: of ``q, k, v``.
        repeats: timed forward + backward calls per method (the median is reported).
        warmup: untimed calls first.
        tile_size: block size of ``flash`` and ``tiled``.
        seed: for the inputs and ``dO``.
        threads: ``torch.set_num_threads`` for the run (``None``: as it is).

    Returns:
        Dicts with ``method, seq_len, forward_backward_ms, time_vs_sdpa`` (time over SDPA's at
        that ``T``), ``saved_mib`` (all the graph keeps for backward), ``saved_beyond_inputs_mib``,
        ``saved_vs_flash`` (``saved_mib`` over flash's, when flash was run), ``scores_mib`` (what one
        ``(B, n_heads, T, T)`` tensor takes) and ``max_abs_diff`` (largest difference of the output
        and of ``dQ, dK, dV`` from SDPA's).

    Raises:
        ValueError: an unknown method or an empty ``seq_lens``.
    """
    for name in methods:
        _method(name, causal, tile_size)  # unknown names fail before any work
    if not seq_lens:
        raise ValueError("seq_lens is empty; give at least one sequence length")
    methods = ["sdpa", *[m for m in methods if m != "sdpa"]]
    with using_threads(threads):
        device = resolve_device(device)
        return [row for T in seq_lens for row in _rows_at(T, methods, batch, n_heads, head_dim, causal, device, dtype,
                                                           repeats, warmup, tile_size, seed)]


def _rows_at(T, methods, batch, n_heads, head_dim, causal, device, dtype, repeats, warmup, tile_size, seed):
    g = torch.Generator(device=device).manual_seed(seed + T)
    shape = (batch, n_heads, T, head_dim)
    q, k, v = (torch.randn(shape, generator=g, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    d_out = torch.randn(shape, generator=g, device=device, dtype=dtype)
    fns = {name: _method(name, causal, tile_size) for name in methods}

    def step(fn):
        return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), d_out)

    reference = None
    rows = {}
    for name, fn in fns.items():
        out = fn(q, k, v)
        results = [out.detach(), *torch.autograd.grad(out, (q, k, v), d_out)]
        del out
        reference = reference or results  # sdpa comes first
        diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(results, reference))
        total, beyond = saved_bytes(fn, q, k, v)
        rows[name] = dict(method=name, seq_len=T, saved_mib=total / MiB, saved_beyond_inputs_mib=beyond / MiB,
                          scores_mib=batch * n_heads * T * T * dtype.itemsize / MiB, max_abs_diff=diff)
    seconds = time_calls({name: step(fn) for name, fn in fns.items()}, repeats=repeats, warmup=warmup)
    for name, row in rows.items():
        row["forward_backward_ms"] = 1e3 * seconds[name]
        row["time_vs_sdpa"] = seconds[name] / seconds["sdpa"]
        row["saved_vs_flash"] = row["saved_mib"] / rows["flash"]["saved_mib"] if "flash" in rows else None
    return list(rows.values())


COLUMNS = [
    ("method", "method", "s"),
    ("seq_len", "T", "d"),
    ("forward_backward_ms", "fwd+bwd ms", ".1f"),
    ("time_vs_sdpa", "x sdpa", ".2f"),
    ("saved_mib", "saved MiB", ".2f"),
    ("saved_beyond_inputs_mib", "beyond q,k,v MiB", ".2f"),
    ("saved_vs_flash", "saved / flash", ".1f"),
    ("scores_mib", "one TxT MiB", ".1f"),
    ("max_abs_diff", "max |diff| vs sdpa", ".1e"),
]


def format_flash(rows: list[dict], settings: dict | None = None) -> str:
    """The table, with the sizes and how time and memory were measured."""
    parts = []
    if settings:
        s = settings
        parts.append(
            f"B={s['batch']}, n_heads={s['n_heads']}, head_dim={s['head_dim']}, causal={s['causal']}, {s['dtype']}, "
            f"blocks of {s['tile_size']}; time: median of {s['repeats']} forward+backward calls after "
            f"{s.get('warmup', 1)} warm-up, methods interleaved."
        )
    parts.append("saved = the distinct storages the autograd graph keeps for backward (saved_tensors_hooks); "
                 "beyond q,k,v leaves out the inputs' own storages.")
    parts.append(format_table(rows, COLUMNS))
    return "\n".join(parts)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-lens", default=None, help="comma-separated lengths T (default 256,512,1024,2048; 32,64 with --small)")
    parser.add_argument("--methods", default=",".join(FLASH_METHODS), help="comma-separated (default naive,sdpa,flash,tiled)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--n-heads", type=int, default=None, help="default 8 (2 with --small)")
    parser.add_argument("--head-dim", type=int, default=None, help="default 64 (16 with --small)")
    parser.add_argument("--tile-size", type=int, default=None, help="block size of flash and tiled (default 128; 16 with --small)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    defaults = FLASH_SMALL if args.small else FLASH_DEFAULTS
    try:
        args.seq_lens = [int(n) for n in args.seq_lens.replace(" ", ",").split(",") if n] if args.seq_lens else defaults["seq_lens"]
    except ValueError:
        parser.error(f"argument --seq-lens: {args.seq_lens!r} is not a comma-separated list of integers")
    args.methods = [m for m in args.methods.replace(" ", ",").split(",") if m]
    if unknown := [m for m in args.methods if m not in FLASH_METHODS]:
        parser.error(f"argument --methods: {','.join(unknown)} not among {','.join(FLASH_METHODS)}")
    for key in ("n_heads", "head_dim", "tile_size"):
        setattr(args, key, defaults[key] if getattr(args, key) is None else getattr(args, key))
    sizes = dict(seq_lens=min(args.seq_lens, default=0), batch=args.batch, n_heads=args.n_heads,
                 head_dim=args.head_dim, tile_size=args.tile_size)
    for key, value in sizes.items():
        if value < 1:
            parser.error(f"argument --{key.replace('_', '-')}: {value} must be >= 1")


def _run(args: argparse.Namespace, device: torch.device):
    settings = dict(seq_lens=args.seq_lens, methods=args.methods, batch=args.batch, n_heads=args.n_heads,
                    head_dim=args.head_dim, tile_size=args.tile_size, dtype=args.dtype, causal=args.causal,
                    repeats=args.repeats, warmup=args.warmup)
    rows = flash_rows(args.seq_lens, args.methods, batch=args.batch, n_heads=args.n_heads, head_dim=args.head_dim,
                      causal=args.causal, device=device, dtype=DTYPES[args.dtype], repeats=args.repeats,
                      warmup=args.warmup, tile_size=args.tile_size)
    summary = {}
    for name in ("naive", "flash", "tiled"):
        mine = [r for r in rows if r["method"] == name]
        if mine:  # how much more the graph keeps when T grows from the first length to the last, and the time ratio
            summary[f"{name}_saved_growth"] = mine[-1]["saved_mib"] / mine[0]["saved_mib"]
            summary[f"{name}_time_vs_sdpa_at_max_T"] = mine[-1]["time_vs_sdpa"]
    summary["max_abs_diff"] = max(r["max_abs_diff"] for r in rows)
    return settings, rows, format_flash(rows, settings), summary


COMMAND = Command(help="forward+backward time and saved-for-backward bytes of flash_attention vs naive and SDPA as T grows",
                  add_arguments=_add_arguments, check=_check, run=_run, repeats=3, warmup=1)
