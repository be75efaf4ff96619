"""Shared pieces of the Hugging Face parity tests (test_hf_families, test_hf_deepseek, test_hf_streaming):
random weights that make any mix-up visible, the tensors a folder stores, and logits compared."""

from __future__ import annotations

import torch
from safetensors.torch import load_file


def random_weights(model: torch.nn.Module, seed: int, router_bias_std: float = 0.0) -> torch.nn.Module:
    """Weights of order 0.1 (norms near 1): logits O(1), routing decisive, any swapped or mis-mapped
    tensor far beyond the tolerance. `router_bias_std` > 0 also draws the routers' choice bias
    (DeepSeek-V3's), enough to change which experts many tokens pick."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0))
        if router_bias_std:
            for name, b in model.named_buffers():
                if name.endswith(("e_score_correction_bias", "expert_bias")):
                    b.copy_(torch.randn(b.shape, generator=gen) * router_bias_std)
    return model.eval()


def stored(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files, as stored."""
    return {k: v for file in sorted(folder.glob("*.safetensors")) for k, v in load_file(file).items()}


def logits(model, vocab: int, seq: int = 24) -> torch.Tensor:
    x = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(x)
    return getattr(out, "logits", out)


def assert_same_logits(got, want) -> None:
    assert want.abs().max() > 0.5  # not a comparison of near-zero numbers
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def our_moe_layers(model) -> list[bool]:
    from fivefold.models.moe.layer import MoE

    return [isinstance(block.feed_forward, MoE) for block in model.layers.values()]
