"""``python -m polyspec.train RECIPE [a.b=v ...]``: run the train stage of a recipe on its own.

Prints the head folder and a JSON summary (steps, wall time, tokens/s, held-out top-1 agreement, estimated acceptance
length). With ``tracking.enabled`` the run is logged as an MLflow run named ``train`` (global rank 0 only: the other
ranks of a ddp run re-execute this command and must not open runs of their own).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from polyspec.errors import PolyspecError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m polyspec.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="recipe YAML file")
    parser.add_argument("overrides", nargs="*", help="a.b=value overrides, e.g. train.max_steps=50")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        from polyspec.config import load_recipe
        from polyspec.tracking import start_run
        from polyspec.train.stage import TRAINING_JSON, is_global_rank_zero, train_stage

        recipe = load_recipe(args.recipe, args.overrides)
        t0 = time.perf_counter()
        command = [sys.executable, "-m", "polyspec.train", *(argv if argv is not None else sys.argv[1:])]
        if is_global_rank_zero():
            with start_run(recipe, "train", command=command) as tracker:
                out = train_stage(recipe, tracker=tracker, progress=not args.no_progress)
        else:
            out = train_stage(recipe, tracker=None, progress=False)
            return 0
        info = json.loads((out / TRAINING_JSON).read_text(encoding="utf-8"))
        keys = ("steps", "epochs_completed", "fit_seconds", "tokens_per_second", "heldout_top1_agreement",
                "acceptance_length_estimate", "train_loss_first", "train_loss_last", "resumed_from")
        summary = {"head": str(out), "stage_seconds": round(time.perf_counter() - t0, 1),
                   **{k: info.get(k) for k in keys}, "draft_k": info.get("draft_k"),
                   "offline_cache": info.get("offline_cache")}
        print(json.dumps(summary, indent=1))
        return 0
    except PolyspecError as exc:
        print(f"polyspec train: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
