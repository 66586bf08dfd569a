"""Processes: the torchrun world (Dist), DDP and FSDP2 wrapping and gathers, the transports between a
trainer and its rollout workers (pipes and a spool, or gloo ranks), CPU threads, and where large CPU
tensors are allocated (memory).

May import: gspo.models, gspo.config (where the rollout workers run is read from the run's
configuration: distributed.worker_devices), gspo.io.
"""
