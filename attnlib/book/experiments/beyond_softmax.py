"""Softmax attention vs linear attention vs gated DeltaNet, trained the same way on Tiny Shakespeare.

Chapter 18. The committed run (38 minutes for the first command on a shared 2-core machine,
14 for the second, run beside it; 2 for the third)::

    python -m attnlib.book.experiments.beyond_softmax --seeds 1337 1338 1339 \
        --out runs/beyond_softmax.json --checkpoints runs/beyond_softmax
    python -m attnlib.book.experiments.beyond_softmax --models gated --seeds 1337 1338 1339 \
        --out runs/beyond_softmax_gated.json --checkpoints runs/beyond_softmax_gated
    python -m attnlib.book.experiments.beyond_softmax --topk-only \
        --merge-from runs/beyond_softmax_gated.json --out runs/beyond_softmax.json \
        --checkpoints runs/beyond_softmax

then copied to ``attnlib/book/results/beyond_softmax.json``. The first trains each model with
each seed and saves the softmax models' weights; the second adds softmax attention with the
output gate (:class:`attnlib.attention.GatedAttention`); the third merges the two, times the
models' training steps in turns (:func:`interleaved_speed`: a fairer speed comparison on a
shared machine than each run's own tokens/s) and evaluates the trained softmax models with
top-k sparse attention (:class:`attnlib.attention.TopKAttention`, each query keeping its k
highest-scoring keys by its own q·k) at k = T, T/2, T/4, T/8.

Every model is chapter 13's GPT (:data:`attnlib.book.experiments.compare_attention.MODEL`:
d_model 64, 4 heads, 4 layers, block 32, batch 16, lr 1e-3) with its attention layers replaced;
the budget is the one chapter 13 compares its seeds at: 1000 steps (its first seed's 5000 steps
take too long for three models and several seeds on a shared machine). The same seed gives the
same data order and evaluation batches for every model.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from attnlib import _cli
from attnlib.attention.deltanet import GatedDeltaNet
from attnlib.attention.linear import LinearAttention
from attnlib.attention.sparse import GatedAttention
from attnlib.book import results as results_files
from attnlib.book.experiments.compare_attention import MODEL, _machine, seed_summary
from attnlib.data import load_char_corpus
from attnlib.models import GPT, GPTConfig
from attnlib.train import TrainConfig, estimate_loss, train

__all__ = ["MODELS", "TRAINING", "build_model", "compare", "load_results", "main", "seed_summary", "topk_tradeoff"]

#: The compared models: a GPT whose attention layers are softmax MHA, linear attention or gated DeltaNet;
#: ``"gated"`` (softmax MHA with Qwen3-Next's output gate) can be added to separate the gate's share.
MODELS = ("softmax", "linear", "deltanet")
ALL_MODELS = (*MODELS, "gated")
TRAINING = dict(batch_size=16, max_iters=1000, eval_interval=250, eval_iters=50, learning_rate=1e-3, seed=1337)
SETTINGS = {k: v for k, v in MODEL.items() if k not in ("n_kv_heads", "kv_latent_dim")}
DEFAULT_OUT = Path("results") / "beyond_softmax.json"


def build_model(name: str, seed: int) -> GPT:
    """Chapter 13's MHA GPT (``name="softmax"``: exactly its initial weights for ``seed``), or the same
    GPT with every ``block.attn`` replaced by :class:`LinearAttention` / :class:`GatedDeltaNet` /
    :class:`GatedAttention` and the GPT-2 initialisation redone with ``seed``.

    Built this way because it is what made the committed run (the same weights for a seed). The linear
    and DeltaNet models are the decoder that ``layer_types=("linear_attention",) * n_layers`` with
    ``linear_layer="linear"`` / ``"gated_deltanet"`` builds: the same parameters, the same logits.
    """
    if name not in ALL_MODELS:
        raise ValueError(f"name={name!r} is not one of {ALL_MODELS}")
    config = GPTConfig(**SETTINGS, attention="mha")
    torch.manual_seed(seed)
    gpt = GPT(config)
    if name != "softmax":
        layer = {"linear": LinearAttention, "deltanet": GatedDeltaNet, "gated": GatedAttention}[name]
        for block in gpt.blocks:
            block.attn = layer(config.d_model, config.n_heads, block_size=config.block_size, bias=config.attention_bias)
        torch.manual_seed(seed)
        gpt.reset_parameters()
    return gpt


def state_bytes(gpt: GPT, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of fixed-size recurrent state, all layers, one sequence (0 for softmax attention)."""
    return sum(getattr(b.attn, "state_bytes", lambda d: 0)(dtype) for b in gpt.blocks)


def compare(seeds: tuple[int, ...], training: dict | None = None, checkpoints: Path | None = None,
            progress: bool = True, on_run=None, models: tuple[str, ...] = MODELS) -> dict:
    """Train every model of ``models`` with every seed; return the results (``variants`` as chapter 13's)."""
    cfg = TrainConfig(**{**TRAINING, **(training or {})}, device="cpu")
    corpus = load_char_corpus()
    results = {"meta": _machine(), "model": SETTINGS, "training": asdict(cfg), "seeds": list(seeds), "variants": {}}
    for seed in seeds:
        for name in models:
            gpt = build_model(name, seed)
            if progress:
                print(f"{name} (seed {seed}): {gpt.num_parameters():,} parameters", file=sys.stderr)
            history = train(gpt, corpus.train, corpus.val, replace(cfg, seed=seed), progress=progress)
            run = {"steps": history.steps, "train_loss": history.train_loss, "val_loss": history.val_loss,
                   "final_val_loss": history.val_loss[-1], "tokens_per_s": history.tokens_per_s,
                   "elapsed_s": history.elapsed_s}
            entry = results["variants"].setdefault(name, {
                "parameters": gpt.num_parameters(),
                "kv_cache_bytes_per_token": gpt.kv_cache_bytes_per_token(torch.float32),
                "state_bytes": state_bytes(gpt),
                "by_seed": {},
            })
            entry["by_seed"][str(seed)] = run
            if checkpoints is not None and name == "softmax":
                checkpoints.mkdir(parents=True, exist_ok=True)
                torch.save(gpt.state_dict(), checkpoints / f"softmax_{seed}.pt")
            if on_run is not None:
                on_run(results)
    return results


@torch.no_grad()
def topk_tradeoff(results: dict, checkpoints: Path, eval_iters: int = 50) -> dict:
    """Validation loss of each seed's trained softmax GPT with top-k attention at k = T, T/2, T/4, T/8.

    Each layer keeps the trained weights; :class:`attnlib.attention.TopKAttention` (no indexer)
    keeps, for each query, the k causal keys of highest q·k, and attends to those only.
    Adds ``results["topk"] = {"k": [...], "by_seed": {seed: [loss per k]}, "dense": {seed: loss}}``.
    """
    from attnlib.attention.sparse import TopKAttention

    corpus = load_char_corpus()
    T, cfg = SETTINGS["block_size"], results["training"]
    ks = [T, T // 2, T // 4, T // 8]
    out = {"k": ks, "by_seed": {}, "dense": {}, "eval_iters": eval_iters, "indexer": "own q·k (exact top-k)"}
    for seed in results["seeds"]:
        gpt = build_model("softmax", seed)
        gpt.load_state_dict(torch.load(checkpoints / f"softmax_{seed}.pt", weights_only=True))
        splits = {"val": corpus.val}
        dense = estimate_loss(gpt, splits, cfg["batch_size"], T, eval_iters, seed + 1, "cpu")["val"]
        losses = []
        mha = [b.attn for b in gpt.blocks]
        for k in ks:
            for block, layer in zip(gpt.blocks, mha):
                sparse = TopKAttention(SETTINGS["d_model"], SETTINGS["n_heads"], top_k=k, block_size=T)
                sparse.load_state_dict(layer.state_dict())
                block.attn = sparse
            losses.append(estimate_loss(gpt, splits, cfg["batch_size"], T, eval_iters, seed + 1, "cpu")["val"])
        out["by_seed"][str(seed)], out["dense"][str(seed)] = losses, dense
    results["topk"] = out
    return results


def interleaved_speed(rounds: int = 7, steps: int = 20, seed: int = 0, models: tuple[str, ...] = MODELS) -> dict:
    """Training tokens/s of each model, measured in turns (model A, B, C, A, B, C, ...) so that a
    changing load on a shared machine hits every model alike; the median over ``rounds``.

    Each turn times ``steps`` AdamW steps on random batches of the experiment's shape, one thread.
    """
    T, batch = SETTINGS["block_size"], TRAINING["batch_size"]
    models = {name: build_model(name, seed) for name in models}
    optimizers = {n: torch.optim.AdamW(m.parameters(), lr=TRAINING["learning_rate"]) for n, m in models.items()}
    g = torch.Generator().manual_seed(seed)
    samples: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds + 1):  # round 0 warms up and is not counted
        for name, model in models.items():
            x, y = (torch.randint(0, SETTINGS["vocab_size"], (batch, T), generator=g) for _ in range(2))
            start = time.perf_counter()
            for _ in range(steps):
                _, loss = model(x, y)
                optimizers[name].zero_grad(set_to_none=True)
                loss.backward()
                optimizers[name].step()
            if r:
                samples[name].append(steps * batch * T / (time.perf_counter() - start))
    return {name: {"median": sorted(v)[len(v) // 2], "samples": v} for name, v in samples.items()}


def load_results(path: str | Path | None = None) -> dict:
    """Read a results file; ``None`` = the committed run shipped in :mod:`attnlib.book.results`."""
    return results_files.read("beyond_softmax", path)


def main(argv: list[str] | None = None) -> dict:
    """Command line: train and write the results file, or (``--topk-only``) add the top-k losses to it."""
    p = argparse.ArgumentParser(prog="python -m attnlib.book.experiments.beyond_softmax", description=main.__doc__)
    p.add_argument("--seeds", type=_cli.seed, nargs="+", default=[TRAINING["seed"]])
    p.add_argument("--max-iters", type=_cli.positive_int, default=TRAINING["max_iters"])
    p.add_argument("--eval-interval", type=_cli.positive_int, default=TRAINING["eval_interval"])
    p.add_argument("--eval-iters", type=_cli.positive_int, default=TRAINING["eval_iters"])
    p.add_argument("--checkpoints", type=Path, default=Path("runs") / "beyond_softmax",
                   help="where the softmax models' weights are saved (and read by --topk-only)")
    p.add_argument("--topk-only", action="store_true",
                   help="evaluate top-k attention on the saved softmax models, and time the models in turns")
    p.add_argument("--models", nargs="+", choices=ALL_MODELS, default=list(MODELS))
    p.add_argument("--merge-from", type=Path, default=None, metavar="FILE",
                   help="with --topk-only: first add the models of FILE (same seeds and settings)")
    p.add_argument("--out", type=_cli.output_file, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"argument --seeds: {args.seeds} repeats a seed")
    if len(set(args.models)) != len(args.models):
        p.error(f"argument --models: {' '.join(args.models)} repeats a model (expected each once)")
    if args.merge_from is not None and not args.topk_only:
        p.error("argument --merge-from: only used with --topk-only")
    if args.topk_only:  # it adds to the results file of a finished run: that file and its checkpoints must exist
        if not args.out.is_file():
            p.error(f"argument --out: --topk-only adds to a results file, and there is none at {str(args.out)!r} "
                    "(train first, without --topk-only)")
        if not args.checkpoints.is_dir():
            p.error(f"argument --checkpoints: --topk-only reads the saved models, and {str(args.checkpoints)!r} "
                    "is not a directory")
        if args.merge_from is not None and not args.merge_from.is_file():
            p.error(f"argument --merge-from: no results file at {str(args.merge_from)!r}")
    command = "python -m attnlib.book.experiments.beyond_softmax " + " ".join(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    if args.topk_only:
        results = json.loads(args.out.read_text())
        if args.merge_from is not None:
            more = json.loads(args.merge_from.read_text())
            if more["seeds"] != results["seeds"] or more["training"] != results["training"]:
                p.error(f"--merge-from {args.merge_from}: other seeds or training settings")
            results["variants"].update(more["variants"])
            results["meta"]["merged"] = more["meta"]
        results = topk_tradeoff(results, args.checkpoints, args.eval_iters)
        results["speed"] = {"models": interleaved_speed(models=tuple(results["variants"])),
                            "threads": torch.get_num_threads()}
        results["topk"].update(command=command, wall_s=round(time.perf_counter() - started, 1))
        _cli.write_json(args.out, results)  # atomic: the finished run's file is never left half-written
        print(json.dumps(results["topk"], indent=1))
        return results

    def write(results: dict, complete: bool = False) -> None:
        results["meta"].update(command=command, complete=complete, wall_s=round(time.perf_counter() - started, 1))
        _cli.write_json(args.out, results)  # atomic: a run stopped while writing keeps the last complete file

    training = {"max_iters": args.max_iters, "eval_interval": args.eval_interval, "eval_iters": args.eval_iters}
    results = compare(tuple(args.seeds), training, args.checkpoints, on_run=write, models=tuple(args.models))
    write(results, complete=True)
    for name, s in seed_summary(results).items():
        r = results["variants"][name]
        tps = [run["tokens_per_s"] for run in r["by_seed"].values()]
        print(f"{name:10s} val {s['mean']:.4f} ± {s['std']:.4f}  tokens/s {sum(tps) / len(tps):,.0f}  "
              f"KV B/token {r['kv_cache_bytes_per_token']:,}  state B {r['state_bytes']:,}")
    return results


if __name__ == "__main__":
    main()
