"""``python -m attnlib.bench kv-cache``: generation speed with and without the KV cache, and its bytes per token.

Chapter 15 (the cache itself is chapter 08). A GPT-2-small-sized model (Radford et al.
2019: 12 layers, 12 heads of 64, d_model 768, vocabulary 50,257, context 1024),
untrained (speed does not depend on the weights), generates greedily from a short
random prompt, for each attention variant, three ways: :meth:`attnlib.GPT.generate` with
``use_cache=True``; the same without the cache (the window re-encoded every step, logits
of the last position only); and the plain loop most tutorials write
(:func:`generate_plain`: a whole forward pass every step, logits for every position, the
last one kept), the baseline behind *LLMs from Scratch*'s 5.3x. The cache bytes per token
are measured on the :class:`attnlib.cache.KVCache` tensors after the prompt, beside
what the layers state (:meth:`attnlib.GPT.kv_cache_bytes_per_token`: each layer's own
``cache_width`` times the bytes of a number).
"""
from __future__ import annotations

import functools

import torch

from attnlib.bench._common import format_table, resolve_device, time_calls
from attnlib.bench._common import threads as using_threads
from attnlib.cache import KVCache
from attnlib.models import GPT, GPTConfig
from attnlib.models.config import ATTENTION_VARIANTS

__all__ = ["GPT2_SMALL", "SMALL", "TINY", "VARIANTS", "format_kv_cache", "generate_plain", "kv_cache_rows", "variant_config"]

#: GPT-2 small's shape. GQA keeps 4 key/value heads (groups of 3 query heads; :func:`variant_config`);
#: MLA's latent is attnlib's default d_model // 4 = 192 numbers (DeepSeek-V2 uses 4 · head_dim, which would be 256).
GPT2_SMALL = GPTConfig(vocab_size=50257, block_size=1024, n_layers=12, n_heads=12, d_model=768)
#: A small model for quick runs (``kv_cache_rows(config=SMALL)``; not a command-line option): big enough
#: that the cache already pays off.
SMALL = GPTConfig(vocab_size=1024, block_size=256, n_layers=4, n_heads=8, d_model=256)
#: ``--small`` on the command line: a tiny model for tests and the install check (milliseconds a token).
TINY = GPTConfig(vocab_size=64, block_size=32, n_layers=2, n_heads=6, d_model=48)
VARIANTS = ("mha", "gqa", "mqa", "mla")


def variant_config(config: GPTConfig, variant: str) -> GPTConfig:
    """``config`` with ``attention=variant``.

    ``"gqa"`` keeps ``config.n_kv_heads`` when it is given and below ``n_heads``, else takes
    ``n_heads // 3`` key/value heads (4 of GPT-2's 12), rounded down to a divisor of ``n_heads``;
    ``"mla"`` keeps ``config.kv_latent_dim`` when given (default ``d_model // 4``).

    Raises:
        ValueError: an unknown variant.
    """
    if variant not in ATTENTION_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {sorted(ATTENTION_VARIANTS)}")
    base = config.replace(attention="mha", n_kv_heads=None, kv_latent_dim=None)
    if variant == "gqa":
        kv = config.n_kv_heads if config.n_kv_heads is not None and config.n_kv_heads < config.n_heads else None
        if kv is None:
            kv = max(1, config.n_heads // 3)
            while config.n_heads % kv:
                kv -= 1
        return base.replace(attention="gqa", n_kv_heads=kv)
    if variant == "mla":
        return base.replace(attention="mla", kv_latent_dim=config.kv_latent_dim)
    return base.replace(attention=variant)


@torch.no_grad()
def generate_plain(model: GPT, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy generation as the simplest loop does it: no cache, and every step runs a full
    forward pass over the last ``block_size`` tokens, computing logits for every position
    and keeping the last. The reference that cached generation is usually compared with.

    Shapes: ``idx`` ``(B, T)`` int64 → ``(B, T + max_new_tokens)`` int64.
    """
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.config.block_size :])  # (B, T, vocab_size): every position
        idx = torch.cat([idx, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)  # keep the last one
    return idx


def _describe(config: GPTConfig) -> str:
    if config.attention == "mla":
        return f"latent d_c={config.kv_latent_dim}"
    return f"{config.n_kv_heads} kv head" + ("s" if config.n_kv_heads > 1 else "")


def kv_cache_rows(
    variants: tuple[str, ...] | list[str] = VARIANTS,
    tokens: int = 200,
    prompt_len: int = 8,
    config: GPTConfig | None = None,
    batch: int = 1,
    device: str | torch.device | None = None,
    repeats: int = 3,
    warmup_tokens: int = 4,
    seed: int = 0,
    threads: int | None = None,
) -> list[dict]:
    """Tokens per second with and without the cache, and the cache's bytes per token, per variant.

    Args:
        variants: names in :data:`attnlib.models.config.ATTENTION_VARIANTS`.
        tokens: new tokens per generation (greedy, ``temperature=0``).
        prompt_len: length of the random prompt.
        config: the model's shape (default :data:`GPT2_SMALL`); each variant's is :func:`variant_config`.
        batch: sequences generated at once.
        device: where to run (``None``: :func:`attnlib.device`).
        repeats: timed generations per setting (the median is reported).
        warmup_tokens: a short untimed generation first, with and without the cache.
        seed: for the weights and the prompt.
        threads: ``torch.set_num_threads`` for the run (``None``: as it is).

    Raises:
        ValueError: an unknown variant (before anything runs).

    Returns:
        Dicts with ``variant, kv_heads`` (a description), ``parameters``,
        ``numbers_per_token_layer`` (the first layer's ``cache_width``), ``bytes_per_token``
        (measured on the cache tensors), ``bytes_per_token_formula`` (what the layers state), ``cached_tokens_per_s``,
        ``uncached_tokens_per_s`` (no cache, last position's logits), ``plain_tokens_per_s``
        (:func:`generate_plain`), ``speedup`` (cached / uncached), ``speedup_vs_plain``
        (cached / plain) and ``same_tokens`` (whether all three generations agree).
    """
    with using_threads(threads):
        return _kv_cache_rows(variants, tokens, prompt_len, config, batch, device, repeats, warmup_tokens, seed)


def _kv_cache_rows(variants, tokens, prompt_len, config, batch, device, repeats, warmup_tokens, seed):
    device = resolve_device(device)
    config = GPT2_SMALL if config is None else config
    configs = {variant: variant_config(config, variant) for variant in variants}  # unknown names fail first
    rows = []
    for variant, cfg in configs.items():
        torch.manual_seed(seed)
        model = GPT(cfg).to(device).eval()
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(cfg.vocab_size, (batch, prompt_len), generator=g).to(device)

        cache = KVCache.for_model(model)
        with torch.no_grad():
            model(prompt, cache=cache)  # prefill: the cache now holds the prompt
        formula = model.kv_cache_bytes_per_token()

        def generate(how: str, n: int = tokens, model=model, prompt=prompt):
            if how == "plain":
                return generate_plain(model, prompt, n)
            return model.generate(prompt, n, temperature=0.0, use_cache=how == "cached")

        ways = ("cached", "uncached", "plain")
        if warmup_tokens:
            for how in ways:
                generate(how, warmup_tokens)
        outputs = {}

        def run(how: str, generate=generate, outputs=outputs):
            outputs[how] = generate(how)  # kept to check that every path gives the same tokens

        seconds = time_calls({how: functools.partial(run, how) for how in ways}, repeats, warmup=0)
        same = all(torch.equal(outputs["cached"], outputs[how]) for how in ways)
        rows.append(
            dict(
                variant=variant,
                kv_heads=_describe(cfg),
                parameters=model.num_parameters(),
                numbers_per_token_layer=model.blocks[0].attn.cache_width,
                bytes_per_token=cache.bytes_per_token() // batch,
                bytes_per_token_formula=formula,
                cached_tokens_per_s=batch * tokens / seconds["cached"],
                uncached_tokens_per_s=batch * tokens / seconds["uncached"],
                plain_tokens_per_s=batch * tokens / seconds["plain"],
                speedup=seconds["uncached"] / seconds["cached"],
                speedup_vs_plain=seconds["plain"] / seconds["cached"],
                same_tokens=same,
            )
        )
    return rows


COLUMNS = [
    ("variant", "variant", "s"),
    ("kv_heads", "keeps", "s"),
    ("numbers_per_token_layer", "numbers/token/layer", "d"),
    ("bytes_per_token", "cache B/token", ",d"),
    ("bytes_per_token_formula", "formula", ",d"),
    ("cached_tokens_per_s", "cached tok/s", ",.1f"),
    ("uncached_tokens_per_s", "uncached tok/s", ",.1f"),
    ("plain_tokens_per_s", "plain tok/s", ",.1f"),
    ("speedup", "cached/uncached", ".1f"),
    ("speedup_vs_plain", "cached/plain", ".1f"),
    ("same_tokens", "same tokens", ""),
]


def format_kv_cache(rows: list[dict], settings: dict | None = None) -> str:
    """The table and how it was measured."""
    parts = []
    if settings:
        c = settings["config"]
        parts.append(
            f"GPT (untrained): {c['n_layers']} layers, {c['n_heads']} heads, d_model {c['d_model']}, vocabulary "
            f"{c['vocab_size']}, block {c['block_size']}; batch {settings['batch']}, prompt of {settings['prompt_len']} "
            f"random tokens, {settings['tokens']} new tokens, greedy; median of {settings['repeats']} runs."
        )
    parts.append(
        "cache B/token: measured on the KVCache tensors after the prompt (all layers, one sequence); "
        "formula: GPT.kv_cache_bytes_per_token() (each layer's cache_width x bytes per number).\n"
        "uncached: no cache, the window re-encoded each step, logits of the last position only; "
        "plain: no cache, a full forward pass each step with logits for every position (the usual simple loop)."
    )
    parts.append(format_table(rows, COLUMNS))
    worst, worst_plain = min(row["speedup"] for row in rows), min(row["speedup_vs_plain"] for row in rows)
    parts.append(
        f"\nThe cache speeds generation up by at least {worst:.1f}x over uncached generation "
        f"and {worst_plain:.1f}x over the plain loop here."
    )
    return "\n".join(parts)
