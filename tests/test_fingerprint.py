"""A run's fingerprint (gspo.train.fingerprint): what each option's name points at, hashed where it
is a local file, recorded as named where it is not; what a difference says."""

import hashlib
import json
import os
from pathlib import Path

import gspo
from gspo.config import TrainConfig
from gspo.train.fingerprint import FILE_OPTIONS, differences, fingerprint
from gspo.train.resolve import absolute_paths


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_local_files_are_hashed_and_names_recorded_as_named(tmp_path):
    (tmp_path / "r.py").write_text("def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    cfg = TrainConfig(model="Qwen/Qwen3-0.6B", revision="v1", dataset="openai/gsm8k",
                      reward=(f"{tmp_path}/r.py:f", "exact_match", "gspo.rewards.builtin:exact_match"))
    got = fingerprint(cfg)
    assert got["gspo"] == gspo.__version__
    assert got["inputs"] == {
        "--model": {"Qwen/Qwen3-0.6B@v1": None},  # a Hub id with its revision, not hashed
        "--dataset": {"openai/gsm8k": None},
        "--reward": {f"{tmp_path}/r.py:f": _sha256((tmp_path / "r.py").read_bytes()),  # the file of file.py:f
                     "exact_match": None,  # gspo's own
                     # a module's source file, found as import finds it
                     "gspo.rewards.builtin:exact_match": _sha256((Path(gspo.__file__).parent / "rewards" /
                                                                  "builtin.py").read_bytes())}}
    assert set(FILE_OPTIONS) >= {"model", "dataset", "eval_dataset", "reward", "env"}
    # a built-in model; the options not set are left out
    assert fingerprint(TrainConfig(model="tiny"))["inputs"] == {"--model": {"tiny": None}}


def test_a_directory_is_its_files_by_path_hidden_ones_left_out(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, order in ((a, ("x.jsonl", "sub/y.jsonl")), (b, ("sub/y.jsonl", "x.jsonl"))):
        for name in order:  # written in another order: the same digest
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(name)
    (b / ".cache").mkdir()
    (b / ".cache" / "lock").write_text("downloaded at ...")  # hidden: not the model's
    digest = fingerprint(TrainConfig(dataset=str(a)))["inputs"]["--dataset"][str(a)]
    assert fingerprint(TrainConfig(dataset=str(b)))["inputs"]["--dataset"][str(b)] == digest
    (b / "sub" / "y.jsonl").rename(b / "y.jsonl")  # the same files elsewhere in it: another directory
    assert fingerprint(TrainConfig(dataset=str(b)))["inputs"]["--dataset"][str(b)] != digest


def test_differences_say_what_changed():
    old = {"gspo": "0.3.0", "inputs": {"--reward": {"/p/r.py:f": "aa", "exact_match": None}, "--dataset": {"d": "1"}}}
    assert differences(old, json.loads(json.dumps(old))) == []
    new = {"gspo": "0.4.0", "inputs": {"--reward": {"/p/r.py:f": "bb", "exact_match": None}, "--dataset": {"e": "1"}}}
    assert differences(old, new) == ["before --reward file /p/r.py changed", "with other --dataset",
                                     "with gspo 0.3.0 (now 0.4.0)"]


def test_every_file_option_names_its_file_from_any_working_directory(tmp_path, monkeypatch):
    # a run saves its options with absolute paths: resumed or compared from another working directory,
    # it reads (and fingerprints) the files it started with
    (tmp_path / "model").mkdir()
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (tmp_path / "r.py").write_text("def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    (tmp_path / "e.py").write_text("class E:\n    def step(self, text):\n        return None\n")
    monkeypatch.chdir(tmp_path)
    tmp_path = tmp_path.resolve()  # as the paths are saved: no symbolic link on the way
    cfg = absolute_paths(TrainConfig(model="model", dataset="rows.jsonl", eval_dataset="rows.jsonl",
                                     reward=("r.py:f",), env="e.py:E"))
    names = {name: getattr(cfg, name) for name in FILE_OPTIONS}
    assert names == {"model": f"{tmp_path}/model", "dataset": f"{tmp_path}/rows.jsonl",
                     "eval_dataset": f"{tmp_path}/rows.jsonl", "reward": (f"{tmp_path}/r.py:f",),
                     "env": f"{tmp_path}/e.py:E"}


def test_a_weight_file_is_known_by_its_size_and_time_unread(tmp_path, monkeypatch):
    # a 7B model's shards were read whole at every start (about 2 s per GB); a file of LARGE bytes or
    # more is now known by (size, modification time): a sparse file of that size costs nothing here
    from gspo.train import fingerprint as fp

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    shard = model / "model.safetensors"
    with open(shard, "wb") as f:
        f.truncate(fp.LARGE)  # sparse: LARGE bytes of zeros, none written
    os.utime(shard, ns=(1_000_000_000, 1_000_000_000))
    read = []
    monkeypatch.setattr(fp, "_file_digest", lambda path, *a: read.append(Path(path).name) or "d")
    first = fp._digest(model)
    assert read == ["config.json"]  # the shard was not read
    os.utime(shard, ns=(2_000_000_000, 2_000_000_000))  # rewritten: a new modification time
    assert fp._digest(model) != first
    os.utime(shard, ns=(1_000_000_000, 1_000_000_000))
    assert fp._digest(model) == first
