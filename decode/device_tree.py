"""The device round for an EAGLE-2 draft tree at T = 0 (decode/drafting/tree.py's rules as fixed-shape tensor code).

A round grows the tree depth by depth on the device: the root's top_k children from the draft's first step (the
linear round's, decode/device_round.py), then per depth the top_k nodes of the newest depth by cumulative draft
log-probability go through the draft in one forward (each sees its ancestors among the tree entries already in the
draft's cache: a [top_k, (depth - 1) top_k] visibility over those slots) and each gets top_k children. The best
``total_tokens`` of all drawn nodes (ties: shallower first, so the set is ancestor-closed) are verified by the target in
one forward under their tree mask; the walk keeps a node when its token is the target's argmax at its parent and its
parent is kept (at most one child per node: siblings are distinct), the deepest kept node ends the path, and the
target's argmax there is the next token. The path's K/V entries move to the slots right after the context
(``index_select`` / ``index_copy_`` with device indices), its hidden states become the draft's features for the next
round. At T = 0 any tree gives the target's greedy tokens, so what is drafted changes acceptance only; at T > 0 the
decoder keeps the host path's tree (its recursive rejection sampling over candidates is not built here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from polyspec.decode.device_round import DeviceRound, RoundState


class TreeRound(DeviceRound):
    """A draft tree of ``shape`` (chain_spec.TreeShape): ``k`` is its depth (the longest path a round accepts)."""

    def __init__(self, target: Any, draft: Any, *, head: bool, shape: Any):
        super().__init__(target, draft, head=head, k=shape.depth)
        kk, d = shape.top_k, shape.depth
        self.top_k = kk
        self.nodes = kk + (d - 1) * kk * kk  # every node drawn
        self.size = min(shape.total_tokens, self.nodes)  # the nodes verified
        self.columns = max((d - 1) * kk, 1)  # tree slots in the draft's cache
        self._depths: torch.Tensor | None = None

    def widths(self) -> tuple[int, ...]:
        return 1, self.top_k, self.k + 1, self.size + 1

    @property
    def drafted(self) -> int:
        return self.size

    def applies(self, prompt: list[int], sampling: Any) -> bool:
        return super().applies(prompt, sampling) and sampling.temperature == 0

    def depths(self, device: torch.device) -> torch.Tensor:
        """Each drawn node's depth [nodes] (1: the root's children), in node order."""
        if self._depths is None or self._depths.device != device:
            kk = self.top_k
            self._depths = torch.tensor([1] * kk + [d for d in range(2, self.k + 1) for _ in range(kk * kk)],
                                        device=device)
        return self._depths

    def round(self) -> torch.Tensor:
        """One round -> [depth + 2] long: the accepted path length a, then the tokens at positions n .. n + depth
        (the path's a tokens, then the target's argmax after it)."""
        s, d = self.state, self.k
        tokens, scores, parents = self._grow(s)  # [M] each
        depth = self.depths(tokens.device)
        key = scores.double() - depth.double() * 1e-9  # equal scores: the ancestor first
        sel = torch.topk(key, self.size).indices.sort().values  # [N], topological
        tok, dep = tokens.index_select(0, sel), depth.index_select(0, sel)
        inv = torch.full_like(depth, -1).index_copy(0, sel, self.levels[0].rows[self.size + 1][:self.size])
        par = parents.index_select(0, sel)
        up = inv.index_select(0, par.clamp(min=0))  # the parent's index among the verified nodes (-1: not one)
        known = (par < 0) | (up >= 0)
        prow = torch.where(par < 0, 0, 1 + up)  # the parent's row in the verification (0: the root)
        logits, hidden = self._verify(s, tok, dep, self._ancestors(sel, parents, inv))
        best = torch.argmax(logits.float(), dim=-1)  # [N + 1]
        match = (tok == best.index_select(0, prow)) & known
        kept = torch.zeros_like(match)
        for _ in range(d):  # a node is kept when its parent is: d passes settle every depth
            kept = match & torch.cat((kept.new_ones(1), kept)).index_select(0, prow)
        a = (dep * kept).max()
        path = torch.stack([torch.argmax(((dep == j) & kept).int()) for j in range(1, d + 1)])  # [d]
        last = torch.where(a > 0, 1 + path.index_select(0, (a - 1).clamp(min=0).view(1))[0], 0)
        return self._commit(s, a, tok.index_select(0, path), path, best.index_select(0, last.view(1)), hidden)

    def _grow(self, s: RoundState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draw the tree: tokens, cumulative draft log-probabilities and parents (-1: the root) of every node [M]."""
        kk, lv = self.top_k, self.levels[1]
        logit, root = self._first_step(s)  # [1, V], [1, H]
        top = torch.topk(torch.log_softmax(logit.float(), dim=-1)[0], kk)
        tokens, scores = [top.indices], [top.values]
        parents = [torch.full((kk,), -1, dtype=torch.long, device=logit.device)]
        masks = [torch.zeros(kk, self.columns, dtype=torch.bool, device=logit.device)]  # ancestors' tree slots
        feats = [root.expand(kk, -1)]  # what each node's draft step reads: its parent's hidden state
        start, offset = lv.slot(s.n), 0  # the first tree slot; the newest depth's first node
        rows = lv.rows[kk]
        for depth in range(2, self.k + 1):
            pick = torch.topk(scores[-1], kk).indices  # the frontier: the newest depth's best [K]
            mask = masks[-1].index_select(0, pick) | F.one_hot((depth - 2) * kk + rows, self.columns).bool()
            logits, hidden = lv.step(tokens[-1].index_select(0, pick),
                                     feats[-1].index_select(0, pick) if self.head else None,
                                     start + (depth - 2) * kk, start, lv.slot(s.n + depth - 2).expand(kk),
                                     mask.int())
            top = torch.topk(torch.log_softmax(logits.float(), dim=-1), kk)  # [K, K]
            tokens.append(top.indices.flatten())
            scores.append((scores[-1].index_select(0, pick)[:, None] + top.values).flatten())
            parents.append((offset + pick).repeat_interleave(kk))
            masks.append(mask.repeat_interleave(kk, 0))
            feats.append(hidden.repeat_interleave(kk, 0))
            offset += tokens[-2].numel()
        return torch.cat(tokens), torch.cat(scores), torch.cat(parents)

    def _ancestors(self, sel: torch.Tensor, parents: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        """[N, N] bool: verified node j is a proper ancestor of verified node i."""
        n = self.size
        anc = torch.zeros(n, n, dtype=torch.bool, device=sel.device)
        up = parents.index_select(0, sel)
        for _ in range(self.k - 1):  # at most depth - 1 proper ancestors
            row = inv.index_select(0, up.clamp(min=0))
            seen = (up >= 0) & (row >= 0)
            anc |= F.one_hot(row.clamp(min=0), n).bool() & seen[:, None]
            up = torch.where(up >= 0, parents.index_select(0, up.clamp(min=0)), up)
        return anc

    def _verify(self, s: RoundState, tok: torch.Tensor, dep: torch.Tensor,
                anc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over the last committed token (the root) and the verified nodes, each seeing the context, the
        root and its ancestors -> (logits [N + 1, V], hidden [N + 1, H])."""
        n, target = self.size, self.levels[0]
        inner = torch.zeros(n + 1, n + 1, dtype=torch.int32, device=tok.device)
        inner[:, 0] = 1
        inner[1:, 1:] = (anc | torch.eye(n, dtype=torch.bool, device=tok.device)).int()
        start = s.n - 1
        ids = torch.cat((s.seq.index_select(0, start.view(1)), tok))
        return target.step(ids, None, start, start, torch.cat((start.view(1), start + dep)), inner)

    def _commit(self, s: RoundState, a: torch.Tensor, path_tokens: torch.Tensor, path: torch.Tensor,
                nxt: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Write the path and the next token, move the path's K/V into place, advance the state; -> the round's
        output."""
        d = self.k
        span = s.n + self.levels[0].rows[d + 1]  # positions n .. n + d
        s.seq.index_copy_(0, span[:d], path_tokens)
        s.seq.index_copy_(0, (s.n + a).view(1), nxt)
        out = torch.cat((a.view(1), s.seq.index_select(0, span)))
        src = s.n + path  # verified node i sits at slot n + i; slots past n + a - 1 receive scratch
        cache = self.target._cache
        for store in (*cache.k, *cache.v):
            store.index_copy_(2, span[:d], store.index_select(2, src))
        s.feat.copy_(hidden.index_select(0, torch.cat((path.new_zeros(1), 1 + path))))
        s.n.add_(a + 1)
        s.acc.copy_(a)
        s.rnd.add_(1)
        return out
