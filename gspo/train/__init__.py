"""The training loop and what it stands on: building a run from its configuration (everything checked
before anything is written), the loop itself, a step's batch, optimizers, the PPO critic,
checkpoints, a run's life (one writer, signals), the plan it prints, held-out evaluation.

May import everything below it: gspo.agents, gspo.sampling, gspo.rewards, gspo.tasks, gspo.models,
gspo.processes, gspo.algo, gspo.config, gspo.io.
"""
