"""The right answer or a clear error where a score modification, a normaliser or the logits leave nothing to
attend to or to sample from: no NaN, no crash deep inside torch.

References are independent of the code under test: SDPA in float64 with the equivalent boolean mask (rows that
see nothing set to zero by hand), ALiBi written from the paper's formula, linear attention as a loop of sums.
"""
import math
import re

import pytest
import torch
import torch.nn.functional as F

from attnlib import RotaryEmbedding
from attnlib.attention import attention, tiled_attention
from attnlib.attention.linear import linear_attention
from attnlib.attention.mods import alibi
from attnlib.generation.sampling import sample_next_token
from attnlib.positional.absolute import sinusoidal_encoding

SCORE_MOD_FUNCTIONS = {"eager": attention, "tiled": lambda *a, **kw: tiled_attention(*a, tile_size=3, **kw)}


def reference(q, k, v, visible):
    """SDPA in float64 with a boolean mask; a row that sees no key gives zeros (by hand, not by the mask)."""
    empty = ~visible.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=visible | empty)
    return out.masked_fill(empty, 0.0)


@pytest.mark.parametrize("name", SCORE_MOD_FUNCTIONS)
@pytest.mark.parametrize("seed", range(6))
def test_a_score_mod_that_hides_keys_is_a_mask(name, seed):
    """A score_mod writing -inf (hiding keys, emptying whole rows) equals the same pattern as a mask; no NaN
    in the output or any gradient."""
    g = torch.Generator().manual_seed(seed)
    B, H, T_q, T_k, d = 2, 3, 1 + seed, 4 + seed, 8
    hidden = torch.rand(B, H, T_q, T_k, generator=g) < 0.5
    hidden[:, :, 0] = True  # the first query of every head sees nothing
    q, k, v = (torch.randn(B, H, T, d, generator=g, requires_grad=True) for T in (T_q, T_k, T_k))

    def hide(score, b, h, q_idx, kv_idx):
        return score.masked_fill(hidden[b, h, q_idx - (T_k - T_q), kv_idx], float("-inf"))

    out, _ = SCORE_MOD_FUNCTIONS[name](q, k, v, score_mod=hide)
    out.sum().backward()
    torch.testing.assert_close(out.double(), reference(q, k, v, ~hidden), atol=1e-5, rtol=1e-5)
    assert out[:, :, 0].abs().max() == 0
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("name", SCORE_MOD_FUNCTIONS)
@pytest.mark.parametrize(
    "mod, error, message",
    [
        (lambda s, b, h, i, j: None, TypeError, "got NoneType"),
        (lambda s, b, h, i, j: 0.0, TypeError, "got float"),
        (lambda s, b, h, i, j: s.long(), TypeError, "got dtype torch.int64"),
        (lambda s, b, h, i, j: s > 0, TypeError, "got dtype torch.bool"),
        (lambda s, b, h, i, j: s[..., :1], ValueError, "got shape"),  # one column, broadcast over the keys
        (lambda s, b, h, i, j: s[..., :1, :], ValueError, "got shape"),  # one row, broadcast over the queries
        (lambda s, b, h, i, j: s.sum(), ValueError, "got shape ()"),
        (lambda s, b, h, i, j: s[None], ValueError, "got shape (1, "),
    ],
)
def test_a_score_mod_result_of_another_kind_is_refused(name, mod, error, message):
    q, k, v = (torch.randn(2, 2, 5, 4) for _ in range(3))
    with pytest.raises(error, match=r"score_mod must return a floating point tensor of the scores' shape .*"
                                    + re.escape(message)):
        SCORE_MOD_FUNCTIONS[name](q, k, v, score_mod=mod)


@pytest.mark.parametrize("name", SCORE_MOD_FUNCTIONS)
def test_a_score_mod_in_another_float_dtype_is_cast_back(name):
    q, k, v = (torch.randn(2, 2, 5, 4) for _ in range(3))
    out, _ = SCORE_MOD_FUNCTIONS[name](q, k, v, score_mod=lambda s, b, h, i, j: s.double() * 0.5)
    assert out.dtype == torch.float32
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.5 / math.sqrt(4))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(6, 4), (3, 6, 4)])
@pytest.mark.parametrize("name", SCORE_MOD_FUNCTIONS)
def test_alibi_of_one_head_on_inputs_without_a_head_dim(shape, name):
    """2-D and 3-D inputs are one head's: alibi(1) adds -m (i - j) with m = 2^-8 (Press et al. 2022, §3)."""
    q, k, v = (torch.randn(*shape) for _ in range(3))
    out, _ = SCORE_MOD_FUNCTIONS[name](q, k, v, score_mod=alibi(1), is_causal=True)
    T = shape[-2]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    bias = (-(2.0 ** -8) * (i - j)).double().masked_fill(j > i, float("-inf"))
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(6, 4), (3, 6, 4)])
def test_alibi_of_several_heads_refuses_scores_of_one(shape):
    q, k, v = (torch.randn(*shape) for _ in range(3))
    with pytest.raises(ValueError, match=re.escape("alibi(4) got scores with 1 head (shape")):
        attention(q, k, v, score_mod=alibi(4))


def test_alibi_refuses_a_head_count_that_is_not_its_own():
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    with pytest.raises(ValueError, match=re.escape("alibi(4) got scores with 3 heads (shape (2, 3, 5, 5))")):
        attention(q, k, v, score_mod=alibi(4))


@pytest.mark.parametrize("mode", ["parallel", "chunked", "recurrent"])
def test_linear_attention_with_eps_zero_gives_zero_where_no_key_is_met(mode):
    """ReLU features of a negative query meet no key (φ(q)·z = 0): output 0 there, not 0/0; other rows equal
    the sums written out."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 7, 4, generator=g) for _ in range(3))
    q[:, :, 2] = -q[:, :, 2].abs() - 0.1  # every feature of query 2 is 0 after ReLU
    out = linear_attention(q, k, v, mode, feature_map="relu", eps=0.0, chunk_size=3)
    fq, fk = q.relu().double(), k.relu().double()
    expected = torch.zeros(2, 2, 7, 4, dtype=torch.float64)
    for i in range(7):
        w = fq[..., i : i + 1, :] @ fk[..., : i + 1, :].transpose(-2, -1)  # (..., 1, i+1)
        den = w.sum(-1, keepdim=True)
        expected[..., i : i + 1, :] = torch.where(den > 0, (w @ v[..., : i + 1, :].double()) / den, 0.0)
    assert torch.isfinite(out).all()
    assert out[:, :, 2].abs().max() == 0
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "base, error, message",
    [
        (0, ValueError, "base=0 must be a finite number > 1"),
        (-10.0, ValueError, "base=-10.0 must be a finite number > 1"),
        (1.0, ValueError, "base=1.0 must be a finite number > 1"),
        (0.5, ValueError, "base=0.5 must be a finite number > 1"),
        (float("inf"), ValueError, "base=inf must be a finite number"),
        (float("nan"), ValueError, "base=nan must be a finite number"),
        ("10000", TypeError, "base must be a number; got '10000'"),
        (True, TypeError, "base must be a number; got True"),
    ],
)
def test_sinusoidal_encoding_refuses_a_base_that_is_no_wavelength_scale(base, error, message):
    with pytest.raises(error, match=re.escape(message)):
        sinusoidal_encoding(4, 8, base=base)


def test_sinusoidal_encoding_with_another_base_follows_the_formula():
    pe = sinusoidal_encoding(5, 6, base=100.0).double()
    pos, i = torch.arange(5.0)[:, None].double(), torch.arange(3.0)[None, :].double()
    angle = pos / 100.0 ** (2 * i / 6)
    torch.testing.assert_close(pe[:, 0::2], angle.sin(), atol=1e-6, rtol=0)
    torch.testing.assert_close(pe[:, 1::2], angle.cos(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 1e-30])
@pytest.mark.parametrize(
    "row",
    [
        [float("nan"), 0.0, 1.0],
        [float("-inf")] * 3,
        [float("inf"), 0.0, 1.0],
        [float("-inf"), float("nan"), float("-inf")],
    ],
)
def test_sampling_refuses_a_row_with_nothing_to_choose_from(row, temperature):
    logits = torch.tensor([[0.0, 1.0, 2.0], row])
    with pytest.raises(ValueError, match=re.escape("logits row 1 holds NaN or +inf, or no finite value")):
        sample_next_token(logits, temperature=temperature)


@pytest.mark.parametrize(
    "logits, error, message",
    [
        (torch.tensor([[1, 2, 3]]), TypeError, "logits must be a floating point tensor (B, vocab_size); got dtype "
                                               "torch.int64"),
        ([[0.0, 1.0]], TypeError, "got list"),
        (torch.zeros(3), ValueError, "logits must have shape (B, vocab_size) with vocab_size >= 1; got (3,)"),
        (torch.zeros(2, 0), ValueError, "got (2, 0)"),
        (torch.zeros(1, 2, 3), ValueError, "got (1, 2, 3)"),
    ],
)
def test_sampling_refuses_logits_of_another_kind(logits, error, message):
    with pytest.raises(error, match=re.escape(message)):
        sample_next_token(logits)


def test_sampling_with_masked_tokens_picks_only_the_others():
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.0]]).repeat(200, 1)
    ids = sample_next_token(logits, temperature=1.0, generator=torch.Generator().manual_seed(0))[:, 0]
    assert set(ids.tolist()) == {1, 3}
    assert sample_next_token(logits[:1], temperature=0.0).item() == 1  # argmax: the first of the finite maxima


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_frequencies_stay_float32_in_a_narrower_model(dtype):
    """A bfloat16 θ_i would put the angle at position 4096 off by radians; the tables keep float32 frequencies
    (as transformers computes its angles), and the angles equal float64's to float32 precision."""
    from attnlib import Decoder, DecoderConfig

    model = Decoder(DecoderConfig.llama(vocab_size=50, block_size=8192, n_layers=1, n_heads=2, d_model=256))
    model = model.to(dtype)
    rope = model.blocks[0].attn.rope
    assert rope.inv_freq.dtype == torch.float32 and model.lm_head.weight.dtype == dtype
    positions = torch.tensor([0, 1, 4095, 8191])
    theta = 1.0 / 10000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    exact = positions.double()[:, None] * theta
    assert (rope.angles(positions).double() - exact).abs().max() < 8191 * 2**-23 * 2  # float32 rounding only
    assert (positions.double()[:, None] * theta.to(dtype).double() - exact).abs().max() > 1.0  # what a cast costs
    assert model(torch.randint(0, 50, (1, 8)))[0].dtype == dtype


def test_rope_frequencies_follow_a_wider_model():
    rope = RotaryEmbedding(16).double()
    assert rope.inv_freq.dtype == torch.float64


@pytest.mark.parametrize("result_shape", [(5, 5), (4, 5), (2, 1, 4, 4), (1, 1, 1, 4, 4), (3,)])
def test_a_mask_mod_result_that_does_not_broadcast_is_refused(result_shape):
    from attnlib.attention.masks import mask_from_mod

    with pytest.raises(ValueError, match=re.escape(f"mask_mod returned shape {result_shape}, which does not "
                                                   "broadcast to the mask's (1, 1, 4, 4)")):
        mask_from_mod(lambda b, h, q_idx, kv_idx: torch.ones(result_shape, dtype=torch.bool), (1, 1, 4, 4))


@pytest.mark.parametrize("mod", [lambda b, h, q, kv: q >= kv, lambda b, h, q, kv: kv < 2, lambda b, h, q, kv: q > 0])
def test_a_mask_mod_of_some_of_the_indices_broadcasts(mod):
    from attnlib.attention.masks import mask_from_mod

    mask = mask_from_mod(mod, (2, 3, 4, 4))
    q, kv = torch.arange(4)[:, None], torch.arange(4)[None, :]
    assert mask.shape == (2, 3, 4, 4) and torch.equal(mask, mod(None, None, q, kv).expand(2, 3, 4, 4))


@pytest.mark.parametrize("row", [[-1.0], [-1.0, -2.0], [1.0, -1.0], [0.0, 3.0, -5.0], [-1e300, 1e300]])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_temperature_that_overflows_float32_samples_the_argmax(row, dtype):
    """Scaled by 1e-300, every logit leaves float32's range (the softmax runs in float32): the row is sampled as
    greedy, never all -inf (found by the property suite: float64 [-1.0] at 1e-300 gave a NaN softmax)."""
    logits = torch.tensor([row], dtype=dtype)
    if not torch.isfinite(logits).all():
        pytest.skip("a value outside this dtype")
    for seed in range(5):
        token = sample_next_token(logits, temperature=1e-300, generator=torch.Generator().manual_seed(seed))
        assert token.item() == logits.argmax().item()
