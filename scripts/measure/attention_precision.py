"""How far a prompt's bf16 attention lands from fp64 attention on the same bf16 inputs: the CPU kernel's
(cpu_kernels.attention) against torch's SDPA (9 query heads over 3 K/V heads, 300 causal rows, six draws).

    python scripts/measure/attention_precision.py

docs/BENCHMARKS.md, "CPU, stop 23".
"""

import torch
import torch.nn.functional as F

from polyspec.decode import cpu_kernels as ck
from polyspec.decode.model import block_mask


def main() -> None:
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    t = 300
    mask = block_mask(0, t, None, torch.device("cpu"))
    for _ in range(6):
        q = (torch.randn(1, 9, t, 64, generator=gen) * 2).to(torch.bfloat16)
        k = (torch.randn(1, 3, t, 64, generator=gen) * 2).to(torch.bfloat16)
        v = torch.randn(1, 3, t, 64, generator=gen).to(torch.bfloat16)
        with torch.inference_mode():
            exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
            kernel = ck.attention(q, k, v, mask).double()
            sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).double()
        print(f"mean |error| vs fp64: kernel {(kernel - exact).abs().mean():.2e}  sdpa {(sdpa - exact).abs().mean():.2e}")


if __name__ == "__main__":
    main()
