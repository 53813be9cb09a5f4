"""What a GPTQ quantisation leaves behind in its process: ``ar`` speed on a chain before and after one.

    python scripts/measure/gptq_aftereffect.py CHAIN RECIPE WORKDIR [inline]

Loads CHAIN, times a 64-token ``ar`` answer, quantises RECIPE's target with GPTQ (``quantize.calibration_samples=5``,
so a new folder under WORKDIR; ``inline``: in this process, as polyspec did before stop 22, else as
``polyspec.quantize.gptq.quantize_model`` does now), then times it again, with 2 threads and with 1, and counts this
process's threads. docs/BENCHMARKS.md, "CPU, stop 22".
"""

import sys
import time
from pathlib import Path

import torch

from polyspec.decode.generate import generate_text, load_chain


def speed(chain, tag: str) -> None:
    generate_text(chain, "Tell me about the moon.", mode="ar", max_new_tokens=16)
    t0 = time.perf_counter()
    r = generate_text(chain, "Tell me about the moon.", mode="ar", max_new_tokens=64)
    threads = len(list(Path("/proc/self/task").iterdir()))
    print(f"{tag}: {len(r['token_ids']) / (time.perf_counter() - t0):.1f} tok/s, {threads} threads, "
          f"torch threads {torch.get_num_threads()}", flush=True)


def main(chain_dir: str, recipe_path: str, workdir: str, how: str = "child") -> None:
    from polyspec.config import load_recipe
    from polyspec.quantize import gptq, quantize_stage

    torch.set_num_threads(2)
    chain = load_chain(Path(chain_dir), device="cpu")
    speed(chain, "before")
    if how == "inline":  # the old behaviour: GPTQModel's threads in this process
        gptq.in_fresh_process = lambda what, fn, *a, **kw: fn(*a, **kw)
    recipe = load_recipe(recipe_path, [f"workdir={workdir}", "quantize.calibration_samples=5",
                                       "tracking.enabled=false"])
    print(quantize_stage(recipe))
    speed(chain, "after GPTQ")
    torch.set_num_threads(1)
    speed(chain, "after GPTQ, 1 thread")


if __name__ == "__main__":
    main(*sys.argv[1:])
