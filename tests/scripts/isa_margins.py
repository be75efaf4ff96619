"""How close each layout-equality bound comes to failing under every CPU code path torch can take.

torch picks its vectorised kernels by the CPU's best instruction set (ATEN_CPU_CAPABILITY =
default | avx2 | avx512 on x86), and MKL picks its own (MKL_ENABLE_INSTRUCTIONS). Each path rounds
differently, so a bound set from one machine's noise can fail on another. This script runs the
layout-equality tests once per path, with tests/layouts.py writing each comparison's largest ratio
of difference to bound ($FIVEFOLD_TOLERANCE_LOG), and reports per test the worst ratio on any path.
It fails when a test fails or a ratio exceeds --limit (0.5: every bound at least 2x the largest
difference seen). Run it when a bound or a numerical path changes (docs/testing.md):

    python tests/scripts/isa_margins.py                       # every path, every layout test file
    python tests/scripts/isa_margins.py tests/test_muon.py    # some files
    python tests/scripts/isa_margins.py --paths default,avx2 --json margins.json
    python tests/scripts/isa_margins.py --workers 2                # two pytest workers per path
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def available_paths() -> dict[str, dict[str, str]]:
    """Each code path this CPU can run, as the environment that selects it: torch's capabilities up
    to the CPU's best, and the best with MKL held to AVX2 (what an AVX2-only CPU's MKL runs)."""
    import torch

    best = torch.backends.cpu.get_cpu_capability().lower()
    order = ["default", "avx2", "avx512"] if best.startswith("avx") else ["default", best]
    chosen = order[: order.index(best) + 1] if best in order else ["default", best]
    paths = {cap: {"ATEN_CPU_CAPABILITY": cap} for cap in chosen}
    if "avx2" in chosen:
        paths[f"{best}+mkl-avx2"] = {"ATEN_CPU_CAPABILITY": best, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    return paths


def layout_test_files() -> list[str]:
    """The test files that compare layouts with the single process (they call assert_same_run)."""
    return sorted(str(p) for p in TESTS.glob("test_*.py") if "assert_same_run" in p.read_text())


def run_path(name: str, env_extra: dict[str, str], files: list[str], pytest_args: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(prefix=f"margins-{name}-", suffix=".jsonl", delete=False) as log:
        log_path = log.name
    # Inductor's caches are keyed without the kernel path: a graph compiled under another path would
    # come back as C++ written for that path's vector instructions, which the build under `default`
    # then fails on ("'at::vec' has not been declared", torch 2.13). Each path compiles afresh.
    inductor_cache = tempfile.mkdtemp(prefix=f"inductor-{name}-")
    env = {**os.environ, **env_extra, "FIVEFOLD_TOLERANCE_LOG": log_path, "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": inductor_cache}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, *files],
                          env=env, capture_output=True, text=True, cwd=TESTS.parent)
    summary = [line for line in proc.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    rows = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    os.unlink(log_path)
    shutil.rmtree(inductor_cache, ignore_errors=True)
    return {"path": name, "env": env_extra, "exit": proc.returncode, "summary": summary[0], "failed": failed,
            "seconds": round(time.monotonic() - start), "rows": rows}


def worst_by_test(results: list[dict]) -> dict[str, dict]:
    """test -> {path: worst ratio over its comparisons and kinds, "kind": the kind of the overall worst}."""
    out: dict[str, dict] = {}
    for result in results:
        for row in result["rows"]:
            ratio, kind = max((row[k], k) for k in ("loss", "grad_norm", "weight"))
            entry = out.setdefault(row["test"], {})
            if ratio >= entry.get(result["path"], -1.0):
                entry[result["path"]] = ratio
            if ratio >= entry.get("worst", -1.0):
                entry["worst"], entry["kind"] = ratio, kind
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="test files (default: every layout-equality file)")
    parser.add_argument("--paths", default="", help="comma-separated subset of: " + ", ".join(available_paths()))
    parser.add_argument("--limit", type=float, default=0.5, help="largest allowed ratio of difference to bound")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--top", type=int, default=15, help="tests listed, worst first")
    parser.add_argument("-k", default="", help="pytest -k expression")
    parser.add_argument("--workers", type=int, default=1,
                        help="pytest workers per path (pytest-xdist, whole files per worker, as the suite runs)")
    args = parser.parse_args(argv)
    paths = available_paths()
    if args.paths:
        unknown = sorted(set(args.paths.split(",")) - set(paths))
        if unknown:
            parser.error(f"--paths: {', '.join(unknown)} not on this CPU; it has {', '.join(paths)}")
        paths = {name: paths[name] for name in args.paths.split(",")}
    files = args.files or layout_test_files()
    pytest_args = (["-k", args.k] if args.k else []) + (["-n", str(args.workers), "--dist", "loadfile"]
                                                        if args.workers > 1 else [])
    results = []
    for name, env in paths.items():
        result = run_path(name, env, files, pytest_args)
        print(f"{name:>18}: {result['summary']} ({result['seconds']} s, {len(result['rows'])} comparisons)", flush=True)
        for line in result["failed"]:
            print(f"{'':>20}{line}")
        results.append(result)
    worst = worst_by_test(results)
    names = list(paths)
    print(f"\nworst ratio of difference to bound, by test ({len(worst)} tests; limit {args.limit}):")
    print("  " + "  ".join(f"{n:>16}" for n in names) + "  kind       test")
    for test, entry in sorted(worst.items(), key=lambda kv: -kv[1]["worst"])[: args.top]:
        print("  " + "  ".join(f"{entry.get(n, float('nan')):>16.3f}" for n in names) + f"  {entry['kind']:<10} {test}")
    over = {t: e for t, e in worst.items() if e["worst"] > args.limit}
    if args.json:
        Path(args.json).write_text(json.dumps({"paths": paths, "results": [{k: v for k, v in r.items() if k != "rows"}
                                                                          for r in results], "worst": worst}, indent=1))
    bad = [r["path"] for r in results if r["exit"] != 0]
    if bad or over:
        print(f"\nFAILED: tests failed under {', '.join(bad) or 'no path'}; {len(over)} tests above {args.limit}")
        return 1
    largest = max((e["worst"] for e in worst.values()), default=0.0)
    print(f"\nok: every test passed under {', '.join(names)}; largest ratio {largest:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
