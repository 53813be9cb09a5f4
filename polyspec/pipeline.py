"""``polyspec run``: the stages of a recipe in order, each keyed by its inputs so reruns skip finished work.

Stages: target (resolve the model source) -> data (ShareGPT, chat template, cache) -> train (draft head) ->
quantize (int4 intermediate) -> profile (T_i, L_i, verdicts) -> export (chain folder) -> a sample answer from the
exported chain. Every stage writes atomically, so a stage killed midway is redone on the next run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from polyspec.config import Recipe
from polyspec.device import is_global_rank_zero
from polyspec.sources import target_stage


def _console():
    from polyspec.console import rich_console

    return rich_console()


def prepare_stage(recipe: Recipe, target_dir: Path | None = None, progress: bool = False) -> dict[str, Any]:
    """Tokenise and cache the recipe's conversations with the target's tokenizer; return the report."""
    from polyspec.data.prepare import prepare_dataset
    from polyspec.sources import load_tokenizer, model_id

    target_dir = target_dir or target_stage(recipe)
    tokenizer = load_tokenizer(target_dir)
    prepared = prepare_dataset(recipe, tokenizer, tokenizer_id=model_id(recipe.target.source, target_dir),
                               progress=progress)
    return dict(prepared.report)


def run_pipeline(recipe: Recipe, command: list[str] | None = None) -> int:
    """Run every stage in order (each skips when its inputs are unchanged); print what was done and the verdicts.
    Third-party output goes to a log file under ``<workdir>/logs`` (:mod:`polyspec.console`), named at the end."""
    from polyspec.console import quiet

    if not is_global_rank_zero():
        # Lightning's ddp launcher re-runs this command on the other ranks: they only join the training.
        from polyspec.train import train_stage

        train_stage(recipe, tracker=None, progress=False)
        return 0
    with quiet(recipe.workdir, "run"):
        return _run_stages(recipe, command)


def _run_stages(recipe: Recipe, command: list[str] | None) -> int:
    from polyspec.config import recipe_to_yaml
    from polyspec.tracking import start_run

    console = _console()
    workdir = Path(recipe.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "recipe.resolved.yaml").write_text(recipe_to_yaml(recipe), encoding="utf-8")
    if command:
        (workdir / "command.txt").write_text(" ".join(command) + "\n", encoding="utf-8")
    t_all = time.perf_counter()

    def stage(name: str, fn, describe):
        t0 = time.perf_counter()
        console.rule(f"[bold]{name}")
        with start_run(recipe, name, command=command, nested=True) as tr:
            result = fn(tr)
        console.print(f"[green]{name:<9}[/]{describe(result)} ({time.perf_counter() - t0:.1f} s)")
        return result

    with start_run(recipe, "run", command=command) as run:
        console.rule("[bold]polyspec run")
        console.print(f"recipe validated; workdir {workdir}; tracking run {run.run_id or '(tracking off)'}")

        target_dir = stage("target", lambda tr: _target_logged(recipe, tr),
                           lambda d: f"{recipe.target.source} -> {d}")
        stage("data", lambda tr: _data_logged(recipe, target_dir, tr), _fmt_counts)

        from polyspec.export import export_stage
        from polyspec.quantize import quantize_stage
        from polyspec.train import train_stage

        head = stage("train", lambda tr: train_stage(recipe, tracker=tr), lambda d: f"draft head {d}")
        int4 = stage("quantize", lambda tr: quantize_stage(recipe, tracker=tr), lambda d: f"int4 intermediate {d}")
        parts = {"target": Path(target_dir), "int4": Path(int4), "head": Path(head)}
        measured = stage("profile", lambda tr: _measure(recipe, tr, parts), lambda p: f"{_kind(recipe)} {p.path}")
        kw = {"search": measured} if recipe.profile.search else {"profile": measured}
        chain = stage("export", lambda tr: export_stage(recipe, tracker=tr, parts=parts, **kw),
                      lambda d: f"chain {d}")

        table = Path(measured.path) / ("search.md" if recipe.profile.search else "verdict.md")
        if table.is_file():
            console.rule("[bold]" + ("chain search" if recipe.profile.search else "verdicts"))
            console.print(table.read_text(encoding="utf-8"), markup=False)

        from polyspec.decode.generate import generate_text, load_chain

        loaded = load_chain(chain, device=recipe.target.device)
        prompt = "What is the capital of France?"
        ans = generate_text(loaded, prompt, max_new_tokens=recipe.decode.max_new_tokens)
        s = ans["stats"]
        run.log_metrics({"sample_tokens_per_second": s["tokens_per_second"]})
        levels = ", ".join(f"{lv['name']} {lv['mean_accepted']:.2f}" for lv in s["levels"])
        console.rule("[bold]sample")
        console.print(f"greedy answer of the exported chain ({s['mode']} mode, {s['new_tokens']} tokens, "
                      f"{s['tokens_per_second']:.1f} tok/s; mean accepted per forward: {levels}):")
        console.print(f"  [bold]user:[/] {prompt}\n  [bold]assistant:[/] {ans['text'].strip()}")
        console.print(f"done in {time.perf_counter() - t_all:.0f} s; chain: {chain}  "
                      f"(try: polyspec generate {chain} --prompt '...'; polyspec serve {chain})")
    return 0


def _kind(recipe: Recipe) -> str:
    return "search" if recipe.profile.search else "profile"


def _measure(recipe: Recipe, tracker, parts: dict[str, Path]):
    """The profile stage: the recipe's chain profiled, or (``profile.search``) the chain search."""
    from polyspec.export import profile_stage, search_stage

    if recipe.profile.search:
        return search_stage(recipe, parts=parts)
    return profile_stage(recipe, tracker=tracker, parts=parts)


def _target_logged(recipe: Recipe, tracker) -> Path:
    target_dir = target_stage(recipe)
    tracker.log_params({"target_dir": str(target_dir)})
    return target_dir


def _data_logged(recipe: Recipe, target_dir: Path, tracker) -> dict[str, Any]:
    report = prepare_stage(recipe, target_dir, progress=True)
    numbers = {f"data/{k}": v for k, v in report.items()}
    tracker.log_metrics({k: float(v) for k, v in numbers.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return report


def _fmt_counts(report: dict[str, Any]) -> str:
    keys = [k for k in ("conversations_read", "conversations_kept", "train_sequences", "heldout_sequences",
                        "total_tokens", "assistant_tokens", "cached") if k in report]
    return ", ".join(f"{k}={report[k]}" for k in keys) if keys else str(report)
