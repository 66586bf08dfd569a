"""Models: loading a policy (built-in tiny models, local directories, hub ids, GGUF files), MoE routing,
the chunked LM head, log-probs of sampled tokens, packed sequences, and PPO's value head.

May import: gspo.io, gspo.algo (metrics, advantages). Nothing here samples, trains or reads a run's
configuration.
"""
