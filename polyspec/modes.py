"""The decoding modes, named once: ``ar`` runs the target alone, ``dual`` the target and the bottom (draft) level,
``chain`` every level. Light (no torch): the recipe schema, the CLI and the engine all read it."""

from __future__ import annotations

MODES = ("ar", "dual", "chain")  # fewest levels first
AR, DUAL, CHAIN = MODES
# dual with prompt lookup (decode.ngram) as the draft: a profile candidate, a bench mode; a chain that chose it
# records mode dual with decode.ngram true
DUAL_NGRAM = "dual-ngram"


def mode_of(n_levels: int) -> str:
    """The mode that runs ``n_levels`` levels: 1 -> ar, 2 -> dual, three or more -> chain."""
    return MODES[min(n_levels, len(MODES)) - 1]
