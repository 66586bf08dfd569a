"""Agents: episodes played by code gspo did not write. The OpenAI-compatible endpoint an agent calls
(gspo.agents.endpoint), the runner that plays each episode on its own event loop and lays its calls
out as the rows the policy sampled (gspo.agents.runner), the adapters of other libraries'
environments (verifiers: gspo.agents.vfenv; TRL's environment_factory: gspo.agents.trlenv; OpenEnv:
gspo.agents.openenv), and the sampling side built from a configuration with all of them
(gspo.agents.side: the task, the environment or agent, and who plays its episodes).

An episode's output is the sampling room's (gspo.sampling.episodes.Episodes): a Rollout with a row
per episode, and an episode's later sequences (forked or edited histories) as `Episodes.more`, so
the training room treats an agent's episodes as any multi-turn episodes.

May import: gspo.sampling, gspo.rewards, gspo.processes, gspo.models, gspo.tasks, gspo.config,
gspo.algo, gspo.io.
"""
