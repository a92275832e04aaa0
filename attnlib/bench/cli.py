"""The command line of :mod:`attnlib.bench`."""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

from attnlib.bench._common import DTYPES, environment, format_environment, resolve_device, write_json
from attnlib.bench._common import threads as using_threads
from attnlib.bench.kv_cache import GPT2_SMALL, SMALL, VARIANTS, format_kv_cache, kv_cache_rows
from attnlib.bench.memory import METHODS, format_memory, memory_rows
from attnlib.bench.mha import MHA_DEFAULTS, format_mha, mha_rows, mha_summary

__all__ = ["main"]

#: Sizes of ``--small`` runs: seconds on a laptop CPU.
MHA_SMALL = dict(batch=2, seq_len=128, d_model=128, n_heads=4)
MEMORY_SMALL = dict(seq_lens=[128, 256, 512], n_heads=4)


def _names(text: str) -> list[str]:
    return [name for name in text.replace(" ", ",").split(",") if name]


def _ints(text: str) -> list[int]:
    return [int(n) for n in _names(text)]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m attnlib.bench",
        description="Benchmarks of chapter 15; each prints a table measured in one run.",
    )
    sub = p.add_subparsers(dest="benchmark", required=True)

    def common(q: argparse.ArgumentParser, repeats: int) -> None:
        q.add_argument("--device", default=None, help="cpu, cuda, mps (default: attnlib.device())")
        q.add_argument("--repeats", type=int, default=repeats, help="timed runs; the median is reported")
        q.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
        q.add_argument("--small", action="store_true", help="small sizes, for a quick run")
        q.add_argument("--json", metavar="FILE", default=None, help="also write settings, environment and rows here")

    mha = sub.add_parser("mha", help="implementations of causal multi-head attention, timed side by side")
    mha.add_argument("--batch", type=int, default=None, help=f"default {MHA_DEFAULTS['batch']}")
    mha.add_argument("--seq-len", type=int, default=None, help=f"default {MHA_DEFAULTS['seq_len']}")
    mha.add_argument("--d-model", type=int, default=None, help=f"default {MHA_DEFAULTS['d_model']}")
    mha.add_argument("--n-heads", type=int, default=None, help=f"default {MHA_DEFAULTS['n_heads']}")
    mha.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    mha.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                     help="also time forward + backward (default: yes)")
    mha.add_argument("--warmup", type=int, default=1)
    mha.add_argument("--block-size", type=int, default=128, help="tile size of tiled_attention")
    common(mha, repeats=5)

    kv = sub.add_parser("kv-cache", help="generation tokens/s with and without the KV cache, cache bytes per token")
    kv.add_argument("--tokens", type=int, default=None, help="new tokens (default 200; 100 with --small)")
    kv.add_argument("--variants", type=_names, default=list(VARIANTS), help="comma-separated (default mha,gqa,mqa,mla)")
    kv.add_argument("--prompt-len", type=int, default=8)
    kv.add_argument("--batch", type=int, default=1)
    common(kv, repeats=3)

    mem = sub.add_parser("memory", help="peak memory and time of naive, SDPA and tiled attention as T grows")
    mem.add_argument("--seq-lens", type=_ints, default=None, help="comma-separated (default 256,512,1024,2048,4096)")
    mem.add_argument("--methods", type=_names, default=list(METHODS), help="comma-separated (default naive,sdpa,tiled)")
    mem.add_argument("--batch", type=int, default=1)
    mem.add_argument("--n-heads", type=int, default=None, help="default 12")
    mem.add_argument("--head-dim", type=int, default=64)
    mem.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    mem.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    mem.add_argument("--block-size", type=int, default=128)
    mem.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                     help="CPU: measure each method in a fresh process (default: yes)")
    common(mem, repeats=3)
    return p


def _pick(value, small: bool, small_value, default):
    if value is not None:
        return value
    return small_value if small else default


def main(argv: list[str] | None = None) -> dict:
    """Run one benchmark, print its table, optionally write ``--json``; return what was written."""
    args = _parser().parse_args(argv)
    with using_threads(args.threads):
        return _run(args, argv)


def _run(args: argparse.Namespace, argv: list[str] | None) -> dict:
    device = resolve_device(args.device)
    env = environment(device)
    if args.benchmark == "mha":
        sizes = {key: _pick(getattr(args, key), args.small, MHA_SMALL[key], MHA_DEFAULTS[key]) for key in MHA_DEFAULTS}
        settings = dict(**sizes, dtype=args.dtype, backward=args.backward, repeats=args.repeats, warmup=args.warmup,
                        block_size=args.block_size)
        print(f"attnlib.bench mha | {format_environment(env)}", flush=True)
        rows = mha_rows(**sizes, device=device, dtype=DTYPES[args.dtype], backward=args.backward,
                        repeats=args.repeats, warmup=args.warmup, block_size=args.block_size)
        text, summary = format_mha(rows, settings), mha_summary(rows)
    elif args.benchmark == "kv-cache":
        config = SMALL if args.small else GPT2_SMALL
        tokens = _pick(args.tokens, args.small, 100, 200)
        settings = dict(config=dataclasses.asdict(config), tokens=tokens, variants=args.variants,
                        prompt_len=args.prompt_len, batch=args.batch, repeats=args.repeats)
        print(f"attnlib.bench kv-cache | {format_environment(env)}", flush=True)
        rows = kv_cache_rows(args.variants, tokens=tokens, prompt_len=args.prompt_len, config=config,
                             batch=args.batch, device=device, repeats=args.repeats)
        text = format_kv_cache(rows, settings)
        summary = {"min_speedup": min(r["speedup"] for r in rows),
                   "min_speedup_vs_plain": min(r["speedup_vs_plain"] for r in rows),
                   "all_same_tokens": all(r["same_tokens"] for r in rows)}
    else:
        seq_lens = _pick(args.seq_lens, args.small, MEMORY_SMALL["seq_lens"], [256, 512, 1024, 2048, 4096])
        n_heads = _pick(args.n_heads, args.small, MEMORY_SMALL["n_heads"], 12)
        settings = dict(seq_lens=seq_lens, methods=args.methods, batch=args.batch, n_heads=n_heads,
                        head_dim=args.head_dim, dtype=args.dtype, causal=args.causal, block_size=args.block_size,
                        repeats=args.repeats, isolate=args.isolate)
        print(f"attnlib.bench memory | {format_environment(env)}", flush=True)
        rows = memory_rows(seq_lens, args.methods, batch=args.batch, n_heads=n_heads, head_dim=args.head_dim,
                           causal=args.causal, device=device, dtype=DTYPES[args.dtype], repeats=args.repeats,
                           block_size=args.block_size, isolate=args.isolate)
        text, summary = format_memory(rows, settings), {}
    print(text)
    payload = dict(benchmark=args.benchmark, command=shlex.join(["python", "-m", "attnlib.bench", *(argv or sys.argv[1:])]),
                   settings=settings, environment=env, rows=rows, summary=summary)
    if args.json:
        print(f"\nwrote {write_json(args.json, payload)}")
    return payload


if __name__ == "__main__":
    main()
