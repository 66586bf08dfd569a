"""Hugging Face Hub ids: models and datasets by name, as transformers and datasets take them.

    from gspo.io.hub import model_dir, load_dataset_dict
    path = model_dir("Qwen/Qwen2.5-0.5B-Instruct")          # a local snapshot directory
    path = model_dir("Qwen/Qwen2.5-0.5B-Instruct", revision="v1.0")
    splits = load_dataset_dict("openai/gsm8k", "main")     # a datasets.DatasetDict

A model id is resolved to a local snapshot directory by `huggingface_hub.snapshot_download`
(downloaded when online, read from the cache under HF_HOME with `HF_HUB_OFFLINE=1`), so
everything downstream (transformers, PEFT, vLLM, the critic, reward models) reads a
directory. Only what loading needs is downloaded: the top-level config, generation config,
tokenizer and chat-template files and the safetensors weights with their index (`*.bin`
weights only when the repository has no safetensors; never ONNX, GGUF, TF/Flax or
subfolders). A dataset id goes to `datasets.load_dataset(id, config)`, which keeps its own
prepared cache under HF_HOME/datasets.

A missing id is one line (`HubError`) saying which case it is: not on the Hub (or private),
gated, no such revision, not in the offline cache, or the Hub unreachable.

Left out: dataset revisions, streaming datasets, `trust_remote_code` models.
"""

from __future__ import annotations

import functools
import glob
import itertools
import re
from pathlib import Path


class HubError(ValueError):
    """A hub id that cannot be resolved; the message is one line saying why."""


# the Hub's repository names: letters, digits, '-', '_', '.' (at most 96), optionally under an org
_ID = re.compile(r"^(?:[A-Za-z0-9][\w.\-]{0,95}/)?[A-Za-z0-9][\w.\-]{0,95}$")

# the top-level files a model directory needs (config, generation config, tokenizer, chat
# template, safetensors weights and their index); `*.bin` weights only without safetensors
MODEL_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".safetensors")
EXTRA_TEMPLATES = "additional_chat_templates/"
LOGIN = "check the id, or log in if it is private: hf auth login / HF_TOKEN"


def looks_like_hub_id(name) -> bool:
    """`org/name` (or a bare `name`) as the Hub spells repository ids, and not a local path
    (`path_like`, or an existing path). `./x`, `/abs/x`, `~/x`, `a/b/c` are paths, never ids.

    >>> looks_like_hub_id("Qwen/Qwen2.5-0.5B-Instruct"), looks_like_hub_id("./nope"), looks_like_hub_id("/a/b")
    (True, False, False)
    """
    return (isinstance(name, str) and bool(_ID.match(name)) and "--" not in name and ".." not in name
            and not path_like(name) and not Path(name).expanduser().exists())


# what a file's name ends with (a weights, config or data file), where a Hub id ends with a name
FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".h5", ".msgpack", ".json",
                 ".jsonl", ".yaml", ".yml", ".txt", ".py", ".csv", ".tsv", ".parquet", ".zip", ".tar", ".gz")


def path_like(name: str) -> bool:
    """A name only a local path can be, never a Hub id: it starts with `.`, `/` or `~`, holds a
    separator other than one `ORG/NAME`'s, names something in an existing directory
    (`runs/x` where ./runs exists), or ends like a file (`model.safetensors`).

    >>> path_like("./m"), path_like("a/b/c"), path_like("model.safetensors"), path_like("Qwen/Qwen3-0.6B")
    (True, True, True, False)
    """
    first, sep, rest = name.partition("/")
    return (name.startswith((".", "/", "~")) or "\\" in name or "/" in rest or name.lower().endswith(FILE_SUFFIXES)
            or (bool(sep) and (not _ID.match(name) or Path(first).expanduser().exists())))


def nearby(name: str, names=(), *, files: bool = False) -> str:
    """'; did you mean X?' for a missing local path `name`: the closest of `names` (built-in
    names) or of the directories beside it (in its parent directory; the files with `files`);
    '' when none is close, and ' (PARENT does not exist)' when its parent directory does not
    exist either.

    >>> nearby("tiny_moe", ["tiny", "tiny-moe"])
    '; did you mean tiny-moe?'
    """
    import difflib

    path = Path(name).expanduser()
    parent = path.parent
    if not parent.is_dir():
        missing = next(p for p in [parent, *parent.parents][::-1] if not p.is_dir())  # the first one missing
        return f" ({missing} {'is a file' if missing.exists() else 'does not exist'})"
    try:
        siblings = sorted(p.name for p in itertools.islice(parent.iterdir(), 2000)
                          if (p.is_file() if files else p.is_dir()))
    except OSError:
        siblings = []
    scored = [(difflib.SequenceMatcher(None, name.lower(), n.lower()).ratio(), n) for n in names]
    prefix = name[:len(name) - len(path.name)] if name.endswith(path.name) else f"{parent}/"
    scored += [(difflib.SequenceMatcher(None, path.name.lower(), s.lower()).ratio(), prefix + s) for s in siblings]
    best = max(scored, default=(0.0, ""))
    return f"; did you mean {best[1]}?" if best[0] >= 0.6 else ""


def close_to(name: str, names, cutoff: float = 0.8) -> bool:
    """Whether `name` is a near miss of one of `names` (a misspelt built-in: tiny_moe, tinymoe)."""
    import difflib

    return bool(difflib.get_close_matches(name.lower(), [n.lower() for n in names], n=1, cutoff=cutoff))


def model_files(files: list[str]) -> list[str]:
    """Of a model repository's files, those a model directory needs.

    >>> model_files(["config.json", "model.safetensors", "pytorch_model.bin", "onnx/model.onnx", "README.md"])
    ['config.json', 'model.safetensors']
    >>> model_files(["config.json", "pytorch_model.bin", "training_args.bin", "model.gguf"])
    ['config.json', 'pytorch_model.bin']
    """
    top = [f for f in files if "/" not in f]
    keep = [f for f in top if f.endswith(MODEL_SUFFIXES)]
    keep += [f for f in files if f.startswith(EXTRA_TEMPLATES) and f.endswith(".jinja")]
    if not any(f.endswith(".safetensors") for f in keep):
        keep += [f for f in top if f.endswith(".bin") and f != "training_args.bin"]
    return sorted(keep)


def model_dir(repo_id: str, *, revision: str | None = None) -> Path:
    """The local snapshot directory of a hub model repository (config, tokenizer, weights);
    downloads what is missing unless HF_HUB_OFFLINE=1. Raises HubError (one line)."""
    from huggingface_hub import snapshot_download

    files = _listing(repo_id, revision)  # None: neither the Hub nor a cached listing could say
    wanted = None if files is None else model_files(files)
    if wanted == []:
        raise HubError(f"model {repo_id}: the repository has no model files (config.json, tokenizer, weights)")
    try:
        path = snapshot_download(repo_id, revision=revision,
                                 allow_patterns=None if wanted is None else [glob.escape(f) for f in wanted])
    except Exception as e:
        raise HubError(explain("model", repo_id, revision, e)) from None
    return Path(path)


def _listing(repo_id: str, revision: str | None) -> list[str] | None:
    """The repository's files: from the Hub when online, else from the tree listing a past
    download cached (the same choice of files then passes snapshot_download's completeness
    check). None when neither answers: snapshot_download then says why, or finds the cache."""
    from huggingface_hub import HfApi, constants, get_cached_repo_tree

    if not constants.is_offline_mode():
        try:
            return [s.rfilename for s in HfApi().model_info(repo_id, revision=revision).siblings or []]
        except Exception:  # not found, gated, no connection: snapshot_download decides (it may find the cache)
            pass
    try:
        return [f.path for f in get_cached_repo_tree(repo_id, revision=revision)]
    except Exception:
        return None


def _one_line(e: BaseException, limit: int = 200) -> str:
    return " ".join(str(e).split())[:limit]


def cache_home() -> str:
    """Where the local Hugging Face cache is, for messages: HF_HOME (and HF_HUB_CACHE if moved)."""
    import os

    from huggingface_hub import constants

    home = f"HF_HOME={constants.HF_HOME}"
    default = os.path.join(constants.HF_HOME, "hub")
    return home if os.path.abspath(constants.HF_HUB_CACHE) == os.path.abspath(default) else \
        f"{home}, HF_HUB_CACHE={constants.HF_HUB_CACHE}"


def classify(e: BaseException) -> str:
    """What a hub failure was: gated, revision, missing, token, incomplete, offline, unreachable or other."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    for cls, case in ((GatedRepoError, "gated"), (RevisionNotFoundError, "revision"),
                      (RepositoryNotFoundError, "missing"), (IncompleteSnapshotError, "incomplete")):
        if isinstance(e, cls):
            return case
    if isinstance(e, HfHubHTTPError) and getattr(e.response, "status_code", None) == 401:
        return "token"
    if constants.is_offline_mode():
        return "offline"
    # LocalEntryNotFoundError (no connection, nothing cached), datasets' ConnectionError, httpx's errors
    unreachable = isinstance(e, (LocalEntryNotFoundError, ConnectionError)) or type(e).__module__.startswith("httpx")
    return "unreachable" if unreachable else "other"


def explain(kind: str, repo_id: str, revision: str | None, e: BaseException, case: str | None = None) -> str:
    """One line for a hub failure of `kind` ('model' or 'dataset') `repo_id`, by what went wrong
    (`case`, default `classify(e)`)."""
    what = f"{kind} {repo_id}" + (f" (revision {revision})" if revision else "")
    page = f"huggingface.co/{'datasets/' if kind == 'dataset' else ''}{repo_id}"
    lines = {
        "gated": f"gated: accept its terms on {page} and log in (HF_TOKEN)",
        "revision": f"no such revision on the Hugging Face Hub (a branch, tag or commit hash of {page})",
        "missing": f"no such {kind} on the Hugging Face Hub ({LOGIN})",
        "token": "the Hugging Face Hub refused the token (401 Unauthorized); check HF_TOKEN or hf auth login",
        "incomplete": f"the cached copy is incomplete ({_one_line(e, 120)}); download it again with network access",
        "offline": f"not in the local Hugging Face cache ({cache_home()}) and HF_HUB_OFFLINE=1: download it once "
                   "with network access",
        "unreachable": f"cannot reach the Hugging Face Hub ({type(e.__cause__ or e).__name__}) and it is not in "
                       f"the local cache ({cache_home()})",
    }
    case = case or classify(e)
    return f"{what}: {lines.get(case) or type(e).__name__ + ': ' + _one_line(e)}"


def load_dataset_dict(repo_id: str, config: str | None = None):
    """All splits of a Hub dataset (`datasets.load_dataset(repo_id, config)`), a DatasetDict;
    from the prepared cache with HF_HUB_OFFLINE=1. Raises HubError (one line). Loaded once per
    process and cache (the training and evaluation splits come from one load)."""
    try:
        import datasets
    except ImportError:
        raise HubError(f"dataset {repo_id}: reading a Hub dataset needs the datasets library: "
                       "pip install 'gspo[data]'") from None
    datasets.disable_progress_bars()
    return _load_dataset_dict(repo_id, config, str(datasets.config.HF_DATASETS_CACHE), datasets.config.HF_HUB_OFFLINE)


@functools.lru_cache(maxsize=4)
def _load_dataset_dict(repo_id: str, config: str | None, cache: str, offline: bool):
    import datasets

    try:
        return datasets.load_dataset(repo_id, config)
    except Exception as e:
        raise HubError(_dataset_error(repo_id, config, e)) from None


def _dataset_error(repo_id: str, config: str | None, e: BaseException) -> str:
    """One line for a failed `load_dataset`: the hub cases of `explain`, or a config problem."""
    from datasets.exceptions import DatasetNotFoundError

    msg = _one_line(e, 1000)
    if isinstance(e, DatasetNotFoundError):  # datasets' wrapping of the hub's error, its cause dropped at times
        case = "gated" if "gated" in msg else "revision" if msg.startswith("Revision") else "missing"
        return explain("dataset", repo_id, None, e, case=case)
    names = re.findall(r"'([^']+)'", msg.partition("[")[2].partition("]")[0]) or \
        msg.partition("cache: ")[2].partition(" Please")[0].split(", ")
    listed = ", ".join(sorted(n for n in names if n))
    where = f"dataset {repo_id}"
    if "Couldn't find cache for" in msg:  # offline, and this config was never prepared
        return (f"{where}: config {config!r} is not in the local Hugging Face cache ({cache_home()}; cached: "
                f"{listed or 'none'}) and HF_HUB_OFFLINE=1: download it once with network access")
    if "BuilderConfig" in msg and "not found" in msg:
        return f"{where}: no config {config!r} (configs: {listed}); choose one with --dataset-config"
    if "Config name is missing" in msg or "multiple" in msg and "configurations" in msg:
        return f"{where}: has several configs ({listed}); choose one with --dataset-config"
    return explain("dataset", repo_id, None, e)
