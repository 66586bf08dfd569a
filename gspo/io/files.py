"""The files a run writes, each whole or not at all: atomic rewrites and JSON-lines logs.

    atomic_write_text(run_dir / "summary.json", text)     # a temporary file, fsync'd, renamed over
    append_jsonl(run_dir / "metrics.jsonl", [row])        # NaN and inf written as null
    rows = read_jsonl(run_dir / "metrics.jsonl")          # a line cut short by a kill ends the log

gspo.train.checkpoint (the run directory and its checkpoints) and gspo.io.reporting (metrics,
samples) both write through these; checkpoint re-exports them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def json_clean(obj):
    """NaN and inf are not JSON: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_clean(v) for v in obj]
    return obj


def append_jsonl(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(json_clean(row)) + "\n")
        f.flush()


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut short by a kill: everything from here on is discarded
    return rows


def trim_jsonl(path: Path, max_step: int) -> None:
    """Keep only rows with step <= max_step (rewritten atomically)."""
    if not path.exists():
        return
    rows = [r for r in read_jsonl(path) if r.get("step", 0) <= max_step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
