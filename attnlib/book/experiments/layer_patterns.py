"""Decoders that mix layer types, trained the same way on Tiny Shakespeare. Chapter 20.

One Llama-style model (:meth:`attnlib.DecoderConfig.llama`: d_model 64, 4 heads, 2 key/value
heads, 6 layers so that one 5:1 period fits, block 64) trained with chapter 13's settings (batch
16, lr 1e-3, 1000 steps, evaluation every 100 steps on 50 batches), each pattern with the same
seeds (same initial weights where the shapes agree, same data order, same evaluation batches):

* ``full``: every layer full attention (the Llama of chapter 16);
* ``local_global_5_1``: five sliding-window layers, then one global (Gemma 3);
* ``alternating``: sliding and full in turn, sliding first (gpt-oss);
* ``nope_every_4th``: full attention, every fourth layer without RoPE (SmolLM3's ``no_rope_layers``);
* ``chunked_nope``: chunked attention on the RoPE layers, every fourth layer NoPE and full
  (Llama 4's iRoPE, without its temperature tuning);
* ``kv_sharing``: the last layers reuse the keys and values of an earlier layer (Gemma 4);
* ``sinks``: one learned sink logit per head in every layer (gpt-oss);
* ``differential``: differential attention (Ye et al. 2024) in every layer.

The window (and chunk) is 16 of the 64 positions: a local layer sees a quarter of the context at
its end, so what the global layers add can show at this size (a window of 128, gpt-oss's, would
be the whole context here). The committed run (``attnlib/book/results/layer_patterns.json``)::

    python -m attnlib.book.experiments.layer_patterns --seeds 1337 1338 1339 \
        --out attnlib/book/results/layer_patterns.json

with patterns added later by ``--patterns NAME ... --merge-with FILE``; the file's ``meta``
records every command. A pattern whose library part is missing from this attnlib (a
:class:`~attnlib.DecoderConfig` field it needs) is refused with the field named.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from attnlib import _cli
from attnlib.book import results as results_files
from attnlib.book.experiments.compare_attention import _machine
from attnlib.book.experiments.seeds import add_seed_runs, seed_summary
from attnlib.data import load_char_corpus
from attnlib.models import Decoder, DecoderConfig
from attnlib.train import TrainConfig, train

__all__ = ["MODEL", "PATTERNS", "TRAINING", "available", "build_model", "cache_bytes_at", "compare",
           "load_results", "main", "pattern_config", "seed_summary"]

#: The model every pattern starts from (chapter 13's sizes, 6 layers, context 64).
MODEL = dict(vocab_size=65, block_size=64, n_layers=6, n_heads=4, n_kv_heads=2, d_model=64)
TRAINING = dict(batch_size=16, max_iters=1000, eval_interval=100, eval_iters=50, learning_rate=1e-3, seed=1337)
WINDOW = 16
_S, _F = "sliding_attention", "full_attention"
#: Each pattern: the :class:`DecoderConfig` fields it sets on :data:`MODEL`.
PATTERNS = {
    "full": {},
    "local_global_5_1": dict(layer_types=(_S,) * 5 + (_F,), sliding_window=WINDOW),
    "alternating": dict(layer_types=(_S, _F) * 3, sliding_window=WINDOW),
    "nope_every_4th": dict(nope_layers=(3,)),
    "chunked_nope": dict(layer_types=("chunked_attention",) * 3 + (_F,) + ("chunked_attention",) * 2,
                         attention_chunk_size=WINDOW, nope_layers=(3,)),
    "kv_sharing": dict(num_kv_shared_layers=2),
    "sinks": dict(attention_sinks=True),
    "differential": dict(attention="differential"),
}
DEFAULT_OUT = Path("results") / "layer_patterns.json"


def _missing_fields(name: str) -> list[str]:
    have = {f.name for f in dataclasses.fields(DecoderConfig)}
    return [k for k in PATTERNS[name] if k not in have]


def available() -> tuple[str, ...]:
    """The patterns this attnlib can build (those whose :class:`DecoderConfig` fields exist, and values pass)."""
    names = []
    for name in PATTERNS:
        if _missing_fields(name):
            continue
        try:
            pattern_config(name)
        except (TypeError, ValueError):
            continue
        names.append(name)
    return tuple(names)


def pattern_config(name: str) -> DecoderConfig:
    """The :class:`DecoderConfig` of pattern ``name`` (a key of :data:`PATTERNS`).

    Raises:
        ValueError: an unknown name, or a pattern whose field this attnlib lacks (named).
    """
    if name not in PATTERNS:
        raise ValueError(f"pattern={name!r} is not one of {tuple(PATTERNS)}")
    if missing := _missing_fields(name):
        raise ValueError(f"pattern={name!r} needs the DecoderConfig field(s) {missing}, not in this attnlib")
    return DecoderConfig.llama(**MODEL, **PATTERNS[name])


def build_model(name: str, seed: int) -> Decoder:
    """Pattern ``name``'s decoder, initialised after ``torch.manual_seed(seed)``."""
    config = pattern_config(name)
    torch.manual_seed(seed)
    return Decoder(config)


@torch.no_grad()
def cache_bytes_at(model: Decoder, T: int | None = None, dtype: torch.dtype = torch.float32) -> int:
    """Bytes a filled cache of ``model`` allocates after a prefill of ``T`` tokens (default: block_size), one
    sequence, measured from the tensors of :meth:`Decoder.new_cache` (a full layer holds ``block_size``
    slots, a sliding layer its window, a chunked layer its chunk, a shared layer nothing)."""
    T = model.config.block_size if T is None else T
    was = next(model.parameters()).dtype
    model.to(dtype)
    cache = model.new_cache()
    model(torch.zeros(1, T, dtype=torch.long), cache=cache)
    model.to(was)
    return cache.nbytes()


def compare(patterns: tuple[str, ...], seeds: tuple[int, ...], training: dict | None = None,
            progress: bool = True, on_run=None) -> dict:
    """Train every pattern with every seed (seed by seed); return the results.

    Returns:
        ``{"meta", "model", "training", "seeds", "variants": {name: {...}}}``: each pattern's
        ``config`` (its fields), ``parameters``, ``kv_cache_bytes_per_token`` (float32, what each layer
        writes per token: :meth:`Decoder.kv_cache_bytes_per_token`), ``cache_bytes_at_block_size``
        (float32, a filled cache of one sequence of ``block_size`` tokens, measured) and ``by_seed``
        (curves, final losses, training tokens/s).
    """
    for name in patterns:
        pattern_config(name)  # every pattern is checked before the first one trains
    cfg = TrainConfig(**{**TRAINING, **(training or {})}, device="cpu")
    corpus = load_char_corpus()
    results = {"meta": _machine(), "model": dict(MODEL, window=WINDOW), "training": asdict(cfg),
               "seeds": list(seeds), "variants": {}}
    for seed in seeds:
        for name in patterns:
            model = build_model(name, seed)
            if progress:
                print(f"{name} (seed {seed}): {model.num_parameters():,} parameters", file=sys.stderr)
            entry = results["variants"].setdefault(name, {
                "config": json.loads(json.dumps(PATTERNS[name])),  # as the file stores it
                "parameters": model.num_parameters(),
                "kv_cache_bytes_per_token": model.kv_cache_bytes_per_token(torch.float32),
                "cache_bytes_at_block_size": cache_bytes_at(model),
                "by_seed": {},
            })
            history = train(model, corpus.train, corpus.val, replace(cfg, seed=seed), progress=progress)
            entry["by_seed"][str(seed)] = {
                "steps": history.steps, "train_loss": history.train_loss, "val_loss": history.val_loss,
                "final_val_loss": history.val_loss[-1], "tokens_per_s": history.tokens_per_s,
                "elapsed_s": history.elapsed_s}
            if on_run is not None:
                on_run(results)
    return results


def merge(first: dict, more: dict) -> dict:
    """``first`` with ``more``'s patterns and seeds added (same model and training settings).

    Raises:
        ValueError: other settings, or a (pattern, seed) run that both files hold.
    """
    for key in ("model", "training"):
        a = {k: v for k, v in first[key].items() if k != "seed"}
        b = {k: v for k, v in more[key].items() if k != "seed"}
        if a != b:
            raise ValueError(f"{key} settings differ: {a} vs {b}")
    merged = add_seed_runs(first, more, "variants", "pattern")
    merged["seeds"] = list(dict.fromkeys([*first["seeds"], *more["seeds"]]))
    return merged


def load_results(path: str | Path | None = None) -> dict:
    """Read a results file; ``None`` = the committed run (:mod:`attnlib.book.results`).

    Raises:
        FileNotFoundError: no file at ``path``.
    """
    return results_files.read("layer_patterns", path)


def main(argv: list[str] | None = None) -> dict:
    """Command line: train the patterns and write the results file (every flag checked before training)."""
    p = argparse.ArgumentParser(prog="python -m attnlib.book.experiments.layer_patterns",
                                description=main.__doc__)
    p.add_argument("--patterns", nargs="+", choices=tuple(PATTERNS), default=None,
                   help="default: every pattern this attnlib can build")
    p.add_argument("--seeds", type=_cli.seed, nargs="+", default=[TRAINING["seed"]])
    p.add_argument("--max-iters", type=_cli.positive_int, default=TRAINING["max_iters"])
    p.add_argument("--eval-interval", type=_cli.positive_int, default=TRAINING["eval_interval"])
    p.add_argument("--eval-iters", type=_cli.positive_int, default=TRAINING["eval_iters"])
    p.add_argument("--merge-with", type=Path, default=None, metavar="FILE",
                   help="add these runs to an earlier results file (same settings) and write both")
    p.add_argument("--out", type=_cli.output_file, default=DEFAULT_OUT)
    p.add_argument("--threads", type=_cli.positive_int, default=1,
                   help="torch threads (default 1: these small matrices gain nothing from more, and extra "
                        "threads on a busy machine spin and slow every process down)")
    args = p.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"argument --seeds: {args.seeds} repeats a seed")
    patterns = tuple(available() if args.patterns is None else args.patterns)
    if len(set(patterns)) != len(patterns):
        p.error(f"argument --patterns: {' '.join(patterns)} repeats a pattern (expected each once)")
    for name in patterns:
        try:
            pattern_config(name)
        except ValueError as err:
            p.error(f"argument --patterns: {err}")
    training = {"max_iters": args.max_iters, "eval_interval": args.eval_interval, "eval_iters": args.eval_iters}
    earlier = None
    if args.merge_with is not None:
        if not args.merge_with.is_file():
            p.error(f"argument --merge-with: no results file at {str(args.merge_with)!r}")
        earlier = json.loads(args.merge_with.read_text())
        planned = {"model": dict(MODEL, window=WINDOW),
                   "training": asdict(TrainConfig(**{**TRAINING, **training}, device="cpu")),
                   "variants": {}, "seeds": [], "meta": {}}
        try:
            merge(earlier, planned)
        except ValueError as err:
            p.error(f"argument --merge-with: {err}")
        twice = [f"{n}/{s}" for n in patterns for s in args.seeds
                 if str(s) in earlier["variants"].get(n, {}).get("by_seed", {})]
        if twice:
            p.error(f"argument --merge-with: {args.merge_with} already holds {', '.join(twice)}")
    command = "python -m attnlib.book.experiments.layer_patterns " + " ".join(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # recorded in the file's meta (threads); restored below

    def write(results: dict, complete: bool = False) -> dict:
        results["meta"].update(command=command, complete=complete, wall_s=round(time.perf_counter() - started, 1))
        if earlier is not None:
            results = merge(earlier, results)
        _cli.write_json(args.out, results)  # atomic: a run stopped while writing keeps the last complete file
        return results

    try:
        results = write(compare(patterns, tuple(args.seeds), training, on_run=write), complete=True)
    finally:
        torch.set_num_threads(before)  # main() called from Python leaves the caller's setting as it was
    for name, s in seed_summary(results).items():
        r = results["variants"][name]
        tps = [run["tokens_per_s"] for run in r["by_seed"].values()]
        print(f"{name:18s} val {s['mean']:.4f} ± {s['std']:.4f} (n={s['n']})  params {r['parameters']:,}  "
              f"KV B/token {r['kv_cache_bytes_per_token']:,}  tokens/s {sum(tps) / len(tps):,.0f}")
    return results


if __name__ == "__main__":
    main()
