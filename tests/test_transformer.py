"""The encoder–decoder Transformer (chapter 10): shapes, masks, chaining, decoding."""
import pytest
import torch
from torch import nn

from attnlib.models.transformer import DecoderLayer, EncoderLayer, FeedForward, Transformer

PAD, BOS, EOS = 0, 1, 2


def make_model(norm_first=True, **kw):
    torch.manual_seed(0)
    return Transformer(20, 17, d_model=32, n_heads=4, n_layers=2, block_size=24, norm_first=norm_first, **kw).eval()


@pytest.mark.parametrize("norm_first", [True, False])
def test_shapes_with_different_lengths(norm_first):
    model = make_model(norm_first)
    src, tgt = torch.randint(3, 20, (3, 9)), torch.randint(3, 17, (3, 5))
    logits, loss = model(src, tgt, tgt)
    assert logits.shape == (3, 5, 17) and loss.ndim == 0
    assert model(src, tgt)[1] is None
    memory, mask = model.encode(src)
    assert memory.shape == (3, 9, 32) and mask.shape == (3, 9) and mask.all()


@pytest.mark.parametrize("norm_first", [True, False])
def test_decoder_self_attention_does_not_leak(norm_first):
    model = make_model(norm_first)
    src, tgt = torch.randint(3, 20, (2, 7)), torch.randint(3, 17, (2, 6))
    changed = tgt.clone()
    changed[:, 3:] = torch.randint(3, 17, (2, 3))
    a, b = model(src, tgt)[0], model(src, changed)[0]
    torch.testing.assert_close(a[:, :3], b[:, :3])
    assert not torch.allclose(a[:, 3:], b[:, 3:])


def test_cross_attention_is_not_causal():
    model = make_model()
    src, tgt = torch.randint(3, 20, (1, 7)), torch.randint(3, 17, (1, 4))
    changed = src.clone()
    changed[0, -1] = 3 if src[0, -1] != 3 else 4
    assert not torch.allclose(model(src, tgt)[0][:, 0], model(changed, tgt)[0][:, 0])


@pytest.mark.parametrize("norm_first", [True, False])
def test_source_padding_is_ignored(norm_first):
    model = make_model(norm_first)
    src = torch.randint(3, 20, (2, 8))
    src[0, 5:] = PAD
    src[1, 7:] = PAD
    tgt = torch.randint(3, 17, (2, 5))
    longer = torch.cat([src, torch.full((2, 4), PAD)], dim=1)
    torch.testing.assert_close(model(src, tgt)[0], model(longer, tgt)[0])
    # changing the tokens under the padding (with the mask built from the original ids) changes nothing
    memory, mask = model.encode(src)
    garbled = memory.clone()
    garbled[~mask] = torch.randn(int((~mask).sum()), 32)
    torch.testing.assert_close(model.decode(tgt, memory, mask), model.decode(tgt, garbled, mask))
    # a shorter source (other padded rows) gives the same logits as the unpadded source alone
    torch.testing.assert_close(model(src[:1, :5], tgt[:1])[0], model(src[:1], tgt[:1])[0])


def test_loss_ignores_padding_targets():
    model = make_model()
    src, tgt = torch.randint(3, 20, (2, 6)), torch.randint(3, 17, (2, 5))
    targets = tgt.clone()
    targets[:, 3:] = PAD
    logits, loss = model(src, tgt, targets)
    manual = nn.functional.cross_entropy(logits[:, :3].flatten(0, 1), targets[:, :3].flatten())
    torch.testing.assert_close(loss, manual)


def test_encoder_layers_are_chained():
    model = make_model()
    src = torch.randint(3, 20, (1, 6))
    memory, mask = model.encode(src)
    x = model.embed(src, model.src_emb)
    for layer in model.encoder:
        x = layer(x, mask)
    torch.testing.assert_close(memory, model.enc_norm(x))
    last_only = model.enc_norm(model.encoder[-1](model.embed(src, model.src_emb), mask))  # the "same input" bug
    assert not torch.allclose(memory, last_only, atol=1e-3)


def test_forward_is_deterministic_in_eval():
    model = make_model()
    src, tgt = torch.randint(3, 20, (2, 6)), torch.randint(3, 17, (2, 5))
    torch.testing.assert_close(model(src, tgt)[0], model(src, tgt)[0])


def test_beam_width_one_equals_greedy():
    model = make_model()
    for seed in range(3):
        src = torch.randint(3, 20, (1, 8), generator=torch.Generator().manual_seed(seed))
        greedy = model.greedy_decode(src, 10)
        beam, score = model.beam_decode(src, beam_width=1, max_new_tokens=10)
        assert torch.equal(beam, greedy)
        assert isinstance(score, float)
    assert model.beam_decode(src, beam_width=3, max_new_tokens=10)[0][0, 0].item() == BOS
    assert not model.training


def test_greedy_decode_pads_after_eos():
    model = make_model()
    with torch.no_grad():
        model.lm_head.bias.fill_(0.0)
        model.lm_head.bias[EOS] = 100.0  # always emits EOS first
    out = model.greedy_decode(torch.randint(3, 20, (2, 5)), 6)
    assert out.tolist() == [[BOS, EOS], [BOS, EOS]]


def test_layers_and_feedforward():
    ff = FeedForward(8, 16, gelu_approximate="tanh")
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(ff(x), ff.proj(nn.functional.gelu(ff.fc(x), approximate="tanh")))
    with pytest.raises(ValueError, match="approximate"):
        FeedForward(8, 16, gelu_approximate="fast")
    with pytest.raises(ValueError, match="d_ff=0 must be a positive integer"):
        FeedForward(8, 0)
    with pytest.raises(TypeError, match="bias must be a bool; got 'yes'"):
        FeedForward(8, bias="yes")
    assert FeedForward(8).fc.out_features == 32  # d_ff defaults to 4 * d_model
    assert EncoderLayer(8, 2, 16)(x).shape == (2, 3, 8)
    assert DecoderLayer(8, 2, 16)(x, torch.randn(2, 5, 8)).shape == (2, 3, 8)


def test_errors():
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        Transformer(10, 10, d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="pad_id=10 must be an id in both vocabularies"):
        Transformer(10, 10, pad_id=10)
    model = make_model()
    assert model.block_size == 24
    with pytest.raises(ValueError, match="src has length 30 > block_size=24"):
        model(torch.randint(3, 20, (1, 30)), torch.randint(3, 17, (1, 3)))
    with pytest.raises(ValueError, match="tgt_in has length 30 > block_size=24"):
        model(torch.randint(3, 20, (1, 5)), torch.randint(3, 17, (1, 30)))
    with pytest.raises(ValueError, match=r"tgt_in holds token id 17, outside the vocabulary \[0, 17\)"):
        model(torch.randint(3, 20, (1, 5)), torch.full((1, 3), 17))
    with pytest.raises(ValueError, match="one source"):
        model.beam_decode(torch.randint(3, 20, (2, 5)))
    with pytest.raises(TypeError, match="src must hold integer token ids"):
        model(torch.randn(1, 5), torch.randint(3, 17, (1, 3)))


def test_gpt_and_transformer_share_one_feed_forward_block():
    from attnlib import GPT, GPTConfig

    gpt = GPT(GPTConfig(vocab_size=11, block_size=8, n_layers=1, n_heads=2, d_model=16, gelu_approximate="tanh"))
    mlp = gpt.blocks[0].mlp
    assert isinstance(mlp, FeedForward) and isinstance(make_model().encoder[0].ff, FeedForward)
    assert {n for n, _ in mlp.named_parameters()} == {"fc.weight", "fc.bias", "proj.weight", "proj.bias"}
    x = torch.randn(2, 3, 16)
    hidden = nn.functional.gelu(x @ mlp.fc.weight.T + mlp.fc.bias, approximate="tanh")
    torch.testing.assert_close(mlp(x), hidden @ mlp.proj.weight.T + mlp.proj.bias)
