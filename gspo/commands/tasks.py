"""`gspo tasks`: the tasks a run can name, and one task's options.

    gspo tasks                                   # built-in tasks, then reasoning-gym's generators
    gspo tasks reasoning_gym:basic_arithmetic    # its options with their defaults, and a sample problem
"""

from __future__ import annotations

import textwrap

BUILTIN = {
    "arithmetic": "sums and differences of 3-digit numbers (model: tiny)",
    "addition": "sums of 3-digit numbers (model: tiny)",
    "chain": "long answers: count up from a in steps of d to 1000 (model: tiny-long)",
    "calculator": "multi-turn: two-digit products with a calculator tool (model: tiny-tool)",
}


def cmd_tasks(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args) or len(args) > 1:
        print(__doc__.strip().split("\n\n", 1)[1] if args and args[0] in ("-h", "--help") else
              "usage: gspo tasks [reasoning_gym:NAME]")
        return 0 if args and args[0] in ("-h", "--help") else 2
    if args:
        return _one(args[0])
    print("built-in tasks (--task NAME):")
    for name, what in BUILTIN.items():
        print(f"  {name:<11} {what}")
    from gspo.tasks.gym import TaskError, names

    try:
        found = names()
    except TaskError as e:
        print(f"\nreasoning-gym's tasks: {str(e).split(': ', 1)[1]}")
        return 0
    print(f"\nreasoning-gym's tasks (--task reasoning_gym:NAME, a mix: reasoning_gym:a=2,b=1; "
          f"options: gspo tasks reasoning_gym:NAME), {len(found)}:")
    print(textwrap.fill(", ".join(found), width=100, initial_indent="  ", subsequent_indent="  "))
    return 0


def _one(spec: str) -> int:
    from gspo.tasks.gym import PREFIX, GymTask, config_fields, parse_spec

    if spec in BUILTIN:
        print(f"{spec}: {BUILTIN[spec]}; no options")
        return 0
    mix = parse_spec(spec if spec.startswith(PREFIX) else PREFIX + spec)
    for name, _ in mix:
        print(f"reasoning_gym:{name} options (--task-option KEY=VALUE), with their defaults:")
        for key, default in config_fields(name).items():
            print(f"  {key} = {default!r}")
    task = GymTask.from_spec(spec if spec.startswith(PREFIX) else PREFIX + spec, test_size=1)
    example = task.test_set(1)[0]
    print(f"\na held-out problem:\n{textwrap.indent(str(example.prompt), '  ')}\nits answer: {example.answer}")
    return 0
