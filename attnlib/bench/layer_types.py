"""``python -m attnlib.bench layer-types``: decode speed and KV-cache bytes of layer patterns, at one context.

Chapters 17, 18 and 20 (issues #21, #23). One model size (:data:`LAYER_TYPES_MODEL`: a
:meth:`attnlib.DecoderConfig.llama` of 12 layers, GQA), its layers mixed as recent models mix them
(``layer_types``, :data:`PATTERNS`), the pattern tiled over the layers:

* ``full``: every layer full attention (Llama 2/3);
* ``sliding``: every layer a sliding window of ``window`` positions (Mistral 7B);
* ``gemma3``: 5 sliding : 1 full (Gemma 3);
* ``alternating``: sliding and full in turn (gpt-oss);
* ``chunked``: 3 chunked (``chunk_size``) : 1 full, the full layers without RoPE (Llama 4's iRoPE);
* ``deltanet``: 3 gated DeltaNet : 1 full (Qwen3-Next).

For each, a random prompt of ``context`` tokens is prefilled once into the model's own cache
(:meth:`attnlib.Decoder.new_cache`: a :class:`~attnlib.cache.LayerCache` per full layer, a ring per
sliding one, the current chunk per chunked one, a :class:`~attnlib.cache.RecurrentState` per DeltaNet
one); then ``tokens`` greedy steps are timed (:func:`attnlib.generation.step`, one token each), from a
copy of that cache each time, in rounds that alternate the patterns (:func:`attnlib.bench._common.time_after_setup`).
Bytes are measured on the filled cache, after the prompt: ``cache.nbytes()`` (allocated; a full layer's
buffer has ``block_size = context + tokens`` slots), the bytes of the positions held
(``held_bytes``: per layer, ``min(length, slots)`` positions, plus the recurrent states), and what each
new token adds (measured after the decode). The same counts by formula: :func:`attnlib.kv_cache_bytes`
(``sliding_window`` = the window or chunk, ``global_every`` = the pattern's period) over the softmax
layers, plus each DeltaNet layer's state (``state_bytes``), where ``kv_cache_bytes`` has no linear layers.
"""
from __future__ import annotations

import argparse
import copy

import torch

from attnlib.bench._common import DTYPES, Command, format_table, resolve_device, time_after_setup
from attnlib.bench._common import threads as using_threads
from attnlib.cache import KVCache, RecurrentState, kv_cache_bytes
from attnlib.generation import step
from attnlib.models import Decoder, DecoderConfig

__all__ = ["COMMAND", "LAYER_TYPES_DEFAULTS", "LAYER_TYPES_MODEL", "LAYER_TYPES_SMALL", "PATTERNS", "format_layer_types",
           "held_bytes", "layer_types_rows", "pattern_config"]

#: name -> (what it is, the period tiled over the layers). ``global_every``: the period's length when its last
#: layer is the only full one (:func:`attnlib.cache.memory.layer_windows`' rule).
PATTERNS = {
    "full": ("all full attention (Llama 3)", ("full_attention",)),
    "sliding": ("all sliding window (Mistral 7B)", ("sliding_attention",)),
    "gemma3": ("5 sliding : 1 full (Gemma 3)", ("sliding_attention",) * 5 + ("full_attention",)),
    "alternating": ("sliding / full in turn (gpt-oss)", ("sliding_attention", "full_attention")),
    "chunked": ("3 chunked : 1 full NoPE (Llama 4)", ("chunked_attention",) * 3 + ("full_attention",)),
    "deltanet": ("3 gated DeltaNet : 1 full (Qwen3-Next)", ("linear_attention",) * 3 + ("full_attention",)),
}
#: The model every pattern shares (its ``block_size`` is set to ``context + tokens`` per run).
LAYER_TYPES_MODEL = DecoderConfig.llama(vocab_size=256, block_size=4160, n_layers=12, n_heads=8, n_kv_heads=2,
                                        d_model=256)
LAYER_TYPES_DEFAULTS = dict(config=LAYER_TYPES_MODEL, context=4096, tokens=64, window=512, chunk_size=1024)
#: ``--small``: 6 layers (every pattern has a full layer), a context past the window and the chunk.
LAYER_TYPES_SMALL = dict(config=DecoderConfig.llama(vocab_size=64, block_size=56, n_layers=6, n_heads=4, n_kv_heads=2,
                                                    d_model=32), context=48, tokens=8, window=8, chunk_size=16)


def pattern_config(config: DecoderConfig, pattern: str, window: int, chunk_size: int) -> DecoderConfig:
    """``config`` with its layers as ``pattern`` (one of :data:`PATTERNS`) says, the period tiled over
    ``config.n_layers`` (layer ``i`` takes the period's entry ``i mod len(period)``).

    Sliding layers get ``sliding_window=window``, chunked ones ``attention_chunk_size=chunk_size``, Llama 4's
    full layers no RoPE (``nope_layers``), DeltaNet layers ``linear_layer="gated_deltanet"``.

    Raises:
        ValueError: an unknown pattern; a window or chunk size the config refuses.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"pattern={pattern!r} is not one of {list(PATTERNS)}")
    period = PATTERNS[pattern][1]
    types = tuple(period[i % len(period)] for i in range(config.n_layers))
    fields: dict = dict(layer_types=types, sliding_window=None, attention_chunk_size=None, nope_layers=())
    if "sliding_attention" in types:
        fields["sliding_window"] = window
    if "chunked_attention" in types:
        fields.update(attention_chunk_size=chunk_size,
                      nope_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"))
    if "linear_attention" in types:
        fields["linear_layer"] = "gated_deltanet"
    return config.replace(**fields)


def held_bytes(cache: KVCache) -> int:
    """Bytes of what a cache holds now: per softmax layer, the positions kept (``min(length, slots)``), and the
    recurrent layers' states (all of it, whatever the length)."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, RecurrentState):
            total += layer.nbytes()
            continue
        for buffer in layer.buffers:  # (B, ..., slots, width)
            kept = min(layer.length, buffer.shape[-2])
            total += buffer[..., :kept, :].numel() * buffer.element_size()
    return total


def _formula(config: DecoderConfig, pattern: str, model: Decoder, seq_len: int, batch: int, dtype: torch.dtype) -> int:
    """:func:`attnlib.kv_cache_bytes` over the softmax layers (the pattern's window or chunk and period), plus the
    DeltaNet layers' states (``state_bytes``), for ``seq_len`` tokens."""
    period = PATTERNS[pattern][1]
    softmax = [i for i, t in enumerate(config.layer_types) if t != "linear_attention"]
    window = config.sliding_window or config.attention_chunk_size
    every = len(period) if window is not None and len(period) > 1 else None
    total = kv_cache_bytes(n_layers=len(softmax), n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                           seq_len=seq_len, dtype=dtype, batch_size=batch, sliding_window=window, global_every=every)
    states = [model.blocks[i].attn.state_bytes(dtype) for i, t in enumerate(config.layer_types) if t == "linear_attention"]
    return total + batch * sum(states)


def layer_types_rows(
    patterns: tuple[str, ...] | list[str] = tuple(PATTERNS),
    config: DecoderConfig | None = None,
    context: int = 4096,
    tokens: int = 64,
    window: int = 512,
    chunk_size: int = 1024,
    batch: int = 1,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
    threads: int | None = None,
    check: bool = False,
) -> list[dict]:
    """Decode tokens/s and cache bytes of each layer pattern at ``context`` tokens (see the module's docstring).

    Args:
        patterns: names in :data:`PATTERNS`.
        config: the model's sizes (default :data:`LAYER_TYPES_MODEL`); its ``block_size`` becomes ``context + tokens``.
        context: prompt tokens prefilled before decoding.
        tokens: greedy decode steps timed per call.
        window, chunk_size: of the sliding and chunked layers.
        batch: sequences decoded at once.
        device, dtype: where and in what the models run (``device`` ``None``: :func:`attnlib.device`).
        repeats: timed decodes per pattern (the median reported), interleaved; warmup: untimed ones first.
        seed: weights and prompt.
        threads: ``torch.set_num_threads`` for the run (``None``: as it is).
        check: also generate the same tokens without a cache (``use_cache=False``: ``tokens + 1`` full forward
            passes over up to ``context + tokens`` positions; slow at long contexts) and compare.

    Returns:
        One dict per pattern: ``pattern, description, layer_types`` (counted, e.g. ``"10 sliding : 2 full"``),
        ``full_layers``, ``parameters``, ``context, new_tokens, batch``, ``nbytes`` (``cache.nbytes()`` after the
        prompt), ``nbytes_formula`` (the formula at ``block_size``), ``held_bytes``, ``held_formula`` (at ``context``),
        ``bytes_per_token`` (held bytes per token of context, one sequence), ``cache_bytes_per_token``
        (``cache.bytes_per_token()``: one position in every softmax layer), ``growth_per_token`` (bytes each decoded
        token added, one sequence), ``held_vs_full`` (over the ``full`` pattern's, when run), ``decode_ms``,
        ``tokens_per_s``, ``speedup_vs_full``, ``same_tokens_each_run`` (every timed decode gave the same tokens:
        each started from the same prefilled cache); with ``check``, ``same_tokens_as_uncached``.

    Raises:
        ValueError: an unknown pattern, a size below 1 (before any work).
    """
    for name in patterns:
        if name not in PATTERNS:
            raise ValueError(f"pattern={name!r} is not one of {list(PATTERNS)}")
    for name, value in (("context", context), ("tokens", tokens), ("window", window), ("chunk_size", chunk_size),
                        ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    config = (LAYER_TYPES_MODEL if config is None else config).replace(block_size=context + tokens)
    configs = {name: pattern_config(config, name, window, chunk_size) for name in dict.fromkeys(patterns)}
    with using_threads(threads):
        return _rows(configs, context, tokens, batch, resolve_device(device), dtype, repeats, warmup, seed, check)


def _kinds(types: tuple[str, ...]) -> str:
    names = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
             "linear_attention": "DeltaNet"}
    counts = {}
    for t in types:
        counts[names[t]] = counts.get(names[t], 0) + 1
    return " : ".join(f"{n} {kind}" for kind, n in counts.items())


def _rows(configs, context, tokens, batch, device, dtype, repeats, warmup, seed, check):
    g = torch.Generator().manual_seed(seed)
    vocab = next(iter(configs.values())).vocab_size
    prompt = torch.randint(vocab, (batch, context), generator=g).to(device)
    prefilled, models, first, live, rows = {}, {}, {}, {}, {}
    for name, config in configs.items():
        torch.manual_seed(seed)
        model = Decoder(config).to(device, dtype).eval()
        cache = model.new_cache()  # what each layer asks for: full, ring, chunk, recurrent state
        with torch.no_grad():
            first[name] = step(model, prompt, cache).argmax(-1, keepdim=True)  # (B, 1): the first new token
        prefilled[name], models[name] = cache, model
        rows[name] = dict(pattern=name, description=PATTERNS[name][0], layer_types=_kinds(config.layer_types),
                          full_layers=config.layer_types.count("full_attention"), parameters=model.num_parameters(),
                          context=context, new_tokens=tokens, batch=batch, nbytes=cache.nbytes(),
                          nbytes_formula=_formula(config, name, model, config.block_size, batch, dtype),
                          held_bytes=held_bytes(cache), held_formula=_formula(config, name, model, context, batch, dtype),
                          bytes_per_token=held_bytes(cache) / (context * batch),
                          cache_bytes_per_token=cache.bytes_per_token())

    def restore(name):
        return lambda: live.__setitem__(name, copy.deepcopy(prefilled[name]))  # the prompt's cache, afresh

    decoded = {name: [] for name in configs}  # the tokens of every decode, to check them

    def decode(name):
        @torch.no_grad()
        def run():
            model, cache, out = models[name], live[name], [first[name]]
            for _ in range(tokens):
                out.append(step(model, out[-1], cache).argmax(-1, keepdim=True))  # greedy, one token a step
            decoded[name].append(torch.cat(out, dim=1))  # (B, 1 + tokens)

        return run

    seconds = time_after_setup({name: decode(name) for name in configs}, {name: restore(name) for name in configs},
                               repeats=repeats, warmup=warmup, device=device)
    for name, row in rows.items():
        grown = held_bytes(live[name])  # the last timed decode's cache: context + tokens positions seen
        row.update(growth_per_token=(grown - row["held_bytes"]) / (tokens * batch), decode_ms=1e3 * seconds[name],
                   tokens_per_s=batch * tokens / seconds[name],
                   same_tokens_each_run=all(torch.equal(t, decoded[name][0]) for t in decoded[name]))
        if check:  # the uncached model, every position recomputed each step: an independent path to the same tokens
            reference = models[name].generate(prompt, tokens + 1, temperature=0.0, use_cache=False)[:, context:]
            row["same_tokens_as_uncached"] = torch.equal(decoded[name][0], reference)
        if "full" in rows:
            row["held_vs_full"] = row["held_bytes"] / rows["full"]["held_bytes"]
            row["speedup_vs_full"] = seconds["full"] / seconds[name]
    return list(rows.values())


MiB = 2**20
COLUMNS = [
    ("pattern", "pattern", "s"),
    ("layer_types", "layers", "s"),
    ("held_mib", "held MiB", ",.2f"),
    ("held_formula_mib", "formula MiB", ",.2f"),
    ("bytes_per_token", "B/token @ctx", ",.0f"),
    ("growth_per_token", "B/new token", ",.0f"),
    ("nbytes_mib", "allocated MiB", ",.2f"),
    ("held_vs_full", "x full", ".3f"),
    ("tokens_per_s", "tok/s", ",.1f"),
    ("speedup_vs_full", "speed x full", ".2f"),
]


def format_layer_types(rows: list[dict], settings: dict | None = None) -> str:
    """The table and how it was measured (``settings``: the command's, ``config`` a dict)."""
    parts = []
    if settings:
        c = settings["config"]
        parts.append(f"Llama-style decoder (untrained): {c['n_layers']} layers, {c['n_heads']} heads ({c['n_kv_heads']} "
                     f"key/value) of {c['head_dim']}, d_model {c['d_model']}; {settings['dtype']}; window "
                     f"{settings['window']}, chunk {settings['chunk_size']}; a prompt of {settings['context']:,} tokens "
                     f"prefilled, then {settings['tokens']} greedy tokens timed (batch {settings['batch']}); median of "
                     f"{settings['repeats']} interleaved runs after {settings['warmup']} warm-up.")
    parts.append("held: bytes of the positions (and recurrent states) the cache keeps after the prompt; formula: "
                 "attnlib.kv_cache_bytes over the softmax layers (window/chunk, period) + DeltaNet states; "
                 "B/token @ctx = held / context; B/new token: what each decoded token added; allocated: cache.nbytes() "
                 "(full layers pre-allocate context + tokens).")
    shown = [dict(r, held_mib=r["held_bytes"] / MiB, held_formula_mib=r["held_formula"] / MiB,
                  nbytes_mib=r["nbytes"] / MiB, pattern=f"{r['pattern']} ({r['description'].split('(')[-1].rstrip(')')})")
             for r in rows]
    parts.append(format_table(shown, COLUMNS))
    return "\n".join(parts)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--patterns", default=",".join(PATTERNS), help=f"comma-separated (default {','.join(PATTERNS)})")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens prefilled (default 4096; 48 with --small)")
    parser.add_argument("--tokens", type=int, default=None, help="decode steps timed (default 64; 8 with --small)")
    parser.add_argument("--window", type=int, default=None, help="sliding window (default 512; 8 with --small)")
    parser.add_argument("--chunk-size", type=int, default=None, help="chunk of chunked layers (default 1024; 16 with --small)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded at once (default 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                        help="compare the decoded tokens with uncached generation (default: only with --small)")


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    defaults = LAYER_TYPES_SMALL if args.small else LAYER_TYPES_DEFAULTS
    text, args.patterns = args.patterns, [p for p in args.patterns.replace(" ", ",").split(",") if p]
    if not args.patterns:
        parser.error(f"argument --patterns: {text!r} names nothing; choose from {','.join(PATTERNS)}")
    if unknown := [p for p in args.patterns if p not in PATTERNS]:
        parser.error(f"argument --patterns: {','.join(unknown)} not among {','.join(PATTERNS)}")
    args.patterns = list(dict.fromkeys(args.patterns))
    for key in ("context", "tokens", "window", "chunk_size"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    for key in ("context", "tokens", "window", "chunk_size", "batch"):
        if getattr(args, key) < 1:
            parser.error(f"argument --{key.replace('_', '-')}: {getattr(args, key)} must be >= 1")
    args.config = defaults["config"].replace(block_size=args.context + args.tokens)
    args.check = args.small if args.check is None else args.check


def _run(args: argparse.Namespace, device: torch.device):
    settings = dict(config=args.config.to_dict(), patterns=args.patterns, context=args.context, tokens=args.tokens,
                    window=args.window, chunk_size=args.chunk_size, batch=args.batch, dtype=args.dtype, seed=args.seed,
                    layer_types={name: pattern_config(args.config, name, args.window, args.chunk_size).layer_types
                                 for name in args.patterns},
                    check=args.check, repeats=args.repeats, warmup=args.warmup)
    rows = layer_types_rows(args.patterns, args.config, context=args.context, tokens=args.tokens, window=args.window,
                            chunk_size=args.chunk_size, batch=args.batch, device=device, dtype=DTYPES[args.dtype],
                            repeats=args.repeats, warmup=args.warmup, seed=args.seed, check=args.check)
    summary = {"held_bytes": {r["pattern"]: r["held_bytes"] for r in rows},
               "tokens_per_s": {r["pattern"]: r["tokens_per_s"] for r in rows},
               "formula_matches": all(r["held_bytes"] == r["held_formula"] and r["nbytes"] == r["nbytes_formula"]
                                      for r in rows),
               "same_tokens": all(r["same_tokens_each_run"] and r.get("same_tokens_as_uncached", True) for r in rows)}
    if "full" in args.patterns:
        summary["held_vs_full"] = {r["pattern"]: r["held_vs_full"] for r in rows}
        summary["speedup_vs_full"] = {r["pattern"]: r["speedup_vs_full"] for r in rows}
    return settings, rows, format_layer_types(rows, settings), summary


COMMAND = Command(help="decode tokens/s and KV-cache bytes of layer patterns (full, sliding, Gemma 3, gpt-oss, "
                       "Llama 4, Qwen3-Next) at one context", add_arguments=_add_arguments, check=_check, run=_run,
                  repeats=5, warmup=1)
