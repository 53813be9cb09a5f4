"""Lightning pieces of head training: the LightningModule, the MLflow callback and the pickle-free checkpoint IO.

This module imports ``lightning`` at the top (about 8 s); import it only inside functions (``polyspec.train.stage``
does), never from package ``__init__`` files.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.io import CheckpointIO

from polyspec.chain_spec import EAGLE3_TYPES
from polyspec.decode.head import subset_logits, subset_weight
from polyspec.train.ckpt_io import load_tree, save_tree
from polyspec.train.features import teacher_aux_and_final, teacher_hidden
from polyspec.train.losses import (
    eagle3_losses,
    eagle_losses,
    eagle_unrolled_losses,
    expected_acceptance_length,
    shift_for_head,
    uniform_noise,
    warmup_linear_decay,
)


class HeadModule(L.LightningModule):
    """Trains an :class:`~polyspec.decode.head.EagleHead` (or an EAGLE-3
    :class:`~polyspec.decode.head3.Eagle3Head`) against a frozen teacher.

    ``teacher`` (online mode, and offline EAGLE-3 for its lm_head) is kept out of the module's parameters and
    checkpoints (it is moved to the module's device on first use); in offline mode batches carry ``hidden`` (and,
    EAGLE-3, ``final``). The teacher's logits come from its lm_head on the rows the loss counts only
    (:func:`polyspec.train.losses.step_rows`), as do the head's. Checkpoints hold only what the head folder holds
    (``head.trainable_state_dict()``).
    """

    def __init__(self, head: torch.nn.Module, cfg: Any, *, draft_k: int, teacher: torch.nn.Module | None = None,
                 probe: Callable[[torch.nn.Module], dict[str, float]] | None = None,
                 loss_ids: torch.Tensor | None = None):
        super().__init__()
        self._probe = probe  # the decoder's acceptance on held-out prompts (rank 0, after each validation)
        # train.draft_vocab: token loss and top-1 over these ids only (the draft vocabulary the head will decode with)
        self.loss_ids: torch.Tensor | None = loss_ids
        self.head = head
        self.cfg = cfg
        self.draft_k = draft_k
        self._teacher = [teacher]  # a list hides it from nn.Module registration (no DDP / checkpoint / .to())
        self.strict_loading = False  # checkpoints omit the frozen shared embedding and lm_head
        self.tokens_seen = 0
        self.train_log: dict[str, float] = {}
        self.last_eval: dict[str, float] = {}
        self._val_sums = torch.zeros(5, dtype=torch.float64)
        self.eagle3 = getattr(head, "head_type", "eagle") in EAGLE3_TYPES
        self._aux = tuple(head.aux_layers) if self.eagle3 else ()
        self._kept = {"head." + k for k in head.trainable_state_dict()}  # what checkpoints hold
        self._unroll_from = 0.0  # optimizer step from which training unrolls the head (configure_optimizers)
        self._fast: dict[Any, Any] = {}  # compiled pieces (_compiled), gathered rows (_loss_rows); kept unregistered

    # -- teacher -------------------------------------------------------------------------------------------------

    def _teacher_signal(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the teacher's lm_head input [B, T, H], the head's input features [B, T, H] or, EAGLE-3, the aux states
        [B, T, A H]) for a batch, online or from the cache. No logits here: the losses compute them on the rows
        that count (losses.step_rows), through :meth:`_teacher_logits`."""
        with torch.no_grad():
            if "final" in batch:  # offline EAGLE-3
                return batch["final"], batch["hidden"]
            if "hidden" in batch:  # offline EAGLE-1/2: the cached feature is the lm_head input itself
                return batch["hidden"], batch["hidden"]
            teacher = self._teacher_on_device()
            if self.eagle3:
                aux, final = teacher_aux_and_final(teacher, batch["input_ids"], self._aux)
                return final, aux
            hidden = teacher_hidden(teacher, batch["input_ids"])
            return hidden, hidden

    def _teacher_logits(self, states: torch.Tensor) -> torch.Tensor:
        """The teacher's logits [R, V] (EAGLE-1/2 with train.draft_vocab: [R, Vd]) of lm_head inputs [R, H]. An
        EAGLE-1/2 head shares the teacher's frozen lm_head; an EAGLE-3 head has its own, so the teacher's is read."""
        if self.eagle3:
            lm_head = self._teacher_on_device().lm_head
            return lm_head(states.to(lm_head.weight.dtype)).float()
        return self._head_logits(states)

    def _head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head's logits [R, V or Vd] of its outputs [R, H] (EAGLE-1/2: over train.draft_vocab's ids if set)."""
        if self.eagle3:
            return self.head.draft_logits(x)
        if self.loss_ids is not None:
            return subset_logits(self.head.lm_head, x, self.loss_ids, self._loss_rows())
        return self.head.lm_head(x.to(self.head.lm_head.weight.dtype)).float()

    def _loss_rows(self) -> torch.Tensor:
        """train.draft_vocab's rows of the frozen lm_head, gathered once per device and compute dtype (inside
        autocast its dtype, which the product would cast them to anyway) instead of in every call."""
        weight = self.head.lm_head.weight
        autocast = torch.is_autocast_enabled(weight.device.type)
        dtype = torch.get_autocast_dtype(weight.device.type) if autocast else weight.dtype
        key = ("loss_rows", weight.device, dtype)
        if key not in self._fast:
            self._fast[key] = subset_weight(self.head.lm_head, self.loss_ids, dtype)
        return self._fast[key]

    def _teacher_on_device(self) -> torch.nn.Module:
        teacher = self._teacher[0]
        if teacher is None:
            raise RuntimeError("online training (and offline EAGLE-3: its lm_head) needs a teacher model")
        if teacher.inv_freq.device != self.device:
            teacher.to(self.device)
        return teacher

    def _unroll_steps(self) -> int:
        """How deep this training step unrolls the head: train.ttt_steps, or 1 before ``_unroll_from`` (the first
        train.ttt_start share of the fit's optimizer steps, set with the schedule in configure_optimizers)."""
        return self.cfg.ttt_steps if self.global_step >= self._unroll_from else 1

    def _compiled(self) -> dict[str, Any]:
        """train.compile's fast path (training steps only): the head's decoder layer and the EAGLE-1/2 row losses
        through ``torch.compile`` (inductor, dynamic shapes: batches differ in length and in the rows that count),
        built on first use. Same maths as the eager reference, fused (tests/test_train.py checks the losses and
        gradients against it); validation and the acceptance probe stay eager. {} when train.compile is off."""
        if not self.cfg.compile:
            return {}
        if "layer" not in self._fast:
            self._fast["layer"] = torch.compile(self.head.layer, dynamic=True)
            self._fast["row_losses"] = torch.compile(eagle_losses, dynamic=True)
        return {k: self._fast[k] for k in ("layer", "row_losses")}

    def _losses(self, batch: dict[str, torch.Tensor], noise: float, steps: int = 1,
                fast: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """The loss parts of a batch with the head unrolled ``steps`` deep; ``loss`` is what the optimizer minimises.
        ``fast``: :meth:`_compiled`'s pieces, or None / {} for the eager reference."""
        fast = fast or {}
        states, hidden = self._teacher_signal(batch)  # EAGLE-3: hidden is the aux concatenation [B, T, A H]
        s = shift_for_head(batch["input_ids"], hidden, states, batch["loss_mask"], batch["lengths"])
        if self.eagle3:  # no feature noise: the training-time test already feeds the head its own states
            outs = self.head.unrolled_states(s["head_ids"], s["head_features"].float(), steps, fast.get("layer"))
            parts = eagle3_losses(outs, s["target_states"], s["weight"], self.head.draft_ids, self.head.t2d,
                                  self.cfg.ttt_decay, head_logits=self._head_logits,
                                  teacher_logits=self._teacher_logits)
            return {**parts, "feature": torch.zeros_like(parts["loss"])}
        feats = uniform_noise(s["head_features"].float(), noise)  # [B, T-1, H]; step 0's input only
        outs = self.head.unrolled_states(s["head_ids"], feats, steps, fast.get("layer"))
        return eagle_unrolled_losses(outs, s["target_features"], s["target_states"], s["weight"],
                                     decay=self.cfg.ttt_decay, feature_weight=self.cfg.feature_loss_weight,
                                     token_weight=self.cfg.token_loss_weight, head_logits=self._head_logits,
                                     teacher_logits=self._teacher_logits,
                                     row_losses=fast.get("row_losses", eagle_losses))

    # -- training --------------------------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        parts = self._losses(batch, self.cfg.feature_noise, self._unroll_steps(), self._compiled())
        loss = parts["loss"]
        self.tokens_seen += int(batch["lengths"].sum())
        count = float(parts["count"])
        self.train_log = {
            "train/loss": float(loss.detach()),
            "train/feature_loss": float(parts["feature"].detach()),
            "train/token_loss": float(parts["token"].detach()),
            "train/top1_agreement": float(parts["correct"]) / count if count else 0.0,
        }
        if "step_correct" in parts:  # the unrolled steps' agreement: how well the head drafts on its own states
            for k, (c, n) in enumerate(zip(parts["step_correct"].tolist(), parts["step_count"].tolist(), strict=True)):
                self.train_log[f"train/step{k}_agreement"] = c / n if n else 0.0
        self.log("loss", loss.detach(), prog_bar=True, on_step=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def configure_optimizers(self):
        params = [p for p in self.head.parameters() if p.requires_grad]
        # EAGLE's and EAGLE-3's recipes train the head without weight decay
        opt = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
        total = self.trainer.estimated_stepping_batches
        total = int(total) if total != float("inf") else 0
        warmup = self.cfg.warmup_steps
        self._unroll_from = (self.cfg.ttt_start or 0.0) * total  # the schedule's total, worked out once per fit

        def factor(step: int) -> float:
            return warmup_linear_decay(step, warmup, total)

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    # -- held-out evaluation ---------------------------------------------------------------------------------------

    def on_validation_epoch_start(self) -> None:
        self._val_sums = torch.zeros(5, dtype=torch.float64, device=self.device)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        parts = self._losses(batch, 0.0, self.cfg.ttt_steps if self.eagle3 else 1)  # EAGLE-1/2: as before
        c = parts["count"].double()
        self._val_sums += torch.stack((parts["feature"].double() * c, parts["token"].double() * c,
                                       parts["loss"].double() * c, parts["correct"].double(), c))

    def on_validation_epoch_end(self) -> None:
        sums = self.trainer.strategy.reduce(self._val_sums.clone(), reduce_op="sum")
        feat, tok, loss, correct, count = (float(x) for x in sums)
        if self.trainer.sanity_checking or count == 0:
            return
        alpha = correct / count
        self.last_eval = {
            "heldout/feature_loss": feat / count,
            "heldout/token_loss": tok / count,
            "heldout/loss": loss / count,
            "heldout/top1_agreement": alpha,
            "heldout/acceptance_length_estimate": expected_acceptance_length(alpha, self.draft_k),
            "heldout/positions": count,
            "step": float(self.global_step),
            "epoch": float(self.current_epoch),
        }
        if self._probe is not None and self.trainer.is_global_zero:
            self.last_eval.update(self._probe(self.head))

    # -- checkpoints -----------------------------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("state_dict")
        if state is not None:
            checkpoint["state_dict"] = {k: v for k, v in state.items() if k in self._kept}
        checkpoint["polyspec_tokens_seen"] = self.tokens_seen

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("state_dict") or {}
        missing = self._kept - set(state)
        if missing:
            raise RuntimeError(f"checkpoint lacks head tensors {sorted(missing)[:4]}: not a head checkpoint")
        self.tokens_seen = int(checkpoint.get("polyspec_tokens_seen", 0))


class LineProgress(L.Callback):
    """polyspec's training progress where the terminal is a pipe or a file: one line per tenth of the optimizer
    steps, ``train: step 40/400 (10%), loss 3.210, 12 s``, on polyspec's stream (rank 0 only)."""

    def __init__(self, marks: int = 10):
        self.marks = marks
        self.next_mark = 1  # the next tenth (of ``marks``) to report
        self.t0 = time.monotonic()

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.t0 = time.monotonic()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        total, step = int(trainer.estimated_stepping_batches), int(trainer.global_step)
        if not trainer.is_global_zero or total <= 0 or step * self.marks < self.next_mark * total:
            return
        while self.next_mark * total <= step * self.marks:  # a resumed run starts past some marks
            self.next_mark += 1
        from polyspec.console import say

        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        loss_text = f", loss {float(loss):.3f}" if loss is not None else ""
        say(f"train: step {step}/{total} ({100 * step // total}%){loss_text}, {time.monotonic() - self.t0:.0f} s")


class TrackerCallback(L.Callback):
    """Logs through a :class:`polyspec.tracking.Tracker` on global rank 0: loss components, lr and tokens/s every
    ``every`` optimizer steps, held-out metrics after each validation. Keeps the logged history for the report."""

    def __init__(self, tracker: Any, every: int, world_size: int):
        self.tracker, self.every, self.world_size = tracker, max(1, every), world_size
        self.history: list[dict[str, float]] = []
        self.evals: list[dict[str, float]] = []
        self._t0 = time.perf_counter()
        self._tok0 = 0
        self._last_step = -1
        self.start_time, self.start_tokens = time.perf_counter(), 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._t0, self._tok0 = time.perf_counter(), pl_module.tokens_seen
        self.start_time, self.start_tokens = self._t0, self._tok0
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step or not (step % self.every == 0 or step == trainer.max_steps):
            return
        self._last_step = step
        now = time.perf_counter()
        rate = (pl_module.tokens_seen - self._tok0) * self.world_size / max(now - self._t0, 1e-9)
        self._t0, self._tok0 = now, pl_module.tokens_seen
        lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else 0.0
        row = {**pl_module.train_log, "lr": float(lr), "tokens_per_second": rate}
        if trainer.is_global_zero:
            self.history.append({"step": float(step), **row})
            self.tracker.log_metrics(row, step=step)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not pl_module.last_eval or not trainer.is_global_zero:
            return
        if self.evals and self.evals[-1].get("step") == pl_module.last_eval.get("step"):
            return
        self.evals.append(dict(pl_module.last_eval))
        self.tracker.log_metrics({k: v for k, v in pl_module.last_eval.items() if k.startswith("heldout/")},
                                 step=trainer.global_step)


class SafetensorsCheckpointIO(CheckpointIO):
    """Lightning checkpoints as single safetensors files (see :mod:`polyspec.train.ckpt_io`); never pickles."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        save_tree(checkpoint, Path(path))

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        device = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
        return load_tree(Path(path), device=device)

    def remove_checkpoint(self, path) -> None:
        p = Path(path)
        if p.is_file():
            p.unlink()
