"""Source 000's experiment, done right: every attention variant trained the same way on Tiny Shakespeare.

Chapter 13. The full run, three seeds (about 45 minutes on an idle CPU core)::

    python -m attnlib.book.experiments.compare_attention --include-leaky --eval-iters 50 \
        --seeds 1337 1338 1339

writes ``results/compare_attention.json`` under the current directory (``--out FILE`` to
choose; every flag, the output path included, is checked before training starts). The
committed run the chapter reads ships inside the package (:mod:`attnlib.book.results`);
:func:`load_results` reads it.

The committed file was made in two steps: the first seed with the leaky models, 5000 steps
(``--include-leaky --eval-iters 50``), then two more seeds of the causal variants, 1000
steps each to fit a shared 2-core machine, added with ``--seeds 1338 1339 --max-iters 1000
--eval-iters 50 --eval-interval 1000 --merge-with FILE``; its ``meta`` records both
commands, and the chapter compares the seeds at step 1000 (``seed_summary(results, 1000)``).

Every variant gets the same configuration (the source's: d_model 64, 4 heads,
n_kv_heads 2, 4 layers, block 32, batch 16, lr 1e-3, 5000 steps, evaluation every 100
steps on 200 batches), the same initial seed and the same data order. ``--seeds`` repeats
every variant with other seeds (initial weights, batch order and evaluation batches all
follow the seed), because one seed cannot rank variants whose losses differ by less than
the seed-to-seed spread; the leaky models run with the first seed only. Two *leaky*
models can be added (``--include-leaky``) to show what a model that sees the future
reports: talking heads with a bias after the softmax (the source's layer) and
multi-head attention without its causal mask.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

import attnlib
from attnlib import _cli
from attnlib.attention import BiasedTalkingHeadsAttention, MultiHeadAttention
from attnlib.book import results as results_files
from attnlib.book.experiments import seeds as _seeds
from attnlib.book.experiments.seeds import seed_summary
from attnlib.data import load_char_corpus
from attnlib.models import GPT, GPTConfig
from attnlib.models.layers import ATTENTION_LAYERS
from attnlib.train import TrainConfig, train

__all__ = ["MODEL", "TRAINING", "VARIANTS", "LEAKY_VARIANTS", "DEFAULT_OUT", "compare", "load_results", "main",
           "merge_seeds", "seed_summary"]

#: The source notebook's model and training settings.
MODEL = dict(vocab_size=65, block_size=32, n_layers=4, n_heads=4, n_kv_heads=2, d_model=64, kv_latent_dim=16)
TRAINING = dict(batch_size=16, max_iters=5000, eval_interval=100, eval_iters=200, learning_rate=1e-3, seed=1337)
VARIANTS = ("mha", "talking_heads", "mqa", "gqa", "mla")

#: Where the command line writes its results unless ``--out`` says otherwise (relative to the current directory).
DEFAULT_OUT = Path("results") / "compare_attention.json"


class NonCausalSelfAttention(MultiHeadAttention):
    """**Leaks on purpose**: multi-head attention with the causal mask left out."""

    def __init__(self, d_model: int, n_heads: int, **kwargs) -> None:
        super().__init__(d_model, n_heads, **{**kwargs, "causal": False})


#: Models that can see the next token: trained only to show what such a leak looks like.
LEAKY_VARIANTS = {"talking_heads_biased": BiasedTalkingHeadsAttention, "mha_no_mask": NonCausalSelfAttention}
#: The variant of :data:`~attnlib.models.layers.ATTENTION_LAYERS` each leaky model is built from (its blocks
#: then get the leaky layer).
LEAKY_BASE = {"talking_heads_biased": "talking_heads", "mha_no_mask": "mha"}


def variant_config(variant: str, model: dict | None = None) -> GPTConfig:
    """The :class:`GPTConfig` of ``variant`` from the shared settings :data:`MODEL` (and ``model``'s overrides).

    ``n_kv_heads`` goes to ``gqa`` only and ``kv_latent_dim`` to ``mla`` only (a config refuses
    them for a variant they do not describe); a leaky variant gets its base's config.

    Raises:
        ValueError: ``variant`` is neither a name of :data:`~attnlib.models.layers.ATTENTION_LAYERS` nor a key of
            :data:`LEAKY_VARIANTS`.
    """
    known = (*ATTENTION_LAYERS, *LEAKY_VARIANTS)
    if variant not in known:
        raise ValueError(f"variant={variant!r} is not one of {known}")
    settings = {**MODEL, **(model or {})}
    n_kv_heads, latent = settings.pop("n_kv_heads", None), settings.pop("kv_latent_dim", None)
    attention = LEAKY_BASE.get(variant, variant)
    return GPTConfig(**settings, attention=attention, n_kv_heads=n_kv_heads if attention == "gqa" else None,
                     kv_latent_dim=latent if attention == "mla" else None)


def build_model(variant: str, model: dict | None = None) -> GPT:
    """A GPT whose attention is ``variant`` (a name of :data:`~attnlib.models.layers.ATTENTION_LAYERS` or a key
    of :data:`LEAKY_VARIANTS`).

    A leaky model is its base variant's GPT whose blocks then get the leaky attention layer,
    starting from exactly the base layer's weights (the GPT-2 initialisation); only what the
    leaky layer adds (the biased talking heads' post-softmax bias) keeps its own value.
    """
    config = variant_config(variant, model)
    gpt = GPT(config)
    if variant in LEAKY_VARIANTS:
        for block in gpt.blocks:
            leaky = LEAKY_VARIANTS[variant](config.d_model, config.n_heads, block_size=config.block_size,
                                            dropout=config.dropout, bias=config.attention_bias)
            missing, unexpected = leaky.load_state_dict(block.attn.state_dict(), strict=False)
            if unexpected or set(missing) - {"mix_weights_bias"}:  # the one parameter the base lacks
                raise RuntimeError(f"{variant}: cannot start from {LEAKY_BASE[variant]}'s weights ({missing}, {unexpected})")
            block.attn = leaky
    return gpt


def _machine() -> dict:
    """The machine and versions; ``commit`` is the git commit of the current directory (run it from the checkout)."""
    commit = "unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "attnlib": attnlib.__version__,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
    }


def compare(
    variants: tuple[str, ...] = VARIANTS,
    training: dict | None = None,
    model: dict | None = None,
    device: str | None = None,
    progress: bool = True,
    seeds: tuple[int, ...] | None = None,
    on_run: Callable[[dict], None] | None = None,
) -> dict:
    """Train each variant with the same seed and data order; return the results as a dict.

    Args:
        variants: names of :data:`~attnlib.models.layers.ATTENTION_LAYERS` (and/or :data:`LEAKY_VARIANTS` keys).
        training: overrides of :data:`TRAINING` (e.g. ``{"max_iters": 300}`` for a short run).
        model: overrides of :data:`MODEL`.
        device: ``None`` = :func:`attnlib.device`.
        progress: show a progress bar per variant.
        seeds: the seeds to train every causal variant with (``None`` = ``(training seed,)``);
            leaky variants train with the first seed only. The runs go seed by seed (all
            variants with the first seed, then the second, ...).
        on_run: called with the results so far after each run (the command line writes
            the file then, so a long run that stops early keeps what it finished).

    Returns:
        ``{"meta", "model", "training", "seeds", "variants": {name: {...}}}``; each variant
        has its first seed's loss curves (``steps, train_loss, val_loss``),
        ``final_train_loss``, ``final_val_loss``, ``tokens_per_s`` (training only) and
        ``elapsed_s``, then ``parameters``, ``kv_cache_bytes_per_token`` (all layers, fp32),
        ``causal``, and ``by_seed``: one entry per seed (its key the seed as a string) with
        that seed's curves, final losses, ``tokens_per_s`` and ``elapsed_s``.

    Raises:
        ValueError: an unknown variant, settings a variant's config refuses, or repeated
            or negative seeds (before any training).
    """
    settings = {**MODEL, **(model or {})}
    for variant in variants:
        variant_config(variant, model)  # every variant's settings are checked before the first one trains
    train_cfg = TrainConfig(**{**TRAINING, **(training or {})}, device=device)
    seeds = (train_cfg.seed,) if seeds is None else tuple(seeds)
    if not seeds or len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise ValueError(f"seeds={seeds} must be distinct integers >= 0 (at least one)")
    train_cfg = replace(train_cfg, seed=seeds[0])
    corpus = load_char_corpus()
    if corpus.vocab_size != settings["vocab_size"]:
        raise ValueError(f"vocab_size={settings['vocab_size']} but the corpus has {corpus.vocab_size} characters")
    results = {"meta": _machine(), "model": settings, "training": asdict(train_cfg),
               "seeds": list(seeds), "variants": {}}
    results["meta"]["device"] = str(train_cfg.device or attnlib.device())
    for seed in seeds:
        for variant in variants:
            if variant in LEAKY_VARIANTS and seed != seeds[0]:
                continue  # a leak shows with one seed; the seeds are for ranking causal variants
            cfg = replace(train_cfg, seed=seed)
            torch.manual_seed(seed)  # same seed: identical initial weights where all shapes agree (mha, talking heads)
            gpt = build_model(variant, model)
            if progress:
                print(f"{variant} (seed {seed}): {gpt.num_parameters():,} parameters", file=sys.stderr)
            history = train(gpt, corpus.train, corpus.val, cfg, progress=progress)
            curves = asdict(history)
            del curves["step_loss"]  # 5000 numbers per variant; the evaluated curves are what the chapter plots
            run = {**curves, "final_train_loss": history.train_loss[-1], "final_val_loss": history.val_loss[-1]}
            if seed == seeds[0]:
                results["variants"][variant] = {
                    **run,
                    "parameters": gpt.num_parameters(),
                    "kv_cache_bytes_per_token": gpt.kv_cache_bytes_per_token(torch.float32),
                    "causal": variant in ATTENTION_LAYERS,
                    "by_seed": {},
                }
            results["variants"][variant]["by_seed"][str(seed)] = run
            if on_run is not None:
                on_run(results)
    return results


def merge_seeds(first: dict, more: dict) -> dict:
    """``first`` with the runs of ``more`` (other seeds, same settings) added; see
    :func:`attnlib.book.experiments.seeds.merge_seeds` (the model settings of :data:`MODEL` must agree).

    Raises:
        ValueError: settings that differ, a variant ``first`` lacks, or a seed both have.
    """
    return _seeds.merge_seeds(first, more, MODEL)


def load_results(path: str | Path | None = None) -> dict:
    """Read a results file written by :func:`main`; ``None`` = the committed full run (:mod:`attnlib.book.results`).

    Raises:
        FileNotFoundError: no file at ``path``.
    """
    return results_files.read("compare_attention", path)


def format_table(results: dict) -> str:
    """The results as a plain-text table, one row per variant."""
    rows = [f"{'variant':22s}{'params':>9s}{'train':>8s}{'val':>8s}{'tokens/s':>10s}{'KV B/token':>12s}"]
    for name, r in results["variants"].items():
        rows.append(
            f"{name:22s}{r['parameters']:>9,}{r['final_train_loss']:>8.4f}{r['final_val_loss']:>8.4f}"
            f"{r['tokens_per_s']:>10,.0f}{r['kv_cache_bytes_per_token']:>12,}"
        )
    return "\n".join(rows)


def _variants(text: str) -> tuple[str, ...]:
    names = tuple(v for v in text.replace(" ", ",").split(",") if v)
    unknown = [v for v in names if v not in (*ATTENTION_LAYERS, *LEAKY_VARIANTS)]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated names from {(*ATTENTION_LAYERS, *LEAKY_VARIANTS)}"
        )
    if repeated := sorted({v for i, v in enumerate(names) if v in names[:i]}):
        raise argparse.ArgumentTypeError(f"{text!r} repeats {','.join(repeated)} (expected each variant once)")
    return names


def main(argv: list[str] | None = None) -> dict:
    """Command line: run the comparison, print the table, write the results file.

    Every flag is checked before the first variant trains (a bad one is an argparse
    ``error:`` line and exit status 2), so a finished run is never lost to a bad ``--out``.
    """
    p = argparse.ArgumentParser(prog="python -m attnlib.book.experiments.compare_attention", description=main.__doc__)
    p.add_argument("--variants", type=_variants, default=VARIANTS, help="comma-separated attention variants")
    p.add_argument("--include-leaky", action="store_true", help=f"also train {', '.join(LEAKY_VARIANTS)}")
    p.add_argument("--max-iters", type=_cli.positive_int, default=TRAINING["max_iters"])
    p.add_argument("--eval-interval", type=_cli.positive_int, default=TRAINING["eval_interval"])
    p.add_argument("--eval-iters", type=_cli.positive_int, default=TRAINING["eval_iters"])
    p.add_argument("--seeds", type=_cli.seed, nargs="+", default=None,
                   help=f"train every causal variant with each seed (default: {TRAINING['seed']})")
    p.add_argument("--merge-with", type=Path, default=None, metavar="FILE",
                   help="add these seeds' runs to an earlier results file (same settings) and write both")
    p.add_argument("--device", type=_cli.device, default=None, help="default: attnlib.device()")
    p.add_argument("--out", type=_cli.output_file, default=DEFAULT_OUT,
                   help=f"where to write the results (JSON); default: {DEFAULT_OUT} under the current directory")
    args = p.parse_args(argv)
    if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
        p.error(f"argument --seeds: {args.seeds} repeats a seed")
    earlier = None
    if args.merge_with is not None:
        if not args.merge_with.is_file():
            p.error(f"argument --merge-with: no results file at {args.merge_with}")
        earlier = json.loads(args.merge_with.read_text())
    variants = args.variants + (tuple(LEAKY_VARIANTS) if args.include_leaky else ())
    training = {"max_iters": args.max_iters, "eval_interval": args.eval_interval, "eval_iters": args.eval_iters}
    command = "python -m attnlib.book.experiments.compare_attention " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    started = time.perf_counter()

    def write(results: dict, complete: bool = False) -> dict:
        results["meta"].update(command=command, complete=complete,
                               wall_s=round(time.perf_counter() - started, 1))
        if earlier is not None:
            results = merge_seeds(earlier, results)
        _cli.write_json(args.out, results)  # atomic: a run stopped while writing keeps the last complete file
        return results

    seeds = None if args.seeds is None else tuple(args.seeds)
    if earlier is not None:  # settings that cannot be merged are refused before training
        planned = TrainConfig(**{**TRAINING, **training}, device=args.device)
        try:
            merge_seeds(earlier, {"model": dict(MODEL), "training": asdict(planned), "variants": {},
                                  "seeds": [], "meta": {}})
        except ValueError as err:
            p.error(f"argument --merge-with: {err}")
    results = compare(variants, training, device=args.device, seeds=seeds, on_run=write)
    results["meta"]["load_average_1min_at_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    results = write(results, complete=True)
    print(format_table(results))
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
