"""A Hugging Face cache built on disk, as a download would leave it, for offline hub tests.

    from tests.hubcache import cache_dataset, cache_model, offline_hub, tiny_qwen2_dir

    def test_x(tmp_path, monkeypatch):
        hf_home = tmp_path / "hf"
        cache_model(hf_home, "Qwen/Qwen2.5-0.5B-Instruct", tiny_qwen2_dir(tmp_path / "q"))
        cache_dataset(hf_home, "openai/gsm8k", {"train": rows, "test": rows}, config="main")
        offline_hub(monkeypatch, hf_home)        # HF_HOME + HF_HUB_OFFLINE=1, in this process
        ...                                      # or: subprocess.run(..., env=offline_env(hf_home))

Models: `HF_HOME/hub/models--ORG--NAME/` with `blobs/<sha256 (LFS) or git blob sha1>`,
`snapshots/<commit>/<file>` as relative symlinks to the blobs, `refs/<revision>` holding the
commit, and the tree listing `trees/<commit>.json` that `snapshot_download` writes (so the
offline completeness check of huggingface_hub runs as it would after a real download).

Datasets: the repository (one parquet file per config/split and a README.md whose `configs:`
YAML names them, like openai/gsm8k's `main/train-00000-of-00001.parquet`) in the hub cache,
AND the prepared arrow cache `HF_HOME/datasets/ORG___NAME/CONFIG/0.0.0/<commit>/` made by the
real parquet builder configured from that README with the commit as its hash, as
`load_dataset` online would leave it; offline, datasets 5.2 reads only the latter.

Left out: xet hashes, `.no_exist` markers, the parquet export of the dataset viewer.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".onnx", ".h5", ".msgpack", ".model", ".parquet")


def _blob_id(data: bytes) -> str:
    """The git blob sha1 of a file (the Hub's etag for a non-LFS file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_lfs(path: str, data: bytes) -> bool:
    return path.endswith(LFS_SUFFIXES) or len(data) > 10 * 2**20


def _storage(hf_home: Path, repo_type: str, repo_id: str) -> Path:
    return Path(hf_home) / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"


def put_repo(hf_home: Path, repo_type: str, repo_id: str, files: dict[str, bytes], revision: str = "main") -> str:
    """Write one commit of a repository into the hub cache; returns its 40-hex commit hash."""
    storage = _storage(hf_home, repo_type, repo_id)
    commit = hashlib.sha1(json.dumps([repo_id, revision, sorted((p, _blob_id(d)) for p, d in files.items())])
                          .encode()).hexdigest()
    tree = {}
    for rel, data in sorted(files.items()):
        lfs = _is_lfs(rel, data)
        etag = hashlib.sha256(data).hexdigest() if lfs else _blob_id(data)
        blob = storage / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = storage / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))  # as huggingface_hub's _create_symlink
        tree[rel] = {"size": len(data), "blob_id": _blob_id(data)}
        if lfs:
            tree[rel].update(lfs_sha256=etag, lfs_size=len(data))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / revision).write_text(commit)
    (storage / "trees").mkdir(exist_ok=True)
    (storage / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": tree}, indent=1))
    return commit


def cache_model(hf_home: Path, repo_id: str, src_dir: Path, revision: str = "main") -> str:
    """Put the files of `src_dir` (a save_pretrained folder) in the cache as `repo_id` at branch
    `revision` (refs/<revision>); returns the commit hash."""
    src = Path(src_dir)
    files = {p.relative_to(src).as_posix(): p.read_bytes() for p in sorted(src.rglob("*")) if p.is_file()}
    files.setdefault(".gitattributes", b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    return put_repo(hf_home, "model", repo_id, files, revision)


def _parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def _readme(configs: dict[str, list[str]]) -> bytes:
    """A dataset card whose `configs:` YAML lists each config's splits, as on gsm8k's card."""
    lines = ["---", "configs:"]
    for name, splits in sorted(configs.items()):
        lines += [f"- config_name: {name}", "  data_files:"]
        for split in splits:
            lines += [f"  - split: {split}", f"    path: {name}/{split}-*"]
    return ("\n".join(lines + ["---", "", "A dataset made by tests/hubcache.py.", ""])).encode()


def _snapshot_files(storage: Path, revision: str = "main") -> dict[str, bytes]:
    ref = storage / "refs" / revision
    if not ref.exists():
        return {}
    snap = storage / "snapshots" / ref.read_text()
    return {p.relative_to(snap).as_posix(): p.read_bytes() for p in sorted(snap.rglob("*")) if p.is_file()}


def cache_dataset(hf_home: Path, repo_id: str, rows_by_split: dict[str, list[dict]], config: str | None = None) -> str:
    """Put a dataset repository (parquet per split under `<config>/`) in the hub cache and prepare
    the arrow cache `load_dataset(repo_id, config, split=...)` reads offline; returns the commit.
    A second call with another config adds it to the same repository (a new commit)."""
    name = config or "default"
    files = _snapshot_files(_storage(hf_home, "dataset", repo_id))
    files.pop("README.md", None)
    for split, rows in rows_by_split.items():
        files[f"{name}/{split}-00000-of-00001.parquet"] = _parquet(rows)
    configs: dict[str, list[str]] = {}
    for rel in files:
        if rel.endswith(".parquet"):
            configs.setdefault(rel.split("/")[0], []).append(rel.split("/")[1].split("-")[0])
    files["README.md"] = _readme(configs)
    files.setdefault(".gitattributes", b"*.parquet filter=lfs diff=lfs merge=lfs -text\n")
    commit = put_repo(hf_home, "dataset", repo_id, files)
    snapshot = _storage(hf_home, "dataset", repo_id) / "snapshots" / commit
    for cfg in configs:
        _prepare(Path(hf_home) / "datasets", repo_id, snapshot, commit, cfg)
    return commit


def _prepare(cache_dir: Path, repo_id: str, snapshot: Path, commit: str, config: str) -> None:
    """Run the packaged parquet builder as `load_dataset` online would (HubDatasetModuleFactory:
    configs from the README, the commit as hash), with the data files read from the snapshot."""
    from datasets.load import (
        BuilderConfigsParameters,
        DatasetModule,
        create_builder_configs_from_metadata_configs,
        get_dataset_builder_class,
    )
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    module_path = _PACKAGED_DATASETS_MODULES["parquet"][0]
    metadata = MetadataConfigs.from_dataset_card_data(DatasetCard.load(snapshot / "README.md").data)
    configs, default = create_builder_configs_from_metadata_configs(module_path, metadata, base_path=str(snapshot))
    name = camelcase_to_snakecase(repo_id.split("/")[-1])
    module = DatasetModule(module_path, commit, {"base_path": str(snapshot), "dataset_name": name},
                           builder_configs_parameters=BuilderConfigsParameters(metadata, configs, default))
    builder_cls = get_dataset_builder_class(module, dataset_name=name)
    # without repo_id: the builder insists its data files are hf:// paths of the repo; the output
    # directory is the one it computes with repo_id (namespace___name/config/version/hash)
    builder = builder_cls(cache_dir=str(cache_dir), config_name=config, hash=commit, base_path=str(snapshot),
                          dataset_name=name)
    namespace = f"{repo_id.split('/')[0]}___" if "/" in repo_id else ""
    out = Path(cache_dir) / f"{namespace}{name}" / builder.config_id / str(builder.config.version) / commit
    builder.download_and_prepare(output_dir=str(out))
    Path(cache_dir, Path(builder._cache_dir).as_posix().replace("/", "_") + ".lock").unlink(missing_ok=True)


def tiny_qwen3_dir(path: Path, *, seed: int = 0, **config) -> Path:
    """A tiny random Qwen3ForCausalLM (2 layers, hidden 64) with a char tokenizer and a chat
    template, saved to `path` (tests/conftest.py `build_chat_model`); `config` overrides fields."""
    from tests.conftest import build_chat_model

    build_chat_model(path, seed=seed)
    if config:
        _rewrite_config(path, config)
    return Path(path)


def tiny_qwen2_dir(path: Path, *, seed: int = 0, **config) -> Path:
    """A tiny random Qwen2ForCausalLM (the Qwen2.5 architecture; 2 layers, hidden 64) with the
    same tokenizer and chat template as `tiny_qwen3_dir`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.conftest import build_chat_model

    build_chat_model(path, seed=seed)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    fields = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0,
                  eos_token_id=1, bos_token_id=None)
    cfg = Qwen2Config(**{**fields, **config})
    for stale in Path(path).glob("*.safetensors"):
        stale.unlink()
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return Path(path)


def _rewrite_config(path: Path, fields: dict) -> None:
    cfg_path = Path(path) / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **fields}, indent=2))


def offline_env(hf_home: Path) -> dict[str, str]:
    """os.environ with HF_HOME=hf_home and HF_HUB_OFFLINE=1 (for a subprocess); no token."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "HF_TOKEN",
                        "HF_DATASETS_OFFLINE")}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def offline_hub(monkeypatch, hf_home: Path, *, offline: bool = True) -> Path:
    """Point this process at `hf_home` (offline unless offline=False): the env vars, and the
    module constants huggingface_hub and datasets computed from them at import."""
    import datasets.config as dconf
    import huggingface_hub.constants as hconst

    hf_home = Path(hf_home)
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "HF_TOKEN", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    for name, value in {"HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub"),
                        "HUGGINGFACE_HUB_CACHE": str(hf_home / "hub"), "HF_HUB_OFFLINE": offline,
                        "HF_TOKEN_PATH": str(hf_home / "token"),
                        "HF_STORED_TOKENS_PATH": str(hf_home / "stored_tokens")}.items():
        monkeypatch.setattr(hconst, name, value, raising=False)
    datasets_cache = hf_home / "datasets"
    for name, value in {"HF_CACHE_HOME": str(hf_home), "HF_DATASETS_CACHE": datasets_cache,
                        "HF_HUB_OFFLINE": offline, "HF_DATASETS_OFFLINE": offline,
                        "DOWNLOADED_DATASETS_PATH": datasets_cache / dconf.DOWNLOADED_DATASETS_DIR,
                        "EXTRACTED_DATASETS_PATH": datasets_cache / dconf.DOWNLOADED_DATASETS_DIR
                        / dconf.EXTRACTED_DATASETS_DIR,
                        "HF_MODULES_CACHE": hf_home / "modules"}.items():
        monkeypatch.setattr(dconf, name, value, raising=False)
    return hf_home
