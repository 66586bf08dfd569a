"""The command line's parts (gspo.cli is the entry point): flags from the configuration, help text,
the shortest `gspo train` command for a configuration, and the `gspo eval` and `gspo tasks` commands.

May import: gspo.lab, gspo.train and everything below them.
"""
