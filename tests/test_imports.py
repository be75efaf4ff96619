"""The shape of the package: every module imports alone, the import graph has no circle, each layer
imports only those below it, and every path the docs and docstrings name exists (docs/design.md,
"Rooms").

The graph is read from the source (ast), so it covers every module without importing any of them;
importing each module alone is checked in forked children of one interpreter that has loaded the
third-party libraries but no fivefold module.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "fivefold"

# Bottom to top: a module may import modules of its own layer and of the layers below.
LAYERS = {"config": 0, "mesh": 1, "runtime": 1, "torch_internals": 1, "models": 2, "configure": 2, "plan": 3, "parallel": 4,
          "data": 5, "checkpoint": 5, "train": 5, "ft": 5, "cli": 6, "tools": 6, "__init__": 7, "__main__": 7}
# Imports inside functions that reach upward, each for a reason the layering cannot express.
UPWARD = {
    # `fivefold --version`: the version is written once, in the package's __init__ (pyproject reads it there).
    ("fivefold.cli.help_text", "fivefold"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS["__init__" if len(parts) == 1 else parts[1]]


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported fivefold module, at import time?) for each import statement of a file. `from a
    import b` names the module a.b when that is one, else a; statements under `if TYPE_CHECKING`
    do not run."""
    tree = ast.parse(path.read_text())
    at_import_time = set()

    def top_level(body):
        for node in body:
            at_import_time.add(id(node))
            if isinstance(node, ast.Try):
                top_level(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                top_level(node.body + node.orelse)

    top_level(tree.body)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                     for a in node.names]
        else:
            continue
        out += [(name, id(node) in at_import_time) for name in names if name.split(".")[0] == "fivefold"]
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> the fivefold modules its import runs. Importing a.b.c from outside package a.b
    also runs a.b's __init__ (and a's)."""
    graph = {}
    for module, path in MODULES.items():
        edges = set()
        for name, now in _imports(path):
            if not now:
                continue
            assert name in MODULES, f"{module} imports {name}, which is not a module of the package"
            parts = name.split(".")
            for i in range(2, len(parts)):
                parent = ".".join(parts[:i])
                if not (module == parent or module.startswith(parent + ".")):
                    edges.add(parent)
            edges.add(name)
        graph[module] = edges - {module}
    return graph


def test_import_graph_has_no_circle():
    graph, state, path = _graph(), {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                circle = path[path.index(other):] + [other]
                pytest.fail("import circle at import time: " + " -> ".join(circle))
            if other not in state:
                visit(other)
        path.pop()
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module)


def test_each_layer_imports_only_those_below():
    upward = []
    for module, path in MODULES.items():
        for name, _ in _imports(path):
            if name in MODULES and _layer(name) > _layer(module) and (module, name) not in UPWARD:
                upward.append(f"{module} -> {name}")
    assert not upward, "imports reaching a layer above (docs/design.md, Rooms): " + ", ".join(upward)


def test_config_and_planner_import_no_torch():
    """Checking a config and planning a layout run anywhere in milliseconds: neither loads torch."""
    code = ("import sys, fivefold.config, fivefold.plan, fivefold.plan.cli, fivefold.plan.auto; "
            "print(sorted(m for m in ('torch', 'torch.distributed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_module_imports_alone():
    """Each module in a fresh child of an interpreter that holds no fivefold module: an import
    circle shows as 'cannot import name ... from partially initialized module'."""
    script = (
        "import os, sys, importlib, traceback\n"
        "import numpy, torch, torch.distributed, safetensors, tokenizers  # third-party: loaded once\n"
        "import torch.distributed.tensor, torch.distributed.pipelining, torch.distributed.fsdp\n"
        "import torch.distributed.checkpoint, torch.distributed.elastic.multiprocessing, torch.utils.checkpoint\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            importlib.import_module(name)\n"
        "        except BaseException:\n"
        "            traceback.print_exc(limit=-1)\n"
        "            os._exit(1)\n"
        "        os._exit(0)\n"
        "    if os.waitpid(pid, 0)[1]:\n"
        "        failed.append(name)\n"
        "print('FAILED', failed)\n")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    alone = [m for m in MODULES if not m.endswith(".__main__")]  # `python -m ...` runs the CLI
    out = subprocess.run([sys.executable, "-c", script, *alone], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.stdout.strip().endswith("FAILED []"), out.stdout[-3000:] + out.stderr[-3000:]


def test_one_list_of_families():
    """config/families.py lists the families; each has its folder and reads its own model_type."""
    from fivefold.config.families import FAMILIES, HF_MODEL_TYPES
    from fivefold.models.registry import FAMILIES as FOLDERS, family_of_hf_model_type, model_spec

    assert tuple(FOLDERS) == FAMILIES
    assert all((PACKAGE / "models" / family / "spec.py").is_file() for family in FAMILIES)
    assert {f: model_spec(f).hf.model_type for f in FAMILIES} == HF_MODEL_TYPES
    assert all(family_of_hf_model_type(kind) == family for family, kind in HF_MODEL_TYPES.items())


# Paths as the docs write them: a known top folder, then slashes, ending in a file name.
_PATH = re.compile(r"(?<![\w./-])((?:src/)?(?:fivefold/)?(?:config|models|parallel|plan|train|data|checkpoint|cli|tools|docs|tests|"
                   r"benchmarks|configs)/[\w./-]*\w\.(?:py|md|toml|csv|json))")
_LINK = re.compile(r"\]\(([^)#\s]+)")


def _documents():
    yield from [REPO / "README.md", REPO / "benchmarks" / "RESULTS.md", *sorted((REPO / "docs").glob("*.md"))]
    yield from sorted(PACKAGE.rglob("*.py"))
    yield from sorted((REPO / "benchmarks").glob("*.py"))


# Files a run writes, named as where their output goes.
WRITTEN = {"benchmarks/gpu_results.md", "benchmarks/gpu_dry_run.md"}


def _exists(path: str, near: Path) -> bool:
    if "*" in path or "<" in path or path in WRITTEN or re.search(r"(^|/)[A-Z_]+(\.\w+)?$", path):
        return True  # a pattern, an output, or a placeholder such as configs/NAME.toml
    return any((base / path).exists() for base in (REPO, REPO / "src", PACKAGE, near.parent))


def test_every_path_named_in_docs_and_docstrings_exists():
    missing = []
    for doc in _documents():
        text = doc.read_text()
        named = set(_PATH.findall(text))
        if doc.suffix == ".md":
            named |= {link for link in _LINK.findall(text) if "://" not in link}
        missing += [f"{doc.relative_to(REPO)}: {p}" for p in sorted(named) if not _exists(p, doc)]
    assert (REPO / "docs" / "design.md").is_file(), "docs/design.md is missing"
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_rooms_stay_small():
    """The package root holds what a reader needs first; every file reads in one sitting."""
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 6, f"modules at the package root: {root}; give the new one a folder"
    long = [f"{p.relative_to(PACKAGE)}: {n} lines" for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > 400]
    assert not long, "files over 400 lines (split them by what they do): " + ", ".join(long)


def test_no_folder_holds_more_than_twenty_modules():
    """A room a reader can take in: past twenty modules, group them by purpose in folders."""
    crowded = {}
    for folder in [PACKAGE, *sorted(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > 20:
            crowded[str(folder.relative_to(PACKAGE.parent))] = len(modules)
    assert not crowded, f"folders with more than 20 modules at their root: {crowded}"


FAMILY_FILES = {"spec.py", "hf.py", "stats.py", "model.py", "rope.py"}  # named once, as a pattern


def test_design_names_every_module():
    """docs/design.md names each module by its path under src/fivefold; a family's folder holds only
    the files its pattern names."""
    design = (REPO / "docs" / "design.md").read_text()
    from fivefold.config.families import FAMILIES

    unnamed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if path.name == "__init__.py":
            continue
        if relative.startswith("models/") and path.parent.name in FAMILIES:
            if path.name not in FAMILY_FILES:
                unnamed.append(relative)
        elif relative not in design:
            unnamed.append(relative)
    assert not unnamed, f"modules docs/design.md does not name: {unnamed}"
