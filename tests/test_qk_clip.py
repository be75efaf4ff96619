"""QK-clip (train.qk_clip, Kimi K2's MuonClip; parallel/qk_clip.py): each head's largest logit is
what the attention really sees (windows, documents, grouped keys); the rescaling brings every head
over the threshold exactly to it and leaves the others alone; every layout clips the same heads by
the same factors as the single process (a 4-rank spawn: dp, tp, cp with its three methods, pp,
ZeRO 1/2/3, bf16, ep, gpt-oss's windows and sinks, document masking, Muon); and the families it
cannot act on are refused with one sentence."""

import pytest
import torch

from layouts import TP_WEIGHT_ATOL, assert_same_run, reference, run_layout, tiny_config, with_documents, write_short_documents
from ranks import run_on_ranks

from fivefold.config import ConfigError

# The tiny models' largest logits are 0.11-0.15 (small initial weights): 0.1 clips some heads each step.
TAU = 0.1
TRAIN = {"qk_clip": TAU, "micro_batch": 1, "steps": 4}
GPT_OSS = {"preset": "tiny-gpt-oss", "n_layers": 4}  # layers 0 and 2 slide over 16 of 32 keys; sinks; biases
MOE = {"moe": {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64}}


def _clipped(model=None, dtype="fp32", **parallel) -> dict:
    return {"model": model or {}, "parallel": parallel, "train": {**TRAIN, "dtype": dtype}}


# Muon: two steps (tests/test_muon_compositions.py says why).
MUON = {"optimizer": "muon", "lr": 0.02, "steps": 2}
LAYOUTS = {
    "dp2 tp2 zero1": _clipped(dp=2, tp=2, zero=1),
    "dp2 tp2 zero3 bf16": _clipped(dtype="bf16", dp=2, tp=2, zero=3),
    "cp2 tp2 ring": _clipped(cp=2, tp=2, zero=1),
    "dp2 cp2 ulysses zero2": _clipped(dp=2, cp=2, zero=2, cp_method="ulysses"),
    "pp2 dp2 zero1": _clipped({"n_layers": 4}, pp=2, dp=2, zero=1),
    "moe dp2 tp2 ep2": _clipped(MOE, dp=2, tp=2, ep=2, zero=1),
    "gpt-oss cp2 tp2 allgather": _clipped(GPT_OSS, cp=2, tp=2, cp_method="allgather", zero=1),
    "muon dp2 tp2 zero1": {**_clipped(dp=2, tp=2, zero=1), "train": {**TRAIN, **MUON}},
}
DOCUMENTS = _clipped(dp=2, cp=2, zero=1)  # document masking under the ring


def four_ranks(documents: str) -> dict:
    runs = {label: run_layout(layout) for label, layout in LAYOUTS.items()}
    return runs | {"documents dp2 cp2 ring": run_layout(with_documents(DOCUMENTS, documents))}


@pytest.fixture(scope="module")
def document_source(tmp_path_factory):
    return write_short_documents(tmp_path_factory.mktemp("documents") / "short.jsonl")


@pytest.fixture(scope="module")
def runs(document_source):
    return run_on_ranks(4, four_ranks, document_source)


def _layouts(document_source) -> dict:
    return LAYOUTS | {"documents dp2 cp2 ring": with_documents(DOCUMENTS, document_source)}


def test_the_shape_inference_forward_is_not_counted(runs):
    """The second stage's ranks ran torch's shape-inference forward on NaN (tests/layouts.py
    nan_shape_inference), and the pp layout still equals the single process below: a NaN maximum
    would have made a clip factor NaN, and the weights."""
    made = [results["pp2 dp2 zero1"].nan_shape_inputs for results in runs]
    assert made[:2] == [0, 0] and all(made[2:]), made


@pytest.mark.parametrize("label", [*LAYOUTS, "documents dp2 cp2 ring"])
def test_layout_clips_as_the_single_process(runs, document_source, label):
    layout = _layouts(document_source)[label]
    want = reference(layout)
    assert sum(want.qk_clipped) > 0, f"{label}: the single process clipped nothing; lower TAU"
    atol = TP_WEIGHT_ATOL if layout["parallel"].get("tp", 1) > 1 else 1e-5
    for rank, results in enumerate(runs):
        got = results[label]
        assert got.qk_clipped == want.qk_clipped, f"{label} rank {rank}: {got.qk_clipped} != {want.qk_clipped}"
        assert_same_run(got, want, weight_atol=atol, label=f"qk-clip {label} rank {rank}")


# ---------------------------------------------------------------- one process

def _model_and_batch(overrides: dict | None = None):
    from fivefold.models import build_model

    cfg = tiny_config(overrides or {})
    torch.manual_seed(0)
    model = build_model(cfg.model, seed=cfg.train.seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len))
    return model, tokens


def _maxima(model, tokens) -> torch.Tensor:
    from fivefold.parallel.qk_clip import QKClipStep

    hook = QKClipStep([model], TAU)
    model(tokens)  # a training forward: evaluation's are not recorded
    return torch.stack([hook.maxima[id(a)][-1] for a in hook.attentions])


@pytest.mark.parametrize("window,documents", [(0, False), (5, False), (0, True), (7, True)])
def test_head_maxima_are_the_largest_allowed_scores(window, documents):
    from fivefold.models.attention.logit_max import head_logit_max
    from fivefold.models.attention.masked import allowed_keys

    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 6, 300, 8, generator=generator), torch.randn(2, 3, 300, 8, generator=generator)
    ids = torch.randint(0, 4, (2, 300), generator=generator).sort(dim=1).values if documents else None
    positions = torch.arange(300)
    got = head_logit_max(q, k, positions, positions, window, ids, ids)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / 8 ** 0.5
    scores = scores.masked_fill(~allowed_keys(300, q.device, window, ids), float("-inf"))
    assert torch.allclose(got, scores.amax(dim=(0, 2, 3)), rtol=1e-6)


@pytest.mark.parametrize("model", [{}, GPT_OSS], ids=["llama-gqa", "gpt-oss"])
def test_clipping_brings_each_head_over_the_threshold_to_it(model):
    """Each head's factor lands on its own logits exactly, though two query heads share a key head.
    One layer at a time: a clipped layer changes the inputs of the layers after it."""
    import copy

    from fivefold.parallel.qk_clip import clip_factors

    net, tokens = _model_and_batch({"model": model})
    before = _maxima(net, tokens)
    tau = before.median().item()  # half the heads pass it
    factors = clip_factors(before, tau)
    assert (factors < 1).any() and (factors == 1).any()
    for layer in range(before.shape[0]):
        clipped = copy.deepcopy(net)
        attention = [m for m in clipped.modules() if hasattr(m, "qk_row_scales")][layer]
        with torch.no_grad():
            for param, rows in attention.qk_row_scales(factors[layer]).items():
                param.mul_(rows.view(-1, *[1] * (param.dim() - 1)))
        after = _maxima(clipped, tokens)
        assert torch.equal(after[:layer], before[:layer])
        want = before[layer].clamp(max=tau)
        assert torch.allclose(after[layer], want, rtol=1e-6, atol=0), (layer, (after[layer] / want - 1).abs().max())


def test_training_clips_and_reports_it():
    from fivefold.train.trainer import train

    clipped = train(tiny_config({"train": TRAIN}))
    free = train(tiny_config({"train": {**TRAIN, "qk_clip": 0.0}}))
    counts = [r["qk_clipped_heads"] for r in clipped.records]
    assert sum(counts) > 0 and all(r["qk_max_logit"] > 0 for r in clipped.records), counts
    assert "qk_clipped_heads" not in free.records[0]
    wq = "layers.0.attention.wq.weight"
    assert not torch.equal(clipped.parallel.full_state_dict()[wq], free.parallel.full_state_dict()[wq])


@pytest.mark.parametrize("overrides,named", [
    ({"model": {"preset": "tiny-qwen3"}}, "model.family = qwen3: its q/k RMSNorm undoes"),
    ({"model": {"preset": "tiny-deepseek-v3", "n_kv_heads": 4}}, "model.family = deepseek_v3: latent attention"),
    ({"lora": {"rank": 4}}, "which lora.rank freezes")])
def test_where_it_cannot_act_it_is_refused(overrides, named):
    from fivefold.configure import validate

    with pytest.raises(ConfigError) as err:
        validate(tiny_config({**overrides, "train": {"qk_clip": TAU}}), world_size=1)
    assert f"train.qk_clip = {TAU}" in str(err.value) and named in str(err.value), str(err.value)
