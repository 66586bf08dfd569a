"""Rewards: the built-in rewards by name, rewards from your own code, and learned reward models.

May import: gspo.tasks (a task's own verifiers, the shared scoring), gspo.models, gspo.config (a bad
--reward-model-device is a ConfigError, as every bad option is), gspo.io.
"""
