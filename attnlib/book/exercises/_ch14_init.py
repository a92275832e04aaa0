"""Exercise check 14.5 (GPT-2's initialisation); :mod:`ch14` registers it."""
from __future__ import annotations

import math

import torch

from attnlib.book.exercises._core import NotSolved, Wrong, case_rng, exercise, expect
from attnlib.book.exercises._run import Refuse, run
from attnlib.models import GPT, GPTConfig


def _own_init() -> Refuse:
    """14.5 is "write the initialisation yourself": the library's and transformers' initialisers are refused."""
    targets = [GPT.reset_parameters]
    try:  # transformers is the book's dependency, imported only when a check needs it
        from transformers import GPT2PreTrainedModel

        targets.append(GPT2PreTrainedModel._init_weights)
    except ImportError:
        pass
    return Refuse("do not call GPT.reset_parameters or transformers' _init_weights: write the initialisation "
                  "yourself", *targets)

#: Two models of different depth, so that the residual scale 1/sqrt(2 n_layers) must be computed.
_INIT_CONFIGS = (
    GPTConfig(vocab_size=301, block_size=48, n_layers=2, n_heads=4, d_model=96,
              gelu_approximate="tanh"),
    GPTConfig(vocab_size=257, block_size=40, n_layers=6, n_heads=2, d_model=80,
              gelu_approximate="tanh"),
)


def _groups(model: GPT) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """The model's weight matrices by kind: embeddings, qkv, fc and the residual projections."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {"residual": [], "other": []}
    for name, p in model.named_parameters():
        if p.dim() != 2:
            continue
        kind = "residual" if name.endswith(GPT.residual_projections) else "other"
        groups[kind].append((name, p.detach()))
    return groups


def _kurtosis(x: torch.Tensor) -> float:
    x = x.double().flatten()
    z = (x - x.mean()) / x.std()
    return float((z**4).mean())


def _check_init_on(gpt2_init_, config: GPTConfig, g: torch.Generator) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
    model = GPT(config)
    with torch.no_grad():  # a model far from GPT-2's init: every number must be set
        for p in model.parameters():
            p.uniform_(-3.0, 3.0)
    before = {name: p for name, p in model.named_parameters()}
    case = f"a GPT with n_layers={config.n_layers}, d_model={config.d_model}"

    result = run(gpt2_init_, model, what=f"gpt2_init_(model) on {case}", refuse=_own_init(), mutable=(0,),
                 copy_args=False)
    if result is not None and result is not model:
        raise Wrong(f"{case}: change the model in place (return None or the model itself), "
                    f"not a new {type(result).__name__}")
    after = dict(model.named_parameters())
    expect(after.keys() == before.keys() and all(after[k] is before[k] for k in before),
           f"{case}: the parameters must stay the same tensors (initialise them in place, "
           "with torch.no_grad() and nn.init.*_ or .normal_(); do not assign new ones)")
    expect(model.lm_head.weight is model.tok_emb.weight,
           f"{case}: lm_head.weight is no longer tied to tok_emb.weight")
    if all(float(p.detach().abs().max()) > 1.0 for p in model.parameters()):
        raise NotSolved("every parameter still holds the check's uniform(-3, 3) numbers: "
                        "initialise them")

    for name, p in model.named_parameters():
        p = p.detach()
        if p.dim() == 1 and (".ln_" in f".{name}" or name.startswith("ln_f")):
            want = 1.0 if name.endswith("weight") else 0.0
            expect(bool((p == want).all()),
                   f"{case}: {name} should be all {want:g} (a LayerNorm starts as the identity: "
                   "weight 1, bias 0)")
        elif p.dim() == 1:
            expect(bool((p == 0).all()), f"{case}: {name} should be all 0 (GPT-2 starts every "
                                         "bias at zero)")

    residual_std = 0.02 / math.sqrt(2 * config.n_layers)
    groups = _groups(model)
    for kind, target in (("other", 0.02), ("residual", residual_std)):
        for name, p in groups[kind]:
            std = float(p.double().std())
            if abs(std / target - 1) < 0.12:
                continue
            if kind == "residual":
                if abs(std / 0.02 - 1) < 0.12:
                    raise Wrong(f"{case}: {name} has std {std:.4f}, as every other weight. GPT-2 "
                                "scales the layers that write into the residual stream "
                                "(attn.out_proj, mlp.proj) by 1/sqrt(N), N the number of "
                                f"residual layers: std 0.02 / sqrt(2 * n_layers) = "
                                f"{residual_std:.4f}")
                if abs(std / (0.02 / math.sqrt(config.n_layers)) - 1) < 0.12:
                    raise Wrong(f"{case}: {name} has std {std:.4f} = 0.02 / sqrt(n_layers). Each "
                                "block adds to the residual stream twice (attention, then the "
                                "MLP): N = 2 * n_layers residual layers, std "
                                f"{residual_std:.4f}")
                raise Wrong(f"{case}: {name} has std {std:.4f}; a residual projection should "
                            f"have 0.02 / sqrt(2 * n_layers) = {residual_std:.4f}")
            if abs(std / residual_std - 1) < 0.12:
                raise Wrong(f"{case}: {name} has std {std:.4f}, the residual projections' scale. "
                            "Only attn.out_proj and mlp.proj write into the residual stream; "
                            "every other weight (embeddings, qkv, fc) is N(0, 0.02)")
            raise Wrong(f"{case}: {name} has std {std:.4f}; GPT-2 draws it from N(0, 0.02), "
                        "std 0.02")
    for kind in ("other", "residual"):
        values = torch.cat([p.flatten() for _, p in groups[kind]])
        k = _kurtosis(values)
        expect(2.7 < k < 3.3,
               f"{case}: the weights have the right std but not a normal distribution "
               f"(kurtosis {k:.2f}; a normal has 3, a uniform 1.8): draw them with "
               "normal_ / nn.init.normal_")
        mean, std = float(values.double().mean()), float(values.double().std())
        expect(abs(mean) < 5 * std / math.sqrt(values.numel()),
               f"{case}: the weights have mean {mean:.2e}: draw them around 0")


@exercise("14.5")
def check_gpt2_init(gpt2_init_) -> None:
    """Check ``gpt2_init_(model)``: GPT-2's initialisation (Radford et al. 2019, §2.3), in place."""
    g = case_rng()
    for config in _INIT_CONFIGS:
        _check_init_on(gpt2_init_, config, g)
