r"""Multi-query associative recall (MQAR) against the bytes a model keeps per sequence. Chapter 21.

MQAR (Arora et al. 2023, "Zoology", §3): a sequence lists ``N`` key-value pairs (keys distinct),
then asks for every key again in a random order; after each queried key the model must output
its value (:func:`mqar_batch`: pad 0, keys ``1..n_keys``, then the values' ids; only the answers
are scored). Attention can look a pair up wherever it is; a fixed-size state must hold all ``N``
pairs; a sliding window forgets the pairs that left it.

Every design (:data:`DESIGNS`) is one Llama-style :class:`attnlib.Decoder` (d_model 128, 4 heads
of 32, 2 layers, context 64) that differs only in its attention layers: full; sliding windows of
16 and 32; linear attention; gated DeltaNet; a 1:1 hybrid (gated DeltaNet, then full: Qwen3.5's
3:1 needs four layers, and a four-layer model of this width was still on the plateau after 500
steps in a trial); top-8 attention. All train alike (AdamW, no weight decay, lr 1e-3, 10 %
warm-up then cosine, clipping at 1; 64 sequences a step, ``N`` cycling through 2, 4, 8, 16 with
``4 · N`` tokens; 1,200 steps), are evaluated per ``N`` on the same 256 held-out sequences, and
then train 300 steps on Tiny Shakespeare for a validation loss. Bytes: float32, one sequence of
``T = 4 · N`` tokens (KV cache or recurrent state). At d_model 64 the models sit for thousands of
steps near ``H_N / N`` (answering with a value not yet asked for); an earlier run with ``N`` up to
32 and 800 steps left every design but full attention without the lookup, and full attention too
in one seed of three. The committed run (one thread per process, two at a time on 2 cores)::

    python -m attnlib.book.experiments.recall --seeds 1337 --out runs/recall_1337.json
    python -m attnlib.book.experiments.recall --seeds 1338 --out runs/recall_1338.json
    python -m attnlib.book.experiments.recall --seeds 1339 --designs gated_deltanet hybrid full \
        --out runs/recall_1339a.json
    python -m attnlib.book.experiments.recall --seeds 1339 --designs sliding sliding_32 linear topk \
        --out runs/recall_1339b.json
    python -m attnlib.book.experiments.recall --merge-only --merge-with runs/recall_1337.json \
        runs/recall_1338.json runs/recall_1339a.json runs/recall_1339b.json \
        --out attnlib/book/results/recall.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from attnlib import _cli, kv_cache_bytes
from attnlib.attention.sparse import TopKAttention
from attnlib.book import results as results_files
from attnlib.book.experiments.compare_attention import _machine
from attnlib.book.experiments.layer_patterns import cache_bytes_at
from attnlib.book.experiments.seeds import add_seed_runs
from attnlib.data import load_char_corpus
from attnlib.models import Decoder, DecoderConfig
from attnlib.train import TrainConfig, train

__all__ = ["DESIGNS", "MODEL", "MQAR", "SHAKESPEARE", "TRAINING", "build_model", "bytes_at", "compare", "load_results",
           "main", "merge", "mqar_batch", "recall_accuracy", "summary", "train_recall"]

MODEL = dict(n_layers=2, n_heads=4, d_model=128)
MQAR = dict(n_keys=64, n_values=64, pairs=(2, 4, 8, 16))
TRAINING = dict(batch_size=64, max_iters=1200, learning_rate=1e-3, weight_decay=0.0, warmup_fraction=0.1,
                eval_sequences=256)
SHAKESPEARE = dict(block_size=64, batch_size=16, max_iters=300, eval_interval=300, eval_iters=50, learning_rate=1e-3)
WINDOW, TOP_K = 16, 8
_L, _F = "linear_attention", "full_attention"
#: Each design: the :class:`DecoderConfig` fields it sets (``"top_k"``: its softmax layers become top-k).
DESIGNS = {
    "full": {},
    "sliding": dict(sliding_window=WINDOW),
    "sliding_32": dict(sliding_window=2 * WINDOW),
    "linear": dict(layer_types=(_L, _L), linear_layer="linear"),
    "gated_deltanet": dict(layer_types=(_L, _L), linear_layer="gated_deltanet"),
    "hybrid": dict(layer_types=(_L, _F), linear_layer="gated_deltanet"),
    "topk": dict(top_k=TOP_K),
}
DEFAULT_OUT = Path("results") / "recall.json"
PAD = 0


def mqar_batch(batch_size: int, pairs: int, generator: torch.Generator, *, n_keys: int = MQAR["n_keys"],
               n_values: int = MQAR["n_values"], seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of MQAR sequences of ``pairs = N`` key-value pairs each, laid out as (``π`` a random order)::

        k_1 v_1 … k_N v_N  k_π1 v_π1 … k_πN v_πN  0 … 0     targets: v_πj at each queried key k_πj, else -100

    Args:
        batch_size: rows. pairs: ``N``. generator: the source of randomness (one state, one batch).
        n_keys, n_values: key and value tokens. seq_len: ``T`` (default ``4 · N``: pairs and queries
            fill it; longer rows end in pad tokens).

    Returns:
        ``(idx, targets)``: int64 ``(batch_size, seq_len)``; ``targets`` is ``-100`` except at queried keys.
    Raises:
        ValueError: ``N < 1``, ``N > n_keys`` (keys must be distinct) or ``seq_len < 4 · N`` (named).
    """
    seq_len = 4 * pairs if seq_len is None and isinstance(pairs, int) else seq_len
    if isinstance(pairs, bool) or not isinstance(pairs, int) or not 1 <= pairs <= n_keys:
        raise ValueError(f"pairs={pairs!r} must be an int in [1, n_keys={n_keys}] (the keys are distinct)")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 4 * pairs:
        raise ValueError(f"seq_len={seq_len!r} must be an int >= 4 · pairs = {4 * pairs} (pairs, then queries)")
    n = pairs
    keys = torch.rand(batch_size, n_keys, generator=generator).argsort(-1)[:, :n] + 1  # (B, N), distinct per row
    values = torch.randint(n_values, (batch_size, n), generator=generator) + 1 + n_keys  # (B, N)
    order = torch.rand(batch_size, n, generator=generator).argsort(-1)  # (B, N): the query order
    idx = torch.full((batch_size, seq_len), PAD, dtype=torch.long)
    targets = torch.full((batch_size, seq_len), -100, dtype=torch.long)
    idx[:, 0:2 * n:2], idx[:, 1:2 * n:2] = keys, values  # the pairs
    idx[:, 2 * n:4 * n:2] = keys.gather(1, order)  # the queries ...
    idx[:, 2 * n + 1:4 * n:2] = targets[:, 2 * n:4 * n:2] = values.gather(1, order)  # ... and their answers
    return idx, targets


def recall_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of the positions with a target (``!= -100``) whose argmax over ``logits (B, T, V)`` is it.
    ValueError: shapes that do not match, or no target at all."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits (B, T, V) {tuple(logits.shape)} do not match targets (B, T) {tuple(targets.shape)}")
    asked = targets != -100
    if not asked.any():
        raise ValueError("targets holds no queried position (every entry is -100)")
    return (logits.argmax(-1)[asked] == targets[asked]).float().mean().item()


def build_model(name: str, seed: int, vocab_size: int, block_size: int) -> Decoder:
    """Design ``name``'s decoder (:data:`DESIGNS`), initialised after ``torch.manual_seed(seed)``; ValueError for
    an unknown name. ``"topk"``: the full design with :class:`TopKAttention` layers of the same sizes, RoPE and
    initial weights (no config field selects top-k attention)."""
    if name not in DESIGNS:
        raise ValueError(f"design={name!r} is not one of {tuple(DESIGNS)}")
    fields = {k: v for k, v in DESIGNS[name].items() if k != "top_k"}
    config = DecoderConfig.llama(**MODEL, vocab_size=vocab_size, block_size=block_size, **fields)
    torch.manual_seed(seed)
    model = Decoder(config)
    for block in model.blocks if "top_k" in DESIGNS[name] else ():
        sparse = TopKAttention(config.d_model, config.n_heads, config.n_kv_heads, top_k=DESIGNS[name]["top_k"],
                               block_size=block_size, bias=config.attention_bias, rope=block.attn.rope)
        sparse.load_state_dict(block.attn.state_dict())  # the full design's initial weights
        block.attn = sparse
    return model


def bytes_at(model: Decoder, seq_len: int) -> int:
    """Bytes (float32) one sequence of ``seq_len`` tokens keeps: its keys and values in the softmax layers
    (:func:`attnlib.kv_cache_bytes`: every position, or the window) plus the linear layers' fixed states."""
    c = model.config
    kv = kv_cache_bytes(layer_types=c.layer_types, seq_len=seq_len, sliding_window=c.sliding_window,
                        n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, dtype=torch.float32)
    return kv + sum(getattr(b.attn, "state_bytes", lambda dtype: 0)(torch.float32) for b in model.blocks)


def _lr(step: int, training: dict) -> float:
    """Linear warm-up over the first ``warmup_fraction`` of the steps, then cosine decay to 0 at ``max_iters``."""
    total, lr = training["max_iters"], training["learning_rate"]
    warmup = max(1, round(training["warmup_fraction"] * total))
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def _pairs_at(step: int) -> int:
    """``N`` of training step ``step``: the values of ``MQAR["pairs"]`` in turn (the small ``N`` teach the
    lookup that the large ones need)."""
    return MQAR["pairs"][step % len(MQAR["pairs"])]


def train_recall(model: Decoder, seed: int, training: dict | None = None) -> dict:
    """Train ``model`` on MQAR batches (``N`` per step: :func:`_pairs_at`) and evaluate it per ``N``.

    The training batches come from ``seed``; the evaluation sequences from a fixed generator (seed
    0), the same for every model and seed. Returns ``{"accuracy": {N: float}, "step_loss": [...],
    "train_s", "eval_s"}`` (``step_loss``: every 50th step's loss).
    """
    training = {**TRAINING, **(training or {})}
    optimizer = torch.optim.AdamW(model.parameters(), lr=training["learning_rate"],
                                  weight_decay=training["weight_decay"], betas=(0.9, 0.98))
    g = torch.Generator().manual_seed(seed)
    losses, start = [], time.perf_counter()
    model.train()
    for step in range(training["max_iters"]):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, training)
        n = _pairs_at(step)
        x, y = mqar_batch(training["batch_size"], n, g)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == training["max_iters"] - 1:
            losses.append([step, round(loss.item(), 4)])
    train_s, start = time.perf_counter() - start, time.perf_counter()
    model.eval()
    accuracy, g_eval = {}, torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in MQAR["pairs"]:
            x, y = mqar_batch(training["eval_sequences"], n, g_eval)
            accuracy[str(n)] = recall_accuracy(model(x)[0], y)
    return {"accuracy": accuracy, "step_loss": losses, "train_s": round(train_s, 1),
            "eval_s": round(time.perf_counter() - start, 1)}


def compare(designs: tuple[str, ...], seeds: tuple[int, ...], training: dict | None = None,
            shakespeare: dict | None = None, progress: bool = True, on_run=None) -> dict:
    """Train every design with every seed on MQAR, then (unless ``shakespeare`` is False) on Tiny Shakespeare.

    Returns:
        ``{"meta", "model", "mqar", "training", "shakespeare", "seeds", "designs": {name: {...}}}``: each
        design's ``config`` (its fields), ``parameters``, ``state_bytes`` (float32, one sequence of the
        longest ``4 · N`` tokens, measured from a filled cache), ``bytes_at`` (:func:`bytes_at` at each
        ``4 · N``) and ``by_seed`` (accuracy per ``N``, losses, timings, Shakespeare's validation loss).
    """
    training = {**TRAINING, **(training or {})}
    sh = None if shakespeare is False else {**SHAKESPEARE, **(shakespeare or {})}
    corpus = None if sh is None else load_char_corpus()
    vocab, T = 1 + MQAR["n_keys"] + MQAR["n_values"], 4 * max(MQAR["pairs"])
    results = json.loads(json.dumps({"meta": _machine(), "model": dict(MODEL, window=WINDOW, top_k=TOP_K),
                                     "mqar": MQAR, "training": training, "shakespeare": sh, "seeds": seeds}))
    results["designs"] = {}
    for seed in seeds:
        for name in designs:
            model = build_model(name, seed, vocab, T)
            if progress:
                print(f"{name} (seed {seed}): {model.num_parameters():,} parameters", file=sys.stderr)
            entry = results["designs"].setdefault(name, {
                "config": json.loads(json.dumps(DESIGNS[name])), "parameters": model.num_parameters(),
                "state_bytes": cache_bytes_at(model, T),
                "bytes_at": {str(n): bytes_at(model, 4 * n) for n in MQAR["pairs"]}, "by_seed": {}})
            run = train_recall(model, seed, training)
            if sh is not None:
                lm = build_model(name, seed, corpus.vocab_size, sh["block_size"])
                cfg = TrainConfig(**{k: v for k, v in sh.items() if k != "block_size"}, seed=seed, device="cpu")
                history = train(lm, corpus.train, corpus.val, cfg, progress=False)
                run["shakespeare"] = {"val_loss": history.val_loss[-1], "elapsed_s": round(history.elapsed_s, 1)}
            entry["by_seed"][str(seed)] = run
            if progress:
                print(f"  {run['accuracy']} {run['train_s']} s", file=sys.stderr)
            if on_run is not None:
                on_run(results)
    return results


def merge(first: dict, more: dict) -> dict:
    """``first`` with ``more``'s designs and seeds added (same model, task and training settings); ValueError for
    other settings, or a (design, seed) run that both hold."""
    for key in ("model", "mqar", "training", "shakespeare"):
        if first[key] != more[key]:
            raise ValueError(f"{key} settings differ: {first[key]} vs {more[key]}")
    merged = add_seed_runs(first, more, "designs", "design")
    merged["seeds"] = sorted({*first["seeds"], *more["seeds"]})
    return merged


def summary(results: dict) -> dict:
    """Per design: ``{"state_bytes", "accuracy": {N: (mean, min, max)}, "shakespeare": (mean, min, max)}``."""
    def stats(values: list[float]) -> tuple[float, float, float]:
        return sum(values) / len(values), min(values), max(values)
    out = {}
    for name, d in results["designs"].items():
        runs = list(d["by_seed"].values())
        acc = {n: stats([r["accuracy"][n] for r in runs]) for n in runs[0]["accuracy"]}
        sh = [r["shakespeare"]["val_loss"] for r in runs if "shakespeare" in r]
        out[name] = {"state_bytes": d["state_bytes"], "accuracy": acc, "shakespeare": stats(sh) if sh else None}
    return out


def load_results(path: str | Path | None = None) -> dict:
    """Read a results file; ``None`` = the committed run (:mod:`attnlib.book.results`); FileNotFoundError: none."""
    return results_files.read("recall", path)


def main(argv: list[str] | None = None) -> dict:
    """Command line: train the designs and write the results file, or (``--merge-only``) merge result files."""
    p = argparse.ArgumentParser(prog="python -m attnlib.book.experiments.recall", description=main.__doc__)
    p.add_argument("--designs", nargs="+", choices=tuple(DESIGNS), default=list(DESIGNS))
    p.add_argument("--seeds", type=_cli.seed, nargs="+", default=[1337])
    p.add_argument("--max-iters", type=_cli.positive_int, default=TRAINING["max_iters"], help="MQAR steps")
    p.add_argument("--shakespeare-iters", type=_cli.nonnegative_int, default=SHAKESPEARE["max_iters"],
                   help="Tiny Shakespeare steps (0: no Shakespeare run)")
    p.add_argument("--merge-with", type=Path, nargs="+", default=None, metavar="FILE",
                   help="add these runs to earlier results files (same settings) and write them all")
    p.add_argument("--merge-only", action="store_true", help="with --merge-with: merge the files, train nothing")
    p.add_argument("--out", type=_cli.output_file, default=DEFAULT_OUT)
    p.add_argument("--threads", type=_cli.positive_int, default=1,
                   help="torch threads (default 1: these small matrices gain nothing from more)")
    args = p.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"argument --seeds: {args.seeds} repeats a seed")
    if len(set(args.designs)) != len(args.designs):
        p.error(f"argument --designs: {' '.join(args.designs)} repeats a design (expected each once)")
    if args.merge_only and not args.merge_with:
        p.error("argument --merge-only: needs --merge-with FILE ...")
    training = {**TRAINING, "max_iters": args.max_iters}
    shakespeare = {**SHAKESPEARE, "max_iters": args.shakespeare_iters,
                   "eval_interval": args.shakespeare_iters} if args.shakespeare_iters else False
    earlier = []
    for file in args.merge_with or ():
        if not file.is_file():
            p.error(f"argument --merge-with: no results file at {str(file)!r}")
        earlier.append(json.loads(file.read_text()))
    command = "python -m attnlib.book.experiments.recall " + " ".join(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()

    def combine(results: dict | None) -> dict:
        files = earlier + ([results] if results is not None else [])
        merged = files[0]
        try:
            for more in files[1:]:
                merged = merge(merged, more)
        except ValueError as err:
            p.error(f"argument --merge-with: {err}")
        return merged

    if args.merge_only:
        results = combine(None)
        results["meta"]["merge_command"] = command
        _cli.write_json(args.out, results)
        return results
    if earlier:  # settings checked before anything trains
        combine(json.loads(json.dumps({"model": dict(MODEL, window=WINDOW, top_k=TOP_K), "mqar": MQAR, "seeds": [],
                                       "training": training, "shakespeare": shakespeare or None, "designs": {},
                                       "meta": {}})))
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # recorded in the file's meta (threads); restored below

    def write(results: dict, complete: bool = False) -> dict:
        results["meta"].update(command=command, complete=complete, wall_s=round(time.perf_counter() - started, 1),
                               load_average_1min_end=round(os.getloadavg()[0], 2))
        results = combine(results) if earlier else results
        _cli.write_json(args.out, results)  # atomic: a run stopped while writing keeps the last complete file
        return results

    try:
        results = write(compare(tuple(args.designs), tuple(args.seeds), training, shakespeare, on_run=write),
                        complete=True)
    finally:
        torch.set_num_threads(before)
    for name, s in summary(results).items():
        acc = "  ".join(f"N={n}: {m:.3f}" for n, (m, _, _) in s["accuracy"].items())
        sh = "" if s["shakespeare"] is None else f"  Shakespeare val {s['shakespeare'][0]:.4f}"
        print(f"{name:15s} {s['state_bytes']:>8,} B  {acc}{sh}")
    return results


if __name__ == "__main__":
    main()
