"""What a training batch of an offline feature cache is made of: the share of padding and the share of rows the
loss counts (train.losses.shift_for_head's weight), over random batches of BATCH rows, and how many rows reach the
longest length. docs/TRAIN.md, "Logits on the rows that count" (stop 31).

    python scripts/measure/batch_rows.py CACHE_DIR [BATCHES [BATCH]]
"""

import random
import sys
from pathlib import Path

from polyspec.train.features import CachedFeatureDataset
from polyspec.train.losses import padded_batch, shift_for_head


def main(cache_dir: str, batches: str = "24", batch: str = "4") -> None:
    ds = CachedFeatureDataset(Path(cache_dir), "train")
    rng = random.Random(0)
    real = padded = counted = rows = 0
    for _ in range(int(batches)):
        b = padded_batch([ds[rng.randrange(len(ds))] for _ in range(int(batch))])
        s = shift_for_head(b["input_ids"], b["hidden"], b["hidden"], b["loss_mask"], b["lengths"])
        real, padded = real + int(b["lengths"].sum()), padded + b["input_ids"].numel()
        counted, rows = counted + int(s["weight"].sum()), rows + s["weight"].numel()
    lengths = [len(ds[i]["input_ids"]) for i in range(len(ds))]
    top = max(lengths)
    print(f"padding {1 - real / padded:.3f}, rows the loss counts {counted / rows:.3f}; "
          f"{sum(n == top for n in lengths)} of {len(lengths)} rows at the longest length {top}")


if __name__ == "__main__":
    main(*sys.argv[1:])
