"""gspo: reinforcement-learning fine-tuning of language models with GSPO, GRPO, GSPO-token and PPO.

    import gspo
    summary = gspo.Trainer(gspo.TrainConfig(steps=60)).train()

See gspo.api.Trainer, and `gspo train --help` for the command line.
"""

from gspo.api import Trainer
from gspo.config import TrainConfig

__version__ = "0.2.0"
__all__ = ["Trainer", "TrainConfig", "__version__"]
