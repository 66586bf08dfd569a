"""Datasets: every format, splits, the seeded training order, and a corpus of malformed files."""

import json

import pytest

from gspo.config import Data
from gspo.tasks.data import DataError, load_dataset_task, read_records

ROWS = [{"prompt": f"q{i}", "answer": str(i), "level": i % 3} for i in range(20)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def files(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {"jsonl": write_jsonl(tmp_path / "d.jsonl", ROWS)}
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    out["json"] = tmp_path / "d.json"
    lines = ["prompt,answer,level"] + [f"{r['prompt']},{r['answer']},{r['level']}" for r in ROWS]
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    out["csv"] = tmp_path / "d.csv"
    (tmp_path / "d.tsv").write_text("\n".join(x.replace(",", "\t") for x in lines) + "\n")
    out["tsv"] = tmp_path / "d.tsv"
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    out["parquet"] = tmp_path / "d.parquet"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    out["saved"] = tmp_path / "saved"
    (tmp_path / "files").mkdir()
    write_jsonl(tmp_path / "files" / "train.jsonl", ROWS)
    out["folder"] = tmp_path / "files"
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "tsv", "parquet", "saved", "folder"])
def test_every_format_reads_the_same_rows(files, fmt):
    recs = read_records(files[fmt], "train")
    assert len(recs) == 20
    assert [r["prompt"] for _, r in recs] == [r["prompt"] for r in ROWS]
    assert [str(r["answer"]) for _, r in recs] == [r["answer"] for r in ROWS]
    assert str(files[fmt]) in recs[3][0]


def test_holdout_split_is_fixed_and_disjoint(files):
    t1 = load_dataset_task(str(files["jsonl"]), eval_size=500)
    t2 = load_dataset_task(str(files["jsonl"]), eval_size=500)
    # 20 rows: holds out min(500, 20 // 10) = 2 rows
    assert len(t1.eval) == 2 and len(t1.train) == 18
    assert [e.prompt for e in t1.eval] == [e.prompt for e in t2.eval]
    assert not {e.prompt for e in t1.eval} & {e.prompt for e in t1.train}


def test_training_order_covers_each_epoch_once(files):
    task = load_dataset_task(str(files["jsonl"]), eval_path=str(files["json"]))
    assert len(task.train) == 20 and len(task.eval) == 20
    # 20 rows, 5 per step: steps 1-4 are epoch 0, a permutation of all rows
    epoch0 = [e.prompt for s in range(1, 5) for e in task.train_batch(s, 5, seed=0)]
    assert sorted(epoch0) == sorted(r["prompt"] for r in ROWS)
    assert task.train_batch(2, 5, seed=0) == task.train_batch(2, 5, seed=0)
    assert task.train_batch(5, 5, seed=0) != task.train_batch(1, 5, seed=0)  # epoch 1 reshuffles
    assert task.train_batch(1, 5, seed=1) != task.train_batch(1, 5, seed=0)
    # a batch may straddle epochs: 20 rows, 6 per step -> step 4 takes 2 rows of epoch 1
    assert len(task.train_batch(4, 6)) == 6


def test_columns_and_chat_prompts(tmp_path):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    p = write_jsonl(tmp_path / "c.jsonl", [{"question": msgs, "solution": 4, "topic": "math"}] * 3)
    task = load_dataset_task(str(p), Data(prompt_column="question", answer_column="solution"))
    ex = task.train[0]
    assert ex.is_chat and ex.prompt == msgs and ex.answer == 4
    assert ex.columns == {"solution": 4, "topic": "math"}


def test_dataset_dict_splits(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:15]),
                               "test": datasets.Dataset.from_list(ROWS[15:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    task = load_dataset_task(str(tmp_path / "dd"), Data(dataset_split="train", eval_split="test"))
    assert len(task.train) == 15 and len(task.eval) == 5
    with pytest.raises(DataError, match=r"no split 'validation' \(splits: train, test\)"):
        load_dataset_task(str(tmp_path / "dd"), Data(dataset_split="validation"))


# A corpus of malformed datasets: (file name, content, expected message fragment). Each message
# must name the file, the line/row, and the field where there is one.
MALFORMED = [
    ("bad.jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n', "bad.jsonl line 2: not valid JSON"),
    ("list.jsonl", '{"prompt": "a", "answer": "1"}\n[1, 2]\n', "list.jsonl line 2: expected a JSON object, got list"),
    ("nocol.jsonl", '{"question": "a", "answer": "1"}\n',
     "nocol.jsonl: no column 'prompt' (columns: question, answer)"),
    ("noans.jsonl", '{"prompt": "a"}\n', "noans.jsonl: no column 'answer'"),
    ("missing.jsonl", '{"prompt": "a", "answer": "1"}\n{"answer": "2"}\n',
     "missing.jsonl line 2: missing field 'prompt'"),
    ("empty_prompt.jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": "  ", "answer": "2"}\n',
     "empty_prompt.jsonl line 2: field 'prompt' is empty"),
    ("int_prompt.jsonl", '{"prompt": 7, "answer": "1"}\n',
     "int_prompt.jsonl line 1: field 'prompt' must be a non-empty string or a list of chat messages, got int"),
    ("null_prompt.jsonl", '{"prompt": null, "answer": "1"}\n', "null_prompt.jsonl line 1: field 'prompt' must be"),
    ("bad_msgs.jsonl", '{"prompt": [{"role": "user"}], "answer": "1"}\n',
     "bad_msgs.jsonl line 1: field 'prompt' is a list but not of chat messages"),
    ("list_answer.jsonl", '{"prompt": "a", "answer": [1, 2]}\n',
     "list_answer.jsonl line 1: field 'answer' must be a string or a number, got list"),
    ("bool_answer.jsonl", '{"prompt": "a", "answer": true}\n',
     "bool_answer.jsonl line 1: field 'answer' must be a string or a number, got bool"),
    ("empty.jsonl", "\n\n", "empty.jsonl: no rows"),
    ("obj.json", '{"prompt": "a"}', "obj.json: expected a JSON list of objects, got dict"),
    ("broken.json", '[{"prompt": "a",\n "answer": }]', "broken.json line 2: not valid JSON"),
    ("ragged.csv", "prompt,answer\na,1\nb,2,3\n", "ragged.csv row 2: more fields than the header has columns"),
    ("nocol.csv", "question,answer\na,1\n", "nocol.csv: no column 'prompt'"),
    ("data.txt", "hello\n", "data.txt: unsupported file type '.txt'"),
    ("latin1.jsonl", b'{"prompt": "caf\xe9", "answer": "1"}\n', "latin1.jsonl: not UTF-8 text"),
    ("bad.parquet", "not parquet at all", "bad.parquet: not a readable Parquet file"),
]


@pytest.mark.parametrize("name,content,expected", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_datasets_name_file_row_and_field(tmp_path, name, content, expected):
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError) as e:
        load_dataset_task(str(p))
    msg = str(e.value)
    assert expected in msg, msg
    assert "\n" not in msg


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such file or directory"):
        load_dataset_task(str(tmp_path / "nope.jsonl"))


def test_single_row_needs_an_eval_set(tmp_path):
    p = write_jsonl(tmp_path / "one.jsonl", ROWS[:1])
    with pytest.raises(DataError, match="need at least 2"):
        load_dataset_task(str(p))
    assert len(load_dataset_task(str(p), eval_path=str(p)).train) == 1


def test_eval_size_0_holds_nothing_out(files):
    """--eval-size 0 trains without evaluation: every row trains, none is held out (it divided
    by the held-out count, 0, before)."""
    task = load_dataset_task(str(files["jsonl"]), eval_size=0)
    assert task.eval == [] and len(task.train) == 20 and task.notes == []  # the fixture's 20 rows
