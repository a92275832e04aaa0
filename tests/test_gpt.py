"""GPTConfig validation, the GPT's forward, causality, learning, generation and bad input."""
import dataclasses
import math
import re

import pytest
import torch

from attnlib import GPT, GPTConfig
from attnlib.generation import sample_next_token, top_k_filter, top_p_filter
from attnlib.models.layers import ATTENTION_LAYERS

SMALL = dict(vocab_size=20, block_size=16, n_layers=2, n_heads=2, d_model=16)


def test_config_resolves_derived_sizes_under_their_own_names():
    c = GPTConfig(n_heads=4, d_model=64)
    assert c.n_kv_heads == 4 and c.head_dim == 16 and c.kv_latent_dim is None  # not given: derived (MHA, no latent)
    assert c.d_ff == 256 and c.layer_types == ("full_attention",) * c.n_layers and c.attention in ATTENTION_LAYERS
    assert GPTConfig(n_heads=4, d_model=64, attention="mqa").n_kv_heads == 1
    assert GPTConfig(n_heads=4, d_model=64, attention="gqa", n_kv_heads=2).n_kv_heads == 2
    assert GPTConfig(n_heads=4, d_model=64, attention="mla").kv_latent_dim == 16  # d_model // 4
    assert GPTConfig(n_heads=4, d_model=64, attention="mla", kv_latent_dim=5).kv_latent_dim == 5
    assert GPTConfig(n_heads=4, d_model=64, head_dim=8).head_dim == 8  # given: kept as given
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.n_heads = 2


def test_replace_never_guesses_which_fields_were_defaulted():
    base = GPTConfig(n_heads=4, d_model=64)
    smaller = base.replace(n_heads=2, d_model=32)
    assert (smaller.n_kv_heads, smaller.head_dim, smaller.d_ff) == (2, 16, 128)  # derived ones follow the new sizes
    kept = GPTConfig(n_heads=4, n_kv_heads=2, attention="gqa").replace(n_layers=1)
    assert (kept.n_kv_heads, kept.n_layers, kept.layer_types) == (2, 1, ("full_attention",))  # given: kept
    mla = GPTConfig(attention="mla", kv_latent_dim=5).replace(d_model=128)
    assert mla.kv_latent_dim == 5
    assert GPTConfig(attention="mla").replace(d_model=128).kv_latent_dim == 32  # derived: follows d_model
    assert dataclasses.replace(base, n_heads=2).n_kv_heads == 2  # dataclasses.replace derives again too
    with pytest.raises(ValueError, match=re.escape("n_heads=3 is not divisible by n_kv_heads=2")):
        GPTConfig(n_heads=4, n_kv_heads=2, d_model=48, attention="gqa").replace(n_heads=3)
    with pytest.raises(ValueError, match=re.escape("n_kv_heads=2 contradicts attention='mqa'")):
        GPTConfig(n_heads=4, n_kv_heads=2, attention="gqa").replace(attention="mqa")


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


@pytest.mark.parametrize("attention", sorted(ATTENTION_LAYERS))
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


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8], ids=str)
def test_forward_takes_ids_of_any_integer_dtype(dtype):
    model = GPT(GPTConfig(**SMALL)).eval()
    idx = torch.randint(0, 20, (2, 7))
    reference, loss = model(idx, idx)
    logits, loss_other = model(idx.to(dtype), idx.to(dtype))
    torch.testing.assert_close(logits, reference, atol=0, rtol=0)
    torch.testing.assert_close(loss_other, loss, atol=0, rtol=0)


def test_forward_rejects_bad_targets():
    model = GPT(GPTConfig(**SMALL))
    with pytest.raises(ValueError, match=re.escape("targets must have the shape of idx (2, 4); got (2, 3)")):
        model(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match=re.escape("targets must hold integer token ids (e.g. torch.long); got dtype torch.float32")):
        model(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4))


def test_gpt_rejects_a_non_config():
    with pytest.raises(TypeError, match="config must be an attnlib.DecoderConfig; got dict"):
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


def test_a_config_rebuilt_from_its_given_fields_derives_again():
    """What a checkpoint stores (``to_dict(derived=False)``) rebuilds the config, whose derived sizes follow a later
    change; rebuilt from every value in use instead, the old head count would be taken as given and refused."""
    config = GPTConfig(**{**SMALL, "n_heads": 4})
    given = config.to_dict(derived=False)
    assert given["head_dim"] is None and given["n_kv_heads"] is None and given["d_model"] == 16
    rebuilt = GPTConfig(**given)
    assert rebuilt == config
    smaller = rebuilt.replace(n_heads=2)
    assert (smaller.n_kv_heads, smaller.head_dim) == (2, 8)
    with pytest.raises(ValueError, match="n_kv_heads=4 contradicts attention='mha'"):
        GPTConfig(**config.to_dict()).replace(n_heads=2)
