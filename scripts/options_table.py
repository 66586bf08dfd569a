"""The Markdown tables of `gspo train` options, from their help in gspo.config.sections, by section.

    python scripts/options_table.py            # print them
    python scripts/options_table.py --write    # replace them in docs/options.md

The sections are TrainConfig's, as `gspo train --help` shows them (gspo.config.SECTIONS); tests/test_docs.py
fails when docs/options.md differs from this output.
"""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gspo.config import SECTIONS  # noqa: E402

OPTIONS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "options.md"
START, END = "<!-- options:start -->", "<!-- options:end -->"


def table() -> str:
    out = []
    for cls, title in SECTIONS.values():
        out += [f"### {title[0].upper()}{title[1:]}", "", "| option | default | meaning |", "| --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            out.append(f"| `{flag}` | `{f.default}` | {f.metadata['help'].replace('|', '/')} |")
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
