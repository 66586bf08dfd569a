"""Two compare.json files, number by number: how many are equal, and the largest differences.

    python benchmarks/compare_diff.py OLD/compare.json NEW/compare.json [--top 10]

For checking that a speed-up left a comparison's results alone (docs/performance.md): wall and
evaluation times are left out (they are what changed); a figure present in one file only is
listed as such. Exit status 0 whatever it finds: it reports, the reader judges.
"""

from __future__ import annotations

import argparse
import json

TIMES = ("wall_seconds", "eval_seconds")


def numbers(x, path: str = ""):
    """(path, value) of every leaf, timings left out."""
    if isinstance(x, dict):
        for k, v in x.items():
            if not k.startswith(TIMES):
                yield from numbers(v, f"{path}/{k}")
    else:
        yield path, x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    old, new = (dict(numbers(json.load(open(p)))) for p in (args.old, args.new))
    only = sorted(set(old) ^ set(new))
    equal, differ = 0, []
    for path in sorted(set(old) & set(new)):
        a, b = old[path], new[path]
        if a == b:
            equal += 1
        elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            differ.append((abs(a - b) / max(abs(a), abs(b)), path, a, b))
        else:
            differ.append((float("inf"), path, a, b))
    print(f"{equal} figures equal, {len(differ)} differ, {len(only)} in one file only")
    if differ:
        print(f"largest relative differences (of {len(differ)}):")
        for rel, path, a, b in sorted(differ, reverse=True)[: args.top]:
            print(f"  {path}: {a!r} -> {b!r} ({rel:.2e} relative)")
    accuracy = [d for d in differ if d[1].rsplit("/", 1)[-1].startswith("accuracy")]
    print(f"accuracy figures that differ: {len(accuracy)}")
    for path in only:
        print(f"  only in {'old' if path in old else 'new'}: {path}")


if __name__ == "__main__":
    main()
