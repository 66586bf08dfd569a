"""`python -m gspo`: the gspo command (gspo.cli), as torchrun starts it (`torchrun ... -m gspo train`)."""

from gspo.cli import entry

entry()
