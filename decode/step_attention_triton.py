"""The Triton kernels of polyspec.decode.step_attention (its docstring says what they compute and how); imported
only where they run (CUDA, or Triton's interpreter in the parity tests), since importing triton fixes the mode."""

import triton
import triton.language as tl


@triton.jit
def rope(base, d, p, cos_t, sin_t, ok, D: tl.constexpr):
    """Rows at ``base`` [R, 1] (pointers to a head's D values) rotated at positions p [R], in fp32."""
    x = tl.load(base + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    partner = tl.load(base + ((d + D // 2) % D)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    rot = tl.where(d[None, :] < D // 2, -partner, partner)  # rotate-half
    c = tl.load(cos_t + p[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    s = tl.load(sin_t + p[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    return x * c + rot * s


@triton.jit
def softmax_block(s, vis, m, den, acc, vals, PRECISION: tl.constexpr):
    """One online-softmax step over scores s [M, N] (visible where ``vis``) and values [N, D]."""
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet stays at zero
    alpha = tl.exp(m - m_use)
    p = tl.exp(s - m_use[:, None])
    den = den * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals, input_precision=PRECISION)
    return m_new, den, acc


@triton.jit
def split_kernel(qk, v, cos_t, sin_t, kc, vc, pos, bounds, inner, part_o, part_ml, scale,
                 s_qk, s_v, s_ch, s_cs,
                 KV: tl.constexpr, G: tl.constexpr, W: tl.constexpr, D: tl.constexpr, C: tl.constexpr,
                 SPLITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_W: tl.constexpr, PRECISION: tl.constexpr):
    kvh, mb, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(bounds)
    prefix = tl.load(bounds + 1)
    if (split < SPLITS) & (split * CHUNK >= start):
        return  # no cached slot here: the combine skips this split
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # row g W + w: query head kvh G + g, block token w
    row_ok = rows < G * W
    w = rows % W
    d = tl.arange(0, D)
    p = tl.load(pos + w, mask=row_ok, other=0)
    q = rope(qk + w[:, None] * s_qk + (kvh * G + rows // W)[:, None] * D, d, p, cos_t, sin_t, row_ok, D)
    q = q.to(qk.dtype.element_ty)  # the reference rounds the rotated query to the activations' dtype
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kc += kvh * s_ch
    vc += kvh * s_ch
    if split < SPLITS:  # cached keys: slots split CHUNK .. below start
        for i in range(CHUNK // BLOCK_N):
            j = split * CHUNK + i * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = j < start
            keys = tl.load(kc + j[:, None] * s_cs + d[None, :], mask=ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
            col = j[None, :] - prefix
            seen = tl.load(inner + w[:, None] * C + col, other=0,
                           mask=row_ok[:, None] & ok[None, :] & (col >= 0) & (col < C))
            vis = ok[None, :] & ((col < 0) | (seen != 0))
            vals = tl.load(vc + j[:, None] * s_cs + d[None, :], mask=ok[:, None], other=0.0)
            m, den, acc = softmax_block(s, vis, m, den, acc, vals, PRECISION)
    else:  # the block's own keys, rotated here, written to their slots by the first row block
        t = tl.arange(0, BLOCK_W)
        t_ok = t < W
        pt = tl.load(pos + t, mask=t_ok, other=0)
        keys = rope(qk + t[:, None] * s_qk + (KV * G + kvh) * D, d, pt, cos_t, sin_t, t_ok, D)
        keys = keys.to(qk.dtype.element_ty)
        vals = tl.load(v + t[:, None] * s_v + kvh * D + d[None, :], mask=t_ok[:, None], other=0.0)
        if mb == 0:
            tl.store(kc + (start + t)[:, None] * s_cs + d[None, :], keys, mask=t_ok[:, None])
            tl.store(vc + (start + t)[:, None] * s_cs + d[None, :], vals, mask=t_ok[:, None])
        s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
        col = (start - prefix) + t[None, :]
        seen = tl.load(inner + w[:, None] * C + col, mask=row_ok[:, None] & t_ok[None, :] & (col < C), other=0)
        m, den, acc = softmax_block(s, seen != 0, m, den, acc, vals, PRECISION)
    at = (kvh * (SPLITS + 1) + split) * (G * W)
    tl.store(part_o + (at + rows)[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
    tl.store(part_ml + 2 * at + rows, m, mask=row_ok)
    tl.store(part_ml + 2 * at + G * W + rows, den, mask=row_ok)


@triton.jit
def combine_kernel(part_o, part_ml, bounds, out, KV: tl.constexpr, G: tl.constexpr, W: tl.constexpr,
                   D: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr):
    """out [1, W, KV G, D] from the live splits' partial outputs, maxima and sums (one rescaling pass)."""
    kvh, rb = tl.program_id(0), tl.program_id(1)
    start = tl.load(bounds)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < G * W
    d = tl.arange(0, D)
    big = tl.full([BLOCK_R], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    num = tl.zeros([BLOCK_R, D], tl.float32)
    for split in range(SPLITS + 1):  # a loop, not unrolled: splits past the length load nothing
        at = (kvh * (SPLITS + 1) + split) * (G * W)
        live = ok & ((split == SPLITS) | (split * CHUNK < start))
        m = tl.load(part_ml + 2 * at + rows, mask=live, other=float("-inf"))
        new = tl.maximum(big, m)
        use = tl.where(new == float("-inf"), 0.0, new)
        keep, add = tl.exp(big - use), tl.exp(m - use)
        den = den * keep + add * tl.load(part_ml + 2 * at + G * W + rows, mask=live, other=0.0)
        num = num * keep[:, None] + add[:, None] * tl.load(part_o + (at + rows)[:, None] * D + d[None, :],
                                                           mask=live[:, None], other=0.0)
        big = new
    head = kvh * G + rows // W
    dst = out + ((rows % W) * (KV * G) + head)[:, None] * D + d[None, :]
    tl.store(dst, (num / tl.where(ok, den, 1.0)[:, None]).to(out.dtype.element_ty), mask=ok[:, None])
