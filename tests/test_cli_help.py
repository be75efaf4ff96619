"""The CLI helps: `fivefold --help` lists the commands, `fivefold train --help` every config key
with its default and help (read from the config dataclasses), `--version` is the installed
package's, every command's --help prints its usage, and the shipped configs are found by name."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import typing
import zipfile
from pathlib import Path

import pytest

import fivefold
from fivefold.cli import commands as cli
from fivefold.cli import help_text as cli_help
from fivefold.config import Config
from fivefold.config.shipped import CONFIG_DIR, names, resolve

REPO = Path(__file__).resolve().parent.parent


def every_key(cls=Config, section=""):
    """(dotted key, the field's declared default, its dataclass, field name) for every config key."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        dotted = f"{section}.{f.name}" if section else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            yield from every_key(hints[f.name], dotted)
        else:
            yield dotted, f.default, cls, f.name


def test_main_help_lists_every_command_on_one_line(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert set(cli.COMMANDS) == set(cli_help.COMMANDS)
    for command, (summary, _) in cli_help.COMMANDS.items():
        assert re.search(rf"^  {command} +{re.escape(summary)}$", out, re.MULTILINE), command
    assert "tiny" in out and "demo" in out  # the shipped configs, by name


def test_version_is_the_installed_packages():
    done = subprocess.run([sys.executable, "-m", "fivefold", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"fivefold {importlib.metadata.version('fivefold')}"
    assert importlib.metadata.version("fivefold") == fivefold.__version__  # pyproject reads it from there


def test_train_help_lists_every_key_with_its_default_and_help(capsys):
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    keys = list(every_key())
    assert len(keys) > 100
    for dotted, default, _, _ in keys:
        shown = {True: "true", False: "false"}.get(default, default) if isinstance(default, bool) else default
        shown = shown if not isinstance(shown, str) or (shown and " " not in shown) else f'"{shown}"'
        line = re.search(rf"^  --{re.escape(dotted)} (\S+) +(\S.*)$", out, re.MULTILINE)
        assert line, f"{dotted} is missing from `fivefold train --help`, or has no help"
        assert line.group(1) == str(shown), (dotted, line.group(1), default)
    # Grouped by section, in the config's order, [model.moe] after [model].
    headers = re.findall(r"^\[([\w.]+)\]", out, re.MULTILINE)
    assert headers == ["model", "model.moe", "parallel", "train", "data", "checkpoint", "debug", "log", "cluster", "lora", "ft"]
    for section in headers:  # each key under its own section
        block = out.split(f"\n[{section}]", 1)[1].split("\n[", 1)[0]
        assert all(k.rsplit(".", 1)[0] == section for k in re.findall(r"^  --([\w.]+) ", block, re.MULTILINE))
    # Help from a trailing comment, from a comment block above the field, and from the table.
    assert re.search(r"--train.global_batch 16 +sequences per optimizer step; > 0$", out, re.MULTILINE)
    assert re.search(r"--model.family \"\" +The ModelSpec \(models/registry.py\)", out, re.MULTILINE)
    assert re.search(r"--model.moe.n_shared_experts 0 +experts every token goes through, beside the routed ones",
                     out, re.MULTILINE)
    assert re.search(r"--parallel.dp 1 +data-parallel degree \(elastic when 0: the same config on$", out, re.MULTILINE)
    # The accepted values come from the key's declaration (config_checks.checked).
    assert re.search(r"--train.beta1 0.9 +AdamW beta1; in \[0, 1\)$", out, re.MULTILINE)
    assert "--nproc N" in out and "--max-restarts K" in out  # the launcher's own options


@dataclasses.dataclass
class _Example:
    a: int = 1  # a's trailing comment
    # b's comment block,
    # two lines long.
    b: int = 2
    c: int = dataclasses.field(default=3, metadata={"help": "c's metadata"})  # not this comment
    d: int = 4


def test_help_prefers_metadata_then_trailing_then_block_comments():
    assert cli_help.key_help(_Example, "a", "x.a") == "a's trailing comment"
    assert cli_help.key_help(_Example, "b", "x.b") == "b's comment block, two lines long."
    assert cli_help.key_help(_Example, "c", "x.c") == "c's metadata"
    assert cli_help.key_help(_Example, "d", "x.d") == ""  # nothing: `fivefold train --help` would show it bare


def test_the_uncommented_table_names_only_existing_uncommented_keys():
    """UNCOMMENTED fills gaps only: a key config/schema.py explains itself is explained there alone, and a
    renamed or removed key does not linger in the table."""
    keys = {dotted: (cls, name) for dotted, _, cls, name in every_key()}
    assert set(cli_help.UNCOMMENTED) <= set(keys), set(cli_help.UNCOMMENTED) - set(keys)
    for dotted, (cls, name) in keys.items():
        own = cli_help.key_help(cls, name, "")  # metadata or comments alone
        assert bool(own) != (dotted in cli_help.UNCOMMENTED), (
            f"{dotted}: {'drop it from' if own else 'add a comment in config/schema.py or a line in'} cli_help.UNCOMMENTED")


@pytest.mark.parametrize("command", list(cli_help.COMMANDS))
def test_every_command_help_prints_its_usage(command, capsys):
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and f"fivefold {command}" in out


def test_the_console_script_help_has_no_traceback():
    for args in (["--help"], ["train", "--help"], ["generate", "-h"], ["nonsense"]):
        done = subprocess.run([sys.executable, "-m", "fivefold", *args], capture_output=True, text=True, timeout=60)
        assert "Traceback" not in done.stderr, (args, done.stderr)
        assert done.returncode == (2 if args == ["nonsense"] else 0), (args, done.stderr)
    assert done.stderr.strip() == ("error: unknown command 'nonsense'; the commands are train, config, layout, "
                                   "plan, prepare, convert, generate, report, viz (see `fivefold --help`)")


# --- the shipped configs -------------------------------------------------------------------------

def test_a_bare_name_resolves_to_the_shipped_config_unless_a_file_is_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert {"tiny", "demo", "llama3-8b"} <= set(names())
    for given in ("tiny", "tiny.toml", "configs/tiny.toml"):
        assert resolve(given) == CONFIG_DIR / "tiny.toml", given
    assert resolve("elsewhere/tiny.toml") == Path("elsewhere/tiny.toml")  # a path is never replaced
    assert resolve("nothing-by-this-name") == Path("nothing-by-this-name")
    (tmp_path / "tiny.toml").write_text("[train]\nsteps = 7\n")
    assert resolve("tiny.toml") == Path("tiny.toml")  # the user's own file wins


@pytest.mark.parametrize("args", [["config", "show", "demo"], ["layout", "tiny"],
                                  ["plan", "llama3-8b", "--json"], ["train", "demo", "--dry-run"]])
def test_commands_take_a_shipped_config_by_name_from_any_folder(args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(args) == 0, capsys.readouterr().err


def test_the_wheel_ships_the_configs_and_they_resolve_by_name(tmp_path):
    """`pip install .` (a wheel, not the editable install) carries the configs: build the wheel from
    a copy of the sources, unpack it as pip would install it, and use `tiny` by name from a folder
    outside the repository with only the wheel's fivefold importable."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    [wheel] = (tmp_path / "dist").glob("fivefold-*.whl")
    members = set(zipfile.ZipFile(wheel).namelist())
    assert {f"fivefold/configs/{n}.toml" for n in names()} <= members, sorted(members)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", "import fivefold, sys; print(fivefold.__file__); "
                           "from fivefold.cli import main; sys.exit(main(['config', 'show', 'tiny']))"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == str(site / "fivefold" / "__init__.py")  # the wheel's copy
    assert 'dir = "runs/tiny"' in done.stdout and "eval_every = 100" in done.stdout  # tiny.toml's own keys
