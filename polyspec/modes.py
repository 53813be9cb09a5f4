"""The decoding modes, named once: ``ar`` runs the target alone, ``dual`` the target over a drafter (the bottom level,
or prompt lookup alone), ``chain`` every level. Light (no torch): the recipe schema, the CLI and the engine all read
it."""

from __future__ import annotations

MODES = ("ar", "dual", "chain")  # fewest levels first
AR, DUAL, CHAIN = MODES


def mode_of(n_levels: int) -> str:
    """The mode that runs ``n_levels`` levels (a drafter counted as one): 1 -> ar, 2 -> dual, three or more -> chain."""
    return MODES[min(n_levels, len(MODES)) - 1]
