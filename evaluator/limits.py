"""The size limit of the credit game, the one constant every layer checks against.

Torch-free on purpose: the CLI's option definitions and the API's request models import it at
start-up. Read `MAX_PLAYERS`.
"""

from __future__ import annotations

from typing import Final

MAX_PLAYERS: Final = 12
"""Largest supported game (m actions per rollout). Exact credit needs the evaluator on all 2**m
coalitions of every rollout: 2**12 = 4096 evaluator calls per rollout is the most the credit
path budgets (the coalition lists alone are (R, 4096, K)); beyond that use a sampling estimator
instead. The experiments use at most m = 8 (256 coalitions; `casi experiment credit`)."""

MAX_FEEDBACK_WORDS: Final = 64
"""The most feedback words a ``feedback`` prompt may show (`evaluator.feedback`): a prompt stays
short (about 1.3 tokens a word)."""
