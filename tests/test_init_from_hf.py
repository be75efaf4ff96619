"""Training starts straight from a Hugging Face folder (`model.init_from`): under dp2 x tp2 x pp2
each rank reads only its slices from the safetensors files, and the run's weights and first-step
loss are transformers' own."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from layouts import tiny_config  # noqa: E402
from ranks import run_on_ranks  # noqa: E402

# The layout tests' tiny shape (tests/layouts.py), so their model keys agree with the folder's.
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=256, rms_norm_eps=1e-5, rope_theta=10000.0,
             max_position_embeddings=1024, tie_word_embeddings=False)
LAYOUT = {"dp": 2, "tp": 2, "pp": 2, "zero": 1}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).float()
    folder = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(folder, max_shard_size="100KB")  # several files and an index
    assert (folder / "model.safetensors.index.json").is_file()
    return folder, model.eval()


def _settings(folder) -> dict:
    return {"model": {"init_from": str(folder)}, "parallel": LAYOUT,
            "train": {"steps": 1, "micro_batch": 1}}


def _start_from_folder(folder: str) -> tuple:
    from fivefold.train.trainer import setup, train

    cfg = tiny_config(_settings(folder))
    _, par = setup(cfg)
    weights = par.full_state_dict()  # before any update: what each rank read, gathered
    return weights, train(cfg).losses[0]


def _first_global_batch(cfg) -> torch.Tensor:
    from fivefold.data.batches import GlobalBatchSampler, load_splits

    split, _ = load_splits(cfg.data, cfg.train.seq_len, cfg.model.vocab_size)
    return split.windows(GlobalBatchSampler(split.num_windows, cfg.train.global_batch, cfg.train.seed).indices(0))


def test_training_starts_from_the_folder_under_dp2_tp2_pp2(hf_folder):
    from fivefold.models import build_model

    folder, hf_model = hf_folder
    results = run_on_ranks(8, _start_from_folder, str(folder))
    cfg = tiny_config(_settings(folder))
    windows = _first_global_batch(cfg)
    inputs, labels = windows[:, :-1], windows[:, 1:]
    with torch.no_grad():
        want_logits = hf_model(inputs).logits
    want_loss = torch.nn.functional.cross_entropy(want_logits.flatten(0, 1), labels.flatten()).item()
    for rank, (weights, loss) in enumerate(results):
        ours = build_model(cfg.model, seed=0)
        ours.load_state_dict(weights, strict=True)
        with torch.no_grad():
            diff = (ours.eval()(inputs) - want_logits).abs().max().item()
        assert diff <= 1e-5, f"rank {rank}: logits differ from transformers' by {diff}"
        assert abs(loss - want_loss) <= 1e-5 * want_loss, f"rank {rank}: first loss {loss} vs {want_loss}"


def test_model_keys_that_disagree_with_the_folder_are_refused(hf_folder):
    from fivefold.config import ConfigError
    from fivefold.configure import load_config

    folder, _ = hf_folder
    with pytest.raises(ConfigError, match=r"model.n_layers=3 differs from .*config.json \(2\); drop it"):
        load_config(None, {"model": {"init_from": str(folder), "n_layers": 3}})
    cfg = load_config(None, {"model": {"init_from": str(folder), "dim": 64}})  # agreeing keys are fine
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.tie_embeddings) == (64, 2, False)
    with pytest.raises(ConfigError, match="model.init_from='.*' needs a Hugging Face folder"):
        load_config(None, {"model": {"init_from": str(folder / "missing")}})
