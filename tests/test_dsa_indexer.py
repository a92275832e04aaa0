"""DeepSeek Sparse Attention (chapter 21): the lightning indexer and top-k MLA against transformers' deepseek_v32.

References: transformers' ``DeepseekV32Indexer`` / ``DeepseekV32Attention`` (and ``DeepseekV3Attention`` for dense
MLA) on tiny random configs, weights copied; eq. 1 written with an explicit loop over heads; brute-force top-k.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV32Config
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

from attnlib.attention.indexer import DSAttention, causal_topk_mask, dsa_cache_bytes, lightning_index
from attnlib.attention.latent import DeepSeekLatentAttention
from attnlib.cache import LayerCache

SIZES = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
INDEX = dict(index_n_heads=8, index_head_dim=16)
TOL32 = 1e-5  # float32 parity with transformers (measured max abs diff: see the report)


def hf_config(top_k: int, bias: bool = False) -> DeepseekV32Config:
    config = DeepseekV32Config(vocab_size=50, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
                               n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                               max_position_embeddings=64, attention_bias=bias, index_topk=top_k, **SIZES, **INDEX)
    config._attn_implementation = "eager"
    return config


def ours_kwargs(config, dense: bool = False) -> dict:
    kw = dict(q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
              qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
              v_head_dim=config.v_head_dim, rope_theta=config.rope_parameters["rope_theta"],
              bias=config.attention_bias, attn_fn="eager")
    if not dense:
        kw.update(index_topk=config.index_topk, index_n_heads=config.index_n_heads,
                  index_head_dim=config.index_head_dim)
    return kw


def randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0  # norms around 1, everything else around 0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))


def copy_into(ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    state = {k.replace("o_proj", "out_proj"): v for k, v in ref.state_dict().items()}
    ours.load_state_dict({k: v for k, v in state.items() if k in ours.state_dict()}, strict=True)


def pair(top_k: int = 4, seed: int = 0, bias: bool = False):
    config = hf_config(top_k, bias)
    ref = hf.DeepseekV32Attention(config, layer_idx=0).eval()
    randomize(ref, seed)
    ours = DSAttention(config.hidden_size, config.num_attention_heads, **ours_kwargs(config)).eval()
    copy_into(ours, ref)
    return config, ref, ours


def hf_inputs(config, x: torch.Tensor, start: int = 0):
    """transformers' position embeddings, additive causal mask (B, 1, T, T_k) and position ids."""
    B, T, _ = x.shape
    pos = torch.arange(start, start + T)[None]
    cos_sin = hf.DeepseekV32RotaryEmbedding(config)(x, pos)
    mask = torch.full((T, start + T), torch.finfo(x.dtype).min).triu(start + 1)  # key s > start + t masked
    return cos_sin, mask[None, None].expand(B, 1, T, start + T), pos


def causal(T_q: int, T_k: int) -> torch.Tensor:
    return torch.ones(T_q, T_k, dtype=torch.bool).tril(T_k - T_q)


def test_lightning_index_is_equation_1():
    g = torch.Generator().manual_seed(1)
    q, k, w = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((2, 5, 3, 4), (2, 7, 4), (2, 5, 3)))
    expected = torch.zeros(2, 5, 7, dtype=torch.float64)
    for j in range(3):  # I_{t,s} = Σ_j w_{t,j} ReLU(0.5 q_{t,j}·k_s)
        expected += w[:, :, j, None] * torch.relu(0.5 * torch.einsum("btd,bsd->bts", q[:, :, j], k))
    torch.testing.assert_close(lightning_index(q, k, w, 0.5), expected, rtol=0, atol=1e-12)


def test_causal_topk_mask_keeps_the_top_past_keys():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 6, 9, generator=g)
    for offset, top_k in ((3, 2), (0, 4), (5, 20)):  # explicit offsets; fewer past keys than k
        keep = causal_topk_mask(scores, top_k, offset)
        for b in range(2):
            for t in range(6):
                past = torch.arange(offset + t + 1).clamp(max=8).unique()  # keys s <= offset + t that exist
                best = past[scores[b, t, past].argsort(descending=True)[:top_k]]
                assert set(keep[b, t].nonzero().flatten().tolist()) == set(best.tolist())
    assert torch.equal(causal_topk_mask(scores, 3), causal_topk_mask(scores, 3, offset=3))  # default: queries last


def test_indexer_scores_and_choices_equal_transformers(monkeypatch):
    config, ref, ours = pair(top_k=4, seed=3)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(4))
    cos_sin, mask, pos = hf_inputs(config, x)
    seen = []
    topk = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda self, *a, **k: seen.append(self) or topk(self, *a, **k))
    with torch.no_grad():
        q_resid = ref.q_a_layernorm(ref.q_a_proj(x))
        index = ref.indexer(x, q_resid, cos_sin, mask[:, 0], pos).long()  # (B, T, k) int32 in transformers
        monkeypatch.undo()
        keys = ours.indexer.keys(x, pos[0])
        scores = ours.indexer.scores(x, q_resid, keys, pos[0])
        keep = ours.indexer(x, q_resid, keys, pos[0])
    allowed = causal(12, 12)
    assert (seen[0][:, allowed] - scores[:, allowed]).abs().max() <= TOL32  # the scores transformers ranks
    theirs = torch.zeros(2, 12, 12, dtype=torch.bool).scatter(-1, index, True) & allowed  # real keys chosen
    assert torch.equal(keep, theirs)
    assert keep.sum(-1).tolist() == [[min(t + 1, 4) for t in range(12)]] * 2  # the selection matters


@pytest.mark.parametrize("top_k,bias", [(1, False), (4, False), (4, True), (7, True)])
def test_dsa_layer_equals_transformers(top_k, bias):
    config, ref, ours = pair(top_k=top_k, seed=5, bias=bias)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected, _ = ref(x, *hf_inputs(config, x)[:2])
        assert (ours(x) - expected).abs().max() <= TOL32
        ours.attn_fn = "sdpa"  # the same mask through SDPA
        assert (ours(x, positions=torch.arange(12).expand(2, 12)) - expected).abs().max() <= TOL32
        _, weights = ours(x, return_weights=True)  # (B, h, T, T): no weight outside the chosen keys
        assert ((weights > 0).sum(-1) <= top_k).all()
        dense = DeepSeekLatentAttention(32, 4, **ours_kwargs(config, dense=True)).eval()
        copy_into(dense, ref)
        assert (dense(x) - expected).abs().max() > 1e-3  # top-k changed the output: the test can fail


def test_topk_at_least_T_is_dense_mla():
    config, ref, ours = pair(top_k=16, seed=7)
    v3 = DeepseekV3Config(**{k: getattr(config, k) for k in (*SIZES, "vocab_size", "max_position_embeddings")},
                          rope_interleave=True)
    v3._attn_implementation = "eager"
    dense_ref = DeepseekV3Attention(v3, layer_idx=0).eval()
    dense_ref.load_state_dict({k: v for k, v in ref.state_dict().items() if not k.startswith("indexer.")})
    dense = DeepSeekLatentAttention(32, 4, **ours_kwargs(config, dense=True)).eval()
    copy_into(dense, ref)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected, _ = dense_ref(x, *hf_inputs(config, x)[:2])
        assert (ours(x) - expected).abs().max() <= TOL32
        assert (dense(x) - expected).abs().max() <= TOL32


def test_cache_decode_and_chunked_prefill_equal_one_pass():
    config, ref, ours = pair(top_k=3, seed=9)
    ours.double()
    x = torch.randn(2, 10, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        full = ours(x)
        cache = LayerCache(16)
        steps = torch.cat([ours(x[:, t:t + 1], cache=cache) for t in range(10)], dim=1)  # one token at a time
        chunks = LayerCache(16)
        two = torch.cat([ours(x[:, :6], cache=chunks), ours(x[:, 6:], cache=chunks)], dim=1)
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(two, full, rtol=0, atol=1e-12)
    d_c, d_R, d_I = config.kv_lora_rank, config.qk_rope_head_dim, config.index_head_dim
    assert [b.shape[-1] for b in cache.buffers] == [d_c, d_R, d_I]  # latent, RoPE key, indexer key
    assert cache.bytes_per_token() == ours.cache_bytes_per_token() == (d_c + d_R + d_I) * 8
    assert ours.mla_cache_width == d_c + d_R and ours.cache_width == d_c + d_R + d_I


def test_cached_chunks_equal_transformers_cache():
    config, ref, ours = pair(top_k=3, seed=11)
    x = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(12))
    past, cache, outs = DynamicCache(config=config), LayerCache(16), []
    with torch.no_grad():
        for lo, hi in ((0, 5), (5, 6), (6, 9)):
            expected, _ = ref(x[:, lo:hi], *hf_inputs(config, x[:, lo:hi], lo)[:2], past_key_values=past)
            outs.append((ours(x[:, lo:hi], cache=cache) - expected).abs().max())
    assert max(outs) <= TOL32


def test_future_tokens_never_change_past_outputs():
    _, _, ours = pair(top_k=3, seed=13)
    ours.double()
    g = torch.Generator().manual_seed(14)
    x = torch.randn(2, 12, 32, dtype=torch.float64, generator=g)
    y = x.clone()
    y[:, 7:] = torch.randn(2, 5, 32, dtype=torch.float64, generator=g)
    with torch.no_grad():
        assert torch.equal(ours(x)[:, :7], ours(y)[:, :7])
        assert not torch.allclose(ours(x)[:, 7:], ours(y)[:, 7:])
        pos = torch.arange(12)
        q_resid = ours.q_a_layernorm(ours.q_a_proj(x))
        keep = ours.indexer(x, q_resid, ours.indexer.keys(x, pos), pos)
    assert not (keep & ~causal(12, 12)).any()


def test_padded_keys_are_never_chosen():
    _, _, ours = pair(top_k=3, seed=15)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(16))
    attention_mask = torch.ones(2, 8, dtype=torch.bool)
    attention_mask[1, :3] = False  # row 1 left-padded by 3
    pos = torch.arange(8)
    with torch.no_grad():
        q_resid = ours.q_a_layernorm(ours.q_a_proj(x))
        keep = ours.select_keys(x, q_resid, ours.cached_tensors(x, None, None, pos), pos, attention_mask, 8)
        out = ours(x, attention_mask=attention_mask)
    assert not keep[1, :, :3].any() and keep[1, 3:].sum(-1).tolist() == [1, 2, 3, 3, 3]
    assert torch.isfinite(out).all()


def test_cache_bytes_per_token_against_mla():
    assert dsa_cache_bytes() == {"mla": 1152, "indexer": 256, "dsa": 1408}  # DeepSeek-V3.2-Exp, bf16
    assert dsa_cache_bytes(index_dtype=torch.float8_e4m3fn)["dsa"] == 1280


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="top_k=0 must be a positive integer"):
        causal_topk_mask(torch.zeros(3, 3), 0)
    with pytest.raises(ValueError, match="offset=-1"):
        causal_topk_mask(torch.zeros(3, 3), 1, offset=-1)
    with pytest.raises(TypeError, match="allowed must be a bool tensor"):
        causal_topk_mask(torch.zeros(3, 3), 1, allowed=torch.ones(3))
    with pytest.raises(ValueError, match=r"k_idx must have shape \(B=2, T_k, d_I=4\)"):
        lightning_index(torch.zeros(2, 3, 2, 4), torch.zeros(2, 5, 3), torch.zeros(2, 3, 2))
    with pytest.raises(ValueError, match=r"weights must have shape \(B, T_q, H_I\) = \(2, 3, 2\)"):
        lightning_index(torch.zeros(2, 3, 2, 4), torch.zeros(2, 5, 4), torch.zeros(2, 3, 3))
    with pytest.raises(TypeError, match="q_idx must be a float tensor"):
        lightning_index(torch.zeros(2, 3, 2, 4, dtype=torch.long), torch.zeros(2, 5, 4), torch.zeros(2, 3, 2))
    config = hf_config(4)
    kw = ours_kwargs(config)
    with pytest.raises(ValueError, match="index_topk=0 must be a positive integer"):
        DSAttention(32, 4, **{**kw, "index_topk": 0})
    with pytest.raises(ValueError, match="qk_rope_head_dim=8 must be <= index_head_dim=4"):
        DSAttention(32, 4, **{**kw, "index_head_dim": 4})
    with pytest.raises(ValueError, match=r"does not take \['n_kv_heads'\]: n_kv_heads=2"):
        DSAttention(32, 4, n_kv_heads=2, **kw)
    layer = DSAttention(32, 4, **kw)
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, d_model=32\)"):
        layer(torch.zeros(1, 3, 16))
    with pytest.raises(ValueError, match="takes no context"):
        layer(torch.zeros(1, 3, 32), torch.zeros(1, 3, 32))
    with pytest.raises(TypeError, match="index_dtype must be a torch.dtype"):
        dsa_cache_bytes(index_dtype="fp8")
