"""``python -m attnlib.bench serving``: batching, paged memory, speculative decoding, prefix caching and chunked
prefill, each against its baseline.

Chapter 19. Five comparisons in one run, each a ratio:

* **batching**: greedy tokens per second for a mix of requests, prompts of different lengths each
  asking for a different number of new tokens (from a quarter of ``new_tokens`` to twice it), one
  at a time (``GPT.generate`` per request) against static batches of ``max_batch`` requests in
  arrival order (left-padded, ``generate(attention_mask=...)``; a batch runs until its longest
  request is done) and against continuous batching on the paged cache, at most ``max_batch``
  requests at once (:func:`attnlib.serving.serve`: a finished request leaves and the next joins
  at once). The decode steps each one takes are counted as well as timed;
* **memory**: KV-cache positions (and bytes, for this model) that a mix of request lengths
  (:func:`attnlib.serving.request_lengths`) reserves: preallocated to ``block_size`` per request against
  pages taken as needed (:func:`attnlib.serving.cache_memory`);
* **speculative**: the target's own greedy decoding against :func:`attnlib.generation.speculative_generate`,
  with the acceptance rate. The models are untrained (speed does not depend on the weights, acceptance
  does): the draft is the target's first ``draft_layers`` layers with its final norm and head
  (self-speculative decoding: Zhang et al. 2023, "Draft & Verify"), so that it agrees with the target
  often enough to be worth measuring. Acceptance rates of a trained draft and target are chapter 19's;
* **prefix cache**: ``n_prompts`` requests sharing a system prompt of ``block_size / 2`` tokens (each with its own
  suffix of up to ``block_size / 8``), served (:func:`~attnlib.serving.serve`) without and with
  ``prefix_cache=True`` (SGLang's RadixAttention: Zheng et al. 2024): prompt tokens through the model, and time;
* **chunked prefill**: ``max_batch - 1`` short requests decoding long outputs while long prompts (``5/8`` of
  ``block_size``) join one at a time, served without and with ``prefill_chunk`` (Sarathi-Serve: Agrawal et al.
  2024): the longest wait of a running request between two of its tokens (median over the timed runs), and time.

The rows keep their order (batching, batching, memory, speculative, then the new ones), so readers that index
them (chapter 19) still work; ``summary`` keeps its three keys and adds ``prefix_cache``, ``prefix_cache_time``,
``chunked_prefill`` and ``chunked_prefill_time`` (each row's ratio).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from attnlib.bench._common import Command, format_table, resolve_device, time_calls
from attnlib.bench._common import threads as using_threads
from attnlib.bench._serving_prefill import prefill_rows
from attnlib.generation import speculative_generate
from attnlib.models import GPT, GPTConfig
from attnlib.serving import cache_memory, left_pad, request_lengths, serve

__all__ = ["COMMAND", "SMALL", "TARGET", "format_serving", "serving_rows", "truncated"]

#: The default target: big enough that one forward pass of several tokens costs little more than of one.
TARGET = GPTConfig(vocab_size=1024, block_size=256, n_layers=8, n_heads=8, d_model=512)
#: ``--small``: a tiny model for tests and quick runs.
SMALL = GPTConfig(vocab_size=64, block_size=64, n_layers=4, n_heads=4, d_model=64)


def truncated(model: GPT, n_layers: int) -> GPT:
    """A copy of ``model`` keeping its first ``n_layers`` blocks (embeddings, final norm and head shared in value):
    a draft with the target's vocabulary (self-speculative decoding).

    Raises:
        ValueError: ``n_layers`` not in ``[1, model.config.n_layers]``.
    """
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 1 <= n_layers <= model.config.n_layers:
        raise ValueError(f"draft_layers={n_layers!r} must be an int in [1, n_layers={model.config.n_layers}]")
    draft = copy.deepcopy(model)
    draft.blocks = nn.ModuleList(list(draft.blocks)[:n_layers])
    draft.config = model.config.replace(n_layers=n_layers, layer_types=model.config.layer_types[:n_layers])
    return draft


def serving_rows(config: GPTConfig | None = None, n_prompts: int = 8, new_tokens: int = 32, draft_layers: int = 1,
                 n_draft: int = 4, page_size: int = 16, n_requests: int = 200, repeats: int = 3, seed: int = 0,
                 device: str | torch.device | None = None, threads: int | None = None,
                 max_batch: int = 4, prefill_chunk: int = 16) -> list[dict]:
    """Measure the three comparisons (see the module's docstring).

    Args:
        config: the target model's shape (default :data:`TARGET`).
        n_prompts: requests of the batching comparison (prompt lengths spread over ``[1, block_size / 4]``).
        new_tokens: greedy tokens per generation (speculative); the batching requests ask for
            ``new_tokens / 4`` to ``2 · new_tokens`` each.
        max_batch: requests decoding together in a static batch and in continuous batching.
        draft_layers: blocks the draft keeps from the target.
        n_draft: draft tokens per round.
        page_size: positions per page (memory; continuous batching).
        n_requests: request lengths in the memory comparison.
        repeats: timed runs per setting (median).
        seed: weights, prompts and request lengths.
        device: where to run (``None``: :func:`attnlib.device`).
        threads: ``torch.set_num_threads`` for the run.
        prefill_chunk: prompt tokens per scheduler step in the chunked-prefill comparison.

    Returns:
        Dicts with ``comparison, baseline, method, unit, baseline_value, method_value, ratio, note``
        (``ratio`` = method / baseline for speed, baseline / method for memory: above 1 is better);
        the batching rows also have ``decode_steps`` (the method's) and ``baseline_decode_steps``; the prefix-cache
        and chunked-prefill rows ``baseline_stats`` and ``method_stats`` (``serve``'s stats of one run each).

    Raises:
        ValueError: ``max_batch`` or ``prefill_chunk`` not an int >= 1.
    """
    for name, value, least in (("max_batch", max_batch, 1), ("prefill_chunk", prefill_chunk, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name}={value!r} must be an int >= {least}")
    with using_threads(threads):
        rows, target = _rows(config or TARGET, n_prompts, new_tokens, draft_layers, n_draft, page_size, n_requests,
                             repeats, seed, resolve_device(device), max_batch)
        return rows + prefill_rows(target, n_prompts, new_tokens, page_size, repeats, seed, max_batch, prefill_chunk)


def _batching_rows(target, config, n_prompts, new_tokens, page_size, repeats, g, device, max_batch):
    """The two batching rows: static batches and continuous batching against one request at a time."""
    budgets = torch.randint(max(1, new_tokens // 4), 2 * new_tokens + 1, (n_prompts,), generator=g).tolist()
    longest = max(1, min(config.block_size // 4, config.block_size - max(budgets)))
    lengths = torch.randint(1, longest + 1, (n_prompts,), generator=g).tolist()
    prompts = [torch.randint(config.vocab_size, (n,), generator=g).to(device) for n in lengths]
    waves = [range(i, min(i + max_batch, n_prompts)) for i in range(0, n_prompts, max_batch)]  # arrival order
    # Decode steps, counted alike for all three: generate's prefill gives a request's first token, then n - 1
    # decode steps (a static batch's run until its longest request is done); serve's trace has one entry a step.
    steps = {"alone": sum(n - 1 for n in budgets), "static": sum(max(budgets[i] for i in w) - 1 for w in waves)}
    outputs = {}

    def one_at_a_time():
        outputs["alone"] = [target.generate(p[None], n, temperature=0.0)[0, -n:] for p, n in zip(prompts, budgets)]

    def static():
        outs = []
        for wave in waves:  # each batch decodes until its longest request is done
            idx, mask = left_pad([prompts[i] for i in wave])
            n = max(budgets[i] for i in wave)
            new = target.generate(idx, n, temperature=0.0, attention_mask=mask)[:, -n:]
            outs += [row[: budgets[i]] for row, i in zip(new, wave)]
        outputs["static"] = outs

    def continuous():
        outs, trace = serve(target, prompts, budgets, max_batch=max_batch, page_size=page_size)
        outputs["continuous"] = [o[-n:] for o, n in zip(outs, budgets)]
        steps["continuous"] = len(trace)

    s = time_calls({"alone": one_at_a_time, "static": static, "continuous": continuous}, repeats)
    tokens = sum(budgets)
    rows = []
    for method, key in ((f"static batches of {max_batch} (left-padded)", "static"),
                        (f"continuous, {max_batch} at once (paged)", "continuous")):
        same = all(torch.equal(a, b) for a, b in zip(outputs["alone"], outputs[key]))
        note = (f"{n_prompts} requests: prompts of {min(lengths)}-{max(lengths)} tokens, {min(budgets)}-{max(budgets)} "
                f"new; decode steps {steps[key]} vs {steps['alone']}; same tokens: {same}")
        rows.append(dict(comparison="batching", baseline="one at a time", method=method, unit="tokens/s",
                         baseline_value=tokens / s["alone"], method_value=tokens / s[key], ratio=s["alone"] / s[key],
                         decode_steps=steps[key], baseline_decode_steps=steps["alone"], note=note))
    return rows, prompts


def _rows(config, n_prompts, new_tokens, draft_layers, n_draft, page_size, n_requests, repeats, seed, device,
          max_batch):
    torch.manual_seed(seed)
    target = GPT(config).to(device).eval()
    draft = truncated(target, draft_layers)  # checked before anything is timed
    g = torch.Generator().manual_seed(seed)
    rows, prompts = _batching_rows(target, config, n_prompts, new_tokens, page_size, repeats, g, device, max_batch)
    outputs = {}

    mix = request_lengths(n_requests, config.block_size, seed)
    m = cache_memory(mix, config.block_size, page_size, target.kv_cache_bytes_per_token())
    rows.append(dict(comparison="memory", baseline=f"preallocated (waste {m['contiguous_waste']:.0%})",
                     method=f"paged, {page_size}/page (waste {m['paged_waste']:.0%})", unit="MB",
                     baseline_value=m["contiguous_bytes"] / 1e6, method_value=m["paged_bytes"] / 1e6,
                     ratio=m["contiguous_bytes"] / m["paged_bytes"],
                     note=f"{n_requests} requests, {m['tokens']:,} tokens, block_size {config.block_size}"))

    prompt = prompts[0][None]
    stats = {}

    def plain():
        outputs["plain"] = target.generate(prompt, new_tokens, temperature=0.0)

    def speculative():
        outputs["spec"], st = speculative_generate(target, draft, prompt, new_tokens, n_draft=n_draft, return_stats=True)
        stats.update(st)

    s = time_calls({"plain": plain, "speculative": speculative}, repeats)
    rows.append(dict(comparison="speculative", baseline="target greedy", method=f"draft {draft_layers} layer(s), k={n_draft}",
                     unit="tokens/s", baseline_value=new_tokens / s["plain"], method_value=new_tokens / s["speculative"],
                     ratio=s["plain"] / s["speculative"],
                     note=f"acceptance {stats['acceptance_rate']:.0%}, {stats['tokens_per_target_call']:.2f} tokens/target "
                          f"pass; same tokens: {torch.equal(outputs['plain'], outputs['spec'])}",
                     acceptance_rate=stats["acceptance_rate"], tokens_per_target_call=stats["tokens_per_target_call"]))
    return rows, target


COLUMNS = [
    ("comparison", "comparison", "s"),
    ("baseline", "baseline", "s"),
    ("method", "method", "s"),
    ("unit", "unit", "s"),
    ("baseline_value", "baseline", ",.2f"),
    ("method_value", "method", ",.2f"),
    ("ratio", "ratio", ".2f"),
    ("note", "note", "s"),
]


def format_serving(rows: list[dict], settings: dict | None = None) -> str:
    """The table and how it was measured (``settings``: the arguments of :func:`serving_rows`, ``config`` a dict)."""
    parts = []
    if settings:
        c = settings.get("config") or {}
        parts.append(f"GPT (untrained): {c.get('n_layers')} layers, {c.get('n_heads')} heads, d_model {c.get('d_model')}, "
                     f"vocabulary {c.get('vocab_size')}, block {c.get('block_size')}; batching: "
                     f"{settings.get('n_prompts')} requests, {settings.get('max_batch')} at once; speculative: "
                     f"{settings.get('new_tokens')} greedy tokens; median of {settings.get('repeats')} runs.")
    parts.append("ratio: method/baseline speed, or baseline/method memory (above 1: the method wins). The draft is the "
                 "target's first layers (self-speculative); a trained pair's acceptance is chapter 19's. Prefix cache "
                 "and chunked prefill: serve without and with the option, greedy (same tokens: checked).")
    parts.append(format_table(rows, COLUMNS))
    return "\n".join(parts)


def _add_arguments(parser) -> None:
    for flag, default, what in (("--prompts", 8, "prompts of different lengths"), ("--tokens", 32, "new tokens each"),
                                ("--draft-layers", 1, "layers of the self-speculative draft"),
                                ("--n-draft", 4, "tokens drafted per target pass"), ("--page-size", 16, "positions a page"),
                                ("--requests", 200, "request lengths in the memory comparison"),
                                ("--max-batch", 4, "requests decoding together (static and continuous batching)"),
                                ("--prefill-chunk", 16, "prompt tokens per scheduler step (chunked prefill)")):
        parser.add_argument(flag, type=int, default=None, help=f"{what} (default {default}; smaller with --small)")
    parser.add_argument("--seed", type=int, default=0)


def _check(parser, args) -> None:
    small = dict(prompts=6, tokens=16, draft_layers=1, n_draft=4, page_size=16, requests=200, max_batch=3,
                 prefill_chunk=8)
    full = dict(prompts=8, tokens=32, draft_layers=1, n_draft=4, page_size=16, requests=200, max_batch=4,
                prefill_chunk=16)
    for key, default in (small if args.small else full).items():
        if getattr(args, key) is None:
            setattr(args, key, default)
        if getattr(args, key) < 1:
            parser.error(f"argument --{key.replace('_', '-')}: {getattr(args, key)} must be >= 1")
    args.config = SMALL if args.small else TARGET
    if args.draft_layers > args.config.n_layers:
        parser.error(f"argument --draft-layers: {args.draft_layers} exceeds the target's {args.config.n_layers} layers")


def _run(args, device):
    settings = dict(config=args.config.to_dict(), n_prompts=args.prompts, new_tokens=args.tokens,
                    draft_layers=args.draft_layers, n_draft=args.n_draft, page_size=args.page_size,
                    n_requests=args.requests, seed=args.seed, repeats=args.repeats, max_batch=args.max_batch,
                    prefill_chunk=args.prefill_chunk)
    rows = serving_rows(args.config, n_prompts=args.prompts, new_tokens=args.tokens, draft_layers=args.draft_layers,
                        n_draft=args.n_draft, page_size=args.page_size, n_requests=args.requests,
                        repeats=args.repeats, seed=args.seed, device=device, max_batch=args.max_batch,
                        prefill_chunk=args.prefill_chunk)
    summary = {row["comparison"]: row["ratio"] for row in rows[:4]}  # batching: continuous batching's ratio
    for row in rows[4:]:  # prefix cache, prefix cache time, chunked prefill, chunked prefill time
        key = row["comparison"].replace(" ", "_") + ("_time" if row["unit"] == "s" else "")
        summary[key] = row["ratio"]
    return settings, rows, format_serving(rows, settings), summary


COMMAND = Command(help="batched vs one-at-a-time generation, paged vs preallocated cache, speculative vs plain decoding",
                  add_arguments=_add_arguments, check=_check, run=_run, repeats=3, warmup=0)
