"""scripts/gpu_check.sh and scripts/make_qwen_shaped.py: the GPU release check, run here as its CPU dry run.

The dry run (`--cpu`) is the GPU pipeline with a tiny Qwen-shaped model, 2 steps, gspo's own
sampler and 2 torchrun processes (about 30 s on 2 cores); what only a GPU shows (vLLM, CUDA
memory, the bf16 gap at 0.5B) is in docs/gpu.md.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "scripts"))

import make_qwen_shaped  # noqa: E402


def run_check(out: Path, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GSPO_PY": sys.executable, **env_extra}
    env.pop("GSPO_GPU_CHECK_CPU", None)
    return subprocess.run(["bash", str(SCRIPT), "--cpu", "--out", str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def table_rows(md: str) -> dict[str, dict[str, str]]:
    """The Markdown table of gpu_check.md as {run: {column: cell}}."""
    lines = [line for line in md.splitlines() if line.startswith("|")]
    cols = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(cols, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]
    return {r["run"]: r for r in rows}


def seconds(cell: str) -> float:
    assert cell.endswith(" s"), cell
    return float(cell[:-2])


def test_default_shapes_are_qwen25_05b():
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):  # shapes only: no 2 GB of random weights
        model = Qwen2ForCausalLM(make_qwen_shaped.qwen2_config(**make_qwen_shaped.QWEN25_05B))
    # Qwen/Qwen2.5-0.5B's parameter count: 151936·896 (tied embeddings) + 24 layers + the final norm
    assert sum(p.numel() for p in model.parameters()) == 494_032_768
    assert model.config.num_key_value_heads == 2 and model.config.tie_word_embeddings


def test_even_token_share_varies_where_length_would_not():
    # every completion of a random model runs to max_new_tokens: 4 tokens here, a length reward is flat
    ids = [[2, 4, 6, 7], [1, 3, 5, 8], [2, 2, 2, 2]]
    assert make_qwen_shaped.even_token_share(["", "", ""], completion_ids=ids) == [0.75, 0.25, 1.0]


def test_tokenizer_covers_the_vocabulary():
    tok = make_qwen_shaped.build_tokenizer(300)
    assert len(tok) == 300 and tok.eos_token_id == 1 and tok.pad_token_id == 0
    assert tok.decode([299]) == "<t299>"  # any id a random model samples decodes
    assert tok.decode(tok("12+7=")["input_ids"]) == "12+7="
    chat = tok.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_cpu_dry_run_prints_the_summary_table(tmp_path):
    proc = run_check(tmp_path / "check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: all stages passed" in proc.stdout
    md = (tmp_path / "check" / "gpu_check.md").read_text()
    assert md in proc.stdout  # printed as written, ready to paste into docs/gpu.md
    assert "tests: SKIPPED (CPU dry run)" in md and "single: ok" in md and "torchrun: ok" in md
    assert "decode: ok" in md and "| layers static |" in md and "no CUDA graphs: the model is on cpu" in md
    rows = table_rows(md.split("decode steps (benchmarks/decode_graphs.py):")[0])  # the runs' table
    assert set(rows) == {"single", "torchrun"}
    assert rows["single"]["processes"] == "1" and rows["torchrun"]["processes"] == "2 (fsdp)"
    for r in rows.values():
        assert r["engine"] == "hf" and r["dtype / params"] == "bfloat16 / float32"
        assert r["old_logp"] == "recompute"  # bf16 compute: auto recomputes, so the gap is measured
        assert r["packing"] == "false" and r["micro-batch tokens"] == "0 (whole minibatch)"
        assert r["steps"] == "2" and r["batch"] == "4x4x16"
        assert seconds(r["first step"]) > 0 and seconds(r["median step"]) > 0
        rollout, update = r["median rollout / update"].removesuffix(" s").split(" / ")
        assert float(rollout) > 0 and float(update) > 0
        assert r["peak allocated (torch)"] == "n/a on CPU" and r["peak used (nvidia-smi)"] == "n/a on CPU"
        assert 0 < float(r["mismatch/token_abs"]) < 0.1  # bf16 against fp32 recomputation: small, never 0
        assert float(r["mismatch/seq_log_ratio"]) > 0
        assert seconds(r["wall"]) > 0
    assert "2 layers, hidden 64" in md


@pytest.mark.slow
def test_a_failing_stage_fails_the_check_and_is_named(tmp_path):
    proc = run_check(tmp_path / "check", "--stages", "single", "--", "--no-such-option")
    assert proc.returncode == 1
    assert "gpu_check: stage single: FAILED" in proc.stdout
    assert "gpu_check: FAILED stages: single" in proc.stdout
    assert ("(no training run finished in this invocation: no table)"
            in (tmp_path / "check" / "gpu_check.md").read_text())


@pytest.mark.slow
def test_one_gpu_skips_the_torchrun_stage(tmp_path):
    # the first GPU run (H100, 2026-11-26) had one GPU: torchrun started 1 process with --parallel fsdp,
    # which gspo refuses ("needs several processes"), and the check failed on a machine that was fine
    proc = run_check(tmp_path / "check", "--stages", "torchrun", GSPO_GPU_CHECK_NPROC="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: stage torchrun: SKIPPED (1 process: --parallel fsdp shards over 2 or more" in proc.stdout
    assert "needs several processes" not in proc.stdout + proc.stderr  # no run was started
    md = (tmp_path / "check" / "gpu_check.md").read_text()
    assert "(no training run finished in this invocation: no table)" in md
