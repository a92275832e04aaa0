"""The command line of :mod:`attnlib.bench`: ``python -m attnlib.bench <name> [options]``, a name of :data:`BENCHMARKS`.

Every flag is checked before anything is measured: a bad size, device, count or output
path gives argparse's ``error:`` line naming the value, and exit status 2. Each run prints
its table and writes settings, environment and rows as JSON to ``--out`` (default
``bench_<name>.json`` in the current directory). ``--small`` runs a tiny configuration
in seconds (tests, the install check).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from attnlib import _cli
from attnlib.bench._common import DTYPES, environment, format_environment, load_average, resolve_device, write_json
from attnlib.bench._common import threads as using_threads
from attnlib.bench.flash import COMMAND as FLASH_COMMAND
from attnlib.bench.hf_llama import COMMAND as HF_LLAMA_COMMAND
from attnlib.bench.kv_cache import GPT2_SMALL, TINY, VARIANTS, format_kv_cache, kv_cache_rows
from attnlib.bench.kv_quant import COMMAND as KV_QUANT_COMMAND
from attnlib.bench.layer_types import COMMAND as LAYER_TYPES_COMMAND
from attnlib.bench.long_context import COMMAND as LONG_CONTEXT_COMMAND
from attnlib.bench.memory import METHODS, format_memory, memory_rows
from attnlib.bench.mha import CORES, LAYERS, MHA_DEFAULTS, format_mha, mha_rows, mha_summary
from attnlib.bench.serving import COMMAND as SERVING_COMMAND
from attnlib.bench.train import TRAIN_SIZES, TRAIN_SMALL, format_train, modern_config, train_rows

__all__ = ["BENCHMARKS", "main"]

#: Benchmarks defined by a :class:`attnlib.bench._common.Command` next to their rows (newer ones).
COMMANDS = {"flash": FLASH_COMMAND, "long-context": LONG_CONTEXT_COMMAND, "serving": SERVING_COMMAND,
            "hf-llama": HF_LLAMA_COMMAND, "layer-types": LAYER_TYPES_COMMAND, "kv-quant": KV_QUANT_COMMAND}
BENCHMARKS = ("mha", "kv-cache", "memory", "train", *COMMANDS)
#: Sizes of ``--small`` runs: seconds on a laptop CPU.
MHA_SMALL = dict(batch=2, seq_len=64, d_model=64, n_heads=4)
MEMORY_SMALL = dict(seq_lens=[32, 64], n_heads=2, head_dim=16)
MEMORY_SEQ_LENS = [256, 512, 1024, 2048, 4096]
ROW_IDS = [f"layer/{k}" for k in LAYERS] + [f"core/{k}" for k in CORES]


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be {'positive' if low == 1 else f'>= {low}'}")
        return value

    parse.__name__ = "integer"
    return parse


positive, non_negative = _int_at_least(1), _int_at_least(0)


def _names(choices: tuple[str, ...] | list[str]) -> Callable[[str], list[str]]:
    """Comma-separated names from ``choices``: at least one, each once."""
    return _cli.name_list(tuple(choices))


def _positive_list(text: str) -> list[int]:
    """Comma-separated lengths: at least one, each a positive integer, each once."""
    parts = [n for n in text.replace(" ", ",").split(",") if n]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text!r} holds no lengths")
    values = [positive(n) for n in parts]
    if repeated := sorted({n for i, n in enumerate(values) if n in values[:i]}):
        raise argparse.ArgumentTypeError(f"{text!r} repeats {','.join(map(str, repeated))} (expected each once)")
    return values


def _device(text: str) -> torch.device:
    """A device this machine has: ``cpu``, ``cuda[:i]``, ``mps`` (:func:`attnlib._cli.device`)."""
    return torch.device(_cli.device(text))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m attnlib.bench",
        description="Benchmarks of chapters 15-19; each prints a table measured in one run and writes it to --out.",
    )
    sub = p.add_subparsers(dest="benchmark", required=True, metavar="{" + ",".join(BENCHMARKS) + "}")

    def common(q: argparse.ArgumentParser, name: str, repeats: int, warmup: int) -> None:
        q.add_argument("--device", type=_device, default=None, help="cpu, cuda, cuda:N, mps (default: attnlib.device())")
        q.add_argument("--repeats", type=positive, default=None,
                       help=f"timed runs, the median reported (default {repeats}; 1 with --small)")
        q.add_argument("--warmup", type=non_negative, default=warmup, help=f"untimed runs first (default {warmup})")
        q.add_argument("--threads", type=positive, default=None, help="torch.set_num_threads (default: torch's choice)")
        q.add_argument("--small", action="store_true", help="a tiny configuration that runs in seconds")
        q.add_argument("--out", "--json", dest="out", metavar="FILE", default=f"bench_{name.replace('-', '_')}.json",
                       help="where to write settings, environment and rows as JSON "
                            f"(default: bench_{name.replace('-', '_')}.json in the current directory)")
        q.set_defaults(default_repeats=repeats)

    mha = sub.add_parser("mha", help="implementations of causal multi-head attention, timed side by side")
    for flag, key in (("--batch", "batch"), ("--seq-len", "seq_len"), ("--d-model", "d_model"), ("--n-heads", "n_heads")):
        mha.add_argument(flag, type=positive, default=None, help=f"default {MHA_DEFAULTS[key]} ({MHA_SMALL[key]} with --small)")
    mha.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    mha.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                     help="also time forward + backward (default: yes)")
    mha.add_argument("--tile-size", type=positive, default=128, help="tile size of tiled_attention (default 128)")
    mha.add_argument("--rows", type=_names(ROW_IDS), default=None,
                     help=f"comma-separated row ids to time (default all; the references always): {','.join(ROW_IDS)}")
    common(mha, "mha", repeats=5, warmup=1)

    kv = sub.add_parser("kv-cache", help="generation tokens/s with and without the KV cache, cache bytes per token")
    kv.add_argument("--tokens", type=positive, default=None, help="new tokens (default 200; 8 with --small)")
    kv.add_argument("--variants", type=_names(VARIANTS), default=list(VARIANTS), help="comma-separated (default mha,gqa,mqa,mla)")
    kv.add_argument("--prompt-len", type=positive, default=8)
    kv.add_argument("--batch", type=positive, default=1)
    common(kv, "kv-cache", repeats=3, warmup=4)

    mem = sub.add_parser("memory", help="peak memory and time of naive, SDPA and tiled attention as T grows")
    mem.add_argument("--seq-lens", type=_positive_list, default=None,
                     help=f"comma-separated (default {','.join(map(str, MEMORY_SEQ_LENS))})")
    mem.add_argument("--methods", type=_names(METHODS), default=list(METHODS), help="comma-separated (default naive,sdpa,tiled)")
    mem.add_argument("--batch", type=positive, default=1)
    mem.add_argument("--n-heads", type=positive, default=None, help="default 12")
    mem.add_argument("--head-dim", type=positive, default=None, help="default 64")
    mem.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    mem.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    mem.add_argument("--tile-size", type=positive, default=128)
    mem.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                     help="CPU: measure each method in a fresh process (default: yes)")
    common(mem, "memory", repeats=3, warmup=1)

    tr = sub.add_parser("train", help="one AdamW step of attnlib's GPT against a TransformerEncoderLayer GPT")
    tr.add_argument("--sizes", type=_names(tuple(TRAIN_SIZES)), default=list(TRAIN_SIZES),
                    help=f"comma-separated (default {','.join(TRAIN_SIZES)}; --small: a tiny model)")
    tr.add_argument("--batch", type=positive, default=None, help="sequences per step (default: each size's own)")
    tr.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    tr.add_argument("--modern", action="store_true",
                    help="also time the modern decoder (RoPE, RMSNorm, SwiGLU) at the same width and depth")
    common(tr, "train", repeats=5, warmup=2)

    for name, command in COMMANDS.items():
        q = sub.add_parser(name, help=command.help)
        command.add_arguments(q)
        common(q, name, repeats=command.repeats, warmup=command.warmup)
    return p


def _check_out(parser: argparse.ArgumentParser, out: str) -> Path:
    """``--out`` must be a file path whose directory exists and is writable, or can be created."""
    try:
        return _cli.output_file(out)
    except argparse.ArgumentTypeError as err:
        parser.error(f"argument --out: {err}")


#: Flags of the :data:`COMMANDS` that their own checks take as text: (flag, dest, what an entry is).
_LIST_FLAGS = {"flash": [("--seq-lens", "seq_lens", "lengths"), ("--methods", "methods", "names")],
               "long-context": [("--lengths", "lengths", "lengths")]}


def _check_lists(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A list flag of a :data:`COMMANDS` benchmark that was given must name something, each entry once."""
    for flag, dest, what in _LIST_FLAGS.get(args.benchmark, ()):
        text = getattr(args, dest)
        if text is None:
            continue  # not given: the command's default
        items = [n for n in text.replace(" ", ",").split(",") if n]
        if not items:
            parser.error(f"argument {flag}: {text!r} holds no {what} (expected a comma-separated list)")
        if repeated := list(dict.fromkeys(n for i, n in enumerate(items) if n in items[:i])):
            parser.error(f"argument {flag}: {text!r} repeats {','.join(repeated)} (expected each once)")


def _check_context(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Tokens a benchmark would generate past its model's context (``block_size``), once the defaults are in."""
    if args.benchmark == "kv-cache":
        block = args.config.block_size
        for flag, n in (("--tokens", args.tokens), ("--warmup", args.warmup)):
            if args.prompt_len + n > block:
                parser.error(f"argument {flag}: --prompt-len {args.prompt_len} + {flag} {n} exceeds the model's "
                             f"block_size {block}{' (--small)' if args.small else ''}")
    elif args.benchmark == "serving":  # requests ask for up to 2 x --tokens new tokens after a prompt of >= 1
        block = args.config.block_size
        if 1 + 2 * args.tokens > block:
            parser.error(f"argument --tokens: {args.tokens} is too many for the model's block_size {block}: a "
                         f"request asks for up to 2 x --tokens after its prompt (expected <= {(block - 1) // 2})")


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks that span several flags; fills in the ``--small`` defaults."""
    args.out = _check_out(parser, args.out)
    if args.repeats is None:
        args.repeats = 1 if args.small else args.default_repeats
    if args.benchmark == "mha":
        for key in MHA_DEFAULTS:
            if getattr(args, key) is None:
                setattr(args, key, (MHA_SMALL if args.small else MHA_DEFAULTS)[key])
        if args.d_model % args.n_heads:
            parser.error(f"argument --d-model: {args.d_model} is not divisible by --n-heads {args.n_heads}")
    elif args.benchmark == "kv-cache":
        args.config = TINY if args.small else GPT2_SMALL
        args.tokens = args.tokens or (8 if args.small else 200)
        if args.prompt_len > args.config.block_size:
            parser.error(f"argument --prompt-len: {args.prompt_len} exceeds the model's block_size {args.config.block_size}")
    elif args.benchmark == "memory":
        args.seq_lens = args.seq_lens or (MEMORY_SMALL["seq_lens"] if args.small else MEMORY_SEQ_LENS)
        args.n_heads = args.n_heads or (MEMORY_SMALL["n_heads"] if args.small else 12)
        args.head_dim = args.head_dim or (MEMORY_SMALL["head_dim"] if args.small else 64)
        if args.device is not None and args.device.type not in ("cpu", "cuda"):
            parser.error(f"argument --device: peak memory is measured on cpu or cuda; got {str(args.device)!r}")
    elif args.benchmark in COMMANDS:
        _check_lists(parser, args)
        COMMANDS[args.benchmark].check(parser, args)
        if getattr(args, "seed", None) is not None and not -(2**63) <= args.seed < 2**64:
            parser.error(f"argument --seed: {args.seed} is outside the seeds torch takes, [-2**63, 2**64)")
    else:
        sizes = TRAIN_SMALL if args.small else {name: TRAIN_SIZES[name] for name in args.sizes}
        args.train_sizes = {name: (config, args.batch or batch) for name, (config, batch) in sizes.items()}
    _check_context(parser, args)


def main(argv: list[str] | None = None) -> dict:
    """Check the flags, run one benchmark, print its table, write ``--out``; return what was written.

    Raises:
        SystemExit: status 2 with an ``error:`` line for a bad flag (before anything runs).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    with using_threads(args.threads):
        return _run(args, sys.argv[1:] if argv is None else argv)


def _run(args: argparse.Namespace, argv: list[str]) -> dict:
    device = resolve_device(args.device)
    env = environment(device)
    print(f"attnlib.bench {args.benchmark} | {format_environment(env)}", flush=True)
    common = dict(repeats=args.repeats, warmup=args.warmup, small=args.small)
    if args.benchmark == "mha":
        sizes = {key: getattr(args, key) for key in MHA_DEFAULTS}
        settings = dict(**sizes, dtype=args.dtype, backward=args.backward, tile_size=args.tile_size, **common)
        rows = mha_rows(**sizes, device=device, dtype=DTYPES[args.dtype], backward=args.backward, repeats=args.repeats,
                        warmup=args.warmup, tile_size=args.tile_size, rows=args.rows)
        text, summary = format_mha(rows, settings), mha_summary(rows)
    elif args.benchmark == "kv-cache":
        settings = dict(config=args.config.to_dict(), tokens=args.tokens, variants=args.variants,
                        prompt_len=args.prompt_len, batch=args.batch, **common)
        rows = kv_cache_rows(args.variants, tokens=args.tokens, prompt_len=args.prompt_len, config=args.config,
                             batch=args.batch, device=device, repeats=args.repeats, warmup_tokens=args.warmup)
        text = format_kv_cache(rows, settings)
        summary = {"min_speedup": min(r["speedup"] for r in rows),
                   "min_speedup_vs_plain": min(r["speedup_vs_plain"] for r in rows),
                   "all_same_tokens": all(r["same_tokens"] for r in rows)}
    elif args.benchmark == "memory":
        settings = dict(seq_lens=args.seq_lens, methods=args.methods, batch=args.batch, n_heads=args.n_heads,
                        head_dim=args.head_dim, dtype=args.dtype, causal=args.causal, tile_size=args.tile_size,
                        isolate=args.isolate, **common)
        rows = memory_rows(args.seq_lens, args.methods, batch=args.batch, n_heads=args.n_heads, head_dim=args.head_dim,
                           causal=args.causal, device=device, dtype=DTYPES[args.dtype], repeats=args.repeats,
                           tile_size=args.tile_size, isolate=args.isolate)
        text, summary = format_memory(rows, settings), {}
    elif args.benchmark in COMMANDS:
        settings, rows, text, summary = COMMANDS[args.benchmark].run(args, device)
        settings.update(common)
    else:
        settings = dict(sizes={name: dict(config=c.to_dict(), batch=b) for name, (c, b) in args.train_sizes.items()},
                        dtype=args.dtype, modern=args.modern, **common)
        if args.modern:  # the Llama-style decoder each size is compared with, every field (norm_eps, tie, ...)
            settings["modern_configs"] = {name: modern_config(c).to_dict() for name, (c, _) in args.train_sizes.items()}
        rows = train_rows(args.train_sizes, device=device, dtype=DTYPES[args.dtype], repeats=args.repeats,
                          warmup=args.warmup, modern=args.modern)
        text = format_train(rows, settings)
        summary = {"ratios": {row["size"]: row["ratio"] for row in rows}, "max_ratio": max(r["ratio"] for r in rows)}
        if args.modern:
            summary["modern_ratios"] = {row["size"]: row["modern_ratio"] for row in rows}
            summary["max_modern_ratio"] = max(r["modern_ratio"] for r in rows)
    print(text)
    env["load_average_end"] = load_average()
    payload = dict(benchmark=args.benchmark, command=shlex.join(["python", "-m", "attnlib.bench", *argv]),
                   settings=settings, environment=env, rows=rows, summary=summary)
    print(f"\nwrote {write_json(args.out, payload)}")
    return payload


if __name__ == "__main__":
    main()
