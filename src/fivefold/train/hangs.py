"""Hangs that name their cause: which collective, in which group, and which ranks never entered it.

A collective timeout only tells a rank that its peers did not answer. PyTorch's flight recorder
(TORCH_FR_BUFFER_SIZE, on for every launch: worker sets it before the process group exists) keeps
each rank's last collectives with their group and a per-group sequence number. When a rank times
out it writes a record to the run folder's `hangs/` (its flight recorder, its groups' ranks, the
step and its Python stack), and a watchdog writes the Python stack of every thread of a rank whose
step has lasted longer than the timeout (a rank that hangs outside any collective). The launcher
then compares the records: in the group where some ranks issued a collective that others never
did, those others are the ones to look at.

On CUDA, NCCL's own flight recorder can dump on timeout too (TORCH_NCCL_TRACE_BUFFER_SIZE=2000,
TORCH_NCCL_DUMP_ON_TIMEOUT=1, TORCH_FR_DUMP_TEMP_FILE=<folder>/nccl_trace_rank_), read with
`torch.distributed.flight_recorder` (docs/launching.md); the CPU tests need neither.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path

from fivefold import torch_internals
from fivefold.config.file_errors import guarded, os_problem
from fivefold.train.faults import ERROR_DIR

FLIGHT_RECORDER_ENTRIES = "2000"
FOLDER = "hangs"


def enable_flight_recorder() -> None:
    """Before the process group exists: its collectives are recorded from the first one on."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)


def folder(log_dir: str) -> Path | None:
    """Where the records go: the run folder's hangs/, else our launcher's error folder (None: nowhere)."""
    base = log_dir or os.environ.get(ERROR_DIR)
    return Path(base) / FOLDER if base else None


class StackWatchdog:
    """Writes every thread's Python stack to hangs/stack-rank<R>.txt when a step has lasted longer
    than `after_s`, half the collective timeout, so that a rank hung outside any collective has
    written it before its peers time out (re-armed at each step; faulthandler's own thread writes,
    wherever the main thread is stuck)."""

    def __init__(self, where: Path | None, rank: int, after_s: float):
        self.file = None
        self.after_s = after_s
        if where is not None:
            self.path = where / f"stack-rank{rank}.txt"
            with guarded(self.path, "write", "or set log.dir to another folder"):
                where.mkdir(parents=True, exist_ok=True)
                self.file = open(self.path, "w")

    def __enter__(self) -> "StackWatchdog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def step_started(self) -> None:
        if self.file is not None:
            self.file.seek(0)
            self.file.truncate()  # only the stack of a step that is stuck now
            faulthandler.dump_traceback_later(self.after_s, repeat=False, file=self.file, exit=False)

    def close(self) -> None:
        """At the end of a run that did not hang: nothing is left behind."""
        if self.file is not None:
            faulthandler.cancel_dump_traceback_later()
            self.file.close()
            self.file = None
            if self.path.stat().st_size == 0:
                self.path.unlink()
                try:
                    self.path.parent.rmdir()  # only when no other rank's file is left in it
                except OSError:
                    pass


def write_record(where: Path | None, rank: int, step: int, err: BaseException) -> None:
    """A timed-out rank's record: its flight recorder, its groups and where its Python code waited."""
    if where is None:
        return
    try:
        _write_record(where, rank, step, err)
    except OSError as failure:  # the timeout's own sentence is the report: it must not be lost to this
        problem = os_problem(where / f"rank{rank}.json", failure, "write hang record",
                             "or set log.dir to another folder to have the next hang named")
        print(f"warning: {problem}", file=sys.stderr, flush=True)


def _write_record(where: Path, rank: int, step: int, err: BaseException) -> None:
    where.mkdir(parents=True, exist_ok=True)
    try:
        entries, groups = torch_internals.flight_recorder()
    except Exception as failure:  # noqa: BLE001 - the timeout's own sentence still goes out
        entries, groups = [], {"error": str(failure)}
    record = {"rank": rank, "step": step, "time": time.time(), "error": str(err).splitlines()[0][:300],
              "stack": traceback.format_exception(err), "groups": groups,
              "entries": [{k: e.get(k) for k in ("process_group", "collective_seq_id", "profiling_name",
                                                 "input_sizes", "is_p2p", "time_created_ns")} for e in entries]}
    tmp = where / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, where / f"rank{rank}.json")


def _records(where: Path) -> dict[int, dict]:
    out = {}
    for path in where.glob("rank*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[record["rank"]] = record
    return out


def diagnose(where: Path | None) -> str | None:
    """One sentence from the ranks' records: the collective some ranks of a group waited in and
    the ranks of that group that never issued it; None when the records do not show one."""
    if where is None or not where.is_dir():
        return None
    records = _records(where)
    if not records:
        return None
    groups = {name: ranks for r in records.values() for name, ranks in r["groups"].items() if isinstance(ranks, list)}
    # The newest collective each reporting rank issued in each group: (sequence number, entry).
    last: dict[str, dict[int, tuple[int, dict]]] = {}
    for rank, record in records.items():
        for entry in record["entries"]:
            if entry.get("is_p2p"):
                continue
            name = entry["process_group"][0]
            seq = entry["collective_seq_id"]
            if seq >= last.setdefault(name, {}).get(rank, (-1, None))[0]:
                last[name][rank] = (seq, entry)
    findings = []
    for name, ranks in groups.items():
        issued = last.get(name, {})
        if not issued:
            continue
        top = max(seq for seq, _ in issued.values())
        waiting = sorted(r for r, (seq, _) in issued.items() if seq == top)
        behind = sorted(r for r in ranks if issued.get(r, (-1, None))[0] < top)
        if behind:
            entry = issued[waiting[0]][1]
            findings.append((entry["time_created_ns"], name, ranks, top, entry, waiting, behind))
    if not findings:
        return None
    _, name, ranks, top, entry, waiting, behind = min(findings)  # the first collective that stuck
    op = entry["profiling_name"].split(":")[-1]
    silent = [r for r in behind if r not in records]
    said = [r for r in behind if r in records]
    parts = []
    if silent:
        stacks = [str(where / f"stack-rank{r}.txt") for r in silent if (where / f"stack-rank{r}.txt").is_file()
                  and (where / f"stack-rank{r}.txt").stat().st_size]
        parts.append(f"rank{'s' if len(silent) > 1 else ''} {_list(silent)} never entered it and wrote no "
                     "timeout record (hung outside a collective, or died)"
                     + (f"; where it stood: {', '.join(stacks)}" if stacks else ""))
    if said:
        parts.append(f"rank{'s' if len(said) > 1 else ''} {_list(said)} never entered it (waiting in an "
                     "earlier collective)")
    step = records[waiting[0]]["step"]
    return (f"hang diagnosis: rank{'s' if len(waiting) > 1 else ''} {_list(waiting)} waited in {op} "
            f"#{top} of the group of ranks {_list(ranks)} (sizes {entry['input_sizes']}) during step {step}; "
            f"{'; '.join(parts)}; the records are in {where}")


def _list(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
