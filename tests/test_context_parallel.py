"""Context parallelism in training: every layout equals the single-process run (losses, gradient
norms, final weights within 1e-5, fp32, 6 steps); bad cp settings get one sentence. The same spawns
run document masking: each cp method's attention against every document alone, and training with
`data.document_mask` under cp2 (each method), tp2, pp2 and bf16 against the single process."""

import pytest

from layouts import (assert_same_run, reference, run_layouts, tiny_config, weight_atol, with_documents,
                     write_short_documents)
from ranks import run_on_ranks
from chat_data import make_qwen3_folder, prepare_folder
from test_document_mask import METHODS, assert_document_ops_exact, document_op_errors

from fivefold.config import ConfigError
from fivefold.configure import validate

EVAL = {"eval_every": 3, "eval_batches": 2}
CP2_LAYOUTS = [
    {"parallel": {"cp": 2}},  # dp=1: gradients must still be averaged over the two cp ranks
    {"parallel": {"cp": 2, "cp_method": "allgather"}},
    {"parallel": {"cp": 2, "cp_method": "ulysses"}},
    # These two also evaluate (train.eval_every): the held-out loss equals the single process's.
    {"parallel": {"cp": 2}, "train": {"micro_batch": 2, "recompute": "selective", **EVAL}},
    {"parallel": {"cp": 2, "cp_method": "allgather"}, "train": {"recompute": "full", **EVAL}},
]
FOUR_RANK_LAYOUTS = [
    {"parallel": {"cp": 4}},
    {"parallel": {"cp": 2, "tp": 2}},
    {"parallel": {"cp": 2, "dp": 2, "zero": 1}},
    {"parallel": {"cp": 2, "dp": 2, "zero": 3}},
    {"parallel": {"pp": 2, "cp": 2, "pp_schedule": "1f1b"}, "train": {"micro_batch": 2, **EVAL}},
    {"parallel": {"cp": 4, "cp_method": "allgather"}},
    {"parallel": {"cp": 2, "tp": 2, "cp_method": "ulysses"}},
]
BF16 = {"parallel": {"cp": 2, "dp": 2, "zero": 1}, "train": {"dtype": "bf16"}}
# Zero-bubble schedule: the ring's backward runs in the input-gradient pass. It needs 4 layers
# (2 ranks x 2 stages), and with 4 layers cp's reassociation noise reaches the weights at ~1.1e-5
# after 6 AdamW steps with or without a pipeline (cp2 x dp2 too): gradients agree to ~1e-6 of their
# scale, but AdamW divides each element by its own RMS, so near-zero elements turn that noise
# into updates of order lr. Losses and gradient norms keep 1e-5; weights get 3e-5.
PP_ZBV = {"parallel": {"pp": 2, "cp": 2, "pp_schedule": "zbv", "pp_virtual": 2},
          "train": {"micro_batch": 2}, "model": {"n_layers": 4}}
# Fine-tuning a Qwen3 made by transformers (`model.init_from`) on packed conversations with a loss
# mask (issue 29: `fivefold prepare --chat` of tests/chat_data.py's 200 conversations, bins of 64
# tokens, a tokenizer of 400 tokens): the loss is the mean over
# the trained tokens of the global batch, whichever micro-batch, dp rank, pipeline stage or cp rank
# holds them (under cp a rank may hold no trained token of a sequence). The same four-rank spawn.
SFT_LAYOUTS = [
    {"parallel": {"dp": 2, "tp": 2}, "train": {"micro_batch": 2}},
    {"parallel": {"pp": 2, "dp": 2}, "train": {"micro_batch": 1, **EVAL}},
    {"parallel": {"cp": 2, "dp": 2}, "train": {"micro_batch": 2, **EVAL}},
]
FIRST_SFT = len(FOUR_RANK_LAYOUTS) + 2  # after BF16 and PP_ZBV in the spawn's list


# Document masking on a corpus of short documents (most windows cross a boundary), each layout
# against the single-process run with the same mask; one without RoPE positions restarting.
DOCUMENT_LAYOUTS = [
    {"parallel": {"cp": 2}},
    {"parallel": {"cp": 2, "cp_method": "allgather"}, "train": {"recompute": "full"}},
    {"parallel": {"cp": 2, "cp_method": "ulysses"}, "data": {"document_positions": False}},
    {"parallel": {"tp": 2}},
    {"parallel": {"pp": 2}, "train": {"micro_batch": 2}},
]
DOCUMENT_BF16 = {"parallel": {"cp": 2}, "train": {"dtype": "bf16"}}
# tp2's row-parallel sums reassociate every step and AdamW's m/sqrt(v) amplifies that on weights whose
# gradients nearly cancel: with the mask, tp2 moves one w1 element by 1.7e-5 (losses and gradient
# norms agree to 2e-7) where the micro-batch split measures 1e-7; tp layouts get the bound of
# tests/test_composition.py (TP_WEIGHT_ATOL).
DOCUMENT_TP_WEIGHT_ATOL = 1e-4


@pytest.fixture(scope="module")
def document_source(tmp_path_factory):
    return write_short_documents(tmp_path_factory.mktemp("documents") / "short.jsonl")


def documents_layout(layout: dict, source: str) -> dict:
    return with_documents(layout, source, **layout.get("data", {}))


def _cp2_rank(layouts, document_layouts):
    return run_layouts(layouts), run_layouts(document_layouts), document_op_errors()


def _four_rank(layouts):
    return run_layouts(layouts), document_op_errors()


@pytest.fixture(scope="module")
def cp2_spawn(document_source):
    documents = [documents_layout(l, document_source) for l in DOCUMENT_LAYOUTS + [DOCUMENT_BF16]]
    return run_on_ranks(2, _cp2_rank, CP2_LAYOUTS, documents)


@pytest.fixture(scope="module")
def cp2_results(cp2_spawn):
    return [runs for runs, _, _ in cp2_spawn]


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """(the prepared conversations, a tiny Qwen3 folder made by transformers to start from)."""
    root = tmp_path_factory.mktemp("chat")
    make_qwen3_folder(root / "qwen3")
    return str(prepare_folder(root, seq_len=64)), str(root / "qwen3")


def chat_layout(layout: dict, folders: tuple[str, str]) -> dict:
    prepared, qwen3 = folders
    chat = with_documents(layout, prepared, val_fraction=0.1)
    return {**chat, "model": {"init_from": qwen3}, "train": {"seq_len": 64, **chat.get("train", {})}}


@pytest.fixture(scope="module")
def four_rank_spawn(chat_folder):
    chat = [chat_layout(layout, chat_folder) for layout in SFT_LAYOUTS]
    return run_on_ranks(4, _four_rank, FOUR_RANK_LAYOUTS + [BF16, PP_ZBV] + chat)


@pytest.fixture(scope="module")
def four_rank_results(four_rank_spawn):
    return [runs for runs, _ in four_rank_spawn]


@pytest.mark.parametrize("index", range(len(CP2_LAYOUTS)))
def test_cp2(cp2_results, index):
    layout = CP2_LAYOUTS[index]
    want = reference(layout)
    for rank, results in enumerate(cp2_results):
        assert_same_run(results[index], want, label=f"{layout} rank {rank}")


@pytest.mark.parametrize("index", range(len(FOUR_RANK_LAYOUTS)))  # bf16 and zbv are checked apart
def test_four_ranks(four_rank_results, index):
    layout = FOUR_RANK_LAYOUTS[index]
    want = reference(layout)
    for rank, results in enumerate(four_rank_results):
        assert_same_run(results[index], want, label=f"{layout} rank {rank}")


@pytest.mark.parametrize("method", METHODS)
def test_document_masked_attention_cp2(cp2_spawn, method):
    assert_document_ops_exact([errors for _, _, errors in cp2_spawn], method)


@pytest.mark.parametrize("method", METHODS)
def test_document_masked_attention_cp4(four_rank_spawn, method):
    assert_document_ops_exact([errors for _, errors in four_rank_spawn], method)


@pytest.mark.parametrize("index", range(len(DOCUMENT_LAYOUTS)))
def test_document_mask_training(cp2_spawn, document_source, index):
    layout = documents_layout(DOCUMENT_LAYOUTS[index], document_source)
    want = reference(layout)
    atol = DOCUMENT_TP_WEIGHT_ATOL if layout["parallel"].get("tp", 1) > 1 else 1e-5
    for rank, (_, runs, _) in enumerate(cp2_spawn):
        assert_same_run(runs[index], want, weight_atol=atol,
                        label=f"document mask {DOCUMENT_LAYOUTS[index]} rank {rank}")


def test_document_mask_changes_training(cp2_spawn, document_source):
    """The mask does something on this corpus: every step's loss moves by more than 4x the 1e-5 the
    layouts are held to (7e-5 at step 1, where attention is near uniform; 7e-4 after)."""
    masked = reference(documents_layout({}, document_source))
    plain = reference({"data": {"source": document_source}})
    assert all(abs(a - b) > 4e-5 * b for a, b in zip(masked.losses, plain.losses))


def test_document_mask_bf16_cp2_tracks_fp32(cp2_spawn, document_source):
    """bf16 compute with document masking: within 2% of the fp32 single-process losses."""
    want = reference(documents_layout({}, document_source))
    for _, runs, _ in cp2_spawn:
        got = runs[len(DOCUMENT_LAYOUTS)]
        for step, (a, b) in enumerate(zip(got.losses, want.losses), 1):
            assert abs(a - b) <= 0.02 * b, f"step {step}: bf16 {a} vs fp32 {b}"
        assert got.losses != want.losses  # it really ran in bf16


def test_bf16_cp2_dp2_tracks_fp32(four_rank_results):
    """bf16 compute, fp32 attention accumulation: within 2% of the fp32 single-process losses."""
    want = reference({"train": {"dtype": "fp32"}})
    for rank_results in four_rank_results:
        got = rank_results[len(FOUR_RANK_LAYOUTS)]
        for step, (a, b) in enumerate(zip(got.losses, want.losses), 1):
            assert abs(a - b) <= 0.02 * b, f"step {step}: bf16 {a} vs fp32 {b}"
        assert got.losses != want.losses  # it really ran in bf16


def test_pp2_zbv_cp2(four_rank_results):
    want = reference(PP_ZBV)
    for rank, results in enumerate(four_rank_results):
        assert_same_run(results[FIRST_SFT - 1], want, weight_atol=3e-5, label=f"{PP_ZBV} rank {rank}")


@pytest.mark.parametrize("index", range(len(SFT_LAYOUTS)))
def test_chat_data_with_a_loss_mask(four_rank_results, chat_folder, index):
    layout = chat_layout(SFT_LAYOUTS[index], chat_folder)
    want = reference(layout)
    # The single process accumulated in two micro-batch splits: a mean of micro-batch means would
    # move the loss by ~1e-2 between them; the global mean over trained tokens moves it by rounding.
    assert want.loss_noise < 1e-6, want.loss_noise
    # The harness's weight rule for the layout (tp's row-parallel sums, cp's blockwise softmax merges):
    # under cp2 the ring's merges moved weights 6.2e-6 on torch's portable kernels, 0.62 of a plain 1e-5.
    atol = weight_atol(layout["parallel"])
    for rank, results in enumerate(four_rank_results):
        assert_same_run(results[FIRST_SFT + index], want, weight_atol=atol, label=f"chat {SFT_LAYOUTS[index]} rank {rank}")


CP2_DP2 = FOUR_RANK_LAYOUTS.index({"parallel": {"cp": 2, "dp": 2, "zero": 1}})


def test_ring_ledger_counts_the_ring(four_rank_results):
    """Per layer: K/V sent once forward and once backward, dK/dV (fp32) twice in backward (cp=2).
    (A layout where the cp group is not also the gradient-reduction group, which the ledger
    could not tell apart.)"""
    cfg = tiny_config(FOUR_RANK_LAYOUTS[CP2_DP2])
    m, t = cfg.model, cfg.train
    kv_bytes = 2 * (t.global_batch // 2) * m.n_kv_heads * (t.seq_len // 2) * m.head_dim * 4
    assert four_rank_results[0][CP2_DP2].comm["cp"] == m.n_layers * 4 * kv_bytes


@pytest.mark.parametrize("overrides, message", [
    ({"parallel": {"cp": 2}, "train": {"seq_len": 30}},
     "train.seq_len=30 is not divisible by 2*parallel.cp=4"),
    ({"parallel": {"cp": 4, "tp": 2, "cp_method": "ulysses"}},
     "parallel.cp_method='ulysses' splits the 2 heads per tensor-parallel rank"),
    ({"parallel": {"cp": 2, "cp_method": "zigzag"}},
     "parallel.cp_method='zigzag' is not one of ring, allgather, ulysses"),
])
def test_bad_cp_settings_get_one_sentence(overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(tiny_config(overrides))
    assert str(error.value).startswith(message), str(error.value)
    assert "\n" not in str(error.value)


def test_ulysses_with_divisible_heads_is_accepted():
    validate(tiny_config({"parallel": {"cp": 4, "cp_method": "ulysses"}}))
