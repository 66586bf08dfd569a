"""The sampling side: rollouts (HF generate, gspo's fast decode, vLLM), multi-turn episodes and their
turn cache, a step's batch produced and scored, and the pipeline of batches (in process or rollout
workers).

May import: gspo.rewards, gspo.tasks, gspo.models, gspo.processes, gspo.algo, gspo.config, gspo.io.
"""
