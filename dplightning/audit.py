"""Moved to :mod:`dplightning.commands.audit` (issue 26: the commands live together); still importable here."""

from dplightning.commands.audit import (
    SABOTAGES,
    AuditResult,
    Sabotage,
    audit,
    epsilon_lower_bound,
    fit_canary_steps,
    guesses,
    main,
    membership_scores,
    one_run_p_value,
    sabotaged,
)

__all__ = [
    "SABOTAGES",
    "AuditResult",
    "Sabotage",
    "audit",
    "epsilon_lower_bound",
    "fit_canary_steps",
    "guesses",
    "main",
    "membership_scores",
    "one_run_p_value",
    "sabotaged",
]
