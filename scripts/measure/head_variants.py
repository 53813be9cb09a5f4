"""Draft-head variants that are not recipe options, trained by the train stage and measured like the shipped head:
a head of N decoder layers instead of one, and a sharpened or softened teacher in the token loss.

    python scripts/measure/head_variants.py train VARIANT RECIPE [a.b=v ...]
    python scripts/measure/head_variants.py eval LAYERS CHAIN RECORDS.json DRAFT_VOCAB HEAD_DIR [HEAD_DIR ...]

VARIANT: ``layers=N`` (fc -> N decoder layers -> lm_head; saved as ``layer.layers.<i>.*``) or ``teacher_t=T``
(the token loss's teacher distribution softmax(logits / T); T = 0: the teacher's argmax as a hard label). The
variant does not enter the head's training key, so give each variant a workdir of its own (its ``cache`` may link
to another workdir's, so the features are not extracted again). ``eval``: first_guess.py's ``heads`` for heads of
LAYERS layers (1: the shipped kind). docs/TRAIN.md, "stop 24".
"""

import dataclasses
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import first_guess  # noqa: E402

from polyspec.decode.model import DecoderLayer  # noqa: E402


class LayerStack(nn.Module):
    """N decoder layers where the head has one (cache slots layer_idx .. layer_idx + N - 1)."""

    def __init__(self, args, n: int):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(n))

    @property
    def input_layernorm(self) -> nn.Module:  # EagleHead reads its compute dtype here
        return self.layers[0].input_layernorm

    def forward(self, x, cos, sin, mask, cache=None, layer_idx=0, start=0):
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, layer_idx + i, start)
        return x


def stacked(head, n: int):
    if n > 1:
        head.layer = LayerStack(head.args, n).to(head.fc.weight.dtype)
        head._cache_layers = n
    return head


def teacher_losses(t: float):
    from polyspec.train.losses import eagle_losses

    def losses(head_logits, head_hidden, target_features, target_logits, weight):
        logits = target_logits.float()
        if t == 0:
            logits = torch.full_like(logits, -1e4).scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
        else:
            logits = logits / t
        return eagle_losses(head_logits, head_hidden, target_features, logits, weight)
    return losses


def train(variant: str, recipe_path: str, *overrides: str) -> None:
    import polyspec.train.losses as losses
    import polyspec.train.stage as stage
    from polyspec.config import load_recipe

    name, value = variant.split("=")
    if name == "layers":
        new_head = stage._new_head
        stage._new_head = lambda cfg, teacher, counts: stacked(new_head(cfg, teacher, counts), int(value))
    elif name == "teacher_t":
        losses.eagle_losses = teacher_losses(float(value))  # what eagle_unrolled_losses calls
    else:
        raise SystemExit(f"unknown variant {variant!r}: layers=N or teacher_t=T")
    t0 = time.time()
    out = stage.train_stage(load_recipe(Path(recipe_path), list(overrides)), None, progress=False)
    print(f"{variant}: {out} ({time.time() - t0:.0f} s)")


def load_stacked(n: int):
    from safetensors.torch import load_file

    from polyspec.decode.head import EagleHead, read_token_counts

    def load(folder, target):
        head = stacked(EagleHead(dataclasses.replace(target.args, num_layers=1), target.embed_tokens,
                                 target.lm_head), n)
        missing, unexpected = head.load_state_dict(load_file(Path(folder) / "model.safetensors"), strict=False)
        if unexpected or any(k.startswith(("fc.", "layer.")) for k in missing):
            raise SystemExit(f"{folder}: not a {n}-layer head ({unexpected or missing})")
        head.token_counts = read_token_counts(folder, target.args.vocab_size)
        return head.to(target.embed_tokens.weight.dtype).eval()
    return load


def evaluate(layers: str, *args: str) -> None:
    if int(layers) > 1:
        first_guess.load_head = load_stacked(int(layers))
    first_guess.heads(*args)


if __name__ == "__main__":
    torch.set_num_threads(2)
    {"train": train, "eval": evaluate}[sys.argv[1]](*sys.argv[2:])
