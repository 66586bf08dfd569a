"""gspo: reinforcement-learning fine-tuning of language models with GSPO, GRPO, GSPO-token and PPO.

    import gspo
    summary = gspo.Trainer(gspo.TrainConfig(steps=60)).train()

See gspo.api.Trainer, and `gspo train --help` for the command line.

`import gspo` is light: `gspo.Trainer` (torch, transformers) and `gspo.TrainConfig` are imported
on first use (PEP 562), as is any submodule named as an attribute (`gspo.models.loading`), so the `gspo`
command's help, `--version` and usage errors do not wait for the training stack.
"""

import importlib
import importlib.util

__version__ = "0.3.0"  # the one place the version is written (pyproject.toml reads it)
__all__ = ["Trainer", "TrainConfig", "__version__"]

_LAZY = {"Trainer": "gspo.api", "TrainConfig": "gspo.config"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # gspo.models.loading without `import gspo.models.loading`
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_LAZY})
