"""Shared pieces of the benchmarks: model configurations, peak memory, timing helpers, `gspo train` runs.

Model configurations (all Qwen3, random weights except `tiny`, written to a cache folder
with save_pretrained and loaded like any user model):

| name | layers | hidden | vocab | parameters |
| --- | --- | --- | --- | --- |
| tiny | 4 | 128 | 20 | 0.8M (the built-in model, trained) |
| mid | 8 | 512 | 32,000 | ~35M |
| 0.5b | 24 | 1024 | 151,936 | ~0.6B (GPU) |

The tokenizer of `mid` and `0.5b` has the built-in character vocabulary first (so the
arithmetic prompts tokenize the same way) padded with placeholder tokens up to the vocabulary
size, so the LM head has the real cost.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CACHE = Path(os.environ.get("GSPO_BENCH_CACHE", Path.home() / ".cache" / "gspo-bench"))

CONFIGS = {
    "mid": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, vocab=32_000),
    "0.5b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab=151_936),
}


def padded_char_tokenizer(vocab_size: int):
    """The built-in character tokenizer, padded with placeholder tokens to `vocab_size`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from gspo.models.tiny import CHARS, SPECIAL

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for c in CHARS:
        vocab[c] = len(vocab)
    i = 0
    while len(vocab) < vocab_size:
        vocab[f"<x{i}>"] = len(vocab)
        i += 1
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def model_path(name: str) -> str:
    """A model directory for configuration `name` (built once and cached)."""
    if name == "tiny":
        return "tiny"
    if name not in CONFIGS:
        raise SystemExit(f"unknown model configuration {name!r}; choose tiny, {', '.join(CONFIGS)}")
    path = CACHE / name
    if not (path / "config.json").exists():
        import torch
        import transformers
        from transformers import Qwen3ForCausalLM

        from gspo.models.tiny import tiny_config

        transformers.utils.logging.disable_progress_bar()
        kw = dict(CONFIGS[name])
        vocab = kw.pop("vocab")
        tok = padded_char_tokenizer(vocab)
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(tiny_config(vocab, max_position_embeddings=4096, **kw))
        # written beside it, then renamed into place: a build killed half-way, or two built at once
        # (benchmarks/gate.py in CI, a test), never leaves a folder with a config and no weights
        tmp = CACHE / f".{name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            tmp.rename(path)
        except OSError:  # another process put its build there first
            shutil.rmtree(tmp, ignore_errors=True)
            if not (path / "config.json").exists():
                raise
    return str(path)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def peak_rss_mb() -> float:
    """The process's peak resident memory so far, in MiB (Linux reports KiB)."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def median(xs):
    return statistics.median(xs) if xs else float("nan")


class Timer:
    def __enter__(self):
        self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t


def variant_dir(out: Path, name: str) -> Path:
    """A variant's run folder under `out`: its name with every other character than a letter or digit a dash."""
    return out / "".join(c if c.isalnum() else "-" for c in name.replace("=", "")).replace("--", "-")


def train_variant(name: str, cmd: list[str], run_dir: Path, env: dict | None = None):
    """One `gspo train` command line (cmd[0] the interpreter) in a process of its own, said as `[name] ...`:
    (summary.json, the metrics rows of its steps, its seconds), or None when it failed (the tail of its
    output said on stderr)."""
    print(f"[{name}] {' '.join(shlex.quote(c) for c in cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        print(f"[{name}] failed (exit code {proc.returncode}) after {seconds:.0f}s:\n{proc.stdout[-3000:]}\n"
              f"{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
        return None
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return summary, [r for r in rows if "time/step_seconds" in r], seconds


def mean_of(rows: list[dict], key: str):
    """The mean of `key` over the rows that log it; None where none does (a synchronous run logs no async/...)."""
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else None
