"""EAGLE-3 against EAGLE-3.1 (``train.head: eagle3`` / ``eagle3.1``: Eagle 3.1's fc_norm and norm_output) on the real
SmolLM2: two heads trained from one recipe (same data, split, seed and step count), then each head's mean accepted
length tau (tokens committed per target verification, greedy dual decoding) on the same held-out prompts, for linear
drafts of ``decode.draft.k`` and for the recipe's draft tree.

    python lab/eagle31_norms.py [--steps 3000] [--prompts 32] [--tokens 96] [a.b=v ...]

The recipe is recipes/smollm2_chain.yaml (``--recipe`` for another) with the ``a.b=v`` overrides given, then
``train.head`` and ``train.max_steps`` set per head. A trained head is found again by its key (the train stage's
reuse), so a rerun only measures. Prints one JSON line per head and the differences, and writes them to
``<workdir>/eagle31_norms.json``. A CPU dry run (minutes; not a measurement):

    OMP_NUM_THREADS=1 python lab/eagle31_norms.py --steps 2 --prompts 2 --tokens 16 workdir=/tmp/e31 \\
        target.device=cpu target.dtype=float32 train.precision=32-true train.features=online \\
        data.max_conversations=40 data.heldout_fraction=0.25 data.max_length=256 train.batch_size=2 \\
        train.warmup_steps=1 train.accept_prompts=0 tracking.enabled=false
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HEADS = ("eagle3", "eagle3.1")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/smollm2_chain.yaml")
    ap.add_argument("--steps", type=int, default=3000, help="optimizer steps per head (train.max_steps)")
    ap.add_argument("--prompts", type=int, default=32, help="held-out first turns decoded per head")
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per prompt")
    ap.add_argument("overrides", nargs="*", help="recipe overrides a.b=v")
    return ap.parse_args()


def heldout_prompts(recipe, target_dir: Path, n: int) -> list[list[int]]:
    """The first ``n`` held-out prompts (first user turn, assistant header open), as the train stage's probe reads
    them: the same for both heads, never trained on."""
    from polyspec.data.prepare import prepare_dataset
    from polyspec.decode.acceptance import prompt_prefix
    from polyspec.sources import load_tokenizer, model_id

    prepared = prepare_dataset(recipe.data, load_tokenizer(target_dir), workdir=Path(recipe.workdir),
                               tokenizer_id=model_id(recipe.target.source, target_dir))
    rows = (prompt_prefix(r["input_ids"], r["loss_mask"]) for r in prepared.heldout)
    return [p for p in rows if p][:n]


def measure(recipe, target_dir: Path, head_dir: Path, prompts: list[list[int]], tokens: int) -> dict:
    """tau of the head in ``head_dir`` over ``prompts``: linear drafts (with per-depth acceptance) and the tree."""
    import torch

    from polyspec.chain_spec import DraftSpec, TreeShape
    from polyspec.decode.acceptance import decoder_acceptance
    from polyspec.decode.generate import eos_ids
    from polyspec.decode.head import load_head, read_head_config
    from polyspec.decode.model import Transformer
    from polyspec.device import resolve_device, resolve_dtype
    from polyspec.sources import load_tokenizer

    device = resolve_device(recipe.target.device)
    target = Transformer.from_pretrained(target_dir, dtype=resolve_dtype(recipe.target.dtype, device),
                                         device=device).eval()
    head = load_head(head_dir, target)
    eos = frozenset(eos_ids(load_tokenizer(target_dir)))
    draft = recipe.decode.draft
    out = {"head": read_head_config(head_dir)["head_type"], "folder": str(head_dir)}
    with torch.inference_mode():
        linear = DraftSpec(k=draft.k)
        for name, spec in (("linear", linear), ("tree", linear.model_copy(update={"tree": draft.tree or TreeShape()}))):
            res = decoder_acceptance(target, head, prompts, max_new_tokens=tokens, draft=spec, eos_token_ids=eos)
            out[f"tau_{name}"] = round(res.tokens_per_verification, 4)
            if res.depth_accept:
                out["depth_accept"] = [round(a, 4) for a in res.depth_accept]
    training = json.loads((head_dir / "training.json").read_text())
    out.update(steps=training.get("steps"), heldout_loss=(training.get("eval_history") or [{}])[-1].get("heldout/loss"))
    return out


def main() -> None:
    from polyspec.config import load_recipe
    from polyspec.pipeline import run_train
    from polyspec.sources import target_stage

    args = parse()
    recipes = {h: load_recipe(args.recipe, [*args.overrides, f"train.head={h}", f"train.max_steps={args.steps}"])
               for h in HEADS}
    target_dir = Path(target_stage(recipes[HEADS[0]]))
    results = {}
    for h, recipe in recipes.items():
        t0 = time.perf_counter()
        run_train(recipe, target_dir=target_dir, progress=True)
        results[h] = {"train_seconds": round(time.perf_counter() - t0, 1)}
    prompts = heldout_prompts(recipes[HEADS[0]], target_dir, args.prompts)
    for h, recipe in recipes.items():
        results[h] |= measure(recipe, target_dir, run_train(recipe, target_dir=target_dir), prompts, args.tokens)
        print(json.dumps(results[h]), flush=True)
    a, b = (results[h] for h in HEADS)
    diff = {f"{k} (eagle3.1 - eagle3)": round(b[k] - a[k], 4) for k in ("tau_linear", "tau_tree")}
    report = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "args": vars(args), "prompts": len(prompts),
              "heads": results, **diff}
    print(json.dumps(diff))
    (Path(recipes[HEADS[0]].workdir) / "eagle31_norms.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
