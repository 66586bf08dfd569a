"""Rollouts on a vLLM server: synchronous against asynchronous sampling (--max-staleness K), with the
weight sync waiting for the generations under way or aborting them (--partial-rollouts).

    .venv-vllm/bin/python benchmarks/server_rollouts.py                     # chain task, 20 steps, seed 0
    .venv-vllm/bin/python benchmarks/server_rollouts.py --steps 40 --seed 1 --eval-size 200
    .venv-vllm/bin/python benchmarks/server_rollouts.py --extra "--max-new-tokens 120"
    .venv-vllm/bin/python benchmarks/server_rollouts.py --variants "partial K=2,sync"   # a subset, in this order
    VLLM_API_KEY=... .venv-vllm/bin/python benchmarks/server_rollouts.py --vllm-server-url http://127.0.0.1:8765
    taskset -c 0 .venv-vllm/bin/python benchmarks/server_rollouts.py --vllm-server-url URL --model DIR
                                   # the trainer on core 0, a server started with `taskset -c 1` on core 1
                                   # (a server on hardware of its own; docs/server.md has both layouts' figures)

It needs the vLLM environment (docs/server.md). Unless --vllm-server-url is given it starts ONE
vLLM OpenAI server itself (127.0.0.1, a free port, a random API key in the environment of the
server and of the runs, its own process group), serving a copy of gspo/assets/tiny-long (the
long-answer model: 55-217-token answers on `--task chain`) in a temporary folder, with the CPU
command of docs/server.md (OMP_NUM_THREADS=2; on a GPU machine without the CPU-only flags); it
waits for GET /health, sends one warm-up completion, and stops the whole group at the end
(finished, failed, Ctrl-C or SIGTERM) unless --keep-server. With --vllm-server-url the runs use
that server (its key: VLLM_API_KEY) and train the model it serves (`--model`, default: the id
/v1/models names, which must then be a directory here).

Every variant is one `python -m gspo train --task chain --rollout-engine vllm-server` against
that server, in a process of its own, with the same seed, steps, --threads (default 1: the
trainer's torch threads; the server has its own), --prompts-per-step 8 --group-size 4 and the
task's --max-new-tokens (240). Variants:

- sync: --max-staleness 0: each step syncs the weights, then samples its batch and waits for it
  (sampling and training take turns);
- async K=1: --max-staleness 1: a thread of the trainer's process samples batch t+1 on the server
  while the trainer trains on batch t; the weight sync at the start of each step waits for the
  generations under way (vLLM's /pause?mode=wait);
- partial K=1: --max-staleness 1 --partial-rollouts: the same, but the sync aborts the
  generations under way and each continues under the new weights from where it stopped (its
  tokens carry the version that sampled each);
- async K=2, partial K=2: the same with --max-staleness 2 (two batches asked for ahead).

Printed, one row per variant, from <out>/<variant>/summary.json and metrics.jsonl (means over
steps 2.., step 1 holding the start of the pipeline, unless said otherwise):

- wall s: the run's wall_seconds (model load, the server checks, evaluation, all steps);
- s/step: time/step_seconds;
- tok/s: completion tokens per second, time/tokens_per_second;
- idle s/step: async/trainer_idle_seconds, the trainer waiting for its batch after the sync;
- sync s/step: async/weight_sync_seconds, the weight sync at the start of the step, with (wait
  mode) the wait for the generations under way; "-" for sync, whose sync is inside its rollout;
- spanning: async/spanning_rows, the share of a batch's completions sampled by more than one
  policy version (partial rollouts that crossed a sync; 0 in wait mode);
- stale: async/staleness_mean over all steps (policy versions behind, per completion token);
- overlap: async/overlap, the share of a batch's sampling time the trainer did not wait for;
- rollout, prepare, update s/step: time/rollout_seconds (sync + sampling, or sync + waiting for
  the batch), time/prepare_seconds (scoring the batch into tensors, and the old log-probs: under
  --max-staleness K >= 1 a forward pass of the weights that train it, docs/async.md) and
  time/update_seconds (the optimizer updates), which add up to s/step;
- acc: held-out greedy accuracy before -> after (+points), with --eval-size > 0, else "-";
- speed: the sync run's s/step divided by this one's (>1: faster).

The async/... columns are "-" for sync, which logs none. Exits non-zero if a variant fails. The
runs stay in --out (default: a fresh temporary folder); the server's log is <out>/vllm-server.log.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from common import mean_of, train_variant, variant_dir

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "gspo" / "assets" / "tiny-long"
COMMON = ["--task", "chain", "--rollout-engine", "vllm-server", "--prompts-per-step", "8", "--group-size", "4"]

VARIANTS = {
    "sync": ["--max-staleness", "0"],
    "async K=1": ["--max-staleness", "1"],
    "partial K=1": ["--max-staleness", "1", "--partial-rollouts"],
    "async K=2": ["--max-staleness", "2"],
    "partial K=2": ["--max-staleness", "2", "--partial-rollouts"],
}


# --- the server --------------------------------------------------------------------------------


def free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != 8777:  # someone else's, on the machine this was written on
            return port


def call(url: str, path: str, key: str | None, body: dict | None = None, timeout: float = 5.0):
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    return json.loads(text) if text.strip() else None


def _die_with_parent() -> None:  # in the child: end when this process does (Linux), even on SIGKILL
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class Server:
    """One vLLM OpenAI server serving `model_dir`, in a process group of its own; told to end with this
    process (PR_SET_PDEATHSIG) unless `keep`."""

    def __init__(self, model_dir: Path, log: Path, keep: bool = False, timeout: float = 600.0):
        self.key, self.port = secrets.token_urlsafe(32), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--seed", "0",
                "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching"]
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_API_KEY=self.key)
        if not _cuda():
            env.update(OMP_NUM_THREADS="2", VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"))
            argv += ["--no-enable-chunked-prefill", "--enforce-eager", "--max-num-batched-tokens", "2048"]
        else:
            argv += ["--gpu-memory-utilization", "0.3"]
        self.log = log
        print(f"[server] starting on {self.url} (log: {log})", flush=True)
        t0 = time.perf_counter()
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True,
                                         preexec_fn=None if keep else _die_with_parent)
        try:  # not yet the caller's to stop: stopped here if it never answers (or on Ctrl-C meanwhile)
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - t0
        print(f"[server] healthy after {self.start_seconds:.0f}s", flush=True)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the vLLM server exited ({self.proc.returncode}) before it answered; see {self.log}")
            try:
                call(self.url, "/health", None)
                return
            except (OSError, urllib.error.URLError, ValueError):
                if time.monotonic() > deadline:
                    raise SystemExit(f"the vLLM server did not answer /health within {timeout:g} s; "
                                     f"see {self.log}") from None
                time.sleep(1.0)

    def stop(self) -> None:
        """SIGTERM to the whole group (the API server and vLLM's engine processes), then SIGKILL."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # an engine process left in the group once the API server has gone
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def warm_up(url: str, key: str | None, model: str) -> None:
    """One short completion, so that the first variant does not pay the server's first request."""
    try:
        call(url, "/v1/completions", key, {"model": model, "prompt": "347(+68)=", "max_tokens": 16,
                                           "temperature": 1.0, "seed": 0}, timeout=120)
    except (OSError, urllib.error.URLError, ValueError) as e:
        print(f"[server] warm-up request failed ({e}); going on", file=sys.stderr, flush=True)


# --- the runs ----------------------------------------------------------------------------------


def run_variant(name: str, flags: list[str], args, out: Path, url: str, model: str, env: dict) -> dict:
    run_dir = variant_dir(out, name)
    cmd = [sys.executable, "-m", "gspo", "train", "--model", model, *COMMON, "--vllm-server-url", url,
           "--seed", str(args.seed), "--threads", str(args.threads), "--steps", str(args.steps),
           "--eval-size", str(args.eval_size), "--output-dir", str(run_dir), "--no-progress", *flags,
           *shlex.split(args.extra)]
    ran = train_variant(name, cmd, run_dir, env)
    if ran is None:
        return {"name": name, "failed": True}
    summary, rows, seconds = ran
    print(f"[{name}] done in {seconds:.0f}s", flush=True)
    later = rows[1:] or rows

    def mean(key, rs=later):
        return mean_of(rs, key)

    return {
        "name": name, "failed": False, "wall": summary["wall_seconds"],
        "per_step": mean("time/step_seconds"), "tok_s": mean("time/tokens_per_second"),
        "idle": mean("async/trainer_idle_seconds"), "sync": mean("async/weight_sync_seconds"),
        "spanning": mean("async/spanning_rows"), "stale": mean("async/staleness_mean", rows),
        "overlap": mean("async/overlap"), "rollout": mean("time/rollout_seconds"),
        "prepare": mean("time/prepare_seconds"),
        "update": mean("time/update_seconds"),
        "before": (summary.get("eval_before") or {}).get("accuracy"),
        "after": (summary.get("eval_after") or {}).get("accuracy"),
    }


def table(results: list[dict]) -> str:
    head = ("| variant | wall s | s/step | tok/s | idle s/step | sync s/step | spanning | stale | overlap | "
            "rollout s/step | prepare s/step | update s/step | acc before -> after | speed |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    base = next((r for r in results if r["name"] == "sync" and not r["failed"]), None)

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in results:
        if r["failed"]:
            lines.append(f"| {r['name']} | failed |" + " |" * (head.count("|") - 3))
            continue
        speed = f"{base['per_step'] / r['per_step']:.2f}x" if base else "-"
        acc = ("-" if r["before"] is None or r["after"] is None or r["before"] != r["before"] else
               f"{100 * r['before']:.1f}% -> {100 * r['after']:.1f}% ({100 * (r['after'] - r['before']):+.1f})")
        lines.append(f"| {r['name']} | {r['wall']:.1f} | {r['per_step']:.2f} | {r['tok_s']:.0f} | "
                     f"{f(r['idle'], '.2f')} | {f(r['sync'], '.2f')} | {f(r['spanning'], '.2f')} | "
                     f"{f(r['stale'], '.2f')} | {f(r['overlap'], '.2f')} | {r['rollout']:.2f} | {r['prepare']:.2f} | "
                     f"{r['update']:.2f} | "
                     f"{acc} | {speed} |")
    return "\n".join(lines)


def _terminated(signum, frame):  # SIGTERM: unwind like Ctrl-C, so that the server is stopped
    raise KeyboardInterrupt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for the runs (default: a fresh temporary folder)")
    p.add_argument("--extra", default="", help="more gspo train flags for every variant, one string")
    p.add_argument("--eval-size", type=int, default=0, help="held-out problems before and after (default 0: none)")
    p.add_argument("--threads", type=int, default=1, help="gspo train --threads for every variant (default 1)")
    p.add_argument("--vllm-server-url", default=None, help="a running server to use (its key: VLLM_API_KEY); "
                   "default: start one here")
    p.add_argument("--model", default=None, help="with --vllm-server-url: the model directory it serves "
                   "(default: the id its /v1/models names)")
    p.add_argument("--keep-server", action="store_true", help="leave the server started here running at the end")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of: {', '.join(VARIANTS)} (default: all)")
    args = p.parse_args()
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    if unknown := [n for n in names if n not in VARIANTS]:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-server-rollouts-"))
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _terminated)
    t_start = time.perf_counter()
    server, scratch = None, None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    try:
        if args.vllm_server_url:
            url, key = args.vllm_server_url.rstrip("/"), os.environ.get("VLLM_API_KEY")
            model = args.model or call(url, "/v1/models", key, timeout=30)["data"][0]["id"]
            where = f"the server at {url}"
        else:
            scratch = Path(tempfile.mkdtemp(prefix="bench-server-model-"))
            model = str(scratch / "tiny-long")  # the served id is this path: the runs' --model
            shutil.copytree(MODEL, model)
            server = Server(Path(model), out / "vllm-server.log", keep=args.keep_server)
            url, key = server.url, server.key
            env["VLLM_API_KEY"] = key
            where = f"one vLLM server started here ({url}, healthy after {server.start_seconds:.0f}s)"
        warm_up(url, key, model)
        results = [run_variant(n, VARIANTS[n], args, out, url, model, env) for n in names]
    finally:
        keep = server is not None and args.keep_server
        if keep:
            print(f"[server] left running: {server.url} (process group {server.proc.pid}; "
                  f"VLLM_API_KEY={server.key}; model {model})", flush=True)
        elif server is not None:
            server.stop()
        if scratch is not None and not keep:  # the model copy the server served
            shutil.rmtree(scratch, ignore_errors=True)

    extra = f"; extra: {args.extra}" if args.extra else ""
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}; "
          f"{where}; task chain, model tiny-long, {args.steps} steps, seed {args.seed}, --threads {args.threads}, "
          f"8 prompts x 4 samples a step{extra}; runs in {out}; benchmark wall {time.perf_counter() - t_start:.0f}s")
    print(table(results))
    if any(r["failed"] for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the run under way and the server are stopped by now
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
