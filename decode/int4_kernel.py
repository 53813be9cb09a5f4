"""The Triton source of polyspec's W4A16 kernel (docs and launch: :mod:`polyspec.decode.int4_triton`, which imports
this module only when a kernel is needed: importing triton takes ~0.2 s)."""

import triton
import triton.language as tl


@triton.jit
def plane(codes, nz, j: tl.constexpr, magic: tl.constexpr, asm: tl.constexpr):
    """q - zero of plane j, [BLOCK_N, L] in nz's dtype."""
    if asm == "":  # the interpreter: the same bit trick in Triton ops
        v = ((codes >> (4 * j)) & 0xF) | magic
        return v.to(tl.int16).to(nz.dtype, bitcast=True) + nz
    return tl.inline_asm_elementwise(asm, "=r,r,r", [codes, nz], dtype=nz.dtype, is_pure=True, pack=2)


@triton.jit
def block(acc, x_ptr, q_ptr, meta_ptr, ub, offs_m, offs_n, offs_u, M, N, K, KU, stride_xm, stride_qn,
          GROUP: tl.constexpr, L: tl.constexpr, MASK_CODES: tl.constexpr, MASK_K: tl.constexpr,
          MAGIC16: tl.constexpr, A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += one block of 4L K values: four planes, each one MMA against its x slice (a
    block past the codes, in a split's tail, reloads the last block and adds it times 0). Masks only where the
    shape needs them: MASK_CODES (N not a multiple of BLOCK_N), MASK_K (K not a multiple of 4L)."""
    per: tl.constexpr = GROUP // L  # planes per group (>= 4: the whole block is one group)
    live = (ub < KU).to(tl.float32)
    ub = tl.minimum(ub, KU - L)
    n_ok = offs_n < N
    if MASK_CODES:
        codes = tl.load(q_ptr + offs_n[:, None] * stride_qn + (ub + offs_u)[None, :], mask=n_ok[:, None], other=0)
    else:
        codes = tl.load(q_ptr + offs_n[:, None] * stride_qn + (ub + offs_u)[None, :])
    part = tl.zeros_like(acc)
    for j in tl.static_range(4):
        k0 = ub * 4 + j * L
        if j % per == 0:
            if MASK_CODES:
                meta = tl.load(meta_ptr + (k0 // GROUP) * N + offs_n, mask=n_ok, other=0)
            else:
                meta = tl.load(meta_ptr + (k0 // GROUP) * N + offs_n)
            nz = (meta & 0xFFFF).to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True)
            nz = tl.broadcast_to(nz[:, None], (offs_n.shape[0], L))
        d = plane(codes, nz, j, MAGIC16, A0 if j == 0 else A1 if j == 1 else A2 if j == 2 else A3)
        xk = k0 + offs_u
        x_ok = (offs_m < M)[:, None] & ((xk < K)[None, :] if MASK_K else True)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + xk[None, :], mask=x_ok, other=0.0)
        part = tl.dot(d, tl.trans(x), part)
        if (j + 1) % per == 0 or j == 3:
            scale = (meta >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * live
            acc += part * scale[:, None]
            part = tl.zeros_like(acc)
    return acc


@triton.jit
def store(y, out_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS: tl.constexpr):
    """out[m, n] = y[n, m] (+ bias[n]) in the output's dtype."""
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], y.to(out_ptr.dtype.element_ty),
             mask=(offs_m < M)[None, :] & (offs_n < N)[:, None])


@triton.jit
def w4a16(x_ptr, q_ptr, meta_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K, KU, stride_xm, stride_qn,
          GROUP: tl.constexpr, L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          SPLITS: tl.constexpr, BLOCKS: tl.constexpr, MASK_CODES: tl.constexpr, MASK_K: tl.constexpr,
          HAS_BIAS: tl.constexpr, MAGIC16: tl.constexpr,
          A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr):
    """out [M, N] = x [M, K] @ W.T (+ bias): program (n, k, m) owns BLOCK_N columns, BLOCK_M rows and split k's
    BLOCKS blocks of K (int4_triton's module doc)."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_u = tl.arange(0, L)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # a compile-time trip count: Triton's interpreter cannot take a tensor-valued range bound under numpy 2
    for i in range(BLOCKS):
        ub = (pid_k * BLOCKS + i) * L  # past KU in a split's tail: the last block again, scaled by 0
        acc = block(acc, x_ptr, q_ptr, meta_ptr, ub, offs_m, offs_n, offs_u, M, N, K, KU, stride_xm, stride_qn,
                    GROUP, L, MASK_CODES, MASK_K, MAGIC16, A0, A1, A2, A3)
    if SPLITS == 1:
        store(acc, out_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS)
    else:
        # partials in fp32; the last split of the tile to arrive sums them in split order (deterministic). The
        # barrier orders every thread's partial before the counter's release (CUTLASS's semaphore pattern).
        ws = ws_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.store(ws + pid_k * M * N, acc, mask=(offs_m < M)[None, :] & (offs_n < N)[:, None])
        tl.debug_barrier()
        lock = lock_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLITS):
                total += tl.load(ws + s * M * N, mask=(offs_m < M)[None, :] & (offs_n < N)[:, None], other=0.0,
                                 cache_modifier=".cg")
            store(total, out_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS)
            tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")
