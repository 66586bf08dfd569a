"""The lab: `gspo compare` (presets, seeds, runs side by side), studies, statistics with familywise
corrections, reports and plots, and the ratio-variance study.

May import: gspo.train and everything below it.
"""
