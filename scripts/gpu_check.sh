#!/usr/bin/env bash
# Check a release on a GPU machine, in one command; the Markdown table it ends with goes into docs/gpu.md.
#
#   bash scripts/gpu_check.sh                       # on a CUDA machine, from anywhere in the clone
#   bash scripts/gpu_check.sh --cpu                 # the same pipeline on CPU, tiny: how tests/test_gpu_check.py runs it
#   bash scripts/gpu_check.sh --out DIR --steps 20 --stages tests,single,torchrun -- --micro-batch-tokens 8192
#
# Stages (each one says "ok", "FAILED" or "SKIPPED (why)"; the script exits 1 if any failed):
#   env       $GSPO_PY (default .venv/bin/python) imports torch and gspo, else `bash scripts/setup.sh`
#             is tried (pip with a 10 s timeout: on a machine without PyPI it fails fast); CUDA is
#             there; vLLM imports in $GSPO_VLLM_PY (default .venv-vllm/bin/python), else the vLLM
#             parts are skipped and the runs use gspo's own sampler (GSPO_GPU_CHECK_SETUP_VLLM=1
#             tries `GSPO_EXTRAS=vllm scripts/setup.sh` first).
#   tests     `pytest -m gpu tests/` in $GSPO_PY; `pytest -m vllm tests/test_vllm.py tests/test_export.py`
#             in $GSPO_VLLM_PY.
#   model     scripts/make_qwen_shaped.py: random weights with Qwen2.5-0.5B's shapes (no download).
#   decode    benchmarks/decode_graphs.py on that model: ms per decode step at 256 rows, eager launches against
#             the step captured in a CUDA graph (--cuda-graphs); OUT/decode/decode.md, in the summary.
#             --cpu: 16 rows, 8 steps, no graphs (the code path only).
#   single    `gspo train` for --steps steps on the arithmetic task, one process: --rollout-engine vllm
#             --dtype bfloat16 --param-dtype float32 --device cuda (reward: the share of even token
#             ids, which varies between samples of a random model; see make_qwen_shaped.py).
#   torchrun  the same run under torchrun on every local GPU with --parallel fsdp (SKIPPED on one GPU).
#   server    vLLM's own server (docs/server.md) on the tiny model, started with docs/server.md's GPU
#             command (127.0.0.1, a random key in its environment, its own process group; on 2+ GPUs
#             the last GPU, else beside the trainer); `gspo train --rollout-engine vllm-server` for 3
#             steps with --vllm-server-sync nccl (stage server-nccl), then 3 with directory sync
#             (server-directory), then 3 with --max-staleness 1 --partial-rollouts over nccl (server-partial);
#             each step's seconds and each sync's seconds (a wrapper around
#             ServerSampler.sync) printed and written to OUT/server/summary.md; the server stopped.
#             SKIPPED when vLLM is not importable, and in --cpu. GSPO_GPU_CHECK_SERVER_START: seconds
#             the server has to answer /health (default 600).
#   summary   per run: the resolved config that matters, first and median step time, rollout and
#             update time, peak GPU memory (torch's max_memory_allocated per process, through a
#             wrapper around gspo.cli.main, and nvidia-smi's memory.used, which counts vLLM's pools),
#             and the sampler/trainer log-prob gap; printed, and written to OUT/gpu_check.md.
#
# --cpu (or GSPO_GPU_CHECK_CPU=1): no GPU tests; a tiny Qwen-shaped model (2 layers, hidden 64),
# 2 steps, --rollout-engine hf --device cpu, torchrun with 2 processes.
# Environment: GSPO_PY, GSPO_VLLM_PY, GSPO_GPU_CHECK_OUT (default runs/gpu-check),
# GSPO_GPU_CHECK_TORCHRUN_ENGINE (hf or vllm: the engine of the torchrun run; default the single run's),
# GSPO_GPU_CHECK_NPROC (torchrun's processes; default every local GPU, --cpu: 2; under 2 the torchrun
# stage is SKIPPED: gspo refuses --parallel fsdp in one process).
set -uo pipefail
cd "$(dirname "$0")/.."

cpu="${GSPO_GPU_CHECK_CPU:-0}"
out="${GSPO_GPU_CHECK_OUT:-runs/gpu-check}"
steps=""
stages="env,tests,model,decode,single,torchrun,server,summary"
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) cpu=1 ;;
        --out) out="$2"; shift ;;
        --steps) steps="$2"; shift ;;
        --stages) stages="env,$2,summary"; shift ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[ "$cpu" = "1" ] && steps="${steps:-2}" || steps="${steps:-20}"
py="${GSPO_PY:-.venv/bin/python}"
vllm_py="${GSPO_VLLM_PY:-.venv-vllm/bin/python}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
status_file="$out/stages.txt"
: > "$status_file"
failed=()

say() { echo "gpu_check: $*"; }
record() { echo "$1|$2" >> "$status_file"; say "stage $1: $2"; }
want() { [[ ",$stages," == *",$1,"* ]]; }
run_stage() {  # run_stage NAME COMMAND...: record ok or FAILED (exit code)
    local name="$1"; shift
    say "== stage $name: $*"
    "$@"
    local rc=$?
    if [ $rc -eq 0 ]; then record "$name" "ok"; else record "$name" "FAILED (exit $rc)"; failed+=("$name"); fi
    return $rc
}

# --- env ------------------------------------------------------------------------------------
export PIP_DEFAULT_TIMEOUT=10 PIP_RETRIES=0  # no PyPI on the machine: fail in seconds, not minutes
if ! "$py" -c "import torch, gspo" 2>/dev/null; then
    if [ -z "${GSPO_PY:-}" ]; then
        say "$py cannot import torch and gspo: trying bash scripts/setup.sh"
        bash scripts/setup.sh || true
    fi
    if ! "$py" -c "import torch, gspo" 2>/dev/null; then
        record env "FAILED ($py cannot import torch and gspo; set GSPO_PY to a Python with a CUDA torch and gspo installed: pip install -e '.[dev]')"
        say "FAILED stages: env"; exit 1
    fi
fi
if [ "$cpu" = "1" ]; then
    device=cpu; nproc="${GSPO_GPU_CHECK_NPROC:-2}"; have_vllm=0
    say "CPU dry run: GPU tests, vLLM and GPU memory skipped"
else
    if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        record env "FAILED (no CUDA device visible to $py's torch; --cpu runs the CPU dry run)"
        say "FAILED stages: env"; exit 1
    fi
    device=cuda
    # every local GPU (torch's count: nvidia-smi -L's, less any hidden by CUDA_VISIBLE_DEVICES)
    nproc="${GSPO_GPU_CHECK_NPROC:-$("$py" -c "import torch; print(torch.cuda.device_count())")}"
    if ! "$vllm_py" -c "import vllm, gspo" 2>/dev/null && [ "${GSPO_GPU_CHECK_SETUP_VLLM:-0}" = "1" ]; then
        say "vLLM missing in $vllm_py: trying GSPO_VENV=${vllm_py%/bin/python} GSPO_EXTRAS=vllm bash scripts/setup.sh"
        GSPO_VENV="${vllm_py%/bin/python}" GSPO_EXTRAS=vllm bash scripts/setup.sh || true
    fi
    if "$vllm_py" -c "import torch, vllm, gspo, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        have_vllm=1
    else
        have_vllm=0
        say "SKIPPED: vLLM does not import with CUDA in $vllm_py (set GSPO_VLLM_PY, or GSPO_GPU_CHECK_SETUP_VLLM=1): no vLLM tests, runs use --rollout-engine hf"
    fi
fi
train_py="$py"; engine=hf
[ "$have_vllm" = "1" ] && { train_py="$vllm_py"; engine=vllm; }
tr_engine="${GSPO_GPU_CHECK_TORCHRUN_ENGINE:-$engine}"
"$train_py" - > "$out/machine.txt" <<'PY'
import platform, torch
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
try:
    import vllm
    v = vllm.__version__
except Exception:
    v = "not importable"
import gspo, transformers
print(f"machine: {platform.node()}, {len(gpus)} x {gpus[0] if gpus else 'no GPU'}, torch {torch.__version__}"
      f" (CUDA {torch.version.cuda}), transformers {transformers.__version__}, vLLM {v}, gspo {gspo.__version__}")
PY
cat "$out/machine.txt"
record env "ok (train with $train_py, engine $engine; torchrun: $nproc processes, engine $tr_engine)"

# --- tests ----------------------------------------------------------------------------------
if want tests; then
    if [ "$cpu" = "1" ]; then
        record tests "SKIPPED (CPU dry run)"
    else
        run_stage tests-gpu "$py" -m pytest -m gpu -q tests/
        if [ "$have_vllm" = "1" ]; then
            run_stage tests-vllm "$vllm_py" -m pytest -m vllm -q tests/test_vllm.py tests/test_export.py
        else
            record tests-vllm "SKIPPED (vLLM not importable)"
        fi
    fi
fi

# --- model ----------------------------------------------------------------------------------
model="$out/qwen-shaped"
if [ "$cpu" = "1" ]; then
    shape=(--layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 128 --vocab 1024 --max-positions 512)
    batch=(--prompts-per-step 4 --group-size 4 --max-new-tokens 16)
else
    shape=()
    batch=(--prompts-per-step 32 --group-size 8 --max-new-tokens 256)
fi
if want model || [ ! -f "$model/config.json" ]; then
    run_stage model "$train_py" scripts/make_qwen_shaped.py "$model" "${shape[@]}"
fi

# --- decode ---------------------------------------------------------------------------------
if want decode; then
    if [ "$cpu" = "1" ]; then
        dec_args=(--device cpu --rows 16 --prompt-tokens 16 --steps 8 --repeats 1)
    else
        dec_args=(--device cuda --rows 256 --prompt-tokens 128 --steps 128 --repeats 2)
    fi
    mkdir -p "$out/decode"
    run_stage decode "$py" benchmarks/decode_graphs.py --model "$model" "${dec_args[@]}" --out "$out/decode/decode.md"
fi

# --- the training runs ----------------------------------------------------------------------
# gspo.cli.main, then each process's peak of torch's allocator (what vLLM's own pools hold is
# in nvidia-smi's figure instead)
cat > "$out/train_peak.py" <<'PY'
"""gspo.cli.main, then write this process's torch.cuda.max_memory_allocated to $GSPO_PEAK_DIR."""
import json, os, sys
import torch
from gspo.cli import main

rc = main(sys.argv[1:])
if torch.cuda.is_available() and os.environ.get("GSPO_PEAK_DIR"):
    rank = int(os.environ.get("RANK", 0))
    peak = {"rank": rank, "max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved()}
    with open(os.path.join(os.environ["GSPO_PEAK_DIR"], f"peak-rank{rank}.json"), "w") as f:
        json.dump(peak, f)
sys.exit(rc)
PY
common=(--model "$model" --task arithmetic --reward "$PWD/scripts/make_qwen_shaped.py:even_token_share"
        --steps "$steps" "${batch[@]}" --eval-size 0 --dtype bfloat16 --param-dtype float32 --device "$device"
        --vllm-max-model-len 1024 --no-progress)

train_run() {  # train_run NAME ENGINE LAUNCHER... [-- GSPO ARGS]: one run in $out/NAME, its wall time and peak memory beside it
    local name="$1" eng="$2"; shift 2
    local launcher=() args=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do launcher+=("$1"); shift; done
    [ $# -gt 0 ] && { shift; args=("$@"); }
    local dir="$out/$name"
    rm -rf "$dir"; mkdir -p "$dir/peak"
    local smi_pid=""
    if [ "$device" = "cuda" ] && command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$dir/peak/nvidia-smi.txt" 2>/dev/null &
        smi_pid=$!
    fi
    local t0=$SECONDS rc
    GSPO_PEAK_DIR="$dir/peak" "${launcher[@]}" "$out/train_peak.py" train "${common[@]}" "${args[@]}" \
        --rollout-engine "$eng" --output-dir "$dir/run" "${extra[@]}" 2>&1 | tee "$dir/log.txt"
    rc=${PIPESTATUS[0]}
    echo $((SECONDS - t0)) > "$dir/wall_seconds.txt"
    [ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null
    echo "${launcher[*]} ${args[*]}" > "$dir/launcher.txt"
    return $rc
}

if want single; then
    run_stage single train_run single "$engine" "$train_py"
fi
if want torchrun && [ "$nproc" -lt 2 ]; then
    # gspo refuses --parallel in one process (nothing to shard): one GPU has no torchrun run to make
    record torchrun "SKIPPED ($nproc process: --parallel fsdp shards over 2 or more, one per GPU)"
elif want torchrun; then
    tr_args=(--parallel fsdp)
    [ "$cpu" = "1" ] && tr_args+=(--threads 1)  # two processes on two cores
    run_stage torchrun train_run torchrun "$tr_engine" "$train_py" -m torch.distributed.run --standalone \
        --nproc-per-node "$nproc" -- "${tr_args[@]}"
fi

# --- server ---------------------------------------------------------------------------------
# gspo.cli.main with each weight sync's seconds appended to $GSPO_SYNC_LOG (a push: pause, push, reset,
# version, resume; and the whole call, the sync check included)
cat > "$out/server_sync.py" <<'PY'
"""gspo.cli.main, with each weight sync's seconds (ServerSampler.sync_seconds) appended to $GSPO_SYNC_LOG."""
import json, os, sys, time
from gspo.cli import main
from gspo.sampling.vllm_server import ServerSampler

_sync = ServerSampler.sync


def sync(self, policy, version=None):
    t0 = time.perf_counter()
    self.sync_seconds = None  # set again only by a sync that pushed
    try:
        _sync(self, policy, version)
    finally:
        pushed, self.sync_seconds = self.sync_seconds is not None, self.sync_seconds or 0.0
    if pushed and os.environ.get("GSPO_SYNC_LOG"):
        with open(os.environ["GSPO_SYNC_LOG"], "a") as f:
            f.write(json.dumps({"method": self.push.name, "version": version, "sync_seconds": self.sync_seconds,
                                "with_check_seconds": time.perf_counter() - t0}) + "\n")


ServerSampler.sync = sync
sys.exit(main(sys.argv[1:]))
PY
srv_dir="$out/server"; srv_tiny="$PWD/gspo/assets/tiny"; srv_pid=""; srv_url=""; srv_key=""

server_alive() { [ -n "$srv_pid" ] && kill -0 "$srv_pid" 2>/dev/null && [[ "$(ps -o stat= -p "$srv_pid" 2>/dev/null)" != *Z* ]]; }
server_stop() {  # the server's whole process group (the API server and vLLM's engine): SIGTERM, SIGKILL after 15 s
    [ -n "$srv_pid" ] || return 0
    kill -TERM -- "-$srv_pid" 2>/dev/null
    for _ in $(seq 15); do server_alive || break; sleep 1; done
    kill -KILL -- "-$srv_pid" 2>/dev/null
    wait "$srv_pid" 2>/dev/null
    srv_pid=""
}
server_start() {  # docs/server.md's GPU command on the tiny model; ready when /health answers
    srv_key="$("$vllm_py" -c "import secrets; print(secrets.token_urlsafe(32))")"
    local port gpus visible=""
    port="$("$vllm_py" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")"
    srv_url="http://127.0.0.1:$port"
    gpus="$("$py" -c "import torch; print(torch.cuda.device_count())")"
    if [ "$gpus" -ge 2 ]; then  # the last GPU for the server, the trainer on the first (NCCL: one rank per GPU)
        visible="${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((gpus - 1)))}"; visible="${visible##*,}"
    fi
    say "server: starting vLLM on $srv_url (GPU ${visible:-shared with the trainer}), output in $srv_dir/server.log"
    (
        export VLLM_SERVER_DEV_MODE=1 VLLM_API_KEY="$srv_key"
        [ -n "$visible" ] && export CUDA_VISIBLE_DEVICES="$visible"
        # a process group of its own (os.setsid), so that stopping it stops vLLM's engine process too
        exec "$vllm_py" -c 'import os, sys; os.setsid(); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])' \
            -m vllm.entrypoints.openai.api_server --model "$srv_tiny" --host 127.0.0.1 --port "$port" \
            --dtype float32 --seed 0 --max-model-len 64 --logprobs-mode processed_logprobs --enable-prefix-caching \
            --weight-transfer-config '{"backend":"nccl"}' --gpu-memory-utilization 0.3
    ) >> "$srv_dir/server.log" 2>&1 < /dev/null &
    srv_pid=$!
    local t0=$SECONDS limit="${GSPO_GPU_CHECK_SERVER_START:-600}"
    while [ $((SECONDS - t0)) -lt "$limit" ]; do
        if ! server_alive; then say "server: exited before it answered /health (see $srv_dir/server.log)"; return 1; fi
        if "$py" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=5)" \
                "$srv_url" 2>/dev/null; then
            echo $((SECONDS - t0)) > "$srv_dir/ready_seconds.txt"
            say "server: ready (GET /health 200) $((SECONDS - t0)) s after start"
            return 0
        fi
        sleep 2
    done
    say "server: no answer to /health within $limit s (GSPO_GPU_CHECK_SERVER_START)"
    return 1
}
server_run() {  # server_run SYNC [NAME OPTION...]: 3 steps of gspo train on the server, in OUT/server/NAME (SYNC)
    local sync="$1" d="$srv_dir/${2:-$1}"
    shift; shift || true
    rm -rf "$d"; mkdir -p "$d"
    VLLM_API_KEY="$srv_key" GSPO_SYNC_LOG="$d/syncs.jsonl" "$vllm_py" "$out/server_sync.py" train \
        --model "$srv_tiny" --rollout-engine vllm-server --vllm-server-url "$srv_url" --vllm-server-sync "$sync" \
        --steps 3 --eval-size 0 --device "$device" --output-dir "$d/run" --no-progress "$@" 2>&1 | tee "$d/log.txt"
    return "${PIPESTATUS[0]}"
}

if want server; then
    if [ "$cpu" = "1" ]; then
        record server "SKIPPED (CPU dry run)"
    elif [ "$have_vllm" != "1" ]; then
        record server "SKIPPED (vLLM not importable)"
    else
        rm -rf "$srv_dir"; mkdir -p "$srv_dir"
        trap server_stop EXIT  # the server goes whatever ends the script
        if run_stage server server_start; then
            run_stage server-nccl server_run nccl
            server_alive || { say "server: gone after the nccl run; starting it again"; server_start; }
            run_stage server-directory server_run directory
            server_alive || { say "server: gone after the directory run; starting it again"; server_start; }
            # sampling while the trainer trains, a sync aborting the generations under way (docs/server.md)
            run_stage server-partial server_run nccl partial --max-staleness 1 --partial-rollouts
        fi
        server_stop
        trap - EXIT
        "$vllm_py" - "$srv_dir" <<'PY'
"""Each server run's step seconds (metrics.jsonl) and sync seconds (syncs.jsonl): OUT/server/summary.md."""
import json, sys
from pathlib import Path

d = Path(sys.argv[1])
ready = d / "ready_seconds.txt"
lines = [f"server stage (tiny model, float32, 3 steps a run): ready {ready.read_text().strip()} s after start"
         if ready.is_file() else "server stage: the server never answered /health"]
for sync in ("nccl", "directory", "partial"):
    metrics, syncs = d / sync / "run" / "metrics.jsonl", d / sync / "syncs.jsonl"
    if not metrics.is_file():
        lines.append(f"- {sync}: no steps (see {d / sync / 'log.txt'})")
        continue
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    pushes = [json.loads(x) for x in syncs.read_text().splitlines() if x.strip()] if syncs.is_file() else []
    steps = ", ".join(f"{r['time/step_seconds']:.2f}" for r in rows)
    rollouts = ", ".join(f"{r['time/rollout_seconds']:.2f}" for r in rows)
    each = ", ".join(f"{p['sync_seconds']:.3f} ({p['with_check_seconds']:.3f})" for p in pushes)
    lines.append(f"- {sync}: {len(rows)} steps of {steps} s (rollouts, the sync included: {rollouts} s); "
                 f"{len(pushes)} syncs of {each or 'n/a'} s (in brackets: with the sync check)")
text = "\n".join(lines) + "\n"
(d / "summary.md").write_text(text)
print(text)
PY
    fi
fi

# --- summary --------------------------------------------------------------------------------
"$train_py" - "$out" <<'PY'
"""The summary table of gpu_check.sh, from each run's config.yaml, metrics.jsonl and peak memory files."""
import datetime, json, statistics, sys
from pathlib import Path

import yaml

out = Path(sys.argv[1])
stages = [line.split("|", 1) for line in (out / "stages.txt").read_text().splitlines() if line]
rows = []
for name in ("single", "torchrun"):
    d = out / name
    if name not in dict(stages):  # not run by this invocation (--stages): an older run's files are not reported
        continue
    cfg_path, metrics_path = d / "run" / "config.yaml", d / "run" / "metrics.jsonl"
    if not cfg_path.is_file() or not metrics_path.is_file():
        continue
    cfg = yaml.safe_load(cfg_path.read_text())
    m = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    launcher = (d / "launcher.txt").read_text().split()
    procs = int(launcher[launcher.index("--nproc-per-node") + 1]) if "--nproc-per-node" in launcher else 1

    def med(key, skip_first=True):
        xs = [r[key] for r in m if key in r]
        xs = xs[1:] if skip_first and len(xs) > 1 else xs  # the first step pays for warm-up (allocations, compiles)
        return statistics.median(xs) if xs else None

    peaks = [json.loads(p.read_text()) for p in sorted((d / "peak").glob("peak-rank*.json"))]
    smi = [float(x) for x in (d / "peak" / "nvidia-smi.txt").read_text().split()] if (d / "peak" / "nvidia-smi.txt").is_file() else []
    cuda = str(cfg.get("device", "cpu")).startswith("cuda")
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    rows.append({
        "run": name, "processes": f"{procs} ({cfg['parallel']})" if "--nproc-per-node" in launcher else "1",
        "engine": cfg["rollout_engine"], "dtype / params": f"{cfg['dtype']} / {cfg['param_dtype']}",
        "old_logp": cfg["old_logp"], "packing": str(cfg["packing"]).lower(),
        "micro-batch tokens": str(cfg["micro_batch_tokens"] or "0 (whole minibatch)"),
        "batch": f"{cfg['prompts_per_step']}x{cfg['group_size']}x{cfg['max_new_tokens']}",
        "steps": str(len(m)),
        "first step": f"{m[0]['time/step_seconds']:.2f} s" if m else "n/a",
        "median step": f"{med('time/step_seconds'):.2f} s" if m else "n/a",
        "median rollout / update": f"{med('time/rollout_seconds'):.2f} / {med('time/update_seconds'):.2f} s" if m else "n/a",
        "peak allocated (torch)": (gib(max(p["max_allocated"] for p in peaks)) if peaks else "n/a") if cuda else "n/a on CPU",
        "peak used (nvidia-smi)": (f"{max(smi) / 1024:.2f} GiB" if smi else "n/a") if cuda else "n/a on CPU",
        "mismatch/token_abs": f"{med('mismatch/token_abs', False):.2e}" if med("mismatch/token_abs", False) is not None else "n/a (not recomputed)",
        "mismatch/seq_log_ratio": f"{med('mismatch/seq_log_ratio', False):.2e}" if med("mismatch/seq_log_ratio", False) is not None else "n/a",
        "wall": f"{int((d / 'wall_seconds.txt').read_text())} s",
    })

model_info = out / "qwen-shaped" / "qwen_shaped.json"
info = json.loads(model_info.read_text()) if model_info.is_file() else {}
lines = [f"gpu_check.sh, {datetime.date.today().isoformat()}; " + (out / "machine.txt").read_text().strip(),
         f"model: Qwen-shaped, random weights, {info.get('parameters', 0) / 1e6:.1f}M parameters "
         f"({info.get('layers')} layers, hidden {info.get('hidden')}, vocab {info.get('vocab')}); task arithmetic, "
         "reward even_token_share", "",
         "stages: " + "; ".join(f"{n}: {s}" for n, s in stages), ""]
if rows:
    cols = list(rows[0])
    lines += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(r[c] for c in cols) + " |" for r in rows]
else:
    lines.append("(no training run finished in this invocation: no table)")
server = out / "server" / "summary.md"
if "server" in dict(stages) and server.is_file():  # the server stage ran in this invocation
    lines += ["", server.read_text().strip()]
decode = out / "decode" / "decode.md"
if "decode" in dict(stages) and decode.is_file():  # ms per decode step, eager and in CUDA graphs
    lines += ["", "decode steps (benchmarks/decode_graphs.py):", "", decode.read_text().strip()]
lines += ["", "median step, rollout, update: over steps 2.. (the first pays for warm-up); mismatch: median over steps;",
          "peak allocated: torch.cuda.max_memory_allocated, max over processes (vLLM's pools not included);",
          "peak used: nvidia-smi memory.used, max over GPUs and 200 ms samples (every process on the GPU)."]
text = "\n".join(lines) + "\n"
(out / "gpu_check.md").write_text(text)
print("\n" + text)
PY
[ $? -eq 0 ] || failed+=("summary")
say "summary written to $out/gpu_check.md"
if [ ${#failed[@]} -gt 0 ]; then
    say "FAILED stages: ${failed[*]}"
    exit 1
fi
say "all stages passed"
