"""GPTConfig validation, the GPT's forward, causality, learning, generation and bad input."""
import math

import pytest
import torch

from attnlib import ATTENTION_REGISTRY, GPT, GPTConfig
from attnlib.generate import sample_next_token, top_k_filter, top_p_filter

SMALL = dict(vocab_size=20, block_size=16, n_layers=2, n_heads=2, d_model=16)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(d_model=770, n_heads=12), ValueError, "d_model=770 is not divisible by n_heads=12"),
        (dict(n_heads=4, n_kv_heads=3), ValueError, "n_heads=4 is not divisible by n_kv_heads=3"),
        (dict(vocab_size=0), ValueError, "vocab_size=0"),
        (dict(block_size=-3), ValueError, "block_size=-3"),
        (dict(n_layers=0), ValueError, "n_layers=0"),
        (dict(n_kv_heads=0), ValueError, "n_kv_heads=0"),
        (dict(d_model=64.0), TypeError, "d_model must be an int"),
        (dict(dropout=1.0), ValueError, "dropout=1.0"),
        (dict(bias="yes"), TypeError, "bias must be a bool"),
        (dict(attention="flash"), ValueError, "attention='flash' is not a known variant; choose one of: gqa, mha, mla, mqa, talking_heads"),
    ],
)
def test_config_rejects_bad_values(kwargs, error, message):
    with pytest.raises(error, match=message):
        GPTConfig(**kwargs)


def test_config_defaults():
    c = GPTConfig(n_heads=4, d_model=64)
    assert c.n_kv_heads == 4 and c.head_dim == 16 and c.attention in ATTENTION_REGISTRY


def test_replace_derives_defaults_anew():
    base = GPTConfig(n_heads=4, d_model=64)
    smaller = base.replace(n_heads=2, d_model=32)
    assert (smaller.n_kv_heads, smaller.kv_latent_dim) == (2, 8)
    kept = GPTConfig(n_heads=4, n_kv_heads=2, kv_latent_dim=5).replace(n_layers=1)
    assert (kept.n_kv_heads, kept.kv_latent_dim, kept.n_layers) == (2, 5, 1)
    with pytest.raises(ValueError, match="n_heads=3 is not divisible by n_kv_heads=2"):
        GPTConfig(n_heads=4, n_kv_heads=2, d_model=48).replace(n_heads=3)


def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    idx = torch.randint(0, 20, (3, 16))
    targets = torch.randint(0, 20, (3, 16))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 16, 20)
    # GPT-2 init gives near-uniform predictions: loss close to ln(vocab_size).
    assert abs(loss.item() - math.log(20)) < 0.1
    assert model(idx)[1] is None


def test_last_only_gives_the_last_position():
    model = GPT(GPTConfig(**SMALL)).eval()
    idx = torch.randint(0, 20, (2, 9))
    last, loss = model(idx, last_only=True)
    assert last.shape == (2, 1, 20) and loss is None
    torch.testing.assert_close(last[:, 0], model(idx)[0][:, -1])
    with pytest.raises(ValueError, match="last_only=True computes no loss"):
        model(idx, idx, last_only=True)


def test_weights_are_tied_and_counted_once():
    model = GPT(GPTConfig(**SMALL))
    assert model.lm_head.weight is model.tok_emb.weight
    c = model.config
    d = c.d_model
    per_block = (2 * 2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    expected = c.vocab_size * d + c.block_size * d + c.n_layers * per_block + 2 * d
    assert model.num_parameters() == expected
    assert model.num_parameters(exclude_embeddings=True) == expected - c.vocab_size * d - c.block_size * d


def test_bias_false_removes_every_bias():
    model = GPT(GPTConfig(**SMALL, bias=False))
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]


@pytest.mark.parametrize("attention", sorted(ATTENTION_REGISTRY))
def test_gpt_is_causal(attention):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, attention=attention)).eval()
    idx = torch.randint(0, 20, (2, 16))
    with torch.no_grad():
        logits, _ = model(idx)
        for t in range(15):
            changed = idx.clone()
            changed[:, t + 1 :] = torch.randint(0, 20, changed[:, t + 1 :].shape)
            other, _ = model(changed)
            assert (other[:, : t + 1] - logits[:, : t + 1]).abs().max() <= 1e-6


def test_gpt_can_learn_one_batch():
    """Overfit one fixed batch: the loss must fall below 0.1 (the model and its gradients are wired right)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layers=2, n_heads=2, d_model=32))
    x = torch.randint(0, 32, (4, 16))
    y = torch.randint(0, 32, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1


@pytest.mark.parametrize(
    "idx, error, message",
    [
        (torch.zeros(1, 17, dtype=torch.long), ValueError, "T=17 exceeds block_size=16"),
        (torch.tensor([[1, 2, 20]]), ValueError, "token id 20, outside the vocabulary"),
        (torch.tensor([[-1, 2]]), ValueError, "token id -1"),
        (torch.zeros(1, 4), TypeError, "integer token ids"),
        (torch.zeros(4, dtype=torch.long), ValueError, r"shape \(B, T\)"),
        ([[1, 2, 3]], TypeError, "torch.Tensor"),
    ],
)
def test_forward_rejects_bad_idx(idx, error, message):
    with pytest.raises(error, match=message):
        GPT(GPTConfig(**SMALL))(idx)


def test_forward_rejects_bad_targets():
    model = GPT(GPTConfig(**SMALL))
    with pytest.raises(ValueError, match="targets must have the shape"):
        model(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="targets must hold integer"):
        model(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4))


def test_gpt_rejects_a_non_config():
    with pytest.raises(TypeError, match="GPTConfig"):
        GPT(dict(SMALL))


def test_generate_greedy_is_argmax_of_forward():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL)).eval()
    prompt = torch.randint(0, 20, (2, 3))
    out = model.generate(prompt, 20, temperature=0)  # runs past block_size=16: the context is cropped
    assert out.shape == (2, 23) and torch.equal(out[:, :3], prompt)
    for t in range(3, 23):
        context = out[:, max(0, t - 16) : t]
        assert torch.equal(model(context)[0][:, -1].argmax(-1), out[:, t])


def test_generate_is_reproducible_with_a_generator():
    model = GPT(GPTConfig(**SMALL))
    prompt = torch.zeros(1, 1, dtype=torch.long)
    a = model.generate(prompt, 10, top_k=5, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 10, top_k=5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert model.training  # generate restores the mode


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=-1), "max_new_tokens=-1"),
        (dict(max_new_tokens=2, temperature=-0.5), "temperature=-0.5"),
        (dict(max_new_tokens=2, top_k=0), "top_k=0"),
        (dict(max_new_tokens=2, top_p=0.0), "top_p=0.0"),
    ],
)
def test_generate_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPT(GPTConfig(**SMALL)).generate(torch.zeros(1, 2, dtype=torch.long), **kwargs)


def test_generate_rejects_an_empty_prompt():
    with pytest.raises(ValueError, match="T=0"):
        GPT(GPTConfig(**SMALL)).generate(torch.zeros(1, 0, dtype=torch.long), 3)


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert torch.equal(torch.isfinite(top_k_filter(logits, 2)), torch.tensor([[False, True, True, False]]))
    assert torch.isfinite(top_k_filter(logits, 10)).all()
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = torch.isfinite(top_p_filter(probs.log(), 0.75))
    assert torch.equal(kept, torch.tensor([[True, True, False, False]]))  # 0.5 < 0.75 <= 0.8
    assert torch.equal(torch.isfinite(top_p_filter(probs.log(), 0.1)), torch.tensor([[True, False, False, False]]))
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([sample_next_token(probs.log(), top_p=0.75, generator=g) for _ in range(200)])
    assert set(draws.flatten().tolist()) <= {0, 1}
