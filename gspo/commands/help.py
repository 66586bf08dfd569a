"""`gspo train --help`: the options of TrainConfig section by section, the algorithms' presets, KL estimators.

The sections are TrainConfig's own (gspo.config.SECTIONS); the text of every option is its
`opt(..., help)` in gspo.config.sections (also shown by tyro and docs/options.md); the algorithms and
their presets are the registered losses (gspo.algo.losses.register_loss).
"""

from __future__ import annotations

import dataclasses
import shutil
import textwrap
import typing

from gspo.algo.losses import LOSSES
from gspo.config import SECTIONS, Loss, option_types

INTRO = """usage: gspo train [--config FILE] [--resume RUN_DIR] [OPTIONS]

Train a policy with GSPO (the default) or another registered loss (below): sample a
group of completions per prompt, score them, turn rewards into advantages, and update with a
clipped (or gated) objective.
Every option is also a key of a YAML file given with --config (underscores for dashes);
--resume RUN_DIR continues a run (options that are safe to change may be given with it).

Coming from TRL? TRL's GRPOConfig option names are accepted too, as flags (--num_generations 8 or
--num-generations 8 is --group-size 8; --learning_rate is --lr, --max_completion_length is
--max-new-tokens, --loss_type dr_grpo is --loss-agg seq-mean-token-sum-norm), as YAML keys and in
TrainConfig.from_trl. docs/trl.md maps every name (gspo/config/trl.py is the table), says what does not
map, and lists the defaults that differ: --device is cpu unless given (TRL takes the GPU when there
is one); the ratio and clip range, updates per rollout, learning rate and precision differ too.

algorithms and their presets (the clip range applies unless --clip-low/--clip-high say otherwise):
{presets}
KL penalty (--beta > 0) per sampled token, ρ = π_ref/π: k1 = -log ρ has an expected gradient of
0 (no pull at all); k2 = ½ (log ρ)² pulls along ∇KL(π‖π_ref); k3 = ρ - 1 - log ρ (default)
along the reverse ∇KL(π_ref‖π), as in GRPO. See docs/library.md.
"""


def _flag(name: str, hint) -> str:
    flag = "--" + name.replace("_", "-")
    args = typing.get_args(hint)
    if name == "algorithm":  # a registered loss (gspo.algo.losses.LOSSES)
        return f"{flag} {{{','.join(LOSSES)}}}"
    if hint is bool:
        return f"{flag}, --no-{name.replace('_', '-')}"
    if typing.get_origin(hint) is typing.Literal:
        return f"{flag} {{{','.join(map(str, args))}}}"
    if typing.get_origin(hint) is tuple:
        return f"{flag} {'VALUE [VALUE ...]' if Ellipsis in args else ' '.join(['VALUE'] * len(args))}"
    kind = next((a for a in args if a is not type(None)), hint) if args else hint
    return f"{flag} {getattr(kind, '__name__', 'VALUE').upper()}"


def _clip_range(info) -> str:
    low, high = info.clip_low, info.clip_high
    if info.gate:  # no clip range: its own options say how it gates
        return "gate " + ", ".join(f"--{o.replace('_', '-')} {getattr(Loss, o):g}" for o in info.options)
    return info.clip_text(low, high)


def train_help(width: int | None = None) -> str:
    width = width or min(110, shutil.get_terminal_size((100, 20)).columns)
    hints = option_types()
    presets = "".join(f"  {name:<11} {_clip_range(info)}: {info.summary}\n" for name, info in LOSSES.items())
    out = [INTRO.format(presets=presets)]
    for cls, title in SECTIONS.values():
        out.append(f"{title}:")
        for f in dataclasses.fields(cls):
            text = f"{f.metadata['help']} (default: {f.default})"
            out.append(f"  {_flag(f.name, hints[f.name])}")
            out += textwrap.wrap(text, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
        out.append("")
    return "\n".join(out)
