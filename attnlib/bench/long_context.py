"""``python -m attnlib.bench long-context``: generation speed and cache bytes as the text grows. Chapter 17.

An untrained Llama-style :class:`attnlib.Decoder` (:meth:`attnlib.DecoderConfig.llama`: RoPE, GQA; speed does not
depend on the weights)
generates greedily with three caches, and after each length the bytes the cache holds are read
from its tensors:

* ``full``: attnlib's :class:`~attnlib.cache.KVCache`, every position kept (pre-allocated to the
  context, so we report the bytes of the positions *held*, which grow with the text);
* ``window``: the model with a sliding window, whose cache is a ring buffer of ``window``
  positions per layer (:class:`~attnlib.cache.RingLayerCache`): flat;
* ``sinks``: StreamingLLM's 4 sinks + a window (:class:`~attnlib.cache.SinkLayerCache`,
  :meth:`attnlib.cache.KVCache.streaming`) on the model without a window: flat.

Tokens/s is the decode rate between two lengths (one token per step, batch 1).
"""
from __future__ import annotations

import time

import torch

from attnlib.bench._common import Command, format_table
from attnlib.cache import KVCache
from attnlib.models import Decoder, DecoderConfig

__all__ = ["CACHES", "COMMAND", "LONG_CONTEXT", "LONG_CONTEXT_SMALL", "format_long_context", "long_context_rows"]

CACHES = ("full", "window", "sinks")
#: A small Llama-shaped model: 4 layers, 8 heads of 32 (2 key/value heads), 64-token window. RMSNorm's eps is
#: 1e-6, as in the committed run (attnlib 1.x's ModernConfig default).
LONG_CONTEXT = dict(config=DecoderConfig.llama(vocab_size=256, block_size=4096, n_layers=4, n_heads=8, n_kv_heads=2,
                                               d_model=256, norm_eps=1e-6),
                    window=64, n_sink=4, lengths=[256, 512, 1024, 2048, 4096])
LONG_CONTEXT_SMALL = dict(config=DecoderConfig.llama(vocab_size=64, block_size=128, n_layers=2, n_heads=4, n_kv_heads=2,
                                                     d_model=32, norm_eps=1e-6),
                          window=16, n_sink=4, lengths=[32, 64, 128])
COLUMNS = [("cache", "cache", "s"), ("length", "tokens", ",d"), ("bytes_held", "cache bytes held", ",d"),
           ("bytes_allocated", "allocated", ",d"), ("tokens_per_s", "tok/s since last", ",.1f")]


def _held(cache: KVCache) -> int:
    """Bytes of the positions a cache holds now (a ring/sink buffer's all; a full cache's filled part)."""
    total = 0
    for layer in cache.layers:
        for buffer in layer.buffers:
            positions = min(layer.length, buffer.shape[-2])
            total += buffer[..., :positions, :].numel() * buffer.element_size()
    return total


@torch.no_grad()
def long_context_rows(config: DecoderConfig, window: int, n_sink: int, lengths: list[int],
                      caches: tuple[str, ...] = CACHES, device: torch.device | str = "cpu", seed: int = 0) -> list[dict]:
    """One row per (cache, length): bytes held and allocated, and tokens/s since the previous length."""
    torch.manual_seed(seed)
    model = Decoder(config).to(device).eval()
    windowed = Decoder(config.replace(sliding_window=window)).to(device).eval()  # the same weights
    windowed.load_state_dict(model.state_dict())
    rows = []
    for kind in caches:
        if kind == "full":
            cache, decoder = model.new_cache(), model  # a LayerCache of block_size positions per layer
        elif kind == "window":
            cache, decoder = windowed.new_cache(), windowed  # a ring buffer per layer
        else:
            cache, decoder = KVCache.streaming(model, window=window, n_sink=n_sink, block_size=max(lengths) + 1), model
        token, done, previous, start = torch.zeros(1, 1, dtype=torch.long, device=device), 0, 0, time.perf_counter()
        for length in lengths:
            while done < length:
                token = decoder(token, cache=cache, last_only=True)[0][:, -1].argmax(-1, keepdim=True)
                done += 1
            now = time.perf_counter()
            rows.append(dict(cache=kind, length=length, bytes_held=_held(cache), bytes_allocated=cache.nbytes(),
                             tokens_per_s=(length - previous) / (now - start)))
            previous, start = length, now
    return rows


def format_long_context(rows: list[dict], settings: dict | None = None) -> str:
    """The table, and the growth of each cache from the shortest to the longest text."""
    parts = []
    if settings:
        c = settings["config"]
        parts.append(f"Llama-style Decoder (untrained): {c['n_layers']} layers, {c['n_heads']} heads "
                     f"({c['n_kv_heads']} key/value), d_model {c['d_model']}; window {settings['window']}, "
                     f"{settings['n_sink']} sinks; batch 1, greedy, one token per step.")
    parts.append(format_table(rows, COLUMNS))
    for kind in dict.fromkeys(r["cache"] for r in rows):
        mine = [r for r in rows if r["cache"] == kind]
        parts.append(f"{kind}: cache held x{mine[-1]['bytes_held'] / mine[0]['bytes_held']:.1f} from "
                     f"{mine[0]['length']} to {mine[-1]['length']} tokens")
    return "\n".join(parts)


def _add_arguments(parser) -> None:
    parser.add_argument("--lengths", default=None, help="comma-separated text lengths (default 256,...,4096)")
    parser.add_argument("--window", type=int, default=None, help="window of the windowed and sink caches (default 64)")
    parser.add_argument("--n-sink", type=int, default=4, help="sinks of the sink cache (default 4)")


def _check(parser, args) -> None:
    defaults = LONG_CONTEXT_SMALL if args.small else LONG_CONTEXT
    try:
        args.lengths = sorted({int(n) for n in args.lengths.split(",") if n}) if args.lengths else defaults["lengths"]
    except ValueError:
        parser.error(f"argument --lengths: {args.lengths!r} is not a comma-separated list of integers")
    config = defaults["config"].replace(block_size=max([*args.lengths, defaults["config"].block_size]))
    args.config, args.window = config, defaults["window"] if args.window is None else args.window
    if min(args.lengths) < 1 or args.window < 1:
        parser.error(f"argument --lengths/--window: lengths {args.lengths} and window {args.window} must be >= 1")
    if not 0 <= args.n_sink <= args.window:
        parser.error(f"argument --n-sink: {args.n_sink} must be between 0 and the window {args.window}")


def _run(args, device):
    settings = dict(config=args.config.to_dict(), window=args.window, n_sink=args.n_sink, lengths=args.lengths)
    rows = long_context_rows(args.config, args.window, args.n_sink, args.lengths, device=device)
    held = {kind: [r["bytes_held"] for r in rows if r["cache"] == kind] for kind in CACHES}
    summary = {f"{kind}_growth": h[-1] / h[0] for kind, h in held.items()}
    return settings, rows, format_long_context(rows, settings), summary


COMMAND = Command(help="generation tokens/s and cache bytes of full, windowed and sink caches as the text grows",
                  add_arguments=_add_arguments, check=_check, run=_run, repeats=1, warmup=0)
