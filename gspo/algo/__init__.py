"""The math of an update: policy losses, their aggregation, advantages, sampler/trainer corrections, and
how each metric averages across tokens and processes.

Pure functions of tensors. May import: torch, gspo.io (words for messages). Imports no configuration,
no model, nothing that samples: a loss reads its options through the small protocol it declares
(gspo.algo.losses.LossOptions), which the configuration's Loss section satisfies.
"""
