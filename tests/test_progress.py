"""Progress a user can see: `gspo compare` says each run's steps as they happen (a line per 10% of
them, after the run's name) and each run's end when it ends, runs side by side or one at a time;
`gspo eval` and `gspo train`'s own evaluations say how far they are when not on a terminal."""

import math
import os
import re
import subprocess
import sys
import time

import pytest

from gspo.cli import main
from gspo.lab.jobs import in_processes

TINY = ["--model", "tiny", "--eval-size", "8", "--prompts-per-step", "4", "--group-size", "2"]


def gspo(*args):
    """The CLI as a user runs it, its output a pipe (not a terminal)."""
    return subprocess.run([sys.executable, "-m", "gspo", *args], capture_output=True, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


@pytest.mark.slow  # starts a process
def test_in_processes_says_each_call_as_it_ends_and_keeps_the_results_in_order():
    ended = []
    results = in_processes([("slow", time.sleep, (3.0,)), ("fast", time.sleep, (0.1,)), ("pow", math.pow, (2.0, 3.0))],
                           2, log=ended.append, done=lambda label, result: ended.append((label, result)))
    assert results == [None, None, 8.0]  # in the order asked
    assert ended == [("fast", None), ("pow", 8.0), ("slow", None)]  # in the order they ended


@pytest.mark.slow  # starts a process
def test_in_processes_first_failure_is_said_then_raised():
    said = []
    with pytest.raises(ValueError, match="math domain error"):
        in_processes([("fine", time.sleep, (0.5,)), ("bad", math.sqrt, (-1.0,))], 2, log=said.append,
                     done=lambda label, result: said.append(f"{label} done"))
    assert said[-1] == "[compare] bad: failed"  # the running call finished first, and was said to
    assert said == ["fine done", "[compare] bad: failed"]


@pytest.mark.slow
def test_compare_side_by_side_shows_each_runs_progress_as_it_happens(tmp_path):
    # a: 2 steps, b: 16; side by side from the start, so a ends well before b's last step
    r = gspo("compare", "--configs", "a:steps=2", "b:steps=16", "--seeds", "0", "--jobs", "2", *TINY,
             "--output-dir", str(tmp_path / "cmp"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    runs = [line for line in lines if not re.match(r"\s*[ab]: accuracy|report: ", line)]  # the table at the end
    done = {run: i for i, line in enumerate(runs) for run in "ab"
            if line.startswith(f"[compare] {run} seed 0: done in ")}
    b_last = max(i for i, line in enumerate(runs) if line.startswith("[b seed 0] "))
    assert done["a"] < b_last < done["b"]  # a's end said when a ended, before b's last line: not after every run
    step = re.compile(r"\[(a|b) seed 0\] step (\d+)/(\d+) \((\d+)%\)  reward [\d.]+  clip/frac \S+  .*\d+ s$")
    steps = {(m[1], int(m[2])): i for i, line in enumerate(runs) if (m := step.match(line))}
    assert {s for run, s in steps if run == "a"} == {1, 2}  # 2 steps: a line each (10% of 2 is under one)
    assert {s for run, s in steps if run == "b"} == set(range(1, 17))
    assert "[a seed 0] step 1/2 (50%)" in r.stdout and "[b seed 0] step 16/16 (100%)" in r.stdout
    assert done["a"] > steps[("a", 2)] and done["b"] > steps[("b", 16)]
    prefix = re.compile(r"\[(compare|a seed 0|b seed 0)\] ")
    for line in runs:  # every line whole, from one writer: one prefix, at its start
        assert prefix.match(line) and len(prefix.findall(line)) == 1, line
    for run in "ab":  # its evaluations before and after, as `gspo train` logs them
        assert sum(line.startswith(f"[{run} seed 0] eval before 8/8 problems (100%)") for line in runs) == 1
        assert sum(line.startswith(f"[{run} seed 0] eval after 8/8 problems (100%)") for line in runs) == 1
        assert f"[{run} seed 0] plan: " in r.stdout and f"[{run} seed 0]   decode: " in r.stdout  # each line named


@pytest.mark.slow
def test_compare_one_at_a_time_logs_lines_even_on_a_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: lines all the same, no bar
    assert main(["compare", "--configs", "gspo", "--seeds", "0", "--jobs", "1", "--steps", "2", *TINY,
                 "--output-dir", str(tmp_path / "cmp")]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"^\[gspo seed 0\] step 1/2 \(50%\)  reward [\d.]+  clip/frac \S+  \d+ s$", out, re.M)
    assert re.search(r"^\[gspo seed 0\] step 2/2 \(100%\)", out, re.M)
    assert re.search(r"^\[compare\] gspo seed 0: done in \d+ s$", out, re.M)
    assert "gspo train (gspo)" not in err and "gspo eval" not in err  # no tqdm bar


@pytest.mark.slow
def test_eval_logs_its_progress_when_not_on_a_terminal():
    r = gspo("eval", "--model", "tiny", "--eval-size", "512", "--k", "0")  # 4 batches of 128
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("eval ")]
    got = [re.fullmatch(r"eval (\d+)/512 problems \((\d+)%\)  \d+ s", line).groups() for line in lines]
    assert got == [("128", "25"), ("256", "50"), ("384", "75"), ("512", "100")]  # on stderr, as they happen
    assert r.stdout.count("\n") == 1 and '"n": 512' in r.stdout  # stdout: the result alone

    r = gspo("eval", "--model", "tiny", "--eval-size", "256", "--k", "0", "--no-progress")
    assert r.returncode == 0 and "problems" not in r.stderr


@pytest.mark.slow
def test_train_logs_its_evaluations_before_and_after_once(tmp_path):
    r = gspo("train", *TINY, "--steps", "2", "--output-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split("  ")[0] for line in lines if line.startswith(("eval ", "step "))] == \
        ["eval before 8/8 problems (100%)", "step 1/2 (50%)", "step 2/2 (100%)", "eval after 8/8 problems (100%)"]


@pytest.mark.slow
def test_on_a_terminal_gspo_train_shows_a_bar_named_by_its_algorithm(tmp_path):
    # stderr a terminal (a pseudo-terminal here): a tqdm bar titled "gspo train (ALGORITHM)" that
    # reaches the run's steps, and no per-10% log lines
    import fcntl
    import pty
    import struct
    import termios

    main_fd, sub_fd = pty.openpty()
    fcntl.ioctl(sub_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 x 100: a bar has room
    p = subprocess.Popen([sys.executable, "-m", "gspo", "train", *TINY, "--steps", "2", "--algorithm", "grpo",
                          "--output-dir", str(tmp_path / "run")], stdout=subprocess.DEVNULL, stderr=sub_fd,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(sub_fd)
    out = b""
    while True:
        try:
            chunk = os.read(main_fd, 4096)
        except OSError:  # the child closed the terminal: it ended
            break
        if not chunk:
            break
        out += chunk
    assert p.wait(timeout=300) == 0, out[-2000:]
    text = out.decode(errors="replace")
    assert "gspo train (grpo)" in text and "2/2" in text, text[-2000:]
    assert "step 1/2 (50%)" not in text  # the log lines are for pipes
