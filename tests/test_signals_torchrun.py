"""Ctrl-C under torchrun: one stop line, naming the torchrun line that resumes the run.

Ctrl-C in a terminal sends SIGINT to the foreground process group: torchrun's agent. Its
workers run in sessions of their own (torch.distributed.elastic starts them so), and the agent
forwards the signal to each; the workers finish the step, checkpoint it and stop together.
What the agent itself prints (its warnings and its SignalException traceback) is its own: see
docs/distributed.md.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from gspo.io.files import read_jsonl
from gspo.processes import distributed
from gspo.train import checkpoint as ckpt

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
LAUNCH = ["--standalone", "--nproc-per-node=2"]


@pytest.mark.slow
def test_ctrl_c_under_torchrun_says_once_how_to_resume(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", *LAUNCH, "-m", "gspo", "train", "--prompts-per-step", "4",
           "--group-size", "2", "--eval-size", "0", "--no-progress", "--steps", "100000", "--output-dir", str(run)]
    # a session of its own: the signal goes to torchrun's process group, as a terminal's Ctrl-C does
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                         start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None and not read_jsonl(run / "metrics.jsonl"):
            time.sleep(0.05)
        assert p.poll() is None, p.stderr.read()[-3000:]
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    done = len(read_jsonl(run / "metrics.jsonl"))
    assert ckpt.latest_checkpoint(run).name == f"step-{done:06d}"
    lines = [line for line in err.splitlines() if "interrupted by" in line]
    assert lines == [f"gspo train: interrupted by SIGINT after step {done}; checkpoint written; continue with: "
                     f"torchrun {' '.join(LAUNCH)} -m gspo train --resume {run}"], err[-3000:]


OWN = ["train", "--steps", "9", "--output-dir", "runs/a"]  # a worker's sys.argv[1:]


@pytest.mark.parametrize("launcher, expected", [
    # the console script, as /proc shows it (the interpreter from its #! line first)
    (["/venv/bin/python3", "/venv/bin/torchrun", "--nproc-per-node", "4", "-m", "gspo", *OWN],
     "torchrun --nproc-per-node 4 -m gspo train --resume 'runs/a b'"),
    (["/venv/bin/python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "gspo.cli", *OWN],
     "torchrun --standalone --nproc-per-node=2 -m gspo.cli train --resume 'runs/a b'"),
    (["torchrun", "--nnodes", "2", "--rdzv-endpoint", "h:29500", "gspo/cli.py", *OWN],
     "torchrun --nnodes 2 --rdzv-endpoint h:29500 gspo/cli.py train --resume 'runs/a b'"),
    ([], "torchrun --nproc-per-node 3 -m gspo train --resume 'runs/a b'"),  # no /proc: from the environment
    (["/bin/sh", "launch.sh"], "torchrun --nproc-per-node 3 -m gspo train --resume 'runs/a b'"),  # not torchrun's
])
def test_the_resume_line_under_torchrun_is_the_users_torchrun_line(monkeypatch, launcher, expected):
    monkeypatch.setattr(distributed, "_launcher_argv", lambda: launcher)
    monkeypatch.setattr(sys, "argv", ["/src/gspo/__main__.py", *OWN])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert distributed.command_line(["train", "--resume", "runs/a b"]) == expected
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # not under torchrun: gspo's own command
    assert distributed.command_line(["train", "--resume", "runs/a b"]) == "gspo train --resume 'runs/a b'"
