"""Start-up at scale: seconds and peak host memory to build rank 0 of each shipped large config in
one process (fake process group, `fivefold layout CONFIG --build`), against the rank's planned
bytes; and Hugging Face import/export peak memory against the model's size.

    OMP_NUM_THREADS=1 python benchmarks/startup.py [--configs llama3-70b,...] [--hf-gb 1.6] [--skip-hf]

Each measurement runs in its own subprocess (peak RSS = that process's ru_maxrss). A config whose
rank-0 share does not fit this machine's memory is reported as such, not run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b", "deepseek-v3-style", "deepseek-v3"]
GB = 1e9


def run(args: list[str], timeout: int = 1800) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def machine_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def planned_resident_bytes(config: str) -> int:
    """Parameters + ZeRO-1/2 master chunks of rank 0, from the planner (no build)."""
    sys.path.insert(0, str(ROOT / "src"))
    from fivefold.configure import load_config
    from fivefold.tools.rank_build import planned_state_bytes

    return planned_state_bytes(load_config(config), 0)["planned_resident_bytes"]


def build_rows(configs: list[str]) -> list[dict]:
    rows = []
    for name in configs:
        need = planned_resident_bytes(name)
        if need > 0.8 * machine_memory_bytes():
            rows.append({"config": name, "skipped": f"rank 0 holds {need / GB:.1f} GB; this machine has "
                                                    f"{machine_memory_bytes() / GB:.1f} GB"})
            continue
        done = run([sys.executable, "-m", "fivefold.cli", "layout", name, "--build",
                    "--rank", "0", "--json"])
        if done.returncode != 0:
            rows.append({"config": name, "failed": done.stderr.strip().splitlines()[-1]})
            continue
        report = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append({"config": name, **report,
                     "param_vs_planned": report["param_bytes"] / report["planned_param_bytes"],
                     "peak_vs_resident": report["peak_rss_bytes"] / report["resident_bytes"]})
    return rows


CHILD = """
import json, resource, sys, time
from fivefold.tools.convert import convert
start = time.perf_counter()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
convert(sys.argv[1], sys.argv[2])
print(json.dumps({"seconds": time.perf_counter() - start, "baseline_rss_bytes": before,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def hf_rows(target_gb: float) -> list[dict]:
    """A random bf16 Llama of about `target_gb`, written tensor by tensor, converted both ways."""
    sys.path.insert(0, str(ROOT / "src"))
    from fivefold.models.hf.stream import make_random_hf_llama

    hidden, ffn, vocab = 2048, 8192, 32768
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn
    layers = max(1, int((target_gb * GB / 2 - 2 * vocab * hidden) / per_layer))
    with tempfile.TemporaryDirectory() as tmp:
        src, ours, back = Path(tmp) / "hf", Path(tmp) / "ours", Path(tmp) / "back"
        make_random_hf_llama(src, hidden=hidden, layers=layers, heads=16, kv_heads=16, ffn=ffn, vocab=vocab)
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        rows = []
        for label, a, b in (("import hf -> fivefold", src, ours), ("export fivefold -> hf", ours, back)):
            done = run([sys.executable, "-c", CHILD, str(a), str(b)])
            if done.returncode != 0:
                rows.append({"step": label, "failed": done.stderr.strip().splitlines()[-1]})
                continue
            m = json.loads(done.stdout.strip().splitlines()[-1])
            grew = m["peak_rss_bytes"] - m["baseline_rss_bytes"]
            rows.append({"step": label, "model_bytes": size, **m, "growth_vs_model": grew / size,
                         "bound_bytes": 0.25 * size + 2**30})
        rows.append({"step": "export files", "files": sorted(p.name for p in back.iterdir())[:4]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--hf-gb", type=float, default=1.6)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores, {machine_memory_bytes() / GB:.1f} GB")
    for row in build_rows([c for c in args.configs.split(",") if c]):
        if "param_bytes" in row:
            print(f"{row['config']:18s} rank 0/{row['world_size']}: {row['seconds']:6.1f} s  "
                  f"params {row['param_bytes'] / GB:6.2f} GB (planned x{row['param_vs_planned']:.4f})  "
                  f"resident {row['resident_bytes'] / GB:6.2f} GB  peak RSS {row['peak_rss_bytes'] / GB:6.2f} GB "
                  f"(x{row['peak_vs_resident']:.3f} of resident)")
        else:
            print(f"{row['config']:18s} {row.get('skipped') or row.get('failed')}")
    if not args.skip_hf:
        for row in hf_rows(args.hf_gb):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
