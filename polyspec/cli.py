"""The one console entry point: ``polyspec <verb> ...``.

Each verb is a function ``cmd_<verb>(args) -> int`` with a docstring that becomes its ``--help``. Heavy packages
(torch, transformers, lightning, mlflow, ...) are imported inside the verbs, never here, so ``polyspec --help`` is fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from polyspec import __version__
from polyspec.chain_spec import add_draft_flags
from polyspec.errors import PolyspecError
from polyspec.modes import MODES


def _load(args: argparse.Namespace):
    from polyspec.config import load_recipe

    return load_recipe(args.recipe, args.overrides)


def _add_recipe(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", type=Path, help="recipe YAML file")
    p.add_argument("overrides", nargs="*", metavar="a.b=v", help="override recipe keys, e.g. train.lr=1e-4")


# --------------------------------------------------------------------------------------------------------------------
# verbs


def cmd_validate(args: argparse.Namespace) -> int:
    """Validate a recipe (with overrides) and print it resolved, every default filled in, as YAML."""
    from polyspec.config import recipe_to_yaml

    recipe = _load(args)
    sys.stdout.write(recipe_to_yaml(recipe))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    """Resolve the recipe's target, then load, tokenise (chat template, assistant-only loss mask), split and cache its
    ShareGPT data. Prints the counts."""
    from polyspec.console import quiet
    from polyspec.pipeline import prepare_stage

    recipe = _load(args)
    with quiet(recipe.workdir, "prepare"):
        report = prepare_stage(recipe, progress=True)
    print(json.dumps(report, indent=2))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run the recipe end to end: data -> train head -> quantize -> profile -> export, skipping finished stages."""
    from polyspec.pipeline import run_pipeline

    recipe = _load(args)
    return run_pipeline(recipe, command=args.command)


def cmd_theory(args: argparse.Namespace) -> int:
    """Exact theory: Theorem 3.2 conditions with the Lemma 3.1 difference, chain time per token, and the exact
    acceptance-length mean and variance (Theorem 3.3 corrected)."""
    from polyspec import theory

    try:
        if args.theory_verb == "insertion":
            out = theory.insertion(args.t_i, args.t_new, args.t_next, args.l_i, args.l_new, args.l_i_new,
                                   args.beta).to_dict()
        elif args.theory_verb == "stability":
            mean, var = theory.acceptance_length_moments(args.alpha, args.n)
            out = {"alpha": args.alpha, "n": args.n, "mean": mean, "variance": var}
        else:  # time
            t = theory.chain_time_per_token(args.costs, args.accept, args.beta)
            out = {"time_per_token": t, "speedup_vs_ar": args.costs[0] / t}
    except ValueError as exc:
        raise PolyspecError(f"polyspec theory {args.theory_verb}: {exc}") from None
    if args.json:
        print(json.dumps(out))
    else:
        width = max(len(k) for k in out)
        for k, v in out.items():
            print(f"{k:<{width}}  {v:.6g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train (or find, when its inputs are unchanged) the recipe's EAGLE draft head; print its folder and metrics."""
    import time

    from polyspec.console import quiet
    from polyspec.device import is_global_rank_zero
    from polyspec.pipeline import run_train
    from polyspec.tracking import start_run
    from polyspec.train.stage import training_summary

    recipe = _load(args)
    t0 = time.perf_counter()
    if not is_global_rank_zero():
        # Lightning's ddp launcher re-runs this command on the other ranks: they only join the training.
        run_train(recipe, progress=False)
        return 0
    with quiet(recipe.workdir, "train"), start_run(recipe, "train", command=args.command) as tracker:
        out = run_train(recipe, tracker, progress=not args.no_progress)
    print(json.dumps(training_summary(out, time.perf_counter() - t0), indent=1))
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    """Quantise the recipe's target to W4A16 (GPTQ, group size 128) with GPTQModel; write the GPTQ folder and a
    quality/speed report (perplexity, top-1 agreement, KL, RTN baseline, L of M2 under M1, forward-time ratio)."""
    from polyspec.console import quiet
    from polyspec.pipeline import run_quantize
    from polyspec.tracking import start_run

    recipe = _load(args)
    with quiet(recipe.workdir, "quantize"), start_run(recipe, "quantize", command=args.command) as tracker:
        out = run_quantize(recipe, tracker=tracker)
    print(f"intermediate model: {out}")
    report = Path(out).parent / "report.json"
    if report.is_file():
        print(f"report: {report}")
    return 0


def _stage_inputs(args: argparse.Namespace, recipe: Any):
    """The level folders the profile / export verbs were given (None: the pipeline's stages), and notes."""
    from polyspec.pipeline import stand_in_parts

    return stand_in_parts(recipe, head=args.head, int4=args.int4, untrained_head=args.untrained_head,
                          rtn_int4=args.rtn_int4)


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure T_i (forward cost per level at decode shapes) and L_i (acceptance lengths) on this device, then decide
    with Theorem 3.2 and the exact Lemma 3.1 cost whether each intermediate level pays; prints the verdict table."""
    from polyspec.console import quiet
    from polyspec.pipeline import run_profile

    recipe = _load(args)
    if args.search or recipe.profile.search:
        return _search(args, recipe)
    with quiet(recipe.workdir, "profile"):
        parts, notes = _stage_inputs(args, recipe)
        prof = run_profile(recipe, parts=parts, notes=notes, threads=args.threads)
    print(Path(prof.path, "verdict.md").read_text(encoding="utf-8"))
    print(f"profile folder: {prof.path}")
    return 0


def _search(args: argparse.Namespace, recipe: Any) -> int:
    """``profile --search``: the chain search over the given levels and the copies made from the target."""
    from polyspec.console import quiet
    from polyspec.pipeline import run_search

    with quiet(recipe.workdir, "profile"):
        parts, _ = _stage_inputs(args, recipe)
        out = run_search(recipe, parts=parts, threads=args.threads).path
    print(Path(out, "search.md").read_text(encoding="utf-8"))
    print(f"search folder: {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Profile (or reuse the profile) and write the validated chain folder: levels, manifest with hashes and
    measurements, the draft head as ONNX with an onnxruntime parity check."""
    from polyspec.console import quiet
    from polyspec.pipeline import run_export
    from polyspec.tracking import start_run

    recipe = _load(args)
    with quiet(recipe.workdir, "export"), start_run(recipe, "export", command=args.command) as tracker:
        parts, notes = _stage_inputs(args, recipe)
        out = run_export(recipe, tracker, parts=parts, notes=notes, threads=args.threads)
    print(f"chain folder: {out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a chain folder over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /metrics)."""
    from polyspec.decode.serve import server as serve

    return serve.run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    """Spec-Bench-style benchmark of a chain: ar, dual, chain, hf and hf-assisted interleaved on the same prompts;
    tokens/s, speedup over ar, mean accepted tokens per level, mismatches against ar at temperature 0."""
    from polyspec.bench import bench

    return bench.run(args)


def cmd_shape_bench(args: argparse.Namespace) -> int:
    """Random-weight model at a named shape (default Llama-2-7B): ar tokens/s against the memory roofline, int4 g128
    and draft-head forward times relative to the target, and a Lemma 3.1 projection from a profiled chain's L_i."""
    from polyspec.bench import shape_bench

    return shape_bench.run(args)


def check_prompt(prompt: str) -> None:
    """One clear error for a --prompt that is empty or not UTF-8 (bytes the shell passed that Python could only keep
    as lone surrogates), before any weights load."""
    if not prompt:
        raise PolyspecError("--prompt is empty; give the user message to answer")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(prompt[exc.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise PolyspecError(f"--prompt is not valid UTF-8 ({what} at character {exc.start}); pass the text in UTF-8 "
                            "(check the terminal's or the file's encoding)") from None


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate from a chain folder (validated first) in ar, dual or chain mode; exactly the target's distribution."""
    from polyspec.chain_spec import DraftSpec, check_draft_flags
    from polyspec.decode.sampling import check_sampling

    check_sampling(args.temperature, args.top_p, args.top_k)  # fail before loading any weights
    check_draft_flags(args)
    check_prompt(args.prompt)
    if args.max_new_tokens < 1:
        raise PolyspecError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from polyspec.decode.generate import generate_text, load_chain

    chain = load_chain(args.chain, device=args.device)
    draft = DraftSpec.parse(args.draft, chain.decode.draft) if args.draft else None
    out = generate_text(chain, args.prompt, mode=args.mode, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                        chat=not args.raw, draft=draft, mu=args.mu)
    if args.json:
        print(json.dumps(out))
    else:
        print(out["text"])
        s = out["stats"]
        levels = ", ".join(f"{lv['name']} {lv['mean_accepted']:.2f}" for lv in s["levels"])
        print(f"[{s['mode']}: {s['new_tokens']} tokens, {s['tokens_per_second']:.1f} tok/s; mean accepted per "
              f"forward: {levels}]", file=sys.stderr)
    return 0


def cmd_chain(args: argparse.Namespace) -> int:
    """Chain folders: `assemble` makes one from parts (target, intermediates, draft head), hashing every file;
    `export-head` writes a chain's draft head in vLLM's (speculators), SGLang's or EAGLE's format (docs/SERVE.md)."""
    if args.chain_verb == "export-head":
        from polyspec.export.head_formats import export_head

        out = export_head(args.chain, args.format, args.out, verifier=args.verifier, draft_vocab=args.draft_vocab,
                          overwrite=args.overwrite)
        print(f"wrote {out}: the draft head of {args.chain} in the {args.format} format")
        return 0
    from polyspec.manifest import assemble_chain

    manifest = assemble_chain(args.out, args.target, args.intermediate or [], args.draft, overwrite=args.overwrite)
    names = " <- ".join(f"{lv.name} ({lv.kind})" for lv in manifest.levels)
    print(f"wrote {args.out}: {names}")
    return 0


def cmd_validate_chain(args: argparse.Namespace) -> int:
    """Check a chain folder (docs/DECODE.md): manifest paths inside it, every file listed and none a pickle, each
    level's kind / dtype / quantisation against its config.json, every sha256 and safetensors header. Exits 1 naming
    each missing, extra, changed or damaged file (2 for an unsafe or malformed manifest)."""
    from polyspec.manifest import validate_chain

    manifest = validate_chain(args.chain)
    files = sum(len(lv.files) for lv in manifest.levels)
    print(f"{args.chain}: valid chain, {len(manifest.levels)} levels, {files} files (all listed), all hashes match")
    return 0


# --------------------------------------------------------------------------------------------------------------------
# parser


def _add_theory(p: argparse.ArgumentParser) -> None:
    """The three questions of `polyspec theory`: insertion, stability, time."""
    tsub = p.add_subparsers(dest="theory_verb", metavar="WHAT", required=True)
    ins = tsub.add_parser("insertion", help="does inserting M_new between M_i and M_{i+1} pay? (Thm 3.2, Lemma 3.1)")
    for flag, hlp in (("--t-i", "forward cost of M_i"), ("--t-new", "forward cost of M_new"),
                      ("--t-next", "forward cost of M_{i+1} (the draft)"),
                      ("--l-i", "accepted tokens per M_i forward with M_{i+1} directly below"),
                      ("--l-new", "accepted tokens per M_new forward (M_{i+1} below)"),
                      ("--l-i-new", "accepted tokens per M_i forward with M_new below")):
        ins.add_argument(flag, type=float, required=True, help=hlp)
    ins.add_argument("--beta", type=float, default=1.0, help="draft forwards per verification (default 1)")
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    st = tsub.add_parser("stability", help="exact mean and variance of the acceptance length min(G, n)")
    st.add_argument("--alpha", type=float, required=True, help="per-token acceptance probability, in [0, 1]")
    st.add_argument("--n", type=int, required=True, help="block length (most tokens accepted per verification)")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    tm = tsub.add_parser("time", help="Lemma 3.1 time per token of a chain")
    tm.add_argument("--costs", type=float, nargs="+", required=True, help="T_1 .. T_n, target first")
    tm.add_argument("--accept", type=float, nargs="*", default=[], help="L_1 .. L_{n-1}")
    tm.add_argument("--beta", type=float, default=1.0)
    tm.add_argument("--json", action="store_true", help="print one JSON object")


def _add_generate(p: argparse.ArgumentParser) -> None:
    """The generate verb's arguments."""
    p.add_argument("chain", type=Path, help="chain folder (with manifest.json)")
    p.add_argument("--prompt", required=True, help="the user message (goes through the chat template)")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="default: the mode the manifest chose when the chain was profiled")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    add_draft_flags(p)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="one JSON object: text, token_ids, stats")


def _add_chain(p: argparse.ArgumentParser) -> None:
    """The chain verb's sub-verbs: assemble, export-head."""
    csub = p.add_subparsers(dest="chain_verb", metavar="WHAT", required=True)
    asm = csub.add_parser("assemble", help="make a chain folder from a target, intermediates and a draft head")
    asm.add_argument("--target", type=Path, required=True, help="the target's Hugging Face folder (M1)")
    asm.add_argument("--intermediate", type=Path, action="append",
                     help="a verifier below the target (e.g. its int4 GPTQ folder); repeat for more, top first")
    asm.add_argument("--draft", type=Path, help="the draft head folder (bottom level)")
    asm.add_argument("--out", type=Path, required=True, help="the chain folder to write")
    asm.add_argument("--overwrite", action="store_true", help="replace --out if it exists")

    from polyspec.export.head_formats import FORMATS as HEAD_FORMATS  # no torch: the parser stays fast

    exh = csub.add_parser("export-head", help="write the chain's draft head in an engine's format (vLLM, SGLang, EAGLE)")
    exh.add_argument("chain", type=Path, help="chain folder (with manifest.json)")
    exh.add_argument("--format", required=True, choices=HEAD_FORMATS,
                     help="speculators: vllm serve (EAGLE-3 heads); sglang: SGLang's EAGLE/EAGLE3 drafts; eagle: "
                          "SafeAILab/EAGLE's folder")
    exh.add_argument("--out", type=Path, required=True, help="the folder to write")
    exh.add_argument("--verifier", help="the target as the engine loads it (default: the chain's target folder)")
    exh.add_argument("--draft-vocab", type=int, default=None,
                     help="sglang, EAGLE-1/2 heads: token map of the N most frequent training tokens (0 = none; "
                          "default: the manifest's decode.draft.vocab)")
    exh.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polyspec",
        description="Polybasic speculative decoding: one recipe to a validated, served model chain.",
    )
    parser.add_argument("--version", action="version", version=f"polyspec {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(name: str, fn: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        doc = (fn.__doc__ or "").strip()
        p = sub.add_parser(name, help=doc.split("\n")[0], description=doc)
        p.set_defaults(func=fn)
        return p

    _add_recipe(verb("validate", cmd_validate))
    _add_recipe(verb("prepare", cmd_prepare))
    _add_recipe(verb("run", cmd_run))

    p = verb("train", cmd_train)
    _add_recipe(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")

    _add_recipe(verb("quantize", cmd_quantize))
    for name, fn in (("profile", cmd_profile), ("export", cmd_export)):
        p = verb(name, fn)
        _add_recipe(p)
        p.add_argument("--head", type=Path, help="draft head folder (default: the train stage's)")
        p.add_argument("--int4", type=Path, help="int4 GPTQ folder (default: the quantize stage's)")
        p.add_argument("--untrained-head", action="store_true", help="use a random-init head (timing, wiring)")
        p.add_argument("--rtn-int4", action="store_true", help="use an RTN int4 copy of the target")
        p.add_argument("--threads", type=int, help="torch threads while profiling (default: unchanged)")
        if name == "profile":
            p.add_argument("--search", action="store_true", help="search which levels, in which order (candidates: "
                           "the given levels, an RTN int4 copy of the target, prompt lookup); writes "
                           "<workdir>/profile/search (same as profile.search=true)")

    from polyspec.decode.serve import server as _serve  # light: no fastapi/torch at import

    _serve.configure_parser(verb("serve", cmd_serve))

    from polyspec.bench import bench as _bench  # light: no torch at import

    _bench.configure_parser(verb("bench", cmd_bench))
    from polyspec.bench import shape_bench as _shape_bench  # light: no torch at import

    _shape_bench.configure_parser(verb("shape-bench", cmd_shape_bench))

    _add_generate(verb("generate", cmd_generate))
    _add_chain(verb("chain", cmd_chain))

    p = verb("validate-chain", cmd_validate_chain)
    p.add_argument("chain", type=Path, help="chain folder (with manifest.json)")

    _add_theory(verb("theory", cmd_theory))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # the command this run records (stamps, tracking); a caller's argv is the same as the shell's `polyspec ...`
    args.command = [sys.argv[0], *sys.argv[1:]] if argv is None else ["polyspec", *argv]
    try:
        return int(args.func(args) or 0)
    except PolyspecError as exc:
        print(f"polyspec {args.verb}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("polyspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
