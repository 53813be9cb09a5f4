"""``polyspec run``: the stages of a recipe in order, each keyed by its inputs so reruns skip finished work.

Stages: target (resolve the model source) -> data (ShareGPT, chat template, cache) -> train (draft head) ->
quantize (int4 intermediate) -> profile (T_i, L_i) -> export (chain folder). Stages that this version of polyspec
does not implement yet are reported as such, never faked.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from polyspec.config import Recipe
from polyspec.errors import PolyspecError

# Stages that exist in later issues; run_pipeline reports them honestly until their modules provide an entry point.
PENDING_STAGES = {
    "train": ("polyspec.train", "train_stage"),
    "quantize": ("polyspec.quantize", "quantize_stage"),
    "profile": ("polyspec.export", "profile_stage"),
    "export": ("polyspec.export", "export_stage"),
}


def _console():
    from rich.console import Console

    return Console(highlight=False)


def model_cache_dir(recipe: Recipe) -> Path:
    return Path(recipe.workdir) / "cache" / "models"


def target_stage(recipe: Recipe) -> Path:
    """Resolve the recipe's target to a local Hugging Face folder (converting the packaged GGUF once)."""
    from polyspec.sources import resolve_model_source

    return resolve_model_source(recipe.target.source, cache_dir=model_cache_dir(recipe),
                                revision=recipe.target.revision)


def prepare_stage(recipe: Recipe, target_dir: Path | None = None) -> dict[str, Any]:
    """Tokenise and cache the recipe's conversations with the target's tokenizer; return the report."""
    from polyspec.data.prepare import prepare_dataset
    from polyspec.sources import load_tokenizer, model_id

    target_dir = target_dir or target_stage(recipe)
    tokenizer = load_tokenizer(target_dir)
    prepared = prepare_dataset(recipe, tokenizer, tokenizer_id=model_id(recipe.target.source, target_dir))
    return dict(prepared.report)


def sample_answer(target_dir: Path, prompt: str, max_new_tokens: int) -> dict[str, Any]:
    """A greedy chat answer from the target through polyspec's own engine (AR mode)."""
    from polyspec.decode.generate import generate_from_folder

    return generate_from_folder(target_dir, prompt, max_new_tokens=max_new_tokens)


def run_pipeline(recipe: Recipe, command: list[str] | None = None) -> int:
    """Run every stage in order; print what was done, skipped or is not implemented yet."""
    import importlib

    from polyspec.tracking import start_run

    console = _console()
    workdir = Path(recipe.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    from polyspec.config import recipe_to_yaml

    (workdir / "recipe.resolved.yaml").write_text(recipe_to_yaml(recipe), encoding="utf-8")
    if command:
        (workdir / "command.txt").write_text(" ".join(command) + "\n", encoding="utf-8")
    done: list[tuple[str, str]] = []
    with start_run(recipe, "run", command=command) as run:
        console.rule("[bold]polyspec run")
        console.print(f"recipe validated; workdir {workdir}; tracking run {run.run_id or '(tracking off)'}")

        t0 = time.perf_counter()
        with start_run(recipe, "target", command=command, nested=True) as tr:
            target_dir = target_stage(recipe)
            tr.log_params({"target_source": recipe.target.source, "target_dir": str(target_dir)})
        console.print(f"[green]target[/]   {recipe.target.source} -> {target_dir} ({time.perf_counter() - t0:.1f} s)")
        done.append(("target", "done"))

        t0 = time.perf_counter()
        with start_run(recipe, "data", command=command, nested=True) as tr:
            report = prepare_stage(recipe, target_dir)
            tr.log_metrics({k: float(v) for k, v in report.items() if isinstance(v, (int, float))
                            and not isinstance(v, bool)})
        console.print(f"[green]data[/]     {_fmt_counts(report)} ({time.perf_counter() - t0:.1f} s)")
        done.append(("data", "cached" if report.get("cached") else "done"))

        for stage, (module, fn) in PENDING_STAGES.items():
            mod = importlib.import_module(module)
            if not hasattr(mod, fn):
                console.print(f"[yellow]{stage:<9}[/]not implemented in polyspec {_version()} yet (see README, Status)")
                done.append((stage, "not implemented"))
                continue
            with start_run(recipe, stage, command=command, nested=True) as tr:  # pragma: no cover - later issues
                getattr(mod, fn)(recipe, tracker=tr)
            done.append((stage, "done"))

        t0 = time.perf_counter()
        prompt = "What is the capital of France?"
        try:
            ans = sample_answer(target_dir, prompt, max_new_tokens=recipe.decode.max_new_tokens)
        except PolyspecError as exc:
            console.print(f"[red]sample[/]   could not generate: {exc}")
            return 1
        run.log_metrics({"sample_tokens_per_second": ans["stats"]["tokens_per_second"]})
        console.print(f"[green]sample[/]   greedy answer of the target (ar mode, {ans['stats']['new_tokens']} tokens, "
                      f"{ans['stats']['tokens_per_second']:.1f} tok/s, {time.perf_counter() - t0:.1f} s):")
        console.print(f"  [bold]user:[/] {prompt}\n  [bold]assistant:[/] {ans['text'].strip()}")
        missing = [s for s, st in done if st == "not implemented"]
        if missing:
            console.print(f"[yellow]no chain exported[/]: stages not implemented yet: {', '.join(missing)}")
    return 0


def _fmt_counts(report: dict[str, Any]) -> str:
    keys = [k for k in ("conversations_read", "conversations_kept", "train_sequences", "heldout_sequences",
                        "total_tokens", "assistant_tokens", "cached") if k in report]
    return ", ".join(f"{k}={report[k]}" for k in keys) if keys else str(report)


def _version() -> str:
    from polyspec import __version__

    return __version__
