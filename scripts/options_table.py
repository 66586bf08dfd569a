"""The Markdown table of `gspo train` options, from TrainConfig's field docstrings.

    python scripts/options_table.py            # print it
    python scripts/options_table.py --write    # replace the table in docs/options.md

tests/test_docs.py fails when docs/options.md's table differs from this output.
"""

import ast
import dataclasses
import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gspo.config import TrainConfig  # noqa: E402


def field_docs(cls) -> dict[str, str]:
    """Docstrings written under dataclass fields (what tyro shows as --help)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


OPTIONS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "options.md"
START, END = "<!-- options:start -->", "<!-- options:end -->"


def table() -> str:
    docs = field_docs(TrainConfig)
    rows = ["| option | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = "--" + f.name.replace("_", "-")
        rows.append(f"| `{flag}` | `{default}` | {docs.get(f.name, '').replace('|', '/')} |")
    return "\n".join(rows)


def main():
    if "--write" in sys.argv:
        text = OPTIONS_PAGE.read_text()
        head, rest = text.split(START, 1)
        _, tail = rest.split(END, 1)
        OPTIONS_PAGE.write_text(f"{head}{START}\n{table()}\n{END}{tail}")
    else:
        print(table())


if __name__ == "__main__":
    main()
