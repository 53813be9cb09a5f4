"""The EAGLE training maths as small pure functions: input alignment, losses, noise, schedule, acceptance estimate.

Alignment (the docstring of :mod:`polyspec.decode.head`): for a sequence x_0..x_{T-1} with teacher features
f_0..f_{T-1} (f_t = the teacher's final-norm'd hidden state at t, whose logits predict x_{t+1}), head row t
(t = 0..T-2) reads (token x_{t+1}, feature f_t) and is trained to output f_{t+1} (feature regression) and, through
the frozen lm_head, the teacher's distribution over x_{t+2}, which is softmax(lm_head(f_{t+1})) — the teacher's own
next-token distribution at position t+1 (token loss). Row t counts in the loss when the token it predicts, x_{t+2},
is an assistant token (``loss_mask``); the last row (x_{T} does not exist) takes the mask of x_{T-1}, so a truncated
assistant turn keeps its last prediction. Padding rows count nowhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def shift_for_head(input_ids: torch.Tensor, features: torch.Tensor, teacher_states: torch.Tensor,
                   loss_mask: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """Teacher outputs on a padded batch -> the head's inputs and targets (rows t = 0..T-2).

    input_ids [B, T], features [B, T, H], teacher_states [B, T, H'] (the teacher's lm_head input: its logits are
    the teacher's next-token distribution), loss_mask [B, T] (1 on assistant tokens), lengths [B] (real tokens per
    row; the rest is padding) -> ``head_ids`` [B, T-1] (x_{t+1}), ``head_features`` [B, T-1, H] (f_t),
    ``target_features`` [B, T-1, H] (f_{t+1}), ``target_states`` [B, T-1, H'] (the teacher's state at t+1, whose
    logits predict x_{t+2}), ``weight`` [B, T-1] float (0/1).
    """
    b, t = input_ids.shape
    pos = torch.arange(t - 1, device=input_ids.device)  # [T-1]
    lengths = lengths.to(input_ids.device)
    real = pos[None, :] < (lengths[:, None] - 1)  # [B, T-1]: both t and t+1 are real tokens
    # mask of the predicted token x_{t+2}; the last real row uses the mask of x_{T-1} (its own target position)
    pred_pos = torch.minimum(pos[None, :] + 2, lengths[:, None] - 1).clamp(min=0)  # [B, T-1]
    pred_mask = loss_mask.gather(1, pred_pos.long()).bool()  # [B, T-1]
    return {
        "head_ids": input_ids[:, 1:],
        "head_features": features[:, :-1],
        "target_features": features[:, 1:],
        "target_states": teacher_states[:, 1:],
        "weight": (real & pred_mask).float(),
    }


def uniform_noise(x: torch.Tensor, half_width: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """x + U(-half_width, half_width) elementwise (EAGLE's feature noise); x unchanged when half_width is 0."""
    if half_width <= 0:
        return x
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)  # [...]
    return x + ((u * 2 - 1) * half_width).to(x.dtype)


def eagle_losses(head_logits: torch.Tensor, head_hidden: torch.Tensor, target_features: torch.Tensor,
                 target_logits: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Masked EAGLE losses and agreement counts (all computed in float32).

    head_logits [B, N, V], head_hidden [B, N, H], target_features [B, N, H], target_logits [B, N, V], weight [B, N]
    (or any other leading shape: :func:`eagle_unrolled_losses` passes the rows that count, [R, ...]) ->
    ``feature`` (SmoothL1 of head_hidden vs target_features, mean over H, weighted mean over rows), ``token``
    (cross-entropy against the teacher's distribution softmax(target_logits), weighted mean over rows),
    ``correct`` (rows where argmax head == argmax teacher, weighted sum) and ``count`` (sum of weights).
    """
    w = weight.float()  # [B, N]
    count = w.sum()
    denom = count.clamp(min=1.0)
    feat = F.smooth_l1_loss(head_hidden.float(), target_features.float(), reduction="none").mean(-1)  # [B, N]
    teacher_p = torch.softmax(target_logits.float(), dim=-1)  # [B, N, V]
    logq = torch.log_softmax(head_logits.float(), dim=-1)  # [B, N, V]
    token = -(teacher_p * logq).sum(-1)  # [B, N]
    agree = (head_logits.argmax(-1) == target_logits.argmax(-1)).float()  # [B, N]
    return {
        "feature": (feat * w).sum() / denom,
        "token": (token * w).sum() / denom,
        "correct": (agree * w).sum(),
        "count": count,
    }


def step_rows(weight: torch.Tensor, k: int) -> torch.Tensor:
    """bool [B, N - k]: the rows of unroll step k that count, i.e. whose targets (``k`` rows later) have weight > 0.

    The losses compute logits on these rows alone: the lm_head over the loss vocabulary and the softmaxes behind the
    token loss are most of a training step, and a third of a ShareGPT batch's rows (user turns, padding) count for
    nothing (docs/TRAIN.md, "Logits on the rows that count")."""
    return weight[:, k:] > 0


def counted_teacher_logits(target_states: torch.Tensor, weight: torch.Tensor,
                           teacher_logits: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[int], torch.Tensor]:
    """The teacher's logits of the rows that count, computed once per batch (no grad): returns ``rows_of(k)``, the
    logits [R_k, V] of unroll step k's rows (:func:`step_rows`), which are all among step 0's."""
    counted = weight > 0  # [B, N]
    with torch.no_grad():
        logits = teacher_logits(target_states[counted])  # [R_0, V]
    index = torch.full(weight.shape, -1, dtype=torch.long, device=weight.device)  # [B, N]: row in ``logits``
    index[counted] = torch.arange(logits.shape[0], device=weight.device)
    return lambda k: logits if k == 0 else logits[index[:, k:][step_rows(weight, k)]]  # step 0: all, in order


def eagle_unrolled_losses(outs: list[torch.Tensor], target_features: torch.Tensor, target_states: torch.Tensor,
                          weight: torch.Tensor, *, decay: float, feature_weight: float, token_weight: float,
                          head_logits: Callable[[torch.Tensor], torch.Tensor],
                          teacher_logits: Callable[[torch.Tensor], torch.Tensor],
                          row_losses: Callable[..., dict[str, torch.Tensor]] = eagle_losses
                          ) -> dict[str, torch.Tensor]:
    """The EAGLE-1/2 loss of a head unrolled ``len(outs)`` steps deep (one step: the plain EAGLE loss).

    outs: per step k the head's output [B, N, H] (:func:`polyspec.decode.head.training_unroll`; row t of step k
    predicts what row t + k of step 0 would, so it is compared with the targets and weights of rows k..N-1);
    target_features [B, N, H] (f_{t+1}), target_states [B, N, H] (the teacher's lm_head input at t + 1) and weight
    [B, N] as :func:`shift_for_head` returns them; ``head_logits`` / ``teacher_logits`` map rows [R, H] to logits
    [R, V] over the loss vocabulary. Equal to :func:`eagle_losses` on every row (tests/test_train.py), computed on
    the rows that count (:func:`step_rows`). ``loss`` = sum over k of decay ** k * (feature_weight * feature +
    token_weight * token). ``feature``, ``token``, ``correct``, ``count`` are step 0's; ``step_correct`` /
    ``step_count`` [K] every step's. ``row_losses``: :func:`eagle_losses`, or its compiled form (train.compile).
    """
    n = weight.shape[1]
    loss = weight.new_zeros((), dtype=torch.float32)
    per_step = []
    teacher = counted_teacher_logits(target_states, weight, teacher_logits)
    for k, out in enumerate(outs[:n]):
        rows = step_rows(weight, k)  # [B, N-k]
        x = out[:, :n - k][rows]  # [R, H]
        p = row_losses(head_logits(x), x, target_features[:, k:][rows], teacher(k), weight[:, k:][rows])
        loss = loss + decay ** k * (feature_weight * p["feature"] + token_weight * p["token"])
        per_step.append(p)
    first = per_step[0]
    return {"loss": loss, "feature": first["feature"], "token": first["token"], "correct": first["correct"],
            "count": first["count"], "step_correct": torch.stack([p["correct"] for p in per_step]),
            "step_count": torch.stack([p["count"] for p in per_step])}


def eagle3_losses(outs: list[torch.Tensor], target_states: torch.Tensor, weight: torch.Tensor,
                  draft_ids: torch.Tensor, t2d: torch.Tensor, decay: float, *,
                  head_logits: Callable[[torch.Tensor], torch.Tensor],
                  teacher_logits: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The EAGLE-3 training-time-test loss over unroll steps (all in float32).

    outs: per step k, the head's output [B, N, H] (Eagle3Head.unroll; row t of step k predicts what row t + k of
    step 0 would); ``head_logits`` maps rows [R, H] to the head's draft-vocabulary logits [R, Vd];
    target_states [B, N, H] (the teacher's lm_head input) and weight [B, N] as :func:`shift_for_head` returns them,
    ``teacher_logits`` mapping rows [R, H] to the teacher's logits [R, V] (row t: its distribution of x_{t+2});
    draft_ids [Vd] ascending target ids; t2d bool [V]. Step k compares its rows 0..N-1-k with the targets and
    weights of rows k..N-1, on the rows that count (:func:`step_rows`). Its cross-entropy is against the teacher's
    distribution renormalised on the draft vocabulary, over the rows whose teacher argmax is in it (SpecForge's
    rule: a token the draft can never propose teaches it nothing); the step losses are summed with weights
    ``decay ** k``. Returns ``loss``; ``token`` (step 0's cross-entropy), ``correct`` / ``count`` (step 0's argmax
    agreement in target ids over every weighted row, the draft vocabulary's misses included) and ``step_correct`` /
    ``step_count`` [K] for every step.
    """
    n = weight.shape[1]
    loss = weight.new_zeros((), dtype=torch.float32)
    token = loss
    correct, count = [], []
    teacher = counted_teacher_logits(target_states, weight, teacher_logits)
    for k, out in enumerate(outs[:n]):
        rows = step_rows(weight, k)  # [B, N-k]
        tl = teacher(k).float()  # [R, V]
        lg = head_logits(out[:, :n - k][rows]).float()  # [R, Vd]
        w = weight[:, k:][rows].float()  # [R]
        best = tl.argmax(-1)  # [R]
        w_in = w * t2d[best].float()
        p = torch.softmax(tl.index_select(-1, draft_ids), dim=-1)  # [R, Vd]
        ce = -(p * torch.log_softmax(lg, dim=-1)).sum(-1)  # [R]
        step = (ce * w_in).sum() / w_in.sum().clamp(min=1.0)
        loss = loss + decay ** k * step
        token = step if k == 0 else token
        correct.append(((draft_ids[lg.argmax(-1)] == best).float() * w).sum())
        count.append(w.sum())
    return {"loss": loss, "token": token, "correct": correct[0], "count": count[0],
            "step_correct": torch.stack(correct), "step_count": torch.stack(count)}


def expected_acceptance_length(alpha: float, k: int) -> float:
    """Expected tokens produced per verification step for a K-token draft when each draft token is accepted
    independently with probability ``alpha`` (stopping at the first rejection) and the verifier always adds one
    token of its own: sum_{i=0..K} alpha^i = (1 - alpha^(K+1)) / (1 - alpha); K + 1 at alpha = 1."""
    alpha = min(max(float(alpha), 0.0), 1.0)
    if k < 0:
        raise ValueError("k must be >= 0")
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def warmup_linear_decay(step: int, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier: linear warmup from 1/warmup to 1 over ``warmup_steps``, then linear decay to 0 at
    ``total_steps`` (EAGLE's schedule); constant 1 after warmup when total_steps is unknown (<= 0)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps <= 0 or total_steps <= warmup_steps:
        return 1.0
    return max(0.0, (total_steps - step) / (total_steps - warmup_steps))


def padded_batch(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Collate rows {input_ids [T_i], loss_mask [T_i], optional hidden [T_i, H] and final [T_i, H]} into right-padded
    tensors: input_ids [B, T] long (pad 0), loss_mask [B, T] (pad 0), lengths [B], hidden / final [B, T, .] (pad 0)
    where present."""
    lengths = torch.tensor([len(r["input_ids"]) for r in rows], dtype=torch.long)  # [B]
    t = int(lengths.max())
    b = len(rows)
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.long)
    out = {"input_ids": ids, "loss_mask": mask, "lengths": lengths}
    states = [k for k in ("hidden", "final") if k in rows[0]]
    for k in states:
        out[k] = torch.zeros(b, t, rows[0][k].shape[-1], dtype=rows[0][k].dtype)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
        mask[i, :n] = torch.as_tensor(r["loss_mask"], dtype=torch.long)
        for k in states:
            out[k][i, :n] = r[k]
    return out


def tokens_in(batch: dict[str, torch.Tensor]) -> int:
    """Real (non-padding) tokens in a collated batch."""
    return int(batch["lengths"].sum())


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else 0


__all__ = ["shift_for_head", "uniform_noise", "eagle_losses", "step_rows", "counted_teacher_logits", "eagle_unrolled_losses", "eagle3_losses", "expected_acceptance_length", "warmup_linear_decay",
           "padded_batch", "tokens_in", "ceil_div"]
