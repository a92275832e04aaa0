"""``python -m attnlib.bench hf-llama``: the Llama-style decoder against ``transformers``' ``LlamaForCausalLM``.

Chapter 16 (issue #21). One model, two codebases: a ``transformers`` ``LlamaForCausalLM`` of
:data:`HF_LLAMA`'s sizes (the 10M row of ``bench train``: 6 layers, d_model 384, 6 heads of 64, 2
key/value heads, vocabulary 65, T 256; RoPE, RMSNorm eps 1e-5, SwiGLU of ``8/3 · d_model``, no biases,
untied head), initialised by ``transformers``, and the :class:`attnlib.Decoder` loaded from it with
:func:`attnlib.from_hf_llama`, whose config must be :meth:`attnlib.DecoderConfig.llama`'s of the same
sizes. Before anything is timed, the two must give the same logits (``max_abs_diff``, refused above
:data:`TOLERANCE`); then, in rounds that alternate the two (:func:`attnlib.bench.time_calls`):

* **train**: one step, ``forward → loss → backward → AdamW.step → zero_grad``, on the same batch of
  ``block_size`` tokens; ``transformers`` computes its own loss (``labels``, with ``shift_labels`` =
  the next tokens, so that both average the same ``B · T`` predictions); the losses of the first
  two steps are compared (``loss_max_abs_diff``: the same step, from the same weights);
* **decode**: greedy generation with a cache, ``Decoder.generate(prompt, n, temperature=0)`` against
  ``LlamaForCausalLM.generate(prompt, max_new_tokens=n, do_sample=False)`` (its default
  ``DynamicCache``), the same random prompt and number of new tokens; the tokens must be equal
  (``same_tokens``).

``ratio`` is attnlib's time over ``transformers``' (below 1: attnlib is faster); the decode row also
gives tokens per second. Both use PyTorch's SDPA (``attn_implementation="sdpa"``).
``transformers`` is an optional dependency of the benchmarks: it is imported when the rows are
measured, and the command line refuses to start without it.
"""
from __future__ import annotations

import argparse
import importlib.util

import torch
from torch import nn

from attnlib.bench._common import Command, format_table, resolve_device, time_calls
from attnlib.bench._common import threads as using_threads
from attnlib.models import Decoder, DecoderConfig, from_hf_llama

__all__ = ["COMMAND", "HF_LLAMA", "HF_LLAMA_SMALL", "PARTS", "TOLERANCE", "format_hf_llama", "hf_llama_config",
           "hf_llama_pair", "hf_llama_rows"]

PARTS = ("train", "decode")
#: The compared model (``bench train``'s 10M row as a Llama: 6 heads of 64, 2 key/value heads) and its runs:
#: training batch, prompt and new tokens of the decode row.
HF_LLAMA = dict(config=DecoderConfig.llama(vocab_size=65, block_size=256, n_layers=6, n_heads=6, n_kv_heads=2,
                                           d_model=384),
                batch=8, prompt_len=16, tokens=200)
#: ``--small``: a model that steps in milliseconds, for tests.
HF_LLAMA_SMALL = dict(config=DecoderConfig.llama(vocab_size=65, block_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                                 d_model=32),
                      batch=2, prompt_len=4, tokens=8)
#: Largest difference of the logits allowed before timing, per dtype: the same function, up to rounding.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}


def _transformers():
    """``transformers``' ``AutoModelForCausalLM`` and ``LlamaConfig``, or an error that says how to install it."""
    if importlib.util.find_spec("transformers") is None:
        raise ModuleNotFoundError("the hf-llama benchmark compares against transformers, which is not installed: "
                                  "pip install transformers (or attnlib[test])")
    from transformers import AutoModelForCausalLM, LlamaConfig

    return AutoModelForCausalLM, LlamaConfig


def hf_llama_config(config: DecoderConfig):
    """The ``transformers`` ``LlamaConfig`` of a :meth:`DecoderConfig.llama` (no BOS/EOS/pad ids: generation
    never stops early).

    Raises:
        ModuleNotFoundError: ``transformers`` is not installed.
        ValueError: a config that is not a plain Llama (another position, norm, feed-forward, attention,
            layer types, biases, RoPE scaling, dropout).
    """
    llama = DecoderConfig.llama(**{k: getattr(config, k) for k in ("vocab_size", "block_size", "n_layers", "n_heads",
                                                                    "d_model", "n_kv_heads", "head_dim", "d_ff",
                                                                    "norm_eps", "rope_base", "tie_embeddings")})
    if config.to_dict() != llama.to_dict():
        differ = {k: v for k, v in config.to_dict().items() if llama.to_dict()[k] != v}
        raise ValueError(f"config is not a plain DecoderConfig.llama: it differs in {differ}")
    _, LlamaConfig = _transformers()
    return LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.d_ff,
                       num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
                       num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim,
                       max_position_embeddings=config.block_size, rms_norm_eps=config.norm_eps,
                       rope_theta=config.rope_base, tie_word_embeddings=config.tie_embeddings, attention_bias=False,
                       mlp_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def hf_llama_pair(config: DecoderConfig, seed: int = 0, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> tuple[Decoder, nn.Module]:
    """``(ours, theirs)``: a ``LlamaForCausalLM`` of ``config``'s sizes (SDPA, ``transformers``' initialisation
    under ``seed``) and the :class:`Decoder` loaded from it by :func:`attnlib.from_hf_llama`, both in train mode.

    Raises:
        ModuleNotFoundError: ``transformers`` is not installed.
        ValueError: ``config`` not a plain Llama (:func:`hf_llama_config`); a loaded config other than ``config``.
    """
    hf_config = hf_llama_config(config)
    AutoModelForCausalLM, _ = _transformers()
    torch.manual_seed(seed)
    theirs = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa").to(device, dtype)
    ours = from_hf_llama(theirs).to(device, dtype)
    if ours.config.to_dict() != config.to_dict():  # the loader must give back the preset it was built from
        differ = {k: (v, config.to_dict()[k]) for k, v in ours.config.to_dict().items() if config.to_dict()[k] != v}
        raise ValueError(f"from_hf_llama gave another config: {differ} (loaded, wanted)")
    return ours.train(), theirs.train()


def _train_step(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, hf: bool, lr: float = 1e-4):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> torch.Tensor:
        if hf:  # transformers' own loss; shift_labels: the targets are already the next tokens
            loss = model(input_ids=idx, labels=targets, shift_labels=targets).loss
        else:
            loss = model(idx, targets)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def hf_llama_rows(
    config: DecoderConfig | None = None,
    parts: tuple[str, ...] | list[str] = PARTS,
    batch: int = 8,
    prompt_len: int = 16,
    tokens: int = 200,
    decode_batch: int = 1,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
    threads: int | None = None,
) -> list[dict]:
    """Time the Llama-style decoder against ``transformers``' ``LlamaForCausalLM`` (see the module's docstring).

    Args:
        config: a :meth:`DecoderConfig.llama` (default :data:`HF_LLAMA`'s).
        parts: some of :data:`PARTS`, in any order.
        batch: sequences of ``block_size`` tokens per training step.
        prompt_len, tokens: the decode row's random prompt and new tokens (``prompt_len + tokens <= block_size``).
        decode_batch: prompts generated at once.
        device: where to run (``None``: :func:`attnlib.device`).
        dtype: ``torch.float32`` or ``torch.float64`` (the logits are compared within :data:`TOLERANCE`).
        repeats: timed calls of each (the median reported), alternating the two codebases.
        warmup: untimed calls of each first (the training row's first two steps are always untimed).
        seed: weights, batch and prompt.
        threads: ``torch.set_num_threads`` for the run (``None``: as it is).

    Returns:
        One dict per part. Both: ``part, parameters`` (attnlib's), ``transformers_parameters``, ``attnlib_ms``,
        ``transformers_ms``, ``ratio`` (attnlib / transformers), ``logits_max_abs_diff``. ``train``: ``batch,
        seq_len, loss_max_abs_diff``. ``decode``: ``batch, prompt_len, new_tokens, attnlib_tokens_per_s,
        transformers_tokens_per_s, same_tokens``.

    Raises:
        ModuleNotFoundError: ``transformers`` is not installed (before any work).
        ValueError: an unknown part, a dtype without a tolerance, a prompt and tokens past ``block_size``,
            a config that is not a plain Llama (before any work).
        RuntimeError: logits that differ by more than :data:`TOLERANCE` (before anything is timed).
    """
    config = HF_LLAMA["config"] if config is None else config
    if unknown := [p for p in parts if p not in PARTS]:
        raise ValueError(f"parts={list(parts)}: {unknown} not among {PARTS}")
    if dtype not in TOLERANCE:
        raise ValueError(f"dtype={dtype} is not one of {list(TOLERANCE)} (the logits are compared before timing)")
    if prompt_len + tokens > config.block_size:
        raise ValueError(f"prompt_len={prompt_len} + tokens={tokens} exceeds block_size={config.block_size}")
    hf_llama_config(config)  # not a plain Llama, or no transformers: refused here
    with using_threads(threads):
        return _rows(config, list(dict.fromkeys(parts)), batch, prompt_len, tokens, decode_batch,
                     resolve_device(device), dtype, repeats, warmup, seed)


def _rows(config, parts, batch, prompt_len, tokens, decode_batch, device, dtype, repeats, warmup, seed):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(config.vocab_size, (batch, config.block_size + 1), generator=g).to(device)
    idx, targets = data[:, :-1], data[:, 1:].contiguous()  # transformers views its labels: contiguous
    rows = []
    for part in parts:
        ours, theirs = hf_llama_pair(config, seed, device, dtype)  # each part from the same fresh weights
        common = dict(parameters=ours.num_parameters(),
                      transformers_parameters=sum(p.numel() for p in theirs.parameters()),
                      logits_max_abs_diff=_logits_diff(ours, theirs, idx, TOLERANCE[dtype]))
        if part == "train":
            steps = {"attnlib": _train_step(ours, idx, targets, hf=False),
                     "transformers": _train_step(theirs, idx, targets, hf=True)}
            # The first two steps from the same weights: the same losses (the same step); then timed.
            losses = [(steps["attnlib"]().item(), steps["transformers"]().item()) for _ in range(2)]
            seconds = time_calls(steps, repeats=repeats, warmup=warmup)
            rows.append(dict(part="train", batch=batch, seq_len=config.block_size, **common,
                             attnlib_ms=1e3 * seconds["attnlib"], transformers_ms=1e3 * seconds["transformers"],
                             ratio=seconds["attnlib"] / seconds["transformers"],
                             loss_max_abs_diff=max(abs(a - b) for a, b in losses)))
        else:
            rows.append(_decode_row(ours, theirs, config, prompt_len, tokens, decode_batch, device, repeats, warmup,
                                    seed, common))
    return rows


@torch.no_grad()
def _logits_diff(ours: nn.Module, theirs: nn.Module, idx: torch.Tensor, tolerance: float) -> float:
    """The largest difference of the two models' logits on ``idx`` (eval mode; the modes are restored).

    Raises:
        RuntimeError: above ``tolerance``: not the same model, so nothing is timed.
    """
    modes = ours.training, theirs.training
    ours.eval()
    theirs.eval()
    diff = (ours(idx)[0].double() - theirs(input_ids=idx).logits.double()).abs().max().item()
    ours.train(modes[0])
    theirs.train(modes[1])
    if diff > tolerance:
        raise RuntimeError(f"the two models' logits differ by {diff:.2e} > {tolerance:.0e}: not the same model, "
                           "nothing timed")
    return diff


def _decode_row(ours, theirs, config, prompt_len, tokens, decode_batch, device, repeats, warmup, seed, common):
    ours.eval()
    theirs.eval()
    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(config.vocab_size, (decode_batch, prompt_len), generator=g).to(device)
    ones = torch.ones_like(prompt)
    outputs = {}

    def attnlib_generate():
        outputs["attnlib"] = ours.generate(prompt, tokens, temperature=0.0)

    def transformers_generate():
        outputs["transformers"] = theirs.generate(prompt, attention_mask=ones, max_new_tokens=tokens, do_sample=False)

    seconds = time_calls({"attnlib": attnlib_generate, "transformers": transformers_generate}, repeats=repeats,
                         warmup=warmup)
    same = outputs["attnlib"].shape == outputs["transformers"].shape and torch.equal(outputs["attnlib"],
                                                                                     outputs["transformers"])
    n = decode_batch * tokens
    return dict(part="decode", batch=decode_batch, prompt_len=prompt_len, new_tokens=tokens, **common,
                attnlib_ms=1e3 * seconds["attnlib"], transformers_ms=1e3 * seconds["transformers"],
                ratio=seconds["attnlib"] / seconds["transformers"], attnlib_tokens_per_s=n / seconds["attnlib"],
                transformers_tokens_per_s=n / seconds["transformers"], same_tokens=same)


COLUMNS = [
    ("part", "part", "s"),
    ("batch", "batch", "d"),
    ("tokens", "tokens", "s"),
    ("attnlib_ms", "attnlib ms", ",.1f"),
    ("transformers_ms", "transformers ms", ",.1f"),
    ("ratio", "ratio", ".3f"),
    ("attnlib_tokens_per_s", "attnlib tok/s", ",.1f"),
    ("transformers_tokens_per_s", "transformers tok/s", ",.1f"),
    ("check", "check", "s"),
]


def format_hf_llama(rows: list[dict], settings: dict | None = None) -> str:
    """The table and how it was measured (``settings``: the command's, ``config`` a dict)."""
    parts = []
    if settings:
        c = settings["config"]
        parts.append(f"Llama (untrained, transformers' initialisation): {c['n_layers']} layers, {c['n_heads']} heads "
                     f"({c['n_kv_heads']} key/value) of {c['head_dim']}, d_model {c['d_model']}, SwiGLU {c['d_ff']}, "
                     f"vocabulary {c['vocab_size']}, T {c['block_size']}; {settings['dtype']}; median of "
                     f"{settings['repeats']} alternating calls after {settings['warmup']} warm-up.")
    parts.append("attnlib: Decoder from attnlib.from_hf_llama(LlamaForCausalLM), same weights, both on SDPA. "
                 "train: forward, loss, backward, AdamW step, zero_grad; decode: greedy generate with a cache "
                 "(attnlib: temperature=0; transformers: do_sample=False, DynamicCache). ratio = attnlib / transformers "
                 "time (below 1: attnlib faster).")
    shown = []
    for row in rows:
        if row["part"] == "train":
            tokens, check = f"{row['seq_len']}", f"loss diff {row['loss_max_abs_diff']:.1e}"
        else:
            tokens, check = f"{row['prompt_len']}+{row['new_tokens']}", f"same tokens: {row['same_tokens']}"
        shown.append(dict(row, tokens=tokens, check=check))
    parts.append(format_table(shown, COLUMNS))
    parts.append(f"logits max |diff| before timing: {max(r['logits_max_abs_diff'] for r in rows):.1e}")
    return "\n".join(parts)


def _names(text: str) -> list[str]:
    return [name for name in text.replace(" ", ",").split(",") if name]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated (default {','.join(PARTS)})")
    parser.add_argument("--batch", type=int, default=None, help="sequences per training step (default 8; 2 with --small)")
    parser.add_argument("--prompt-len", type=int, default=None, help="decode prompt (default 16; 4 with --small)")
    parser.add_argument("--tokens", type=int, default=None, help="new tokens per generation (default 200; 8 with --small)")
    parser.add_argument("--decode-batch", type=int, default=1, help="prompts generated at once (default 1)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--seed", type=int, default=0)


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    defaults = HF_LLAMA_SMALL if args.small else HF_LLAMA
    args.config = defaults["config"]
    text, args.parts = args.parts, _names(args.parts)
    if not args.parts:
        parser.error(f"argument --parts: {text!r} names nothing; choose from {','.join(PARTS)}")
    if unknown := [p for p in args.parts if p not in PARTS]:
        parser.error(f"argument --parts: {','.join(unknown)} not among {','.join(PARTS)}")
    args.parts = list(dict.fromkeys(args.parts))
    for key in ("batch", "prompt_len", "tokens"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    for key in ("batch", "prompt_len", "tokens", "decode_batch"):
        if getattr(args, key) < 1:
            parser.error(f"argument --{key.replace('_', '-')}: {getattr(args, key)} must be >= 1")
    if args.prompt_len + args.tokens > args.config.block_size:
        parser.error(f"argument --tokens: --prompt-len {args.prompt_len} + --tokens {args.tokens} exceeds the model's "
                     f"block_size {args.config.block_size}")
    if importlib.util.find_spec("transformers") is None:
        parser.error("hf-llama compares against transformers, which is not installed: pip install transformers")


def _run(args: argparse.Namespace, device: torch.device):
    import transformers

    settings = dict(config=args.config.to_dict(), parts=args.parts, batch=args.batch, prompt_len=args.prompt_len,
                    tokens=args.tokens, decode_batch=args.decode_batch, dtype=args.dtype, seed=args.seed,
                    attn_implementation="sdpa", transformers=transformers.__version__, repeats=args.repeats,
                    warmup=args.warmup)
    rows = hf_llama_rows(args.config, args.parts, batch=args.batch, prompt_len=args.prompt_len, tokens=args.tokens,
                         decode_batch=args.decode_batch, device=device, dtype=getattr(torch, args.dtype),
                         repeats=args.repeats, warmup=args.warmup, seed=args.seed)
    summary = {f"{row['part']}_ratio": row["ratio"] for row in rows}
    summary["logits_max_abs_diff"] = max(row["logits_max_abs_diff"] for row in rows)
    if any(row["part"] == "decode" for row in rows):
        summary["same_tokens"] = all(row["same_tokens"] for row in rows if row["part"] == "decode")
    return settings, rows, format_hf_llama(rows, settings), summary


COMMAND = Command(help="the Llama-style decoder against transformers' LlamaForCausalLM (same weights): a training "
                       "step and greedy decoding", add_arguments=_add_arguments, check=_check, run=_run, repeats=5,
                  warmup=1)
