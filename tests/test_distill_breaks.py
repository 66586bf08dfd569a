"""Inputs the distillation code was not built for (a reviewer's): each test one defect found."""

from __future__ import annotations

import json

from gspo.cli import main

FAST = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "8", "--eval-size", "8", "--no-progress"]


def test_a_context_field_only_some_rows_have_is_refused_at_the_start(tmp_path, capsys, monkeypatch):
    # --teacher-context was checked against the first example only: a dataset whose field is missing
    # from later rows crashed mid-run with a KeyError traceback, after the run directory was written
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "partial.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1),
                                        **({"hint": f"it is {i + 1}"} if i % 2 == 0 else {})}) + "\n"
                            for i in range(40)))
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "3", "--dataset", str(data), "--prompt-column", "question",
                 "--reward", "exact_match", "--teacher", "self", "--teacher-context", " hint: {hint}",
                 "--output-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "teacher_context: names the field 'hint'" in err[0], err
    assert not run.exists()
