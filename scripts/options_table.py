"""The Markdown tables of `gspo train` options, from TrainConfig's field docstrings, by section.

    python scripts/options_table.py            # print them
    python scripts/options_table.py --write    # replace them in docs/options.md

The sections are those of `gspo train --help` (gspo.config.HELP_GROUPS); tests/test_docs.py
fails when docs/options.md differs from this output.
"""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gspo.config import TrainConfig  # noqa: E402
from gspo.help import HELP_GROUPS, field_docs  # noqa: E402

OPTIONS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "options.md"
START, END = "<!-- options:start -->", "<!-- options:end -->"


def table() -> str:
    docs = field_docs(TrainConfig)
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    out = []
    for group, names in HELP_GROUPS.items():
        out += [f"### {group[0].upper()}{group[1:]}", "", "| option | default | meaning |", "| --- | --- | --- |"]
        for name in names:
            flag = "--" + name.replace("_", "-")
            out.append(f"| `{flag}` | `{defaults[name]}` | {docs.get(name, '').replace('|', '/')} |")
        out.append("")
    return "\n".join(out).rstrip()


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
