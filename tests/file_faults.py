"""Faults injected at the file boundary, and the one sentence the CLI answers with, for the tests
of file errors (test_*_file_errors.py, test_paths_of_the_wrong_kind.py, test_layout_build_files.py).
Injected rather than made with chmod: root, who runs many CI containers, is not stopped by it."""

import pathlib

from fivefold.cli import main


def refuse_reads(monkeypatch, path, code: int, method: str = "read_text") -> None:
    """pathlib.Path.<method> of `path` raises OSError(code), as the storage would; other paths read."""
    read = getattr(pathlib.Path, method)

    def refusing(self, *args, **kwargs):
        if self == path:
            raise OSError(code, "injected", str(self))
        return read(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, method, refusing)


def one_sentence(capsys, *argv) -> str:
    """`fivefold ARGV` exits 2 with one line on stderr and no traceback: that line, without its prefix."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as done:
        code = done.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    prefix = "fivefold plan: " if argv[0] == "plan" else "error: "  # the planner's own prefix
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0].removeprefix(prefix)
