"""Feature extraction with and without the full logits, alternated batch by batch in one process (docs/TRAIN.md,
stop 21): the train stage's batches of 4 over a prepared split's first 160 rows, twice.

    python scripts/measure/extract_ab.py TARGET_FOLDER PREPARED_SPLIT_FOLDER     # e.g. <workdir>/cache/data/<key>/train
"""

import sys
import time
from pathlib import Path

import datasets
import torch

from polyspec.train.features import TokenDataset, collate, load_teacher, teacher_hidden, teacher_outputs


def main(target: str, split_dir: str) -> None:
    teacher = load_teacher(Path(target), torch.bfloat16, "cpu")
    ds = TokenDataset(datasets.load_from_disk(split_dir))
    batches = [collate([ds[i] for i in range(s, min(s + 4, len(ds)))])["input_ids"] for s in range(0, 160, 4)]
    seconds = {"logits": 0.0, "hidden only": 0.0}
    for rep in range(2):
        for ids in batches:
            for kind in (("logits", "hidden only") if rep % 2 == 0 else ("hidden only", "logits")):
                t0 = time.perf_counter()
                teacher_outputs(teacher, ids) if kind == "logits" else teacher_hidden(teacher, ids)
                seconds[kind] += time.perf_counter() - t0
    tokens = 2 * sum(ids.numel() for ids in batches)  # padded positions, as the pass computes them
    for kind, s in seconds.items():
        print(f"{kind}: {s:.1f} s, {tokens / s:.0f} positions/s")
    print(f"speedup {seconds['logits'] / seconds['hidden only']:.3f}x")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(*sys.argv[1:])
