"""EAGLE-2 draft trees: the bottom level drafts a tree, one forward per depth, and the level directly above verifies
every node in one forward and walks it from the root (:func:`verify_tree`).

The root's children are the draft's top_k candidates after the context; at each further depth the top_k nodes of the
newest depth with the highest cumulative draft log-probability go through the draft in one forward (each sees its
ancestors through a tree mask) and each gets top_k children. At T = 0 the best total_tokens nodes of everything drawn
are kept (EAGLE-2's re-ranking; the set is ancestor-closed because a child's score never exceeds its parent's). At
T > 0 nothing is re-ranked: whether a node joins the tree must not depend on its own token, or the verification would
no longer be exact, so every drawn child is kept and the budget caps how many children are drawn (fixed before
drawing). With prompt lookup (``draft.lookup``), where the context already ends in a repeat, lookup's block is the
round's instead (a linear block, no draft forward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from polyspec.decode.drafting.lookup import proposed_block
from polyspec.decode.sampling import (
    argmax_rows,
    sample,
    sample_without_replacement,
    top_ids,
    top_log_probs,
    verify_candidates,
    warp,
)
from polyspec.decode.state import common_prefix


@dataclass
class Tree:
    """A draft tree in topological order (parents before children). Node -1 is the root: the last context token."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # 1 for the root's children
    children: dict[int, list[int]] = field(default_factory=dict)  # node -> children in the order they were drawn
    proposals: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> the draft row its children came from
    # cumulative draft log-probability (while drafting); 0.0 where a greedy tree reads none (_Drafting._scored)
    scores: list[float] = field(default_factory=list)

    def add(self, node: int, xs: list[int], logq: list[float], q: torch.Tensor | None, depth: int) -> list[int]:
        """Children ``xs`` of ``node``, drawn from the draft row q (None at T = 0) with log-probabilities logq;
        returns their ids."""
        if xs and q is not None:
            self.proposals[node] = q
        base = self.scores[node] if node >= 0 else 0.0
        new = list(range(len(self.tokens), len(self.tokens) + len(xs)))
        self.tokens += xs
        self.parents += [node] * len(xs)
        self.depths += [depth] * len(xs)
        self.scores += [base + lq for lq in logq]
        for c in new:
            self.children.setdefault(node, []).append(c)
        return new

    def kept(self, keep: list[int]) -> Tree:
        """The nodes ``keep`` (ascending, ancestor-closed) renumbered 0 .. len(keep) - 1."""
        new_id = {old: j for j, old in enumerate(keep)} | {-1: -1}
        out = Tree(tokens=[self.tokens[o] for o in keep], parents=[new_id[self.parents[o]] for o in keep],
                   depths=[self.depths[o] for o in keep])
        for old in keep:  # creation order keeps each node's children in their drawing order
            out.children.setdefault(new_id[self.parents[old]], []).append(new_id[old])
        out.proposals = {new_id[o]: q for o, q in self.proposals.items() if o in new_id}
        return out


def ancestor_mask(n_lin: int, width: int, nodes: list[int], parents: list[int], col: dict[int, int]) -> torch.Tensor:
    """A tree forward's mask [n_lin + len(nodes), width]: the first n_lin rows (context not in the cache yet) causal
    over the first n_lin columns; row n_lin + r sees those, nodes[r] and every ancestor of it (column col[a] for tree
    node a; -1 is the root). Written as bytes and made a tensor once: this runs every depth of every round, and each
    torch op costs tens of microseconds after a target forward has streamed its weights."""
    rows = n_lin + len(nodes)
    cells = bytearray(rows * width)
    for r in range(n_lin):
        cells[r * width:r * width + r + 1] = b"\x01" * (r + 1)
    for r, node in enumerate(nodes, start=n_lin):
        cells[r * width:r * width + n_lin] = b"\x01" * n_lin
        while node != -1:
            cells[r * width + col[node]] = 1
            node = parents[node]
    return torch.frombuffer(cells, dtype=torch.bool).view(rows, width) if cells else torch.zeros(rows, width,
                                                                                                 dtype=torch.bool)


class TreeDrafter:
    """An EAGLE-2 tree of ``shape`` (chain_spec.TreeShape) from level ``st.draft_level``, prompt-lookup blocks of up
    to ``lookup`` first."""

    has_level = True

    def __init__(self, shape: Any, lookup: int = 0):
        self.shape, self.lookup = shape, lookup

    def propose(self, st: Any, ctx: list[int], room: int) -> Tree | tuple[list[int], torch.Tensor | None]:
        i = st.draft_level
        if room < 1 or (st.levels[i].needs_features and len(ctx) < 2):
            return Tree()
        found = proposed_block(st, ctx, min(self.lookup, room))
        if found is not None:
            return found
        return _Drafting(st, self.shape, ctx, room).run()


class _Drafting:
    """One tree being drawn: the draft's forwards depth by depth (see the module docstring)."""

    def __init__(self, st: Any, shape: Any, ctx: list[int], room: int):
        self.st, self.shape, self.ctx, self.room = st, shape, ctx, room
        self.i = st.draft_level
        self.level = st.levels[self.i]
        self.tree = Tree()
        self.budget = 10 ** 9 if st.greedy else shape.total_tokens  # T = 0: draw freely, re-rank after
        self.hidden_of: dict[int, torch.Tensor] = {}
        self._root_feature: torch.Tensor | None = None

    def run(self) -> Tree:
        st, shape = self.st, self.shape
        logits = st.forward(self.i, self.ctx, first_row=len(self.ctx) - 1)  # [1, V]
        st.check_vocab(logits.shape[-1], self.i)
        newest = self._expand([-1], logits, 1)  # logits [1, V]: the root's row
        in_cache: list[int] = []  # tree nodes appended to the draft's cache, in cache order
        base_len = self.level.cache_len
        for depth in range(2, min(shape.depth, self.room) + 1):
            frontier = self._frontier(newest)
            if not frontier or len(self.tree.tokens) >= self.budget:
                break
            out = self._forward(in_cache, frontier)
            in_cache += frontier
            newest = self._expand(frontier, out[:len(frontier)], depth)
        if self.level.cache_len != base_len:
            self.level.truncate(base_len)  # drop the tree entries: the draft holds ctx only again
        return self._finished()

    def root_feature(self) -> torch.Tensor:
        """The feature the draft reads after the context (looked up at the first forward past depth 1 that needs it:
        a depth-1 tree never does)."""
        if self._root_feature is None:
            self._root_feature = self.st.root_feature(self.i, self.ctx)
        return self._root_feature

    def _frontier(self, newest: list[int]) -> list[int]:
        """The nodes expanded next: the newest depth's best by score, none after an EOS (at T > 0 only as many as the
        budget can still give children)."""
        t, k = self.tree, self.shape.top_k
        width = k if self.st.greedy else min(k, -(-(self.budget - len(t.tokens)) // k))
        return sorted((n for n in newest if t.tokens[n] not in self.st.eos), key=lambda n: -t.scores[n])[:width]

    def _forward(self, in_cache: list[int], frontier: list[int]) -> torch.Tensor:
        """One draft forward over the frontier (each node sees its ancestors, all in the cache already)."""
        t = self.tree
        col = {n: c for c, n in enumerate(in_cache + frontier)}
        mask = ancestor_mask(0, len(in_cache) + len(frontier), frontier, t.parents, col)
        feats = None
        if self.level.needs_features:
            feats = torch.stack([self.root_feature() if t.parents[n] == -1 else self.hidden_of[t.parents[n]]
                                 for n in frontier])
        positions = [len(self.ctx) - 1 + t.depths[n] for n in frontier]
        out, hid = self.level.forward_tree([t.tokens[n] for n in frontier], positions, mask, feats)
        self.st.stats[self.i].forward_passes += 1
        if hid is not None:
            self.hidden_of.update(zip(frontier, hid, strict=False))
        return out

    def _expand(self, nodes: list[int], rows: torch.Tensor, depth: int) -> list[int]:
        """Children for each of ``nodes`` from its draft row (rows [F, V]); returns the new nodes."""
        st, k, new = self.st, self.shape.top_k, []
        if st.greedy:  # the whole forward's rows read once: each row's k best and their log-probabilities
            tokens, logq = top_log_probs(rows, k) if self._scored() else self._unscored(rows, k)  # [F][k] each
            for r, node in enumerate(nodes):
                new += self.tree.add(node, tokens[r], logq[r], None, depth)
            return new
        for r, node in enumerate(nodes):
            q = warp(rows[r], st.sampling.temperature, st.sampling.top_p, st.sampling.top_k)  # [V]
            n = min(k, self.budget - len(self.tree.tokens))
            xs, qx = sample_without_replacement(q, n, st.noise(q.device)) if n > 0 else ([], [])
            new += self.tree.add(node, xs, [math.log(max(p, 1e-300)) for p in qx], q, depth)
        return new

    @staticmethod
    def _unscored(rows: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
        ids = top_ids(rows, k)
        return ids, [[0.0] * len(row) for row in ids]

    def _scored(self) -> bool:
        """Whether a greedy tree reads its nodes' scores: to pick a frontier past depth 1 or to keep the best
        total_tokens of more drawn. A depth-1 tree keeping every child reads none, so its children come from
        top_ids, no softmax over the row (1.012x the tree's speed in whole generations, docs/DECODE.md)."""
        return min(self.shape.depth, self.room) > 1 or self.shape.top_k > self.shape.total_tokens

    def _finished(self) -> Tree:
        t = self.tree
        keep = list(range(len(t.tokens)))
        if self.st.greedy and len(keep) > self.shape.total_tokens:
            keep = sorted(sorted(keep, key=lambda n: (-t.scores[n], t.depths[n], n))[:self.shape.total_tokens])
        self.st.draft_stats.tokens_emitted += len(keep)
        return t.kept(keep)


def verify_tree(st: Any, i: int, ctx: list[int], tree: Tree, room: int) -> tuple[list[int], torch.Tensor | None]:
    """Level i (directly above the draft) runs ONE forward over its unprocessed context plus every tree node (each
    node sees the context and its ancestors) and walks the tree from the root (:func:`walk`); its cache keeps the
    accepted path, compacted into place. Returns the tokens it emits and p_i at their positions (None at T = 0)."""
    level = st.levels[i]
    start = min(common_prefix(st.seen[i], ctx), len(ctx) - 1)
    st.truncate(i, start)
    if level.cache_len > start:
        level.truncate(start)
    lin = ctx[start:]
    n_lin, n_tree = len(lin), len(tree.tokens)
    mask = ancestor_mask(n_lin, n_lin + n_tree, list(range(n_tree)), tree.parents, {j: n_lin + j for j in range(n_tree)})
    positions = list(range(start, len(ctx))) + [len(ctx) - 1 + d for d in tree.depths]
    logits, hidden = level.forward_tree(lin + tree.tokens, positions, mask)
    st.stats[i].forward_passes += 1
    st.seen[i] = list(ctx)
    st.has_hidden[i] += [False] * n_lin
    if hidden is not None and st.feeds(i):
        st.store_hidden(i, start, hidden[:n_lin])
    st.check_vocab(logits.shape[-1], i)
    out, path, p = walk(st, tree, logits[n_lin - 1:])  # row 0: the root (last context token); 1 + j: node j
    out = st.cut(out, room)
    _keep_path(st, i, ctx, tree, path[:len(out)], hidden[[n_lin + a for a in path[:len(out)]]]
               if hidden is not None and st.feeds(i) else None)
    st.roll_back_below(i, ctx + out)
    return out, None if p is None else p[:len(out)]


def _keep_path(st: Any, i: int, ctx: list[int], tree: Tree, path: list[int], hidden: torch.Tensor | None) -> None:
    """Level i's cache keeps the accepted path right after ctx (a level without compact() recomputes it instead)."""
    level = st.levels[i]
    if not path or not hasattr(level, "compact"):
        level.truncate(len(ctx))
        return
    level.compact([len(ctx) + a for a in path], len(ctx))
    st.seen[i] = list(ctx) + [tree.tokens[a] for a in path]
    st.has_hidden[i] += [False] * len(path)
    if hidden is not None:
        st.store_hidden(i, len(ctx), hidden)


def walk(st: Any, tree: Tree, logits: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor | None]:
    """Walk a verified tree down from the root (logits [1 + n_tree, V]: row 0 the root, row 1 + j node j): at each
    node its children are verified with :func:`~polyspec.decode.sampling.verify_candidates`, the walk goes down the
    accepted child and ends with the correction token or, at a leaf, a bonus token. Returns the tokens emitted, the
    accepted path (tree nodes) and the verifier's distributions at the emitted positions ([len, V]; None at T = 0,
    as the linear rounds)."""
    if st.greedy:  # one-hot rows make verify_candidates argmax matching: every row's argmax, read once, walks it
        best = argmax_rows(logits)  # [1 + n_tree]
        out, path, node = [], [], -1
        while True:
            out.append(best[node + 1])
            kept = [c for c in tree.children.get(node, []) if tree.tokens[c] == out[-1]]
            if not kept or out[-1] in st.eos:
                return out, path, None
            node = kept[0]
            path.append(node)
    s = st.sampling
    out, path, rows, node = [], [], [], -1
    while True:  # only the rows the walk visits are warped
        rows.append(warp(logits[node + 1], s.temperature, s.top_p, s.top_k))
        kids = tree.children.get(node, [])
        if not kids:
            out.append(sample(rows[-1], st.gen))  # a leaf (or nothing drawn): the bonus token
            return out, path, torch.stack(rows)
        j, x = verify_candidates(rows[-1], tree.proposals[node], [tree.tokens[c] for c in kids], st.gen)
        out.append(x)
        if j is None or x in st.eos:
            return out, path, torch.stack(rows)
        node = kids[j]
        path.append(node)
