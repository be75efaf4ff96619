"""Config: loading, precedence, overrides, `config show`, and one clear sentence per bad input.

Every bad input must be reported as a ConfigError whose single sentence names the key and the fix
(docs/design.md principle 5); the CLI turns it into one `error:` line and exit code 2, never a traceback.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.config import ConfigError, parse_overrides, to_toml
from fivefold.configure import load_config
from fivefold.config.presets import PRESETS
from fivefold.config.shipped import CONFIG_DIR
from fivefold.configure import validate

MISSING = object()  # marks the case whose config path does not exist


# (id, TOML text or None, overrides (CLI list or nested dict), world size, fragments that must all
# appear in the message: the key(s), the bad value and the fix).
BAD_INPUTS = [
    ("unknown-key-did-you-mean", None, ["--train.stpes", "3"], None,
     ["unknown key train.stpes", "(did you mean 'steps'?)"]),
    ("unknown-nested-key-from-toml", "[model.moe]\nn_expert = 4\n", None, None,
     ["unknown key model.moe.n_expert", "(did you mean 'n_experts'?)"]),
    ("unknown-section", "[paralel]\ntp = 2\n", None, None,
     ["unknown section [paralel]", "(did you mean 'parallel'?)"]),
    ("unknown-section-from-cli", None, ["--trian.steps", "3"], None,
     ["unknown section [trian]", "(did you mean 'train'?)"]),
    ("section-is-a-value", "train = 3\n", None, None,
     ["[train] must be a section of keys", "got 3"]),
    ("toml-float-for-int", "[train]\nsteps = 1.5\n", None, None,
     ["train.steps must be an integer", "got 1.5"]),
    ("toml-word-for-number", '[train]\nlr = "fast"\n', None, None,
     ["train.lr must be a number", "got 'fast'"]),
    ("toml-int-for-bool", "[checkpoint]\nasync_save = 1\n", None, None,
     ["checkpoint.async_save must be true or false", "got 1"]),
    ("cli-word-for-int", None, ["--parallel.tp", "two"], None,
     ["parallel.tp must be an integer", "got 'two'"]),
    ("cli-bad-bool", None, ["--parallel.sp", "maybe"], None,
     ["parallel.sp must be true or false", "got 'maybe'"]),
    ("cli-bad-compile", None, ["--train.compile", "maybe"], None,
     ["train.compile='maybe' is not one of false, true, auto"]),
    ("toml-int-for-compile", "[train]\ncompile = 1\n", None, None,
     ["train.compile='1' is not one of false, true, auto"]),
    ("cli-override-without-value", None, ["--parallel.tp"], None,
     ["--parallel.tp needs a value", "e.g. --parallel.tp 2"]),
    ("cli-override-without-dashes", None, ["parallel.tp", "2"], None,
     ["expected an override like --parallel.tp 2", "got 'parallel.tp'"]),
    ("zero-tp", None, ["--parallel.tp", "0"], None,
     ["parallel.tp must be > 0", "got 0"]),
    ("zero-steps", None, ["--train.steps", "0"], None,
     ["train.steps must be > 0", "got 0"]),
    ("zero-stage-out-of-range", None, ["--parallel.zero", "4"], None,
     ["parallel.zero=4 is not one of 0, 1, 2, 3", "3 also parameters"]),
    ("degrees-not-world-size", None, ["--parallel.dp", "2", "--parallel.tp", "2"], 8,
     ["parallel.dp*tp*pp*cp = 2*2*1*1 = 4", "the job has 8 ranks", "make the degrees multiply to 8"]),
    ("tp-not-dividing-heads", None, ["--parallel.tp", "3"], None,
     ["parallel.tp=3 does not divide model.n_heads=4", "choose a value among 1, 2, 4"]),
    ("tp-not-dividing-kv-heads", None, {"model": {"n_heads": 8, "n_kv_heads": 2}, "parallel": {"tp": 4}},
     None, ["parallel.tp=4 does not divide model.n_kv_heads=2", "choose a value among 1, 2"]),
    ("tp-not-dividing-vocab", None, {"model": {"vocab_size": 257}, "parallel": {"tp": 2}}, None,
     ["parallel.tp=2 does not divide model.vocab_size=257", "choose a value among 1, 257"]),
    ("tp-not-dividing-ffn", None, {"model": {"ffn_dim": 385}, "parallel": {"tp": 2}}, None,
     ["parallel.tp=2 does not divide model.ffn_dim=385", "choose a value among 1, 5, 7, 11, 35, 55, 77, 385"]),
    ("kv-heads-not-dividing-heads", None, {"model": {"n_kv_heads": 3}}, None,
     ["model.n_kv_heads=3 does not divide model.n_heads=4", "choose a value among 1, 2, 4"]),
    ("dp-shard-not-dividing-dp", None, {"parallel": {"dp": 4, "dp_shard": 3, "zero": 3}}, None,
     ["parallel.dp_shard=3 does not divide parallel.dp=4", "choose a value among 1, 2, 4"]),
    ("hsdp-with-zero-0", None, {"parallel": {"dp": 4, "dp_shard": 2, "zero": 0}}, None,
     ["parallel.dp_shard < parallel.dp (HSDP) needs parallel.zero >= 1"]),
    ("micro-batch-not-dividing-per-rank-batch", None,
     {"parallel": {"dp": 2}, "train": {"global_batch": 16, "micro_batch": 3}}, None,
     ["train.micro_batch=3 does not divide the per-rank batch", "train.global_batch/parallel.dp = 8",
      "choose a divisor of 8"]),
    ("global-batch-not-divisible-by-dp", None, {"parallel": {"dp": 3}, "train": {"global_batch": 16}}, None,
     ["parallel.dp=3 does not divide train.global_batch=16", "choose a value among 1, 2, 4, 8, 16"]),
    ("seq-len-over-max", None, ["--train.seq_len", "2048"], None,
     ["train.seq_len=2048 exceeds model.max_seq_len=1024", "lower train.seq_len or raise model.max_seq_len"]),
    ("seq-len-not-divisible-by-tp-with-sp", None, {"parallel": {"tp": 2}, "train": {"seq_len": 127}}, None,
     ["train.seq_len=127 is not divisible by parallel.tp*cp=2", "or set parallel.sp=false"]),
    ("unknown-preset", None, ["--model.preset", "llama3-9b"], None,
     ["model.preset 'llama3-9b' is unknown", "(did you mean 'llama3-8b'?)",
      "choose one of tiny"]),
    ("unknown-pp-schedule", None, ["--parallel.pp_schedule", "1f2b"], None,
     ["parallel.pp_schedule='1f2b' is not one of gpipe, 1f1b, interleaved_1f1b, zb, zbv, dualpipev"]),
    ("unknown-cp-method", None, ["--parallel.cp_method", "rings"], None,
     ["parallel.cp_method='rings' is not one of ring, allgather, ulysses"]),
    ("unknown-dtype", None, ["--train.dtype", "fp16"], None,
     ["train.dtype='fp16' is not one of fp32, bf16"]),
    ("unknown-recompute", None, ["--train.recompute", "partial"], None,
     ["train.recompute='partial' is not one of none, selective, full"]),
    ("order-missing-a-dimension", None, ["--parallel.order", "pp,dp,tp"], None,
     ["parallel.order='pp,dp,tp' must name each of pp, dp, cp, tp once", "e.g. 'pp,dp,cp,tp'"]),
    ("order-repeats-a-dimension", None, ["--parallel.order", "pp,dp,dp,tp"], None,
     ["parallel.order='pp,dp,dp,tp' must name each of pp, dp, cp, tp once"]),
    ("top-k-over-n-experts", None, {"model": {"moe": {"n_experts": 4, "top_k": 5}}}, None,
     ["model.moe.top_k=5 must be between 1 and model.moe.n_experts=4"]),
    ("missing-data-source", None, ["--data.source", "/nonexistent/corpus.txt"], None,
     ["data.source '/nonexistent/corpus.txt' does not exist", "or 'builtin'"]),
    ("missing-tokenizer-file", None, ["--data.tokenizer", "/nonexistent/tokenizer.json"], None,
     ["data.tokenizer '/nonexistent/tokenizer.json' is not a file", "Hugging Face tokenizer.json or 'byte'"]),
    ("vocab-too-small-for-bytes", None, ["--model.vocab_size", "128"], None,
     ["model.vocab_size=128 is too small for the byte tokenizer", "at least 256"]),
    ("missing-config-file", MISSING, None, None,
     ["does not exist", "pass a TOML file or the name of a shipped config: ", "tiny"]),
    ("invalid-toml", "[train\nsteps = 3\n", None, None,
     ["is not valid TOML"]),
]


def _message(tmp_path: Path, toml_text, overrides, world_size) -> str:
    path = None
    if toml_text is MISSING:
        path = tmp_path / "no-such-config.toml"
    elif toml_text is not None:
        path = tmp_path / "config.toml"
        path.write_text(toml_text)
    with pytest.raises(ConfigError) as info:
        validate(load_config(path, overrides), world_size)
    return str(info.value)


@pytest.mark.parametrize("toml_text, overrides, world_size, fragments",
                         [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_names_key_and_fix(tmp_path, toml_text, overrides, world_size, fragments):
    message = _message(tmp_path, toml_text, overrides, world_size)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from {message!r}"
    assert "\n" not in message, f"not one sentence: {message!r}"


def test_enough_distinct_bad_inputs():
    assert len({case[0] for case in BAD_INPUTS}) == len(BAD_INPUTS) >= 20


def test_file_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="nope.toml does not exist"):
        load_config(missing)
    broken = tmp_path / "broken.toml"
    broken.write_text("[train]\nsteps = = 3\n")
    with pytest.raises(ConfigError, match=r"broken\.toml is not valid TOML: .*line 2"):
        load_config(broken)


# The nearest good neighbours of the bad inputs above pass: the checks are not over-eager.
GOOD_INPUTS = [
    (["--parallel.tp", "2"], None),
    (["--parallel.dp", "2", "--parallel.tp", "2"], 4),
    ({"parallel": {"tp": 2, "sp": False}, "train": {"seq_len": 127}}, None),
    ({"parallel": {"dp": 4, "dp_shard": 2, "zero": 1}}, 4),
    ({"parallel": {"dp": 4, "dp_shard": 4, "zero": 0}}, 4),
    ({"parallel": {"dp": 2}, "train": {"global_batch": 16, "micro_batch": 4}}, 2),
    ({"model": {"moe": {"n_experts": 4, "top_k": 4}}}, None),
    (["--parallel.order", "dp, pp, tp, cp"], None),
    (["--train.seq_len", "1024"], None),
]


@pytest.mark.parametrize("overrides, world_size", GOOD_INPUTS)
def test_good_neighbours_validate(overrides, world_size):
    cfg = load_config(None, overrides)
    assert validate(cfg, world_size) is cfg


@pytest.mark.parametrize("text, value", [("true", True), ("False", False), ("1", True), ("0", False),
                                         ("yes", True), ("no", False), ("on", True), ("off", False)])
def test_bool_parsing_from_cli(text, value):
    assert load_config(None, ["--parallel.sp", text]).parallel.sp is value


@pytest.mark.parametrize("given, value", [("true", "true"), ("false", "false"), ("auto", "auto"), (True, "true"),
                                          (False, "false")])
def test_compile_is_false_true_or_auto_and_takes_booleans(given, value, tmp_path):
    """train.compile's choices include true and false, so TOML's booleans (and old checkpoints'
    state.json, which stored a boolean) mean them."""
    if isinstance(given, str):
        assert load_config(None, ["--train.compile", given]).train.compile == value
    toml = tmp_path / "run.toml"
    toml.write_text(f"[train]\ncompile = {str(given).lower() if isinstance(given, bool) else repr(given)}\n")
    assert load_config(str(toml)).train.compile == value
    assert load_config(None, {"train": {"compile": given}}).train.compile == value


def test_cli_strings_are_typed():
    cfg = load_config(None, ["--parallel.tp", "2", "--train.lr", "1e-3", "--train.warmup", " 7 ",
                             "--data.text_field", "body", "--model.moe.n_experts", "8"])
    assert cfg.parallel.tp == 2 and type(cfg.parallel.tp) is int
    assert cfg.train.lr == 1e-3 and type(cfg.train.lr) is float
    assert cfg.train.warmup == 7
    assert cfg.data.text_field == "body"
    assert cfg.model.moe.n_experts == 8


def test_toml_int_is_accepted_for_float():
    cfg = load_config(None, {"train": {"lr": 1}})
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float


def test_equals_form_of_overrides():
    assert parse_overrides(["--parallel.tp=2", "--train.lr", "1e-3", "--data.source=a=b.txt",
                            "--model.moe.top_k=4"]) == {
        "parallel": {"tp": "2"}, "train": {"lr": "1e-3"}, "data": {"source": "a=b.txt"},
        "model": {"moe": {"top_k": "4"}}}
    cfg = load_config(None, ["--parallel.tp=2", "--train.steps=9"])
    assert (cfg.parallel.tp, cfg.train.steps) == (2, 9)


def test_conflicting_overrides():
    with pytest.raises(ConfigError, match="--train.steps.x conflicts with another override"):
        parse_overrides(["--train.steps", "3", "--train.steps.x", "4"])


def test_precedence_defaults_preset_toml_cli(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "llama3-1b"\nn_layers = 2\ndim = 512\n'
                    "[train]\nsteps = 50\nlr = 1e-3\n")
    cfg = load_config(path, ["--model.dim", "256", "--train.steps", "7"])
    llama = PRESETS["llama3-1b"]
    assert cfg.model.preset == "llama3-1b"
    assert cfg.model.n_heads == llama["n_heads"] == 32  # preset over the default (4)
    assert cfg.model.vocab_size == llama["vocab_size"] == 128256
    assert cfg.model.rope_theta == 500000.0
    assert cfg.model.n_layers == 2  # TOML over the preset (16)
    assert cfg.model.dim == 256  # CLI over TOML (512) over the preset (2048)
    assert cfg.train.steps == 7  # CLI over TOML
    assert cfg.train.lr == 1e-3  # TOML kept where the CLI says nothing
    assert cfg.train.seq_len == 128  # default where nobody says anything
    assert cfg.model.moe.n_experts == 0

    # A preset chosen on the command line still yields to explicit TOML model keys.
    cfg = load_config(path, ["--model.preset", "llama3-8b"])
    assert cfg.model.preset == "llama3-8b"
    assert (cfg.model.n_layers, cfg.model.dim) == (2, 512)
    assert cfg.model.ffn_dim == PRESETS["llama3-8b"]["ffn_dim"] == 14336
    assert cfg.model.tie_embeddings is False


def test_moe_preset_merges_key_by_key():
    cfg = load_config(None, {"model": {"preset": "mixtral-8x7b", "moe": {"top_k": 1}}})
    assert (cfg.model.moe.n_experts, cfg.model.moe.top_k) == (8, 1)
    assert cfg.model.moe.expert_ffn_dim == 14336


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_validates(name):
    cfg = validate(load_config(None, ["--model.preset", name]))
    for key, value in PRESETS[name].items():
        if key == "moe":
            for moe_key, moe_value in value.items():
                assert getattr(cfg.model.moe, moe_key) == moe_value, f"{name}: moe.{moe_key}"
        else:
            assert getattr(cfg.model, key) == value, f"{name}: {key}"


def test_presets_include_llama3_sizes():
    assert {"tiny", "llama3-1b", "llama3-8b", "llama3-70b", "llama3-405b"} <= set(PRESETS)


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path, in_config_folder):
    in_config_folder(path)
    validate(load_config(path))


@pytest.mark.parametrize("args", [
    [],
    ["--parallel.tp", "2", "--train.steps", "7", "--train.lr", "0.0005", "--log.dir", "runs/x y"],
    ["--model.preset", "llama3-8b", "--train.seq_len", "4096", "--parallel.dp", "8", "--parallel.zero", "3"],
    ["--model.preset", "deepseek-v3-style", "--parallel.ep", "8"],
])
def test_config_show_reloads_to_an_equal_config(tmp_path, capsys, args):
    assert main(["config", "show", *args]) == 0
    shown = capsys.readouterr().out
    path = tmp_path / "shown.toml"
    path.write_text(shown)
    again = load_config(path)
    assert again.to_dict() == load_config(None, args).to_dict()
    assert shown == to_toml(again) + "\n"


def test_config_show_reads_a_file_and_overrides(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nsteps = 50\n[parallel]\ntp = 2\n")
    assert main(["config", "show", str(path), "--train.steps=11"]) == 0
    shown = capsys.readouterr().out
    assert "steps = 11\n" in shown and "tp = 2\n" in shown
    assert "[model.moe]\n" in shown and "[checkpoint]\n" in shown


def test_to_toml_escapes_strings():
    cfg = load_config(None, {"data": {"text_field": 'say "hi"'}, "log": {"dir": "C:\\runs\\x"}})
    import tomllib

    assert load_config(None, tomllib.loads(to_toml(cfg))).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("argv, fragment", [
    (["config", "show", "--parallel.tp", "3"], "error: parallel.tp=3 does not divide model.n_heads=4"),
    (["config", "show", "--train.stpes", "3"], "error: unknown key train.stpes (did you mean 'steps'?)"),
    (["config", "show", "/nonexistent/run.toml"], "error: config file /nonexistent/run.toml does not exist"),
    (["config", "list"], "error: usage: fivefold config show"),
    # Refused before any rank starts or any training happens.
    (["train", "--train.stpes", "3"], "error: unknown key train.stpes"),
    (["train", "--parallel.dp", "2"], "error: parallel.dp*tp*pp*cp = 2*1*1*1 = 2 but the job has 1 ranks"),
    (["train", "--nproc", "2", "--parallel.tp", "3"], "but the job has 2 ranks; make the degrees multiply to 2"),
    (["train", "--nproc", "0"], "error: --nproc must be >= 1, got 0"),
])
def test_cli_reports_one_error_line(capsys, argv, fragment):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("error: ")
    assert fragment in lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert captured.out == ""


def test_cli_bad_toml_file(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("[parallel]\ntp = \n")
    assert main(["config", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: config file {path} is not valid TOML")
    assert err.count("\n") == 1


def test_toml_string_for_a_number_is_refused(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nsteps = "10"\n')
    with pytest.raises(ConfigError, match=r"train.steps must be an integer, got '10'"):
        load_config(path)
