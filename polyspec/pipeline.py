"""``polyspec run``: the stages of a recipe in order, each keyed by its inputs so reruns skip finished work.

Stages: target (resolve the model source) -> data (ShareGPT, chat template, cache) -> train (draft head) ->
quantize (int4 intermediate) -> profile (T_i, L_i, verdicts) -> export (chain folder) -> a sample answer from the
exported chain. Every stage writes atomically, so a stage killed midway is redone on the next run.

Each stage function takes its own recipe section and the few values it needs besides (a folder, the workdir, the
device); the ``run_*`` functions here read those off a recipe, for ``polyspec run`` and the single-stage verbs.
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
    prepared = prepare_dataset(recipe.data, tokenizer, workdir=recipe.workdir,
                               tokenizer_id=model_id(recipe.target.source, target_dir), progress=progress)
    return dict(prepared.report)


def run_quantize(recipe: Recipe, tracker: Any = None, target_dir: Path | None = None) -> Path:
    """The quantize stage on the recipe's sections (the target resolved when not given); returns the int4 folder."""
    from polyspec.quantize import quantize_stage
    from polyspec.quantize.stage import ReportSettings

    return quantize_stage(recipe.quantize, target_dir=Path(target_dir or target_stage(recipe)), workdir=recipe.workdir,
                          data=recipe.data, report=ReportSettings.of(recipe), tracker=tracker)


def run_train(recipe: Recipe, tracker: Any = None, *, target_dir: Path | None = None, **kw: Any) -> Path:
    """The train stage on the recipe's sections (the target resolved when not given; with ``train.teacher:
    intermediate`` the quantize stage's int4 folder as the teacher); ``kw``: train_stage's progress, callbacks and
    log_every. Returns the head folder."""
    from polyspec.train import train_stage
    from polyspec.train.stage import TrainInputs

    target = Path(target_dir or target_stage(recipe))
    teacher = run_quantize(recipe, target_dir=target) if recipe.train.teacher == "intermediate" else None
    inputs = TrainInputs(target=recipe.target, target_dir=target, data=recipe.data, draft=recipe.decode.draft,
                         workdir=Path(recipe.workdir), teacher_dir=teacher)
    return train_stage(recipe.train, inputs, tracker, **kw)


def stage_folders(recipe: Recipe) -> list[Path]:
    """[target, int4, head] folders of a recipe, from its target, quantize and train stages (each keyed by its
    inputs: a finished one returns at once)."""
    target = Path(target_stage(recipe))
    return [target, Path(run_quantize(recipe, target_dir=target)), Path(run_train(recipe, target_dir=target))]


def stand_in_parts(recipe: Recipe, *, head: Path | None = None, int4: Path | None = None,
                   untrained_head: bool = False, rtn_int4: bool = False) -> tuple[list[Path] | None, dict[str, Any]]:
    """The CLI's level choices: explicit folders, a random-init head or an RTN int4 copy (made under
    ``<workdir>/profile``) in place of the train / quantize stages' levels. Returns (folders or None, notes)."""
    notes: dict[str, Any] = {}
    if not (head or int4 or untrained_head or rtn_int4):
        return None, notes
    target = Path(target_stage(recipe))
    work = Path(recipe.workdir) / "profile"
    if untrained_head and not head:
        from polyspec.export.stage import make_untrained_head

        head = work / "untrained_head"
        if not (head / "model.safetensors").is_file():
            make_untrained_head(target, head)
        notes["head"] = "untrained (random initialisation, seed 0)"
    if rtn_int4 and not int4:
        from polyspec.decode.int4 import save_int4_checkpoint

        int4 = work / "rtn_int4"
        if not (int4 / "config.json").is_file():
            save_int4_checkpoint(target, int4, group_size=recipe.quantize.group_size)
        notes["int4"] = f"RTN int4 g{recipe.quantize.group_size} (decode.int4.save_int4_checkpoint)"
    if int4 is None:
        int4 = run_quantize(recipe, target_dir=target)
    if head is None:
        head = run_train(recipe, target_dir=target)
    return [target, Path(int4), Path(head)], notes


def _measure_inputs(recipe: Recipe, parts: Any, say: Any) -> dict[str, Any]:
    """What the profile and search stages take besides the profile section."""
    from polyspec.export.package import ordered_parts

    levels = ordered_parts(parts) if parts is not None else stage_folders(recipe)
    return {"levels": levels, "workdir": recipe.workdir, "device": recipe.target.device, "dtype": recipe.target.dtype,
            "draft": recipe.decode.draft, "data": recipe.data, **({"say": say} if say is not None else {})}


def run_profile(recipe: Recipe, tracker: Any = None, *, parts: Any = None, notes: dict[str, Any] | None = None,
                threads: int | None = None, say: Any = None) -> Any:
    """The profile stage on the recipe's sections (``parts``: the level folders, default the stages' own)."""
    from polyspec.export import profile_stage

    return profile_stage(recipe.profile, tracker=tracker, notes=notes, threads=threads,
                         **_measure_inputs(recipe, parts, say))


def run_search(recipe: Recipe, *, parts: Any = None, threads: int | None = None, say: Any = None) -> Any:
    """The chain search on the recipe's sections (``parts``: the level folders, default the stages' own)."""
    from polyspec.export import search_stage

    return search_stage(recipe.profile, threads=threads, **_measure_inputs(recipe, parts, say))


def run_export(recipe: Recipe, tracker: Any = None, *, parts: Any = None, measured: Any = None,
               notes: dict[str, Any] | None = None, threads: int | None = None, say: Any = None) -> Path:
    """The export stage on the recipe's sections: the chain the search chose (``profile.search``) or the profiled
    chain, ``measured`` (a Profile or Search) measured first when not given."""
    from polyspec.export import export_stage
    from polyspec.export.package import ordered_parts

    levels = ordered_parts(parts) if parts is not None else stage_folders(recipe)
    if recipe.export.onnx:
        from polyspec.export.package import check_onnx_head

        check_onnx_head(levels[-1])  # before minutes of profiling
    if measured is None:
        measured = run_measure(recipe, tracker, parts=levels, notes=notes, threads=threads, say=say)
    return export_stage(recipe.export, levels=levels, decode=recipe.decode, workdir=recipe.workdir,
                        tracker=tracker, log_model=recipe.tracking.log_model, register_as=recipe.tracking.register_as,
                        **{_kind(recipe): measured}, **({"say": say} if say is not None else {}))


def run_pipeline(recipe: Recipe, command: list[str] | None = None) -> int:
    """Run every stage in order (each skips when its inputs are unchanged); print what was done and the verdicts.
    Third-party output goes to a log file under ``<workdir>/logs`` (:mod:`polyspec.console`), named at the end."""
    from polyspec.console import quiet

    if not is_global_rank_zero():
        # Lightning's ddp launcher re-runs this command on the other ranks: they only join the training.
        run_train(recipe, progress=False)
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

        head = stage("train", lambda tr: run_train(recipe, tr, target_dir=target_dir), lambda d: f"draft head {d}")
        int4 = stage("quantize", lambda tr: run_quantize(recipe, tr, target_dir), lambda d: f"int4 intermediate {d}")
        parts = {"target": Path(target_dir), "int4": Path(int4), "head": Path(head)}
        measured = stage("profile", lambda tr: run_measure(recipe, tr, parts=parts), lambda p: f"{_kind(recipe)} {p.path}")
        chain = stage("export", lambda tr: run_export(recipe, tr, parts=parts, measured=measured),
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


def run_measure(recipe: Recipe, tracker: Any = None, *, parts: Any = None, notes: dict[str, Any] | None = None,
                threads: int | None = None, say: Any = None) -> Any:
    """The pipeline's profile stage: the recipe's chain profiled, or (``profile.search``) the chain searched."""
    if recipe.profile.search:
        return run_search(recipe, parts=parts, threads=threads, say=say)
    return run_profile(recipe, tracker, parts=parts, notes=notes, threads=threads, say=say)


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
