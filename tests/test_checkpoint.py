"""Checkpoints reshard across layouts and resume exactly.

One run saves at step 3 of 6 under dp2·zero1 (and an MoE run under dp2·ep2·zero1 with bias
balancing, whose router buffers must travel too); resumed runs under other layouts must produce
the uninterrupted run's losses for steps 4-6 (within 1e-5; bit-for-bit under the saving layout)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from layouts import LOSS_RTOL, reference, tiny_config
from ranks import run_on_ranks

from fivefold.config import ConfigError
from fivefold.checkpoint import save_load as checkpoint

MOE = {"moe": {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64, "balance": "bias"}}
SAVE = {"parallel": {"dp": 2, "zero": 1}, "train": {"micro_batch": 2}}
MOE_SAVE = {"model": MOE, "parallel": {"dp": 2, "ep": 2, "zero": 1}}
TWO_RANK_RESUMES = {"dp2 zero1 (same layout)": {"parallel": {"dp": 2, "zero": 1}, "train": {"micro_batch": 2}},
                    "cp2": {"parallel": {"cp": 2}}}
FOUR_RANK_RESUMES = {"tp2 pp2": {"parallel": {"tp": 2, "pp": 2}, "train": {"micro_batch": 2}},
                     "dp4 zero3": {"parallel": {"dp": 4, "zero": 3}},
                     # V schedule: rank 0 holds the first and the last stage, so both copies of the
                     # tied embedding (and their moments, inside zero-1 chunks) are on one rank.
                     "dp2 pp2 zbv zero1": {"parallel": {"dp": 2, "pp": 2, "pp_schedule": "zbv", "pp_virtual": 2,
                                                        "zero": 1}, "train": {"micro_batch": 1}},
                     "dp4 hsdp zero2": {"parallel": {"dp": 4, "dp_shard": 2, "zero": 2}},
                     "dp2 tp2 zero0": {"parallel": {"dp": 2, "tp": 2, "zero": 0}},
                     "pp2 interleaved cp2": {"parallel": {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual": 2,
                                                          "cp": 2}, "train": {"micro_batch": 2}}}


def _with(layout: dict, **checkpoint_keys) -> dict:
    out = {k: dict(v) for k, v in layout.items()}
    out["model"] = {"n_layers": 4, **out.get("model", {})}  # four stages for the V and interleaved schedules
    out["checkpoint"] = checkpoint_keys
    return out


def _train(overrides: dict):
    from fivefold.train.trainer import train

    result = train(tiny_config(overrides))
    return {"losses": result.losses, "steps": [r["step"] for r in result.records]}


def two_ranks(root: str) -> dict:
    out = {"full": _train(_with(SAVE, dir=f"{root}/dense", every=3))}
    for label, layout in TWO_RANK_RESUMES.items():
        out[label] = _train(_with(layout, resume=f"{root}/dense/step_00000003"))
    # Asynchronous: the ranks' writer threads meet in a process group of their own.
    out["moe full"] = _train(_with(MOE_SAVE, dir=f"{root}/moe", every=3, async_save=True))
    out["moe ep1"] = _train(_with({"model": MOE, "parallel": {"dp": 2, "zero": 2}},
                                  resume=f"{root}/moe/step_00000003"))
    return out


def four_ranks(root: str) -> dict:
    # These runs save too (step 6), so their gathered weights and AdamW state can be compared.
    out = {label: _train(_with(layout, resume=f"{root}/dense/step_00000003", dir=f"{root}/{label}", every=3))
           for label, layout in FOUR_RANK_RESUMES.items()}
    # parallel.dp = 0: dp follows the world size (4 here); the global batch is kept, each rank's share halves.
    out["dp0 on 4 ranks"] = _train(_with({"parallel": {"dp": 0}}, resume=f"{root}/dense/step_00000003"))
    out["dp0 saving"] = _train(_with({"parallel": {"dp": 0, "zero": 1}}, dir=f"{root}/elastic", every=3))
    out["moe ep4"] = _train(_with({"model": MOE, "parallel": {"dp": 4, "ep": 4}},
                                  resume=f"{root}/moe/step_00000003"))
    out["moe dp2 tp2 ep2 zero2"] = _train(_with({"model": MOE, "parallel": {"dp": 2, "tp": 2, "ep": 2, "zero": 2}},
                                                resume=f"{root}/moe/step_00000003"))
    # ep borrowing tp: each of the 4 ranks (2 dp x 2 tp) holds one expert.
    out["moe dp2 tp2 ep4 zero1"] = _train(_with({"model": MOE, "parallel": {"dp": 2, "tp": 2, "ep": 4, "zero": 1}},
                                                resume=f"{root}/moe/step_00000003"))
    out["moe dp4 ep2 zero3"] = _train(_with({"model": MOE, "parallel": {"dp": 4, "ep": 2, "zero": 3}},
                                            resume=f"{root}/moe/step_00000003"))
    out["moe dp4 hsdp2 ep2 zero3"] = _train(_with({"model": MOE, "parallel": {"dp": 4, "dp_shard": 2, "ep": 2, "zero": 3}},
                                                  resume=f"{root}/moe/step_00000003"))
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def two(root):
    return run_on_ranks(2, two_ranks, root)[0]


@pytest.fixture(scope="module")
def four(root, two):  # needs the checkpoints `two` wrote
    return run_on_ranks(4, four_ranks, root)[0]


def _assert_close(got, want, label, rtol=LOSS_RTOL):
    assert len(got) == len(want), label
    for a, b in zip(got, want):
        assert abs(a - b) <= rtol * abs(b), f"{label}: resumed losses {got} != uninterrupted {want}"


def test_saving_run_matches_single_process(two):
    _assert_close(two["full"]["losses"], reference(_with(SAVE)).losses, "dp2 zero1 with checkpoints")


def test_same_layout_resume_is_bit_for_bit(two):
    got = two["dp2 zero1 (same layout)"]
    assert got["steps"] == [4, 5, 6]  # the data stream continues; it does not restart at batch 0
    assert got["losses"] == two["full"]["losses"][3:]


@pytest.mark.parametrize("label", ["cp2"])
def test_resume_two_rank_layouts(two, label):
    assert two[label]["steps"] == [4, 5, 6]
    _assert_close(two[label]["losses"], two["full"]["losses"][3:], label)


@pytest.mark.parametrize("label", list(FOUR_RANK_RESUMES))
def test_resume_four_rank_layouts(four, two, label):
    assert four[label]["steps"] == [4, 5, 6]
    _assert_close(four[label]["losses"], two["full"]["losses"][3:], label)


def test_elastic_dp_follows_the_world_size(four, two, root):
    """The same config (parallel.dp = 0) on 2, 4 and 1 ranks continues one run: dp2's checkpoint
    goes on as dp4, dp4's as one process, with the uninterrupted losses."""
    from fivefold.train.trainer import train

    want = two["full"]["losses"]
    assert four["dp0 on 4 ranks"]["steps"] == [4, 5, 6]
    _assert_close(four["dp0 on 4 ranks"]["losses"], want[3:], "dp2 -> dp0 on 4 ranks")
    _assert_close(four["dp0 saving"]["losses"], want, "dp0 on 4 ranks from the start")
    one = train(tiny_config(_with({"parallel": {"dp": 0}}, resume=f"{root}/elastic/step_00000003")))
    assert [r["step"] for r in one.records] == [4, 5, 6]
    _assert_close(one.losses, want[3:], "dp4 -> dp0 on 1 process")


@pytest.mark.parametrize("label", list(FOUR_RANK_RESUMES))
def test_other_layouts_save_the_same_state(four, root, label):
    """Saving under tp2·pp2 (tied embedding split over stages) and FSDP2 writes the same whole
    weights and AdamW moments as dp2·zero1 (tp reassociation: ~1e-4 after AdamW, see test_pipeline)."""
    want = checkpoint.read_tensors(f"{root}/dense/step_00000006", prefix="")
    got = checkpoint.read_tensors(f"{root}/{label}/step_00000006", prefix="")
    weights = {k for k in want if not k.startswith("rng/")}
    assert {k for k in got if not k.startswith("rng/")} == weights, label
    assert any(k.startswith("exp_avg_sq/") for k in weights)
    for name in weights:
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=1e-3, msg=f"{label} {name}")


def test_each_rank_writes_only_its_pieces(four, root):
    """A sharded checkpoint: four ranks under tp2·pp2 each write a file, and together they hold
    each stored element once (DCP writes replicated pieces from one rank only)."""
    folder = f"{root}/tp2 pp2/step_00000006"
    import pathlib

    files = sorted(p.name for p in pathlib.Path(folder).glob("*.distcp"))
    assert files == [f"__{r}_0.distcp" for r in range(4)]
    sizes = [pathlib.Path(folder, f).stat().st_size for f in files]
    whole = sum(t.numel() * t.element_size() for t in checkpoint.read_tensors(folder, prefix="").values())
    assert min(sizes) > 0.1 * whole / 4 and sum(sizes) < 1.2 * whole, (sizes, whole)


@pytest.mark.parametrize("where, label", [("two", "moe ep1"), ("four", "moe ep4"), ("four", "moe dp2 tp2 ep2 zero2"),
                                          ("four", "moe dp2 tp2 ep4 zero1"), ("four", "moe dp4 ep2 zero3"), ("four", "moe dp4 hsdp2 ep2 zero3")])
def test_moe_resharded_across_ep(two, four, where, label):
    got = (two if where == "two" else four)[label]
    assert got["steps"] == [4, 5, 6]
    _assert_close(got["losses"], two["moe full"]["losses"][3:], label)


def test_files_and_keep_last(two, root):
    dense = f"{root}/dense"
    assert open(f"{dense}/latest").read().strip() == "step_00000006"
    state = json.loads(open(f"{dense}/step_00000003/state.json").read())
    assert state["step"] == 3 and state["sampler"]["step"] == 3
    assert state["scheduler"]["last_epoch"] == 3


def test_keep_last_k_and_stale_tmp_removed(tmp_path):
    cfg = tiny_config({"train": {"steps": 4}, "checkpoint": {"dir": str(tmp_path), "every": 1, "keep": 2}})
    (tmp_path / ".tmp-step_00000009-dead").mkdir(parents=True)  # a save killed half-way
    (tmp_path / ".tmp-step_00000009-dead" / checkpoint.MARKER).write_text("")  # ... that fivefold began
    from fivefold.train.trainer import train

    train(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003", "step_00000004"]


# --- damaged and mismatched checkpoints: one sentence naming the file or tensor -----------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from fivefold.train.trainer import train

    path = tmp_path_factory.mktemp("one")
    train(tiny_config({"train": {"steps": 2}, "checkpoint": {"dir": str(path), "every": 2}}))
    return path / "step_00000002"


def _resume(path, verify="sizes", **model):
    from fivefold.train.trainer import train

    return train(tiny_config({"train": {"steps": 3}, "model": model,
                              "checkpoint": {"resume": str(path), "verify": verify}}))


def _copy(saved, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    return bad


def _reseal(folder):
    """Rewrite the manifest over a deliberately changed folder, so that the checks behind it
    (DCP's own reads, the metadata allow-list, the shapes) are what meets the damage."""
    from fivefold.checkpoint import manifest as checkpoint_manifest

    data = {p.name: checkpoint_manifest.digest(p) for p in folder.glob("*.distcp")}
    checkpoint_manifest.write(folder, data)


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_truncated_file_is_named(saved, tmp_path):
    bad = _copy(saved, tmp_path)
    data = (bad / "__0_0.distcp").read_bytes()
    (bad / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=rf"checkpoint {bad} is damaged: __0_0.distcp is {len(data) // 2} bytes "
                                          rf"but {len(data)} were written \(truncated or still being copied\); "
                                          r"resume from another checkpoint"):
        _resume(bad)
    _reseal(bad)  # behind the manifest, DCP's read still refuses it in one sentence
    with pytest.raises(ConfigError, match=r"bad could not be read: a data file is corrupt, truncated or missing"):
        _resume(bad)


def test_missing_file_is_named(saved, tmp_path):
    bad = _copy(saved, tmp_path)
    (bad / ".metadata").unlink()
    with pytest.raises(ConfigError, match=r"is damaged: \.metadata is missing"):
        _resume(bad)
    (bad / "__0_0.distcp").unlink()
    shutil.copy(saved / ".metadata", bad / ".metadata")
    with pytest.raises(ConfigError, match=r"is damaged: __0_0.distcp is missing"):
        _resume(bad)
    (bad / "manifest.json").unlink()
    with pytest.raises(ConfigError, match=r"is damaged: manifest.json is missing \(the save did not finish\)"):
        _resume(bad)


def test_flipped_byte_is_named(saved, tmp_path):
    bad = _copy(saved, tmp_path)
    _flip_a_byte(bad / "__0_0.distcp")
    with pytest.raises(ConfigError, match=r"is damaged: __0_0.distcp does not match its checksum"):
        _resume(bad, verify="full")  # the default ("sizes") reads only the small files' checksums
    _flip_a_byte(bad / "__0_0.distcp")
    _flip_a_byte(bad / "config.toml")
    with pytest.raises(ConfigError, match=r"is damaged: config.toml does not match its checksum"):
        _resume(bad)


def test_auto_skips_a_damaged_newest_checkpoint(tmp_path, capsys):
    """Under resume = auto the newest whole checkpoint is used, with a warning naming each damaged
    newer one; when none is whole, one sentence instead of a start from step 0."""
    from fivefold.train.trainer import train

    run = {"train": {"steps": 4}, "checkpoint": {"dir": str(tmp_path), "every": 2}}
    full = train(tiny_config(run))
    _flip_a_byte(tmp_path / "step_00000004" / "__0_0.distcp")
    capsys.readouterr()
    resumed = train(tiny_config({**run, "checkpoint": {"dir": str(tmp_path), "resume": "auto", "verify": "full"}}))
    assert f"warning: skipped damaged checkpoint {tmp_path}/step_00000004 (__0_0.distcp does not match its " \
           f"checksum (the file was altered or damaged)); resuming from {tmp_path}/step_00000002" in capsys.readouterr().err
    assert [r["step"] for r in resumed.records] == [3, 4]
    assert resumed.losses == full.losses[2:]  # step 2's checkpoint resumes bit for bit
    for step in ("00000002", "00000004"):
        (tmp_path / f"step_{step}" / "state.json").unlink()
    with pytest.raises(ConfigError, match=rf"no whole checkpoint under {tmp_path}: {tmp_path}/step_00000004 "
                                          r"\(state.json is missing\); .*step_00000002 \(state.json is missing\); "
                                          r"restore one from a copy"):
        train(tiny_config({**run, "checkpoint": {"dir": str(tmp_path), "resume": "auto"}}))


def test_shape_mismatch_names_the_tensor(saved, tmp_path):
    # state.json claims dim=96 (else the model-key check refuses first): the tensors' shapes still do not fit.
    bad = _copy(saved, tmp_path)
    state = json.loads((bad / "state.json").read_text())
    state["model"].update(dim=96, head_dim=24)
    (bad / "state.json").write_text(json.dumps(state))
    _reseal(bad)
    with pytest.raises(ConfigError, match=r"tensor 'tok_embeddings.weight' has shape \[256, 64\] but this "
                                          r"model expects \[256, 96\]"):
        _resume(bad, dim=96)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="is not a checkpoint"):
        _resume(tmp_path)


def test_loading_never_unpickles(saved, tmp_path):
    # DCP's metadata is a pickle: a planted one that would run code is refused, not run.
    import os
    import pickle

    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    bad = _copy(saved, tmp_path)
    (bad / ".metadata").write_bytes(pickle.dumps(Exploit()))
    _reseal(bad)  # a forger can rewrite the manifest too: the allow-list must still refuse it
    with pytest.raises(ConfigError, match=r"\.metadata is corrupt or not a fivefold checkpoint "
                                          r"\((posix|nt)\.system is not allowed in checkpoint metadata\)"):
        _resume(bad)
    assert not marker.exists()
    # The real metadata passes the same allow-list, and tensors load as plain tensors.
    tensors = checkpoint.read_tensors(saved)
    assert tensors and all(type(t) is torch.Tensor for t in tensors.values())


# --- Hugging Face conversion ---------------------------------------------------------------------

def _hf_logits(folder, x):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(x).logits


def _our_logits(checkpoint_path, x):
    from fivefold.tools.convert import checkpoint_to_model

    with torch.no_grad():
        return checkpoint_to_model(checkpoint_path)(x)


def test_export_to_hf_gives_equal_logits(saved, tmp_path):
    from fivefold.cli import main

    assert main(["convert", str(saved.parent), str(tmp_path / "hf")]) == 0  # root: follows `latest`
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    want = _our_logits(saved, x)
    assert want.abs().max() > 0.5
    torch.testing.assert_close(_hf_logits(tmp_path / "hf", x), want, atol=1e-5, rtol=0)
    import fivefold

    with torch.no_grad():  # the Python API reads a fivefold checkpoint root too
        torch.testing.assert_close(fivefold.load_pretrained(saved.parent)(x), want, atol=0, rtol=0)


def test_sharded_checkpoint_exports_to_hf(four, root, tmp_path):
    """A checkpoint spread over four ranks' files (pp2 zbv, the tied embedding on one rank twice)
    converts in one process; transformers computes the same logits."""
    from fivefold.tools.convert import convert

    convert(f"{root}/dp2 pp2 zbv zero1", tmp_path / "hf")  # a checkpoint root: follows `latest`
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    want = _our_logits(f"{root}/dp2 pp2 zbv zero1/step_00000006", x)
    torch.testing.assert_close(_hf_logits(tmp_path / "hf", x), want, atol=1e-5, rtol=0)


def test_hf_import_train_export_round_trip(saved, tmp_path):
    from layouts import BASE

    from fivefold.configure import load_config
    from fivefold.tools.convert import convert
    from fivefold.train.trainer import train

    convert(saved, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "imported")
    cfg = load_config(tmp_path / "imported" / "config.toml", {
        "train": {**BASE["train"], "steps": 2}, "data": BASE["data"], "log": BASE["log"],
        "checkpoint": {"resume": str(tmp_path / "imported"), "dir": str(tmp_path / "run"), "every": 2}})
    result = train(cfg)
    assert [r["step"] for r in result.records] == [1, 2]  # weights only: a fresh run from them
    convert(tmp_path / "run", tmp_path / "hf2")
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    trained = _our_logits(tmp_path / "run", x)
    torch.testing.assert_close(_hf_logits(tmp_path / "hf2", x), trained, atol=1e-5, rtol=0)
    assert (trained - _hf_logits(tmp_path / "hf", x)).abs().max() > 1e-3  # it trained from the import
    # The first step started from the imported weights, not from the seed's initial weights.
    fresh = train(load_config(tmp_path / "imported" / "config.toml", {
        "train": {**BASE["train"], "steps": 1}, "data": BASE["data"], "log": BASE["log"]}))
    assert result.losses[0] != fresh.losses[0]


def test_async_save_writes_the_same_checkpoint(tmp_path):
    from fivefold.train.trainer import train

    for mode in ("sync", "async"):
        train(tiny_config({"train": {"steps": 3}, "checkpoint": {
            "dir": str(tmp_path / mode), "every": 1, "async_save": mode == "async"}}))
    for step in (2, 3):
        a = checkpoint.read_tensors(tmp_path / "sync" / f"step_0000000{step}", prefix="")
        b = checkpoint.read_tensors(tmp_path / "async" / f"step_0000000{step}", prefix="")
        # The process-wide RNG moved on between the two runs (in one process); all else is equal.
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if not k.startswith("rng/")), step
    assert (tmp_path / "async" / "latest").read_text().strip() == "step_00000003"


def test_a_checkpoint_of_the_code_before_the_redesign_resumes_the_same_run(tmp_path):
    """tests/data/checkpoint-0.1.0: step 2 saved by the code before the package was reorganised;
    today's code resumes it and steps 3 and 4 equal that code's uninterrupted run."""
    from fivefold.configure import load_config
    from fivefold.train.trainer import train

    data = Path(__file__).parent / "data" / "checkpoint-0.1.0"
    want = json.loads((data / "expected.json").read_text())["uninterrupted"][2:]
    # That code decayed every tensor alike: train.param_groups = "" (today's default exempts norms
    # and the embedding, docs/optimizers.md).
    cfg = load_config(data / "run.toml", {"log": {"dir": str(tmp_path)}, "train": {"param_groups": ""},
                                          "checkpoint": {"resume": str(data / "step_00000002")}})
    train(cfg)
    got = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [3, 4]
    for g, w in zip(got, want):
        assert g["lr"] == pytest.approx(w["lr"], rel=1e-12)
        for key in ("loss", "grad_norm"):
            assert abs(g[key] - w[key]) <= LOSS_RTOL * abs(w[key]), (key, g, w)
