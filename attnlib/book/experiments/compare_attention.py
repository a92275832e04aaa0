"""Source 000's experiment, done right: every attention variant trained the same way on Tiny Shakespeare.

Chapter 13. The full run (about 15 minutes on a 2-core CPU)::

    python -m attnlib.book.experiments.compare_attention --out results/compare_attention.json

Every variant gets the same configuration (the source's: d_model 64, 4 heads,
n_kv_heads 2, 4 layers, block 32, batch 16, lr 1e-3, 5000 steps, evaluation every 100
steps on 200 batches), the same initial seed and the same data order. Two *leaky*
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
from dataclasses import asdict
from pathlib import Path

import torch

import attnlib
from attnlib.attention import ATTENTION_REGISTRY, BiasedTalkingHeadsAttention, MultiHeadAttention
from attnlib.config import GPTConfig
from attnlib.data import load_char_corpus
from attnlib.model import GPT
from attnlib.train import TrainConfig, train

__all__ = ["MODEL", "TRAINING", "VARIANTS", "LEAKY_VARIANTS", "RESULTS_PATH", "compare", "load_results", "main"]

#: The source notebook's model and training settings.
MODEL = dict(vocab_size=65, block_size=32, n_layers=4, n_heads=4, n_kv_heads=2, d_model=64, kv_latent_dim=16)
TRAINING = dict(batch_size=16, max_iters=5000, eval_interval=100, eval_iters=200, learning_rate=1e-3, seed=1337)
VARIANTS = ("mha", "talking_heads", "mqa", "gqa", "mla")

#: The committed results of the full run (in the repository, beside the package).
RESULTS_PATH = Path(__file__).resolve().parents[2] / "results" / "compare_attention.json"


class NonCausalSelfAttention(MultiHeadAttention):
    """**Leaks on purpose**: multi-head attention with the causal mask left out."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.d_model, config.n_heads, config.block_size, config.dropout, config.bias, causal=False)

    @staticmethod
    def kv_cache_size(config: GPTConfig) -> int:
        return 2 * config.n_heads * config.head_dim


#: Models that can see the next token: trained only to show what such a leak looks like.
LEAKY_VARIANTS = {"talking_heads_biased": BiasedTalkingHeadsAttention, "mha_no_mask": NonCausalSelfAttention}


def build_model(variant: str, config: GPTConfig | None = None) -> GPT:
    """A GPT whose attention is ``variant`` (a registry name or a key of :data:`LEAKY_VARIANTS`)."""
    known = (*ATTENTION_REGISTRY, *LEAKY_VARIANTS)
    if variant not in known:
        raise ValueError(f"variant={variant!r} is not one of {known}")
    config = config or GPTConfig(**MODEL)
    if variant in ATTENTION_REGISTRY:
        return GPT(GPTConfig(**{**asdict(config), "attention": variant}))
    ATTENTION_REGISTRY[variant] = LEAKY_VARIANTS[variant]  # registered only while the model is built
    try:
        return GPT(GPTConfig(**{**asdict(config), "attention": variant}))
    finally:
        del ATTENTION_REGISTRY[variant]


def _machine() -> dict:
    commit = "unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
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
) -> dict:
    """Train each variant with the same seed and data order; return the results as a dict.

    Args:
        variants: registry names (and/or :data:`LEAKY_VARIANTS` keys).
        training: overrides of :data:`TRAINING` (e.g. ``{"max_iters": 300}`` for a short run).
        model: overrides of :data:`MODEL`.
        device: ``None`` = :func:`attnlib.device`.
        progress: show a progress bar per variant.

    Returns:
        ``{"meta", "model", "training", "variants": {name: {...}}}``; each variant has its
        loss curves (``steps, train_loss, val_loss``), ``final_train_loss``,
        ``final_val_loss``, ``parameters``, ``tokens_per_s`` (training only),
        ``elapsed_s``, ``kv_cache_bytes_per_token`` (all layers, fp32) and ``causal``.
    """
    model_cfg = GPTConfig(**{**MODEL, **(model or {})})
    train_cfg = TrainConfig(**{**TRAINING, **(training or {})}, device=device)
    corpus = load_char_corpus()
    if corpus.vocab_size != model_cfg.vocab_size:
        raise ValueError(f"vocab_size={model_cfg.vocab_size} but the corpus has {corpus.vocab_size} characters")
    results = {"meta": _machine(), "model": asdict(model_cfg), "training": asdict(train_cfg), "variants": {}}
    results["meta"]["device"] = str(train_cfg.device or attnlib.device())
    for variant in variants:
        torch.manual_seed(train_cfg.seed)  # same seed: identical initial weights where all shapes agree (mha, talking heads)
        gpt = build_model(variant, model_cfg)
        attn_cls = type(gpt.blocks[0].attn)
        if progress:
            print(f"{variant}: {gpt.num_parameters():,} parameters", file=sys.stderr)
        history = train(gpt, corpus.train, corpus.val, train_cfg, progress=progress)
        curves = asdict(history)
        del curves["step_loss"]  # 5000 numbers per variant; the evaluated curves are what the chapter plots
        results["variants"][variant] = {
            **curves,
            "final_train_loss": history.train_loss[-1],
            "final_val_loss": history.val_loss[-1],
            "parameters": gpt.num_parameters(),
            "kv_cache_bytes_per_token": attn_cls.kv_cache_size(model_cfg) * model_cfg.n_layers * 4,
            "causal": variant in ATTENTION_REGISTRY,
        }
    return results


def load_results(path: str | Path | None = None) -> dict:
    """Read a results file written by :func:`main` (default: the committed :data:`RESULTS_PATH`)."""
    path = Path(path) if path is not None else RESULTS_PATH
    if not path.is_file():
        raise FileNotFoundError(
            f"no results at {path}; run `python -m attnlib.book.experiments.compare_attention --out {path}` first"
        )
    return json.loads(path.read_text())


def format_table(results: dict) -> str:
    """The results as a plain-text table, one row per variant."""
    rows = [f"{'variant':22s}{'params':>9s}{'train':>8s}{'val':>8s}{'tokens/s':>10s}{'KV B/token':>12s}"]
    for name, r in results["variants"].items():
        rows.append(
            f"{name:22s}{r['parameters']:>9,}{r['final_train_loss']:>8.4f}{r['final_val_loss']:>8.4f}"
            f"{r['tokens_per_s']:>10,.0f}{r['kv_cache_bytes_per_token']:>12,}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    """Command line: run the comparison, print the table, write the results file."""
    p = argparse.ArgumentParser(prog="python -m attnlib.book.experiments.compare_attention", description=main.__doc__)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated registry names")
    p.add_argument("--include-leaky", action="store_true", help=f"also train {', '.join(LEAKY_VARIANTS)}")
    p.add_argument("--max-iters", type=int, default=TRAINING["max_iters"])
    p.add_argument("--eval-interval", type=int, default=TRAINING["eval_interval"])
    p.add_argument("--eval-iters", type=int, default=TRAINING["eval_iters"])
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="where to write the results (JSON)")
    args = p.parse_args(argv)
    variants = tuple(v for v in args.variants.split(",") if v)
    if args.include_leaky:
        variants += tuple(LEAKY_VARIANTS)
    training = {"max_iters": args.max_iters, "eval_interval": args.eval_interval, "eval_iters": args.eval_iters}
    results = compare(variants, training, device=args.device)
    results["meta"]["command"] = "python -m attnlib.book.experiments.compare_attention " + " ".join(argv or sys.argv[1:])
    results["meta"]["load_average_1min_at_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    print(format_table(results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
