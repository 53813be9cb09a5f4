"""float32 vs bf16 for head training on this device: the three numbers that decide ``train.precision: auto``.

``python -m polyspec.bench.train_dtype MODEL_DIR [--batch 4] [--length 256] [--vocab 8192]`` times, in both dtypes,
(1) one lm_head-shaped product [B*T, H] x [H, Vd], (2) the target's forward over a B x T batch in polyspec's engine
(what offline feature extraction does) and (3) one EagleHead training step (forward, draft-vocabulary loss, backward,
AdamW; bf16 = autocast over float32 master weights), and prints one JSON object. docs/TRAIN.md, "bf16 on the CPU",
has this machine's numbers.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any


def _seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Mean seconds of ``fn`` over ``repeats`` calls after one warm-up (oneDNN picks and caches its kernels)."""
    from polyspec.decode.timing import timed

    fn()
    return timed(lambda: [fn() for _ in range(repeats)], "cpu")[1] / repeats


def _matmul(dtype, rows: int, hidden: int, vocab: int, repeats: int) -> dict[str, float]:
    import torch

    a, w = torch.randn(rows, hidden, dtype=dtype), torch.randn(vocab, hidden, dtype=dtype)
    s = _seconds(lambda: torch.nn.functional.linear(a, w), repeats)
    return {"seconds": s, "gflops": 2 * rows * hidden * vocab / s / 1e9}


def _teacher(model_dir: str, dtype, ids, repeats: int) -> dict[str, float]:
    import torch

    from polyspec.decode.model import Transformer

    model = Transformer.from_pretrained(model_dir, dtype=dtype, device="cpu").eval()
    with torch.no_grad():
        s = _seconds(lambda: model(ids), repeats)
    return {"seconds": s, "tokens_per_second": ids.numel() / s}


def _head_step(model_dir: str, autocast: bool, ids, vocab: int, repeats: int) -> dict[str, float]:
    import torch

    from polyspec.decode.head import EagleHead
    from polyspec.decode.model import Transformer

    target = Transformer.from_pretrained(model_dir, dtype=torch.float32, device="cpu").eval()
    head = EagleHead(target.args, target.embed_tokens, target.lm_head)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
    feats = torch.randn(*ids.shape, target.args.hidden_size)  # [B, T, H]
    vocab_ids = torch.arange(vocab)
    teacher_p = torch.softmax(torch.randn(*ids.shape, vocab), dim=-1)  # [B, T, Vd]

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits, out = head(ids, feats, vocab_ids=vocab_ids)
            loss = -(teacher_p * torch.log_softmax(logits.float(), -1)).sum(-1).mean() + \
                torch.nn.functional.smooth_l1_loss(out.float(), feats)
        loss.backward()
        opt.step()
        opt.zero_grad()

    s = _seconds(step, repeats)
    return {"seconds": s, "tokens_per_second": ids.numel() / s}


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m polyspec.bench.train_dtype", description=__doc__.split("\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192, help="draft vocabulary of the loss")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    ids = torch.randint(0, a.vocab, (a.batch, a.length))
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "batch": a.batch, "length": a.length, "vocab": a.vocab}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        out[name] = {
            "matmul": _matmul(dtype, a.batch * a.length, _hidden(a.model_dir), a.vocab, 10 * a.repeats),
            "teacher_forward": _teacher(a.model_dir, dtype, ids, a.repeats),
            "head_step": _head_step(a.model_dir, dtype == torch.bfloat16, ids, a.vocab, a.repeats),
        }
    print(json.dumps(out, indent=1))
    return 0


def _hidden(model_dir: str) -> int:
    from pathlib import Path

    from polyspec.decode.model import read_hf_config

    return int(read_hf_config(Path(model_dir))["hidden_size"])


if __name__ == "__main__":
    raise SystemExit(main())
