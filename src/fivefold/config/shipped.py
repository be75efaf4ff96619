"""The example configs shipped inside the package (src/fivefold/configs/*.toml), found by name.

They live in the package, not beside it, so that `pip install .` (a wheel, not only an editable
install) carries them: `fivefold train demo` or `fivefold plan llama3-8b ...` works from any folder.
A name is used only when no such file exists, so a user's own `demo.toml` always wins.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).parents[1] / "configs"  # package data, beside the config code


def names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def resolve(path: str | Path) -> Path:
    """`path` itself when it is a file; else the shipped config it names: `NAME`, `NAME.toml`, or
    `configs/NAME.toml` (the repository kept the configs there before they moved into the package).
    Anything else comes back unchanged, for the caller to report as missing."""
    path = Path(path)
    if path.is_file() or path.parent not in (Path("."), Path("configs")):
        return path
    shipped = CONFIG_DIR / f"{path.name.removesuffix('.toml')}.toml"
    return shipped if shipped.is_file() else path
