"""What proposes the tokens a round verifies: the one home of drafting.

A drafter turns the run's state and the context into the round's proposal for the level directly above it:

* a linear block ``(tokens, q)``: the tokens and the draft's distribution at each ([k, V]; None at T = 0, where
  verification is argmax matching), verified by one forward and exact speculative sampling (decode/chain.py);
* or a :class:`~polyspec.decode.drafting.tree.Tree`, verified by :func:`~polyspec.decode.drafting.tree.verify_tree`.

Drafters (each built from the chain's :class:`~polyspec.chain_spec.DraftSpec` by :func:`make_drafter`):
:class:`~polyspec.decode.drafting.linear.LinearDrafter` (the draft model's k tokens), :class:`~polyspec.decode.
drafting.tree.TreeDrafter` (its EAGLE-2 tree) and :class:`~polyspec.decode.drafting.lookup.LookupDrafter` (prompt
lookup alone, no model). Prompt lookup is one setting, ``draft.lookup``: the model drafters take its block first where
the context ends in a repeat. A drafter reads and moves caches only through the run's
:class:`~polyspec.decode.state.RunState`; ``has_level`` says whether the chain's bottom level is its draft model.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from polyspec.decode.drafting.linear import LinearDrafter
from polyspec.decode.drafting.lookup import LookupDrafter
from polyspec.decode.drafting.tree import Tree, TreeDrafter

Proposal = tuple[list[int], torch.Tensor | None] | Tree


class Drafter(Protocol):
    has_level: bool  # the chain's bottom level drafts (False: no model, prompt lookup alone)

    def propose(self, st: Any, ctx: list[int], room: int) -> Proposal:
        """The round's proposal after ``ctx`` (at most ``room`` tokens on any path)."""
        ...


def make_drafter(spec: Any) -> Drafter:
    """The drafter a :class:`~polyspec.chain_spec.DraftSpec` describes."""
    if spec.source == "lookup":
        return LookupDrafter(spec.lookup)
    if spec.tree is not None:
        return TreeDrafter(spec.tree, spec.lookup)
    return LinearDrafter(spec.k, spec.lookup)


__all__ = ["Drafter", "LinearDrafter", "LookupDrafter", "Proposal", "Tree", "TreeDrafter", "make_drafter"]
