"""Talking heads, MQA/GQA and MLA: equal to their special cases and to each other, causal, clear errors.

Causality of every registry entry (alone and inside the GPT) is tested in test_modules.py and test_gpt.py.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode  # private, but stable across recent releases

from attnlib import GPT, GPTConfig, MultiHeadAttention
from attnlib.attention import (
    ATTENTION_REGISTRY,
    KV_SHARING,
    BiasedTalkingHeadsAttention,
    CausalSelfAttention,
    GroupedQueryAttention,
    MultiHeadLatentAttention,
    MultiQueryAttention,
    TalkingHeadsAttention,
)
from attnlib.functional import padding_mask

ATOL = 1e-5
CONFIG = GPTConfig(d_model=32, n_heads=4, n_kv_heads=2, block_size=12, kv_latent_dim=8)


def leak(module, T=12, d_model=32, t=5):
    x = torch.randn(2, T, d_model)
    x2 = x.clone()
    x2[:, t + 1 :] = torch.randn_like(x2[:, t + 1 :])
    with torch.no_grad():
        return (module(x)[:, : t + 1] - module(x2)[:, : t + 1]).abs().max().item()


def test_registry_has_every_variant():
    assert set(ATTENTION_REGISTRY) == {"mha", "talking_heads", "mqa", "gqa", "mla"}
    for name in ATTENTION_REGISTRY:
        model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layers=1, n_heads=4, d_model=16, n_kv_heads=2, attention=name))
        assert model(torch.randint(0, 11, (2, 8)))[0].shape == (2, 8, 11)


# ---------------------------------------------------------------- talking heads
def test_biased_talking_heads_leaks_and_ours_does_not():
    torch.manual_seed(0)
    assert leak(TalkingHeadsAttention(CONFIG).eval()) <= 1e-6
    assert leak(BiasedTalkingHeadsAttention(CONFIG).eval()) > 1e-3


def test_biased_talking_heads_puts_weight_on_future_keys():
    module = BiasedTalkingHeadsAttention(CONFIG).eval()
    _, weights = module(torch.randn(1, 6, 32), return_weights=True)
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)
    assert (weights[..., future] != 0).all()


def test_talking_heads_with_identity_mixing_is_multi_head_attention():
    th = TalkingHeadsAttention(CONFIG)
    mha = CausalSelfAttention(CONFIG)
    mha.load_state_dict(th.state_dict(), strict=False)
    x = torch.randn(2, 12, 32)
    torch.testing.assert_close(th(x), mha(x), atol=ATOL, rtol=0)


def test_talking_heads_mixes_heads_and_stays_finite_on_empty_rows():
    th = TalkingHeadsAttention(CONFIG)
    with torch.no_grad():
        th.mix_logits.copy_(torch.randn(4, 4))
        th.mix_weights.copy_(torch.randn(4, 4))
    x = torch.randn(2, 6, 32, requires_grad=True)
    mask = padding_mask(torch.tensor([0, 4]), 6).unsqueeze(1)  # sequence 0 has no keys at all
    y, weights = th(x, mask=mask, return_weights=True)
    assert torch.isfinite(y).all() and torch.isfinite(weights).all()
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(th.mix_logits.grad).all()
    assert torch.equal(weights[0], torch.zeros_like(weights[0]))
    assert leak(th.eval()) <= 1e-6  # causal with any mixing matrices


# ---------------------------------------------------------------- MQA / GQA
@pytest.mark.parametrize("kv_sharing", KV_SHARING)
def test_gqa_with_as_many_kv_heads_as_heads_is_mha(kv_sharing):
    config = GPTConfig(d_model=32, n_heads=4, n_kv_heads=4, block_size=12)
    mha, gqa = CausalSelfAttention(config), GroupedQueryAttention(config, kv_sharing=kv_sharing)
    gqa.load_state_dict(mha.state_dict())  # the same qkv layout: [W_q; W_k; W_v]
    x = torch.randn(2, 12, 32)
    torch.testing.assert_close(gqa(x), mha(x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kv_sharing", KV_SHARING)
def test_mqa_is_gqa_with_one_kv_head(kv_sharing):
    mqa = MultiQueryAttention(CONFIG, kv_sharing=kv_sharing)
    gqa = GroupedQueryAttention(GPTConfig(d_model=32, n_heads=4, n_kv_heads=1, block_size=12), kv_sharing=kv_sharing)
    gqa.load_state_dict(mqa.state_dict())
    assert mqa.n_kv_heads == 1 and mqa.qkv.out_features == 32 + 2 * 8
    x = torch.randn(2, 12, 32)
    torch.testing.assert_close(mqa(x), gqa(x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_the_three_kv_sharings_agree(n_kv_heads):
    config = GPTConfig(d_model=32, n_heads=4, n_kv_heads=n_kv_heads, block_size=12)
    modules = {name: GroupedQueryAttention(config, kv_sharing=name) for name in KV_SHARING}
    for module in modules.values():
        module.load_state_dict(modules["sdpa"].state_dict())
    x = torch.randn(3, 12, 32)
    key_mask = padding_mask(torch.tensor([12, 7, 3]), 12).unsqueeze(1)  # (B, 1, 1, T)
    head_mask = torch.rand(3, 4, 12, 12) < 0.8
    head_mask[..., 0] = True
    reference = modules["repeat_interleave"]
    for name, module in modules.items():
        torch.testing.assert_close(module(x), reference(x), atol=ATOL, rtol=0, msg=name)
        for mask in (key_mask, head_mask):
            torch.testing.assert_close(module(x, mask=mask), reference(x, mask=mask), atol=ATOL, rtol=0, msg=name)
        y, w = module(x, return_weights=True)
        y_ref, w_ref = reference(x, return_weights=True)
        torch.testing.assert_close(w, w_ref, atol=ATOL, rtol=0)


class NewStorageBytes(TorchDispatchMode):
    """Adds up the bytes of every new storage the operations inside allocate."""

    def __init__(self, *known):
        super().__init__()
        self.seen = {t.untyped_storage().data_ptr() for t in known}
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.seen:
                self.seen.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize("kv_sharing, copies", [("expand", False), ("sdpa", False), ("repeat_interleave", True)])
def test_which_kv_sharings_copy_the_shared_heads(kv_sharing, copies):
    """A decoding step (one query per head, a long cache): copying K/V dwarfs everything else it allocates."""
    config = GPTConfig(d_model=2048, n_heads=16, n_kv_heads=2, block_size=1024)
    with torch.device("meta"):
        layer = GroupedQueryAttention(config, kv_sharing=kv_sharing)
    q = torch.randn(2, 16, 1, 128)  # (B, n_heads, 1, head_dim): one new token
    k, v = torch.randn(2, 2, 1024, 128), torch.randn(2, 2, 1024, 128)  # (B, n_kv_heads, T_k, head_dim)
    with NewStorageBytes(q, k, v) as log:
        layer.attend(q, k, v, None, False)
    kv_bytes = k.untyped_storage().nbytes() + v.untyped_storage().nbytes()
    assert (log.bytes >= 8 * kv_bytes) if copies else (log.bytes < kv_bytes / 4), log.bytes


# ---------------------------------------------------------------- MLA
def test_mla_absorbed_equals_naive():
    naive = MultiHeadLatentAttention(CONFIG)
    absorbed = MultiHeadLatentAttention(CONFIG, absorb=True)
    absorbed.load_state_dict(naive.state_dict())
    x = torch.randn(2, 12, 32)
    torch.testing.assert_close(absorbed(x), naive(x), atol=ATOL, rtol=0)
    mask = padding_mask(torch.tensor([12, 5]), 12).unsqueeze(1)
    torch.testing.assert_close(absorbed(x, mask=mask), naive(x, mask=mask), atol=ATOL, rtol=0)
    _, w_naive = naive(x, return_weights=True)
    _, w_absorbed = absorbed(x, return_weights=True)
    torch.testing.assert_close(w_absorbed, w_naive, atol=ATOL, rtol=0)


def test_mla_absorbed_equals_naive_in_the_gpt():
    config = GPTConfig(vocab_size=13, block_size=10, n_layers=2, n_heads=4, d_model=32, kv_latent_dim=8, attention="mla")
    model = GPT(config).eval()
    idx = torch.randint(0, 13, (2, 10))
    naive, _ = model(idx)
    for block in model.blocks:
        block.attn.absorb = True
    torch.testing.assert_close(model(idx)[0], naive, atol=ATOL, rtol=0)


def test_mla_keys_and_values_come_from_the_latent():
    mla = MultiHeadLatentAttention(CONFIG)
    x = torch.randn(1, 5, 32)
    c = mla.latent(x)
    assert c.shape == (1, 5, 8)
    _, k, v = mla.project(x)
    torch.testing.assert_close(k, mla.split_heads(c @ mla.k_up.weight.T))
    torch.testing.assert_close(v, mla.split_heads(c @ mla.v_up.weight.T))


# ---------------------------------------------------------------- cache sizes and errors
def test_kv_cache_sizes_follow_deepseek_v2_table_1():
    config = GPTConfig(d_model=64, n_heads=4, n_kv_heads=2, kv_latent_dim=16)
    d_h, n_h, n_g = config.head_dim, config.n_heads, config.n_kv_heads
    sizes = {name: cls.kv_cache_size(config) for name, cls in ATTENTION_REGISTRY.items()}
    assert sizes == {"mha": 2 * n_h * d_h, "talking_heads": 2 * n_h * d_h, "gqa": 2 * n_g * d_h, "mqa": 2 * d_h, "mla": 16}
    # ... and they are the widths of what each layer produces per token
    x = torch.randn(1, 3, 64)
    _, k, v = GroupedQueryAttention(config).project(x)
    assert k[0, :, 0].numel() + v[0, :, 0].numel() == sizes["gqa"]
    assert MultiHeadLatentAttention(config).latent(x)[0, 0].numel() == sizes["mla"]


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: GPTConfig(n_heads=4, n_kv_heads=3), ValueError, "n_heads=4 is not divisible by n_kv_heads=3"),
        (lambda: GPTConfig(kv_latent_dim=0), ValueError, "kv_latent_dim=0"),
        (lambda: GPTConfig(kv_latent_dim=2.5), TypeError, "kv_latent_dim must be an int"),
        (lambda: GroupedQueryAttention(CONFIG, kv_sharing="copy"), ValueError, "kv_sharing='copy'"),
        (lambda: GroupedQueryAttention(CONFIG, n_kv_heads=3), ValueError, "n_heads=4 is not divisible by n_kv_heads=3"),
        (lambda: MultiHeadAttention(32, 4)(torch.randn(1, 3, 32), mask=torch.ones(3, 3)), TypeError, "boolean"),
        (lambda: GroupedQueryAttention(CONFIG)(torch.randn(1, 13, 32)), ValueError, "T=13 exceeds block_size=12"),
        (lambda: MultiHeadLatentAttention(CONFIG)(torch.randn(1, 3, 31)), ValueError, "d_model=32"),
    ],
)
def test_bad_configurations_and_inputs(make, error, message):
    with pytest.raises(error, match=message):
        make()
