"""Hugging Face weights stream: boxes read straight from safetensors shards, sharded export that
transformers loads, conversion both ways, and conversion's peak memory a fraction of the model's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_parity import logits as parity_logits
from hf_parity import random_weights, stored
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from fivefold.config import ConfigError  # noqa: E402
from fivefold.tools.convert import checkpoint_to_model, convert, hf_to_checkpoint  # noqa: E402
from fivefold.models import build_meta_model, build_model  # noqa: E402
from fivefold.models.hf.interop import config_from_hf, hf_box_reader, load_pretrained, save_hf  # noqa: E402
from fivefold.models.registry import model_spec  # noqa: E402
from fivefold.models.hf.stream import HFBoxes, make_random_hf_llama  # noqa: E402
from fivefold.checkpoint.save_load import read_tensors  # noqa: E402

INDEX = "model.safetensors.index.json"


def hf_llama(tied: bool) -> torch.nn.Module:
    return random_weights(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=tied)), 1)


def hf_mixtral() -> torch.nn.Module:
    return random_weights(transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=None, tie_word_embeddings=False)), 2)


MODELS = {"llama-untied": lambda: hf_llama(False), "llama-tied": lambda: hf_llama(True), "mixtral": hf_mixtral}


def save_sharded(model, folder: Path) -> dict[str, torch.Tensor]:
    """Saved by transformers in several shards with an index; returns the tensors as stored."""
    model.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / INDEX).is_file() and len(list(folder.glob("*.safetensors"))) > 2
    return stored(folder)


def logits(model, vocab: int) -> torch.Tensor:
    return parity_logits(model, vocab, seq=16)


def source(name: str, tied: bool, expert: int | None = None) -> str:
    if name == "output.weight" and tied:
        return "model.embed_tokens.weight"
    if expert is not None:  # layers.L.feed_forward.experts.w1 -> ...block_sparse_moe.experts.E.w1.weight
        layer, w = name.split(".")[1], name.rsplit(".", 1)[1]
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight"
    return model_spec("mixtral" if "router" in name else "llama").hf.hf_name(name)


def random_box(shape, gen) -> tuple[tuple, tuple]:
    offsets = [int(torch.randint(0, n, (), generator=gen)) for n in shape]
    sizes = [int(torch.randint(1, n - o + 1, (), generator=gen)) for o, n in zip(offsets, shape)]
    return tuple(offsets), tuple(sizes)


@pytest.mark.parametrize("kind", MODELS)
def test_boxes_are_slices_of_the_stored_tensors(tmp_path, kind):
    hf = MODELS[kind]().to(torch.bfloat16)  # stored as bf16, read as fp32
    files = save_sharded(hf, tmp_path)
    cfg, fill = hf_box_reader(tmp_path)
    assert cfg == config_from_hf(hf.config.to_dict())
    gen = torch.Generator().manual_seed(0)
    for name, t in build_meta_model(cfg).state_dict().items():  # a tied model's output.weight too
        shape = tuple(t.shape)
        for offsets, sizes in [((0,) * len(shape), shape), random_box(shape, gen), random_box(shape, gen)]:
            box = fill(name, shape, offsets, sizes)
            assert box.dtype == torch.float32 and tuple(box.shape) == sizes, name
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            if name.endswith("expert_bias"):
                want = torch.zeros(sizes)
            elif ".experts." in name:
                want = torch.stack([files[source(name, cfg.tie_embeddings, e)] for e in range(shape[0])])[index]
            else:
                want = files[source(name, cfg.tie_embeddings)][index]
            assert torch.equal(box, want.float()), (name, offsets, sizes)


class Spy:
    """A safetensors handle that records which tensors are sliced, and how."""

    def __init__(self, handle, log: list):
        self.handle, self.log = handle, log

    def get_slice(self, name):
        whole, log = self.handle.get_slice(name), self.log

        class Slice:
            def __getitem__(self, index):
                log.append((name, index))
                return whole[index]
        return Slice()


def test_an_expert_box_reads_only_its_experts_slices(tmp_path):
    files = save_sharded(hf_mixtral(), tmp_path)
    _, fill = hf_box_reader(tmp_path)
    log: list = []
    real = fill._open
    fill._open = lambda file: Spy(real(file), log)
    box = fill("layers.1.feed_forward.experts.w2", (4, 32, 48), (1, 8, 4), (2, 16, 20))
    names = [f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight" for e in (1, 2)]
    assert log == [(n, (slice(8, 24), slice(4, 24))) for n in names]
    assert torch.equal(box, torch.stack([files[n][8:24, 4:24] for n in names]))


def test_reader_checks_every_tensor_up_front(tmp_path):
    hf_llama(False).save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / INDEX).read_text())
    file = tmp_path / index["weight_map"]["model.norm.weight"]
    tensors = load_file(file)
    save_file({**tensors, "model.norm.weight": torch.ones(65)}, file, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"tensor model.norm.weight in .* has shape \[65\], but config.json "
                                          r"implies \[64\]$"):
        hf_box_reader(tmp_path)
    del tensors["model.norm.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"does not hold tensor model.norm.weight, which {INDEX} places there"):
        hf_box_reader(tmp_path)
    del index["weight_map"]["model.norm.weight"]
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"is missing tensor model.norm.weight \(shape \[64\]\) that config.json"):
        hf_box_reader(tmp_path)


def test_a_box_outside_the_tensor_is_refused(tmp_path):
    save_sharded(hf_llama(True), tmp_path)
    _, fill = hf_box_reader(tmp_path)
    with pytest.raises(ValueError, match=r"box at \[120, 0\] of size \[16, 64\] in output.weight"):
        fill("output.weight", (128, 64), (120, 0), (16, 64))
    with pytest.raises(ValueError, match="no such tensor"):
        fill("layers.9.attention.wq.weight", (64, 64), (0, 0), (1, 1))


@pytest.mark.parametrize("kind", MODELS)
def test_export_is_sharded_as_transformers_shards(tmp_path, kind):
    hf = MODELS[kind]()
    cfg = config_from_hf(hf.config.to_dict())
    ours = random_weights(build_model(cfg, seed=0), 4)
    save_hf(ours, tmp_path / "ours", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "ours" / INDEX).read_text())
    files = sorted((tmp_path / "ours").glob("*.safetensors"))
    assert len(files) > 2 and {f.name for f in files} == set(index["weight_map"].values())
    assert files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    back, info = type(hf).from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    torch.testing.assert_close(logits(back.eval(), cfg.vocab_size), logits(ours, cfg.vocab_size), atol=1e-5, rtol=0)
    back.save_pretrained(tmp_path / "theirs", max_shard_size=20_000)  # the same index as transformers'
    theirs = json.loads((tmp_path / "theirs" / INDEX).read_text())
    assert index["metadata"] == theirs["metadata"] and index["weight_map"].keys() == theirs["weight_map"].keys()
    save_hf(ours, tmp_path / "ours")  # default shard size: one file, no index left behind
    assert [f.name for f in (tmp_path / "ours").glob("*.safetensors")] == ["model.safetensors"]
    assert not (tmp_path / "ours" / INDEX).exists()


@pytest.mark.parametrize("kind", MODELS)
def test_convert_round_trips_exactly(tmp_path, kind):
    hf = MODELS[kind]()
    files = save_sharded(hf, tmp_path / "hf")
    hf_to_checkpoint(tmp_path / "hf", tmp_path / "ckpt", block_bytes=2048)  # several boxes per tensor
    cfg = config_from_hf(hf.config.to_dict())
    assert len(list((tmp_path / "ckpt").glob("*.distcp"))) > 2 * len(build_meta_model(cfg).state_dict())
    loaded = load_pretrained(tmp_path / "hf")
    for name, t in read_tensors(tmp_path / "ckpt", cfg).items():
        assert t.dtype == torch.float32 and torch.equal(t, loaded.state_dict()[name]), name
    want = logits(hf, cfg.vocab_size)
    torch.testing.assert_close(logits(checkpoint_to_model(tmp_path / "ckpt"), cfg.vocab_size), want,
                               atol=1e-5, rtol=0)
    convert(tmp_path / "ckpt", tmp_path / "back", max_shard_bytes=20_000)
    again = stored(tmp_path / "back")
    assert again.keys() == files.keys() and all(torch.equal(again[k], files[k]) for k in files)
    back = type(hf).from_pretrained(tmp_path / "back").eval()
    torch.testing.assert_close(logits(back, cfg.vocab_size), want, atol=1e-5, rtol=0)


def test_random_folder_loads_in_transformers(tmp_path):
    make_random_hf_llama(tmp_path, hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, vocab=128,
                         max_shard_bytes=30_000)
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert hf.dtype == torch.bfloat16 and hf.model.norm.weight.eq(1).all()
    ours = load_pretrained(tmp_path)
    torch.testing.assert_close(logits(ours, 128), logits(hf.float().eval(), 128), atol=1e-5, rtol=0)


# The child measures its own resident set: baseline after imports, peak (VmHWM) after converting.
CHILD = """
import json, sys
from fivefold.config import ModelConfig
from fivefold.tools.convert import convert
from fivefold.models import build_meta_model

def status(key):
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1]) * 1024

build_meta_model(ModelConfig())  # torch's one-off set-up on first meta-device use (~30 MB), not the model's
baseline = status("VmRSS:")
convert(sys.argv[1], sys.argv[2])
print(json.dumps({"baseline": baseline, "peak": status("VmHWM:")}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmHWM from /proc")
def test_conversion_peak_memory_is_a_fraction_of_the_model(tmp_path):
    # ~320 MB fp32 in 64 MiB shards; the largest tensor (the embedding) is 16 MiB.
    make_random_hf_llama(tmp_path / "hf", hidden=512, layers=24, heads=8, kv_heads=4, ffn=1536, vocab=8192,
                         dtype=torch.float32, max_shard_bytes=64 * 2**20)
    size = sum(f.stat().st_size for f in (tmp_path / "hf").glob("*.safetensors"))
    for src, dst in (("hf", "ckpt"), ("ckpt", "back")):
        run = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / src), str(tmp_path / dst)],
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert run.returncode == 0, run.stderr[-3000:]
        got = json.loads(run.stdout.splitlines()[-1])
        print(f"{src} -> {dst}: model {size / 2**20:.0f} MiB, baseline {got['baseline'] / 2**20:.0f} MiB, "
              f"peak {got['peak'] / 2**20:.0f} MiB (+{(got['peak'] - got['baseline']) / 2**20:.0f})")
        assert got["peak"] <= got["baseline"] + size / 4, (src, dst, got, size)
    reader = HFBoxes(tmp_path / "hf", dtype=None)  # and the round trip is exact, tensor by tensor
    back = HFBoxes(tmp_path / "back", dtype=None)
    for name in reader.shapes:
        assert torch.equal(reader.whole(name), back.whole(name)), name
        reader.close()
        back.close()
