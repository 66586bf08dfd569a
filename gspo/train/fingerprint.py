"""A run's fingerprint: what it was trained from that its configuration does not say, the gspo
version and the content of the local files its options name. Written as `fingerprint.json` beside
config.yaml when a run starts, so that `gspo compare` reuses or resumes a run only when both are
unchanged (gspo.lab.jobs.saved_config) and `gspo train --resume` says when they changed.

    from gspo.train.fingerprint import changed_since, write_fingerprint
    write_fingerprint(run_dir, cfg)      # gspo.train.checkpoint.start_run, after config.yaml
    why = changed_since(run_dir, cfg)    # None: unchanged; else `was trained before --reward file rewards.py changed`

`cfg` resolved, its paths absolute (gspo.train.resolve), as the run holds it. fingerprint.json:

    {"gspo": "0.3.0",
     "inputs": {"--model": {"tiny": null},
                "--dataset": {"/home/me/data.jsonl": "9f86d081..."},
                "--reward": {"exact_match": null, "/home/me/rewards.py:brevity": "2c26b46b..."}}}

Each option of FILE_OPTIONS that is set maps each name it holds to the sha256 of what the name
points at: a file's content; a directory's files (by their paths in it, sorted, each path with its
content's digest; names beginning with `.` left out, such as a downloaded model's `.cache/`);
`file.py:name`'s file; `package.module:name`'s module source file (found as import finds it, the
module not run). A name that is no local file maps to null: a built-in (a model, a reward; its
version is gspo's), a Hub id (`org/name@revision` with --revision), an object's placeholder.

Left out: --config, whose values are the configuration and are compared option by option (a
comment edited in it makes no other run); the packages a task, a reward or an environment
imports (reasoning-gym, verifiers, a module's own imports): their versions are not recorded.
Cost: a file under LARGE bytes is read whole once per process (`_file_digest` remembers it by path,
size and modification time), at about 2 s per GB; a file of LARGE bytes or more (a model's weight
shards) is known by its size and modification time alone, so a local 7B model costs milliseconds,
not a minute, at every start and every `gspo compare` (writing a file changes its modification
time; a copy that keeps it, `cp -p`, of other content of the same size would go unseen).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from importlib.machinery import PathFinder
from pathlib import Path

import gspo
from gspo.config import TrainConfig
from gspo.io.files import atomic_write_text
from gspo.models.loading import BUILTIN_MODELS
from gspo.rewards.builtin import BUILTIN_REWARDS

FILE = "fingerprint.json"
LARGE = 256 << 20  # bytes: a file this large is known by its size and modification time, unread

# Every option that names a local file or directory whose content changes what is trained under
# the same configuration: the one list fingerprints are made of (docs/compare.md names them).
FILE_OPTIONS = {
    "model": "the starting weights and tokenizer: a local model directory, or a .gguf file",
    "dataset": "the training prompts: a data file or a datasets directory",
    "eval_dataset": "the held-out prompts every accuracy is measured on",
    "reward": "the rewards: file.py:function, package.module:function, a reward model's directory",
    "env": "the environment or agent: file.py:Class, package.module:Class",
}
NAMED_REWARDS = (*BUILTIN_REWARDS, "reasoning_gym", "answer_format")  # gspo's own, never a file


def fingerprint(cfg: TrainConfig) -> dict:
    """The fingerprint of a run of `cfg` (resolved, paths absolute) made now."""
    inputs = {}
    for name in FILE_OPTIONS:
        value = getattr(cfg, name)
        specs = value if isinstance(value, tuple) else () if value is None else (value,)
        if specs:
            inputs["--" + name.replace("_", "-")] = {_shown_name(name, s, cfg): _digest_of(name, s) for s in specs}
    return {"gspo": gspo.__version__, "inputs": inputs}


def write_fingerprint(run_dir: Path, cfg: TrainConfig) -> None:
    atomic_write_text(Path(run_dir) / FILE, json.dumps(fingerprint(cfg), indent=2) + "\n")


def changed_since(run_dir: Path, cfg: TrainConfig) -> str | None:
    """None when the run in `run_dir` was trained from what a run of `cfg` (resolved, paths absolute)
    would be now; else why not, in words that follow the run's name: `was trained before --reward
    file rewards.py changed, with gspo 0.3.0 (now 0.4.0)`, `has no fingerprint.json (...)`."""
    try:
        old = json.loads((Path(run_dir) / FILE).read_text())
    except FileNotFoundError:
        return f"has no {FILE} (made by an older gspo: what it was trained from cannot be checked)"
    except (OSError, ValueError) as e:
        return f"has an unreadable {FILE} ({type(e).__name__}: {e})"
    changes = differences(old, fingerprint(cfg))
    return f"was trained {', '.join(changes)}" if changes else None


def differences(old: dict, new: dict) -> list[str]:
    """What differs from fingerprint `old` in `new`, in words: `before --dataset file d.jsonl
    changed`, `with other --reward` (names not in both: a configuration that differs says so
    first), `with gspo 0.3.0 (now 0.4.0)`."""
    was, now = old.get("inputs") or {}, new["inputs"]
    changed = [f"{option} {_what(name)}" for option, names in now.items() for name, digest in names.items()
               if name in was.get(option, {}) and was[option][name] != digest]
    other = [o for o in sorted(set(was) | set(now)) if set(was.get(o, {})) != set(now.get(o, {}))]
    out = [f"before {' and '.join(changed)} changed"] if changed else []
    out += [f"with other {', '.join(other)}"] if other else []
    if old.get("gspo") != new["gspo"]:
        out.append(f"with gspo {old.get('gspo')} (now {new['gspo']})")
    return out


def _shown_name(option: str, spec: str, cfg: TrainConfig) -> str:
    """A Hub model with its revision (`org/name@v1`); any other name as the configuration holds it."""
    if option == "model" and cfg.policy.revision and _source(option, spec) is None:
        return f"{spec}@{cfg.policy.revision}"
    return spec


def _digest_of(option: str, spec: str) -> str | None:
    source = _source(option, spec)
    return None if source is None else _digest(source)


def _source(option: str, spec: str) -> Path | None:
    """The local file or directory `spec` (a value of `option`) is read from; None: no local file."""
    if (option == "model" and spec in BUILTIN_MODELS) or (option == "reward" and spec in NAMED_REWARDS):
        return None
    path = Path(spec).expanduser()
    if path.exists():  # a data file, a model or reward model directory, a .gguf file
        return path
    target, colon, _ = spec.rpartition(":")
    if option not in ("reward", "env") or not colon or not target:
        return None
    if _is_file_target(target):  # path/to/file.py:name
        path = Path(target).expanduser()
        return path if path.is_file() else None
    return _module_file(target)


def _is_file_target(target: str) -> bool:
    """`path/to/file.py` of `path/to/file.py:name`, not `package.module` (as gspo.rewards.builtin reads it)."""
    return target.endswith(".py") or "/" in target or "\\" in target


def _module_file(name: str) -> Path | None:
    """The source file of module `name`, found as import finds it, neither it nor its packages run."""
    parts = name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: found, not run
        for i in range(1, len(parts)):
            if spec is None or spec.submodule_search_locations is None:
                return None
            spec = PathFinder.find_spec(".".join(parts[:i + 1]), spec.submodule_search_locations)
    except (ImportError, ValueError):
        return None
    origin = spec.origin if spec is not None else None
    return Path(origin) if origin and Path(origin).is_file() else None


def _digest(path: Path) -> str:
    """sha256 of a file's content, or of a directory's files (each path in it with its file's digest)."""
    if path.is_file():
        try:
            st = path.stat()
            if st.st_size >= LARGE:  # weights: what changed them changed their modification time too
                return hashlib.sha256(f"size {st.st_size} mtime_ns {st.st_mtime_ns}".encode()).hexdigest()
            return _file_digest(str(path.resolve()), st.st_size, st.st_mtime_ns)
        except OSError as e:  # a file the run may not even read (a stray lock in a model directory): no reason to stop
            return f"unreadable ({e.strerror})"
    h = hashlib.sha256()
    for f in _files(path):
        h.update(f"{f.relative_to(path).as_posix()}\0{_digest(f)}\n".encode())
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    """A directory's files, below it too, by their paths in it; names beginning with `.` left out."""
    out = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        out += [Path(here) / f for f in files if not f.startswith(".")]
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


@functools.cache
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file, once per (path, size, modification time) in a process."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _what(spec: str) -> str:
    """`file rewards.py`, `module my.rewards`, `directory data`: what a name points at, in words (a path
    under the working directory shown from it)."""
    target, colon, _ = spec.rpartition(":")
    if colon and target and not Path(spec).expanduser().exists():
        return f"file {_short(target)}" if _is_file_target(target) else f"module {target}"
    return f"{'directory' if Path(spec).expanduser().is_dir() else 'file'} {_short(spec)}"


def _short(path: str) -> str:
    try:
        return Path(path).expanduser().resolve().relative_to(Path.cwd()).as_posix()
    except ValueError:
        return path
