"""The sampling maths of lossless speculative decoding, as small pure functions.

Every level's logits go through the same :func:`warp` (temperature, then top-k, then top-p), and the warped target
distribution is what the chain preserves. :func:`verify_block` is exact speculative sampling (Leviathan et al. 2023,
Chen et al. 2023): a token ``x`` proposed from ``q`` is kept with probability ``min(1, p(x)/q(x))``; at the first
rejection the replacement is drawn from :func:`residual` ``= normalise(max(0, p - q))``; if every token is kept a bonus
token is drawn from ``p`` at the next position. The tokens it emits are then exact samples from ``p``.

All randomness comes from a ``torch.Generator`` passed in, never from the global RNG. Temperature 0 is greedy: warped
rows are one-hot at the argmax (lowest index on ties), so acceptance is argmax matching and sampling returns the
argmax; the comparisons below are written so that one-hot rows give exact answers.

Host syncs: the distributions may live on an accelerator, where every read of a value by Python waits for the device.
So each function moves only the scalars its decision needs, gathered on the device and read in ONE transfer
(``tolist``), and never a full-vocabulary row; the acceptance uniforms are drawn on the host (a CPU generator) and
compared there. :func:`sample` reads one index, :func:`verify_block` and :func:`verify_candidates` one vector of
gathered probabilities (plus the one :func:`sample` of a correction or bonus token), and
:func:`sample_without_replacement` its k tokens with their probabilities (``tests/test_chain.py`` counts them).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from polyspec.errors import PolyspecError


def check_sampling(temperature: float, top_p: float = 1.0, top_k: int = 0) -> None:
    """Raise PolyspecError unless temperature >= 0, 0 < top_p <= 1 and top_k is an integer >= 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise PolyspecError(f"sampling temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
        raise PolyspecError(f"sampling top_p must be in (0, 1] (1 disables nucleus sampling), got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise PolyspecError(f"sampling top_k must be an integer >= 0 (0 disables top-k), got {top_k!r}")


def warp(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Logits [..., V] -> probabilities [..., V] (float32, or float64 for float64 input); each row sums to 1.

    temperature == 0: one-hot at the argmax (the lowest index among equal maxima). Otherwise softmax(logits / T)
    restricted to the top_k largest logits (all tokens tied with the k-th are kept; 0 = no limit), then to the
    smallest set of most likely tokens whose mass reaches top_p (a token is kept when the mass of the tokens ranked
    before it, in a stable descending sort, is below top_p; 1 = no limit), renormalised.
    """
    check_sampling(temperature, top_p, top_k)
    x = logits.double() if logits.dtype == torch.float64 else logits.float()  # [..., V]
    if temperature == 0:
        idx = torch.argmax(x, dim=-1, keepdim=True)  # [..., 1] first maximal index
        return torch.zeros_like(x).scatter_(-1, idx, 1.0)
    x = x / temperature
    v = x.shape[-1]
    if 0 < top_k < v:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # [..., V]
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # [..., V]
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # [..., V]
        keep_sorted = mass_before < top_p  # the first (most likely) token is always kept
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def uniform(generator: torch.Generator, n: int | None = None) -> torch.Tensor:
    """U[0, 1) draws from ``generator`` on the generator's device, float64: a scalar when n is None, else shape [n]."""
    return torch.rand(() if n is None else (n,), generator=generator, dtype=torch.float64, device=generator.device)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [V] by inverse CDF with one uniform from ``generator`` (a CPU generator: the draw is a host
    value); never a zero-probability token. The CDF is searched on probs' device and one index is read back."""
    cdf = torch.cumsum(probs.double(), dim=0)  # [V]
    u = float(uniform(generator))
    idx = int(torch.searchsorted(cdf, cdf[-1:] * u, right=True)[0])
    # searchsorted(right=True) returns the first index whose cdf exceeds u, which always has probability > 0; only
    # rounding (u landing on the total mass) can push it past the end: take the last token with probability > 0 then.
    if idx >= probs.shape[0]:
        idx = int(torch.nonzero(probs > 0)[-1, 0])
    return idx


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p - q)) over the last dim [..., V]; where p <= q everywhere (p == q) fall back to p."""
    r = torch.clamp(p - q, min=0)  # [..., V]
    total = r.sum(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(total > 0, r / torch.where(total > 0, total, torch.ones_like(total)), p)


def verify_block(p: torch.Tensor, q: torch.Tensor, tokens: list[int] | torch.Tensor,
                 generator: torch.Generator) -> tuple[int, int]:
    """Exact speculative sampling of one block: returns (n_accepted, next_token).

    p [m+1, V]: the verifier's distributions at the m block positions plus the one after; q [m, V]: the distributions
    the m block tokens were drawn from; tokens [m]. Token j is kept when u_j * q_j(x_j) < p_j(x_j) (u_j ~ U[0, 1),
    i.e. with probability min(1, p/q), written without a division so one-hot rows and q = 0 are exact). At the first
    rejection next_token ~ residual(p_j, q_j); if all m are kept next_token ~ p_m (the bonus token). Draws m + 1
    uniforms in total whatever happens, so the generator's use does not depend on the outcome.
    """
    m = len(tokens)
    if p.shape[0] != m + 1 or q.shape[0] != m:
        raise ValueError(f"verify_block: p has {p.shape[0]} rows and q {q.shape[0]} for {m} tokens (want m+1 and m)")
    n_acc = m
    if m:
        tok = tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(x) for x in tokens]
        # p_j(x_j) and q_j(x_j) gathered on the device (indexed by host ints: no index copy), read in one transfer.
        px_qx = torch.stack([p[j, x] for j, x in enumerate(tok)]
                            + [q[j, x].to(p.device) for j, x in enumerate(tok)]).double().tolist()  # [2 m]
        u = uniform(generator, m).tolist()
        n_acc = next((j for j in range(m) if not u[j] * px_qx[m + j] < px_qx[j]), m)
    if n_acc < m:
        nxt = sample(residual(p[n_acc], q[n_acc].to(p.device)), generator)
    else:
        nxt = sample(p[m], generator)
    return n_acc, nxt


# -- temperature 0 without full-vocabulary rows -----------------------------------------------------------------------
# At T = 0 every warped row is one-hot, so a distribution is its hot index and verify_block reduces to argmax matching.
# The decoder's linear rounds use these at T = 0 (no [m, V] rows built, no uniforms drawn: nothing random happens at
# T = 0); tests/test_sampling.py holds them to warp + verify_block on the same logits.


def _host_array(x: torch.Tensor) -> Any:
    """A 2-D CPU tensor's values as a numpy array (a view: nothing is copied or transferred), for the vectorised
    reductions below; None on an accelerator or for another shape (then torch's own ops run where the values are)."""
    return x.numpy() if x.is_cpu and x.dim() == 2 else None


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """logits [m, V] -> the hot index of each row's warp at T = 0, as ints: the first maximal index (a NaN counts as
    the maximum, as in torch.argmax). On the CPU numpy's vectorised argmax finds it: torch's took 0.3 ms for 3 rows of
    SmolLM2's 49,152 logits on the Cascade Lake VM, paid every round, against 0.02 ms; the ints come straight from
    numpy (each torch op costs tens of microseconds after a forward has streamed the weights: no detach unless
    needed)."""
    x = _float_rows(logits)
    a = _host_array(x)
    if a is None:
        return torch.argmax(x, dim=-1).tolist()
    return a.argmax(-1).tolist()


def _float_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits as float32 without autograd, with no torch op where they already are (each costs tens of microseconds
    after a forward has streamed the weights)."""
    x = logits.detach() if logits.requires_grad else logits
    return x if x.dtype == torch.float32 else x.float()


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The k largest entries of each row of logits [F, V], largest first, and their log-softmax values, as lists of F
    rows (among equal logits the order is not specified): a greedy draft tree's children and their scores, with no
    softmax over the vocabulary (a draft vocabulary's rows are mostly -inf). On the CPU, for k <= 8, k vectorised
    argmax passes over a copy and one exp pass: a softmax and torch.topk (which a -inf in the row had forced) cost
    0.19 ms a greedy tree step after a target forward, each torch op tens of microseconds there. Elsewhere torch's
    log_softmax and topk, read in one transfer."""
    x = _float_rows(logits)
    k = min(k, x.shape[-1])
    a = _host_array(x) if k <= 8 else None
    found = None if a is None else _top_passes(a, k)
    if found is not None:
        return found
    top = torch.topk(torch.log_softmax(x, dim=-1), k)
    ids, vals = torch.stack([top.indices.double(), top.values.double()]).tolist()  # [2, F, k]
    return [[int(j) for j in row] for row in ids], vals


def top_ids(logits: torch.Tensor, k: int) -> list[list[int]]:
    """The indices of :func:`top_log_probs` alone (largest first, k cut to the row's length): a greedy depth-1 tree
    that keeps every child reads no scores. On the CPU, for k <= 8, k argmax passes over the rows themselves (each
    pick set to -inf and put back after), no copy and no exp pass: 0.16 against 0.39-0.49 ms after a 300 MB stream
    (a throwaway harness), each numpy call paying for its code's cache misses there."""
    x = _float_rows(logits)
    k = min(k, x.shape[-1])
    a = _host_array(x) if k <= 8 else None
    found = None
    if a is not None:
        picked: list[tuple[Any, Any]] = []  # (indices, values) of each pass, to put back
        try:
            found = _argmax_passes(a, k, picked)
        finally:
            for best, vals in reversed(picked):
                a[range(a.shape[0]), best] = vals
    if found is not None:
        return [[int(col[r]) for col in found] for r in range(a.shape[0])]
    return torch.topk(x, k).indices.tolist()


def _argmax_passes(b: Any, k: int, picked: list[tuple[Any, Any]] | None = None) -> list[Any] | None:
    """The k largest indices of each row of the numpy array b [F, V], by k argmax passes that set each pick to -inf
    in b (its value appended to ``picked``); None where a row has fewer than k finite values (a pass could pick an
    index taken already) or no finite maximum."""
    import numpy as np

    rows, idx = range(b.shape[0]), []
    for _ in range(k):
        best = b.argmax(-1)
        vals = b[rows, best]
        if not np.isfinite(vals).all():
            return None
        idx.append(best)
        if picked is not None:
            picked.append((best, vals))
        b[rows, best] = -np.inf
    return idx


def _top_passes(a: Any, k: int) -> tuple[list[list[int]], list[list[float]]] | None:
    """top_log_probs on a numpy array a [F, V]; None where :func:`_argmax_passes` finds too few finite logits."""
    import numpy as np

    b, rows = a.copy(), range(a.shape[0])
    idx = _argmax_passes(b, k)
    if idx is None:
        return None
    top = a[rows, idx[0]]  # each row's maximum
    np.subtract(a, top[:, None], out=b)
    lse = np.log(np.exp(b, out=b).sum(-1))  # log sum exp(a - max): the float32 sums, as torch's log_softmax
    ids = [[int(col[r]) for col in idx] for r in rows]
    return ids, [[float(a[r, j]) - float(top[r]) - float(lse[r]) for j in row] for r, row in zip(rows, ids, strict=True)]


def greedy_verify(logits: torch.Tensor, tokens: list[int]) -> tuple[int, int]:
    """verify_block at T = 0 from the verifier's logits [m+1, V] and the m block tokens (each the draft's argmax):
    (n_accepted = length of the prefix where the verifier's argmax equals the token, the verifier's argmax after it)."""
    return accept_prefix(argmax_rows(logits), tokens)


def accept_prefix(best: list[int], tokens: list[int]) -> tuple[int, int]:
    """:func:`greedy_verify` from the verifier's argmax rows ``best`` [m+1] (:func:`argmax_rows`, already computed)."""
    n_acc = 0
    while n_acc < len(tokens) and best[n_acc] == int(tokens[n_acc]):
        n_acc += 1
    return n_acc, best[n_acc]


# -- multi-candidate verification (the EAGLE-2 draft tree) ------------------------------------------------------------


def sample_without_replacement(probs: torch.Tensor, k: int,
                               generator: torch.Generator) -> tuple[list[int], list[float]]:
    """An ordered sample of ``min(k, support)`` distinct tokens from probs [V] without replacement, with their
    probabilities: token 1 ~ probs, token j ~ probs restricted to the tokens not drawn yet (renormalised).
    Gumbel-top-k: the k largest of log(probs) + Gumbel noise, in decreasing order, are exactly such a sequential sample
    (Kool et al., 2019). The noise is drawn on ``generator``'s device (best: probs' device, so nothing of size V
    crosses); the tokens and their probabilities come back in one transfer."""
    p = probs.detach().double()  # [V]
    k = min(int(k), p.shape[0])
    if k < 1:
        return [], []
    u = uniform(generator, p.shape[0]).to(p.device).clamp_(min=1e-300)  # [V]
    keys = torch.log(p) - torch.log(-torch.log(u))  # [V]; -inf where p == 0
    idx = torch.topk(keys, k).indices  # [k]
    tokens, px = torch.stack([idx.double(), p[idx]]).tolist()  # the one transfer
    # Zero-probability tokens (keys -inf) rank after every token of the support: dropping them leaves the same sample.
    kept = [j for j in range(k) if px[j] > 0]
    return [int(tokens[j]) for j in kept], [px[j] for j in kept]


def verify_candidates(p: torch.Tensor, q: torch.Tensor, candidates: list[int],
                      generator: torch.Generator) -> tuple[int | None, int]:
    """Recursive rejection sampling over distinct candidates drawn from q without replacement (in draw order).

    p [V]: the verifier's distribution at this tree node; q [V]: the draft's distribution the candidates were drawn
    from (by :func:`sample_without_replacement`). Candidate j is tried against the current residual target r_j with
    proposal q_j = q without candidates 1..j-1, renormalised (the law it was drawn from given the earlier draws): it is
    kept with probability min(1, r_j(x)/q_j(x)); after a rejection r_{j+1} = normalise(max(0, r_j - q_j)) — exactly
    one step of :func:`verify_block` per candidate, so the returned token is an exact sample of p whatever the
    candidates were. If none is kept, the token is drawn from the last residual.

    The residual chain depends on the candidates only, not on the draws, so it runs on p's device for every candidate
    first and r_j(x_j), q_j(x_j) and q_j's remaining mass come back in one transfer; the draws (one per candidate tried,
    then one for the residual: the same stream as trying them one by one) are compared on the host.

    Returns (index of the accepted candidate or None, the token). With a one-hot p (temperature 0) this is argmax
    matching: the candidate equal to argmax(p) is kept whenever it is present, else argmax(p) is returned.
    """
    r = first = p.detach().double()  # [V]
    qq = q.detach().to(device=p.device, dtype=torch.float64, copy=True)  # [V], modified below
    residuals, tested = [], []  # residuals[j]: r_{j+1}; tested: r_j(x_j), q_j(x_j), mass of q_j without x_j
    for x in candidates:
        x = int(x)
        tested += [r[x], qq[x].clone()]
        r = residual(r, qq)
        residuals.append(r)
        qq[x] = 0.0
        total = qq.sum()
        tested.append(total)
        qq /= total  # garbage after a zero total, which ends the walk below before it is read
    values = torch.stack(tested).tolist() if tested else []  # [3 k]: the one transfer
    r = first
    for j, x in enumerate(candidates):
        rx, qx, total = values[3 * j:3 * j + 3]
        if float(uniform(generator)) * qx < rx:
            return j, int(x)
        r = residuals[j]
        if total <= 0:
            break
    return None, sample(r, generator)
