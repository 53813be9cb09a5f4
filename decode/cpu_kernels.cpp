// polyspec CPU fast path: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for the few rows a decode or verify step has.
//
// Why: at batch 1 a decoder step is bound by how fast the weights stream from memory. torch's fp32 CPU GEMM runs a
// single-threaded GEMV at M = 1 (~10 GB/s on our 2-core machine, where a plain reduction reads 30+ GB/s) and a
// packing GEMM above it, which re-reads the weights. This kernel walks the weight rows in memory order, one
// contiguous slice of rows per OpenMP thread (the runtime torch itself uses), and takes each row against every input
// row while it is in L1 (passes of up to 8 input rows in vector registers; see rows() for the pass sizes). Up to three
// weights can be computed side by side in one call (q/k/v, gate/up).
//
// Batch invariance: output (m, n) is the same sequence of fused multiply-adds whatever M is (fp32 rows: two 16-lane
// accumulators over k = 0, 32, ... and k = 16, 48, ..., an odd 16-wide step into the first, their sum, a fixed-order
// lane sum, the K % 16 tail, then the bias; every other row kernel states its sequence), so a token's logits do not
// depend on how many tokens share its forward. Built by
// polyspec/decode/cpu_kernels.py with -O3 -march=native; plain C ABI, called through ctypes with torch tensors' data
// pointers. Weights: fp32, or bf16 (uint16 bits): for a bf16 input the vdpbf16ps rows (AVX512-BF16; bf16 products
// summed in fp32), else widened to fp32 in blocks of rows (rows_wide). Inputs, biases and outputs are fp32 at the ABI
// (the caller widens a bf16 input and rounds the output).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

template <typename V>
struct Words;  // a vector of fp32 lanes' 16-bit and 32-bit unsigned counterparts
template <>
struct Words<v16f> {
    typedef v16h h;
    typedef v16u u;
};
template <>
struct Words<v8f> {
    typedef v8h h;
    typedef v8u u;
};

// Loads of a vector V of fp32 lanes (v16f by default; the portable rows' vr): fp32 values, or bf16 bits widened.
template <typename V = v16f>
static inline V load_f32(const float* p) {
    V v;
    memcpy(&v, p, sizeof(v));
    return v;
}

template <typename V = v16f>
static inline V load_bf16(const uint16_t* p) {
    typename Words<V>::h h;
    memcpy(&h, p, sizeof(h));
    const typename Words<V>::u u = __builtin_convertvector(h, typename Words<V>::u) << 16;
    V v;
    memcpy(&v, &u, sizeof(v));
    return v;
}

#ifdef __AVX512F__
// 16 bf16 values: one widening load and a shift. GCC's vector conversion of this shape split into two 8-lane widenings,
// extracts and an insert, shuffles on the port of the second 512-bit multiply-add: attention over 8 rows of SmolLM2's
// heads took 1.31x the time when it widened its K/V rows so (docs/BENCHMARKS.md).
template <>
inline v16f load_bf16<v16f>(const uint16_t* p) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline float lane_sum(v16f v) {  // fixed pairwise order: halves, quarters, ...
    v8f h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    float a = q[0] + q[2], b = q[1] + q[3];
    return a + b;
}

// lane_sum of four vectors at once, bitwise: the same halves, quarters and pairs, the four side by side (12 vector
// operations where four lane_sums take ~36; a block's sums were ~15 % of its time at K = 576).
static inline void lane_sums4(v16f a, v16f b, v16f c, v16f d, float* out) {
    const v16f ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                    __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const v16f cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                    __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const v16f q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                   __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const v16f t = q + __builtin_shufflevector(q, q, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const v16f u = t + __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    out[0] = u[0], out[1] = u[4], out[2] = u[8], out[3] = u[12];
}

template <typename W>
static inline v16f load_w(const W* p);
template <>
inline v16f load_w<float>(const float* p) { return load_f32(p); }
template <>
inline v16f load_w<uint16_t>(const uint16_t* p) { return load_bf16(p); }

static inline float w_scalar(const float* p) { return *p; }
static inline float w_scalar(const uint16_t* p) { return bf16_to_f32(*p); }

// Calls f(std::integral_constant<int, G>{}) for a pass of g input rows (1..MAX - 1; MAX and more: MAX): every row
// kernel's passes are compiled for each G, so the accumulators stay in registers.
template <int MAX = 8, typename F>
static inline void by_pass(int64_t g, F&& f) {
    static_assert(MAX >= 4 && MAX <= 8, "passes of 4 to 8 rows");
    switch (g < MAX ? g : MAX) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: if constexpr (MAX >= 5) f(std::integral_constant<int, 5>{}); break;
        case 6: if constexpr (MAX >= 6) f(std::integral_constant<int, 6>{}); break;
        case 7: if constexpr (MAX >= 7) f(std::integral_constant<int, 7>{}); break;
        default: if constexpr (MAX >= 8) f(std::integral_constant<int, 8>{}); break;
    }
}

// One block of R weight rows (from row n) against all M input rows, in balanced passes of up to P: dots(G, m0, out)
// fills out[r * 8 + g] for the pass's G inputs from input m0; the block is read from memory in the first pass and
// from L1 in later ones. The blocked row kernels (dp, wide, int4) share it.
template <int R, int P, typename Dots>
static inline void block_passes(int64_t M, int64_t N, int64_t n, const float* bias, float* y, Dots&& dots) {
    float out[R * 8];
    const int64_t passes = (M + P - 1) / P;
    for (int64_t q = 0, m0 = 0; q < passes; q++) {
        const int64_t g = passes == 1 ? M : (M - m0) / (passes - q);  // one pass: no 64-bit division (~60 cycles)
        by_pass<P>(g, [&](auto G) { dots(G, m0, out); });
        for (int r = 0; r < R; r++)
            for (int64_t i = 0; i < g; i++) y[(m0 + i) * N + n + r] = out[r * 8 + i] + (bias ? bias[n + r] : 0.0f);
        m0 += g;
    }
}

// The weight rows stream from memory in address order (pack_weights lays a model's weights out in the order a step
// reads them), and the hardware prefetcher alone leaves a verification of 2-5 rows waiting on memory: each 128-byte
// step also asks for the lines PREFETCH_BYTES ahead. The hint is the build's POLYSPEC_PREFETCH_LOCALITY
// (cpu_kernels.py picks it by CPU vendor): 0, non-temporal (prefetchnta), on AMD, so a model's weights streaming
// through do not evict what is read again soon (the draft head's weights between two target steps, the KV cache):
// on the 2-core AMD EPYC VM bf16 SmolLM2 generations 1.03x (ar) and 1.07x (dual) faster than without a prefetch,
// 1.02x / 1.04x faster than with temporal ones. 1 (prefetcht2) elsewhere: on an Intel Xeon (Cascade Lake) the bf16
// target's layers took 2.6x as long with prefetchnta, and 1.25x without a prefetch (docs/KERNELS.md). A prefetch
// never faults: running past the end of a weight is harmless.
#ifndef POLYSPEC_PREFETCH_LOCALITY
#define POLYSPEC_PREFETCH_LOCALITY 1
#endif
#ifndef POLYSPEC_PREFETCH_BYTES
#define POLYSPEC_PREFETCH_BYTES 9216
#endif
static constexpr int64_t PREFETCH_BYTES = POLYSPEC_PREFETCH_BYTES;
static inline void prefetch_ahead(const void* p) {
    const char* c = (const char*)p + PREFETCH_BYTES;
    __builtin_prefetch(c, 0, POLYSPEC_PREFETCH_LOCALITY);
    __builtin_prefetch(c + 64, 0, POLYSPEC_PREFETCH_LOCALITY);
}

// A 16-row block's weight line at p: the line PREFETCH_BYTES ahead with the build's hint and, with a temporal hint,
// the line PREFETCH_NEAR bytes ahead into L1 (prefetcht0). The far line reaches L2 in time, but each step's load
// then waited on L2: with the near one the half-width build's bf16 target layers took 0.93-0.96x the time at 1-5 rows
// and 0.98-1.01x at 8, the 16-lane build's 0.91-0.98x (Xeon 207 VM, docs/BENCHMARKS.md). Not measured on AMD, whose
// non-temporal hint (0) keeps the far prefetch alone.
#ifndef POLYSPEC_PREFETCH_NEAR
#define POLYSPEC_PREFETCH_NEAR 1024
#endif
static inline void prefetch_block_line(const void* p) {
    __builtin_prefetch((const char*)p + PREFETCH_BYTES, 0, POLYSPEC_PREFETCH_LOCALITY);
#if POLYSPEC_PREFETCH_LOCALITY > 0
    __builtin_prefetch((const char*)p + POLYSPEC_PREFETCH_NEAR, 0, 3);
#endif
}

// Pins two loaded weight vectors in registers for the loop body. Without it GCC folds the load into every input
// row's multiply (one weight load per input row instead of one per row: 2G loads per step where 2 do), and at
// widths 2-5 the loads, not the multiplies, fill the load ports (docs/KERNELS.md, "The CPU fast path").
template <typename V>
static inline void in_register(V& a, V& b) {
#ifdef __AVX512F__
    asm("" : "+v"(a), "+v"(b));
#else
    (void)a;
    (void)b;
#endif
}

// One weight row against G input rows: two accumulators per input row (k = 0, 32, ... and k = 16, 48, ...), an odd
// 16-wide step into the first, their sum, a fixed-order lane sum, then the K % 16 tail. out[g] for g < G.
template <typename W, int G>
static inline void row_dots(const float* x, const W* row, int64_t K, float* out) {
    v16f a0[G], a1[G];
    for (int g = 0; g < G; g++) a0[g] = a1[g] = (v16f){0};
    const int64_t k32 = K - K % 32, k16 = K - K % 16;
    for (int64_t k = 0; k < k32; k += 32) {
        prefetch_ahead(row + k);
        v16f w0 = load_w<W>(row + k), w1 = load_w<W>(row + k + 16);
        in_register(w0, w1);
        for (int g = 0; g < G; g++) {
            a0[g] += w0 * load_f32(x + g * K + k);
            a1[g] += w1 * load_f32(x + g * K + k + 16);
        }
    }
    if (k16 > k32) {
        const v16f w0 = load_w<W>(row + k32);
        for (int g = 0; g < G; g++) a0[g] += w0 * load_f32(x + g * K + k32);
    }
    for (int g = 0; g < G; g++) {
        float s = lane_sum(a0[g] + a1[g]);
        for (int64_t k = k16; k < K; k++) s += w_scalar(row + k) * x[g * K + k];
        out[g] = s;
    }
}

// Rows n_begin..n_end-1 of w, in memory order, each against all M input rows in one or more passes, so the row is
// read from memory once and from L1 for the later passes.
template <typename W>
static void rows(const float* x, const W* w, const float* bias, int64_t M, int64_t K, int64_t N, int64_t n_begin,
                 int64_t n_end, float* y) {
    float out[8];
    for (int64_t n = n_begin; n < n_end; n++) {
        const W* row = w + n * K;
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M;) {
            const float* xm = x + m0 * K;
            const int64_t left = M - m0;
            // Passes over the row (the first from memory, later ones from L1): measured on our VM (DECODE.md), fp32
            // rows with up to 5 inputs run fastest as passes of 3 and of 1 (a 2-, 4- or 5-input pass is slower), 6
            // and more as passes of 8. (bf16 weights take rows_wide.)
            const int64_t g = M >= 6 ? (left >= 8 ? 8 : left) : (left >= 3 ? 3 : 1);
            by_pass(g, [&](auto G) { row_dots<W, decltype(G)::value>(xm, row, K, out); });
            for (int64_t i = 0; i < g; i++) y[(m0 + i) * N + n] = out[i] + b;
            m0 += g;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The portable row kernels' vector (the widened bf16 rows and the int4 ones): RL lanes of fp32. 16 (512-bit) with
// AVX-512; 8 (256-bit) without it (AVX2 CPUs, 16 registers) and in the half-width build (POLYSPEC_HALF_WIDTH: 256-bit
// vectors with AVX-512VL's 32 registers, this core's multiply rate halved, as on a Zen 4-class core that issues
// 512-bit operations in two halves; POLYSPEC_PORTABLE_ROWS=half). The lane count sets the summation order, so a
// 16-lane build and an 8-lane one agree to rounding, and the two 8-lane builds bitwise.
// ---------------------------------------------------------------------------------------------------------------
#if defined(__AVX512F__) && !defined(POLYSPEC_HALF_WIDTH)
static constexpr int RL = 16;
typedef v16f vr;
#else
static constexpr int RL = 8;
typedef v8f vr;
#endif
typedef Words<vr>::u vru;
typedef int32_t vri __attribute__((vector_size(RL * 4)));

static inline float lane_sum(v8f v) {  // the 16-lane order from the halves on
    v4f q = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    float a = q[0] + q[2], b = q[1] + q[3];
    return a + b;
}

static inline void lane_sums4(v8f a, v8f b, v8f c, v8f d, float* out) {  // bitwise lane_sum of each
    const v8f ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    const v8f cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
    const v8f q = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
                  __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
    const v8f u = q + __builtin_shufflevector(q, q, 1, 0, 3, 2, 5, 4, 7, 6);
    out[0] = u[0], out[1] = u[2], out[2] = u[4], out[3] = u[6];
}

// ---------------------------------------------------------------------------------------------------------------
// bf16 weights widened to fp32 (CPUs without AVX512-BF16, and fp32 inputs against bf16 weights): blocks of R weight
// rows against G input rows, so each loaded input vector feeds R multiplies and each widened weight vector G. One row
// at a time (2G input loads and 2G multiplies per 32 weights, the inputs re-read from L1 or, at K = 1,536 and 6+
// inputs, from L2, for every row) ran 8 verified rows at 2.7x a decode step's time on an Intel Xeon (Cascade Lake),
// at a quarter of its multiply rate. The weights are widened in pairs: a 32-bit lane holding words 2i and 2i + 1
// gives word 2i by a 16-bit shift and word 2i + 1 by masking, two operations per 2 RL weights where a zero-extend takes
// four; so the input is taken in the same order, per 2 RL inputs the RL even ones then the RL odd ones (pairs_prepare).
// Per (row, input) one accumulator: per 2 RL-chunk the even products then the odd ones, a natural-order RL-wide step
// for K % 2 RL >= RL, a fixed-order lane sum, the K % RL tail: the same sequence for every R, G and M
// (batch-invariant).
// ---------------------------------------------------------------------------------------------------------------

// Per-thread buffers reused from call to call (slot: which one), grown as needed and never zeroed: every user writes
// all it reads. Fresh zero-filled vectors had cost a layer call ~200 KB of memset at 8 rows (2 % of the step, on the
// calling thread while the others wait).
static float* scratch(int slot, int64_t n) {
    static thread_local std::vector<float> bufs[9];
    if ((int64_t)bufs[slot].size() < n) bufs[slot].resize(n);
    return bufs[slot].data();
}

// x [M, K] -> [M, K] in this thread's scratch: per 2 RL inputs the RL even ones, then the RL odd ones; a short tail
// (K % 2 RL) stays as it is.
static const float* pairs_prepare(const float* x, int64_t M, int64_t K) {
    float* xd = scratch(6, M * K);
    const int64_t kc = K - K % (2 * RL);
    for (int64_t m = 0; m < M; m++) {
        const float* xm = x + m * K;
        float* dm = xd + m * K;
        for (int64_t k = 0; k < kc; k += 2 * RL)
            for (int i = 0; i < RL; i++) {
                dm[k + i] = xm[k + 2 * i];
                dm[k + RL + i] = xm[k + 2 * i + 1];
            }
        memcpy(dm + kc, xm + kc, (K - kc) * sizeof(float));
    }
    return xd;
}

// The lane sums of a block's R x G accumulators, four at a time (lane_sums4), into sums[r * G + g].
template <int R, int G>
static inline void block_lane_sums(const vr (&acc)[R][G], float* sums) {
    const vr* a = &acc[0][0];
    int i = 0;
    for (; i + 4 <= R * G; i += 4) lane_sums4(a[i], a[i + 1], a[i + 2], a[i + 3], sums + i);
    for (; i < R * G; i++) sums[i] = lane_sum(a[i]);
}

template <int R, int G>
static inline void block_dots_wide(const float* xd, const uint16_t* w, int64_t K, float* out) {
    vr acc[R][G];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) acc[r][g] = (vr){0};
    const int64_t kc = K - K % (2 * RL), kl = K - K % RL;
    const vru high = (vru){0} + 0xffff0000u;
    for (int64_t k = 0; k < kc; k += 2 * RL) {
        if (k % 32 == 0)  // one line of each row per 32 weights, PREFETCH_BYTES ahead
            for (int r = 0; r < R; r++)
                __builtin_prefetch((const char*)(w + r * K + k) + PREFETCH_BYTES, 0, POLYSPEC_PREFETCH_LOCALITY);
        for (int h = 0; h < 2; h++) {  // the even words, then the odd ones: R widened vectors live at a time
            vr wr[R];
            for (int r = 0; r < R; r++) {
                vru u;
                memcpy(&u, w + r * K + k, sizeof(u));
                u = h == 0 ? u << 16 : u & high;
                memcpy(&wr[r], &u, sizeof(u));
            }
            for (int g = 0; g < G; g++) {
                const vr xv = load_f32<vr>(xd + g * K + k + RL * h);
                for (int r = 0; r < R; r++) acc[r][g] += wr[r] * xv;
            }
        }
    }
    if (kl > kc)
        for (int r = 0; r < R; r++) {
            const vr wr = load_bf16<vr>(w + r * K + kc);
            for (int g = 0; g < G; g++) acc[r][g] += wr * load_f32<vr>(xd + g * K + kc);
        }
    float sums[R * G];
    block_lane_sums(acc, sums);
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            float s = sums[r * G + g];
            for (int64_t k = kl; k < K; k++) s += bf16_to_f32(w[r * K + k]) * xd[g * K + k];
            out[r * 8 + g] = s;
        }
}

// One block of R widened bf16 rows (from row n) against the M prepared input rows (block_passes).
template <int R, int P>
static void block_rows_wide(const float* xd, const uint16_t* w, const float* bias, int64_t M, int64_t K, int64_t N,
                            int64_t n, float* y) {
    block_passes<R, P>(M, N, n, bias, y, [&](auto G, int64_t m0, float* out) {
        block_dots_wide<R, decltype(G)::value>(xd + m0 * K, w + n * K, K, out);
    });
}

// Rows n_begin..n_end-1: blocks of 4 rows against passes of up to 6 inputs (24 accumulators), of 3 rows against up to
// 8 from 7 inputs (24), single rows at the end (4 rows at 6 inputs: 0.90x the time of 3). Against one row at a time
// on the Cascade Lake VM the bf16 target's 30 layers take ~0.75x the time at widths 5-8 (docs/KERNELS.md). The
// half-width build keeps these blocks (its 32 registers hold them); without AVX-512 (16 registers) rows go one at a
// time against passes of up to 8.
static void rows_wide(const float* xd, const uint16_t* w, const float* bias, int64_t M, int64_t K, int64_t N,
                      int64_t n_begin, int64_t n_end, float* y) {
    int64_t n = n_begin;
#ifdef __AVX512F__
    if (M <= 6)
        for (; n + 4 <= n_end; n += 4) block_rows_wide<4, 6>(xd, w, bias, M, K, N, n, y);
    else
        for (; n + 3 <= n_end; n += 3) block_rows_wide<3, 8>(xd, w, bias, M, K, N, n, y);
#else
    if (M <= 2)
        for (; n + 4 <= n_end; n += 4) block_rows_wide<4, 4>(xd, w, bias, M, K, N, n, y);
    else if (M <= 5)
        for (; n + 2 <= n_end; n += 2) block_rows_wide<2, 5>(xd, w, bias, M, K, N, n, y);
#endif
    for (; n < n_end; n++) block_rows_wide<1, 8>(xd, w, bias, M, K, N, n, y);
}

// ---------------------------------------------------------------------------------------------------------------
// bf16 weights in 16-row blocks (pack_weights makes this copy of a packed model's bf16 weights, polyspec_pack_nk16):
// [ceil(N / 16)][ceil(K / 2)][16] 32-bit words, lane i of (block b, pair p) = w[16b + i][2p] << 16 | w[16b + i][2p + 1]
// (0 past N or K; word 2p in the high half, which vdpbf16ps takes first: rows_nk16_dp). A vector then holds 16 rows at
// one k, so an output is a multiply-add per k into one lane: no lane sums, and each loaded (and widened) weight vector
// feeds every input of the pass, each input value broadcast once per pair for all the block's rows. The row kernels
// above (rows_wide) read the weights row by row and end every (row, input) in a lane sum; at 8 inputs on the Cascade
// Lake VM they ran at ~0.55 ns per 16-lane multiply-add against ~0.25 peak, and 8 verified rows cost ~1.9x a decode
// step (docs/KERNELS.md, "Verifying rows without AVX512-BF16").
// Per (row, input) one fp32 accumulator takes k = 0, 1, 2, ... in order, the bias added last: the same sequence for
// every pass size, M, vector width and build (batch-invariant, and bitwise the same in the 16- and 8-lane builds).
// ---------------------------------------------------------------------------------------------------------------

#ifdef __AVX512F__
static constexpr int NK_PASS = 8;  // inputs per pass: 8 (16-lane: 2 blocks x 8 = 16 accumulators; 8-lane: 1 x 2 x 8)
#else
static constexpr int NK_PASS = 5;  // 16 registers: 1 block (2 vectors) x 5 inputs = 10 accumulators, 4 widened, 1 input
#endif
static constexpr int NK_BLOCKS = RL == 16 ? 2 : 1;  // 16-row blocks per call
static constexpr int64_t SPLIT_ROWS = 32;  // the unit of rows the threads share out (share_rows): whole blocks

static inline vr splat(float f) {
#if defined(__AVX512F__) && !defined(POLYSPEC_HALF_WIDTH)
    return (vr)_mm512_set1_ps(f);
#else
    return (vr)_mm256_set1_ps(f);
#endif
}

// M inputs in balanced passes of up to NK_PASS (sizes differ by one at most: 5 inputs on AVX2 as 2 + 3, not 4 + 1,
// whose lone input chained its multiply-adds on the block's two accumulators): f(m0, G) for each.
template <typename F>
static inline void nk16_passes(int64_t M, F&& f) {
    const int64_t passes = (M + NK_PASS - 1) / NK_PASS;
    for (int64_t q = 0, m0 = 0; q < passes; q++) {
        const int64_t g = passes == 1 ? M : (M - m0) / (passes - q);  // one pass: no 64-bit division
        f(m0, g);
        m0 += g;
    }
}

typedef uint64_t v4q __attribute__((vector_size(32)));  // 4 pairs of floats

// Pairs p..p+3 of 4 input rows (from x, K floats apart) -> for each pair the 4 rows' side by side, at d, d + ld, ...
static inline void pairs_transpose4(const float* x, int64_t K, float* d, int64_t ld) {
    v4q r[4];
    for (int i = 0; i < 4; i++) memcpy(&r[i], x + i * K, sizeof(v4q));
    v4q t0 = __builtin_shufflevector(r[0], r[1], 0, 4, 2, 6), t1 = __builtin_shufflevector(r[0], r[1], 1, 5, 3, 7);
    v4q t2 = __builtin_shufflevector(r[2], r[3], 0, 4, 2, 6), t3 = __builtin_shufflevector(r[2], r[3], 1, 5, 3, 7);
    const v4q o[4] = {__builtin_shufflevector(t0, t2, 0, 1, 4, 5), __builtin_shufflevector(t1, t3, 0, 1, 4, 5),
                      __builtin_shufflevector(t0, t2, 2, 3, 6, 7), __builtin_shufflevector(t1, t3, 2, 3, 6, 7)};
    for (int i = 0; i < 4; i++) memcpy(d + i * ld, &o[i], sizeof(v4q));
}

// x [M, K] -> per pass of G inputs from m0 (nk16_passes), per pair p: x[m0 + g][2p], x[m0 + g][2p + 1] for g < G
// (0 past K), so a pass reads one ascending stream of 2G values per pair. In this thread's scratch. Written pair by
// pair, one ascending stream out of G in (a row at a time wrote every 2G-th pair of floats: the half-width layers
// took 1.06x the time at 8 rows, docs/BENCHMARKS.md); passes of 4 and 8 inputs 4 pairs at a time, transposed in
// registers (8 at a time by pairs_transpose4 at K = 576: 0.30 us against 0.78 a pair at a time, in cache).
static const float* nk16_prepare(const float* x, int64_t M, int64_t K) {
    const int64_t P = (K + 1) / 2, whole = K / 2;
    float* xi = scratch(7, M * 2 * P);
    nk16_passes(M, [&](int64_t m0, int64_t g) {
        by_pass<NK_PASS>(g, [&](auto G) {
            float* d = xi + m0 * 2 * P;
            const float* xr = x + m0 * K;
            int64_t p = 0;
            if constexpr (G == 1) {  // one input: its pairs in order, the row as it is
                memcpy(d, xr, whole * 2 * sizeof(float));
                p = whole;
            }
            if constexpr (G % 4 == 0)  // 4 pairs of 4 inputs at a time, transposed in registers
                for (; p + 4 <= whole; p += 4)
                    for (int q = 0; q < G; q += 4) pairs_transpose4(xr + q * K + 2 * p, K, d + (p * G + q) * 2, 2 * G);
            for (; p < whole; p++)
                for (int i = 0; i < G; i++) memcpy(d + (p * G + i) * 2, xr + i * K + 2 * p, 2 * sizeof(float));
            for (int i = 0; whole < P && i < G; i++) {  // odd K: the last input and a 0
                d[(whole * G + i) * 2] = xr[i * K + K - 1];
                d[(whole * G + i) * 2 + 1] = 0.0f;
            }
        });
    });
    return xi;
}

// RL lanes of 16-row block words (pack_nk16: word 2p in the high half, 2p + 1 in the low) -> the fp32 values of the
// words 2p (e) and 2p + 1 (o). With AVX512-BW each is one load that zeroes the low words: of the lanes as they are
// (e), and of the lanes read 2 bytes early (o: each lane's low word lands in its high half; the word read from before
// the lanes is masked off, so it is never touched). Without it, a load, a mask and a shift: on the half-width build
// the shift took a multiply-add's port: the step at 8 rows 0.96x the time (lab/step_mix.py, docs/BENCHMARKS.md).
static inline void widen_pairs(const uint32_t* src, vr& e, vr& o) {
#if defined(__AVX512BW__) && !defined(POLYSPEC_HALF_WIDTH)
    e = (vr)_mm512_castsi512_ps(_mm512_maskz_loadu_epi16(0xaaaaaaaau, src));
    o = (vr)_mm512_castsi512_ps(_mm512_maskz_loadu_epi16(0xaaaaaaaau, (const char*)src - 2));
#elif defined(__AVX512BW__) && defined(__AVX512VL__)
    e = (vr)_mm256_castsi256_ps(_mm256_maskz_loadu_epi16(0xaaaa, src));
    o = (vr)_mm256_castsi256_ps(_mm256_maskz_loadu_epi16(0xaaaa, (const char*)src - 2));
#else
    vru u;
    memcpy(&u, src, sizeof(u));
    const vru eu = u & ((vru){0} + 0xffff0000u), ou = u << 16;
    memcpy(&e, &eu, sizeof(eu));
    memcpy(&o, &ou, sizeof(ou));
#endif
}

// Where a pass of B 16-row blocks leaves its sums: at p[g * ld + row], as they are (the staging buffer) or, with add,
// plus bias[row] or +0.0f where there is none, as the staged write-out adds them (nk16_rows).
struct BlockOut {
    float* p;
    int64_t ld;
    const float* bias;
    bool add;
};

template <typename V>
static inline void block_store(const BlockOut& o, int g, int row, V v) {
    if (o.add) {
        V b = (V){0};
        if (o.bias) memcpy(&b, o.bias + row, sizeof(b));
        v += b;
    }
    memcpy(o.p + g * o.ld + row, &v, sizeof(v));
}

// B consecutive 16-row blocks (from wb) against G prepared inputs (xp), their sums to o.
template <int B, int G>
static inline void nk16_dots(const float* xp, const uint32_t* wb, int64_t P, const BlockOut& o) {
    constexpr int V = B * 16 / RL;  // weight vectors per pair
    vr acc[V][G];
    for (int j = 0; j < V; j++)
        for (int g = 0; g < G; g++) acc[j][g] = (vr){0};
    for (int64_t p = 0; p < P; p++) {
        for (int b = 0; b < B; b++)  // each block's line PREFETCH_BYTES ahead (a pair is one 64-byte line of a block)
            prefetch_block_line(wb + (b * P + p) * 16);
        vr we[V], wo[V];
        for (int j = 0; j < V; j++) widen_pairs(wb + ((j * RL / 16) * P + p) * 16 + (j * RL) % 16, we[j], wo[j]);
        const float* xq = xp + p * 2 * G;
        for (int g = 0; g < G; g++) {
            const vr xe = splat(xq[2 * g]);
            for (int j = 0; j < V; j++) acc[j][g] += we[j] * xe;
        }
        for (int g = 0; g < G; g++) {
            const vr xo = splat(xq[2 * g + 1]);
            for (int j = 0; j < V; j++) acc[j][g] += wo[j] * xo;
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < V; j++) block_store(o, g, j * RL, acc[j][g]);
}

// Rows nb..ne-1 of the blocked weight against the M prepared inputs: per NK_BLOCKS blocks, every pass (the blocks
// are read from memory in the first pass, from L1/L2 in later ones), dots computing each. Blocks wholly inside
// nb..ne-1 are written into y by dots itself, bias added; the others' rows are staged and those outside nb..ne-1 or
// past N dropped (a thread's slice of concatenated weights may start mid-block). The staged write-out of every
// block had cost ~60 ns a block (one thread, 16-row blocks: the half-width build's steps 1.03x at K = 576).
template <typename Dots>
static void nk16_rows(const uint32_t* wb, const float* bias, int64_t M, int64_t K, int64_t N, int64_t nb, int64_t ne,
                      float* y, Dots&& dots) {
    const int64_t P = (K + 1) / 2, bend = (ne + 15) / 16;
    float out[NK_PASS * 16 * NK_BLOCKS];
    for (int64_t b = nb / 16; b < bend; b += NK_BLOCKS) {
        const int nbk = bend - b < NK_BLOCKS ? (int)(bend - b) : NK_BLOCKS;
        const bool whole = b * 16 >= nb && (b + nbk) * 16 <= ne;
        nk16_passes(M, [&](int64_t m0, int64_t g) {
            const BlockOut o = whole ? BlockOut{y + m0 * N + b * 16, N, bias ? bias + b * 16 : nullptr, true}
                                     : BlockOut{out, 16 * nbk, nullptr, false};
            by_pass<NK_PASS>(g, [&](auto G) {  // dots(G, blocks, m0, first block, o), blocks a compile-time count
                if (nbk == NK_BLOCKS)
                    dots(G, std::integral_constant<int, NK_BLOCKS>{}, m0, wb + b * P * 16, o);
                else
                    dots(G, std::integral_constant<int, 1>{}, m0, wb + b * P * 16, o);
            });
            if (whole) return;
            const int64_t lo = b * 16 > nb ? b * 16 : nb, hi = (b + nbk) * 16 < ne ? (b + nbk) * 16 : ne;
            for (int64_t i = 0; i < g; i++)
                for (int64_t n = lo; n < hi; n++)
                    y[(m0 + i) * N + n] = out[i * 16 * nbk + (n - b * 16)] + (bias ? bias[n] : 0.0f);
        });
    }
}

// The widened blocks against fp32 inputs prepared by nk16_prepare.
static void rows_nk16(const float* xi, const uint32_t* wb, const float* bias, int64_t M, int64_t K, int64_t N,
                      int64_t nb, int64_t ne, float* y) {
    const int64_t P = (K + 1) / 2;
    nk16_rows(wb, bias, M, K, N, nb, ne, y, [&](auto G, auto B, int64_t m0, const uint32_t* w, const BlockOut& o) {
        nk16_dots<decltype(B)::value, decltype(G)::value>(xi + m0 * 2 * P, w, P, o);
    });
}

// ---------------------------------------------------------------------------------------------------------------
// Int4 weights, GPTQ-style groups (decode/int4.py's Int4Linear buffers): codes q[n, k] in 0..15, two per byte (even k
// in the low nibble), fp32 scales s[n, g] and uint8 zeros z[n, g] per group of gs inputs; w = (q - z) * s.
// The codes become weights in registers, never dequantised to memory. The input is de-interleaved once per call (per
// 2 RL inputs: the RL even ones, then the RL odd ones, matching the low and high nibbles of RL bytes). Needs K and gs
// multiples of 32 (a short last group is fine). Per (m, n) the arithmetic is independent of M, as for the dense rows.
// ---------------------------------------------------------------------------------------------------------------

typedef int32_t v16i __attribute__((vector_size(64)));


struct RowsInput {  // x prepared once per call for the int4 and widened bf16 rows
    const float* xd;     // [M, K] in pairs order (pairs_prepare): the portable int4 rows and the widened bf16 ones
    const float* xs;     // [M, K / gs] group sums (the bf16 int4 rows)
    const uint16_t* xb;  // the bf16 path: per row, per 128-code chunk of each group, x's bf16 high then low parts
    int64_t xb_row;      // uint16 words per row of xb
    const float* xi;     // per pass, per pair of inputs, the pass's rows side by side (nk16_prepare)
    const int8_t* xq;    // [M, K] int8 (qv_prepare: the blocked int4 rows)
    const float* xa;     // [M, ng] per row and group the int8 scale a
    const float* xas;    // [M, ng] a sum(xq)
    const uint32_t* xe;  // nk16_prepare's order as bf16 pairs (nk16_prepare_dp: the vdpbf16ps blocks)
};

// RL bytes of codes -> RL 32-bit lanes (vpmovzxbd: GCC's vector conversion of this shape goes scalar).
static inline vri widen_codes(const uint8_t* p) {
#if defined(__AVX512F__) && !defined(POLYSPEC_HALF_WIDTH)
    return (vri)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#else
    return (vri)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
#endif
}

// A (row, group)'s 16 dequantised values, w_c = (c - z) s for codes c = 0..15, and their lookup by code: one vpermps
// on a 16-lane table; vpermt2ps on two 8-lane halves (AVX-512VL); two vpermps and a blend on AVX2. The lookup reads
// only the index's low 4 bits (3 for a vpermps half), so a byte's low nibble needs no mask and its high one a shift.
#if defined(__AVX512F__) && !defined(POLYSPEC_HALF_WIDTH)
struct Lut {
    v16f t;
};
static inline Lut lut_make(float s, uint8_t z) {
    const v16f c = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return {(c - (float)z) * s};
}
static inline vr lut(const Lut& l, vri i) { return __builtin_shuffle(l.t, i); }
#else
struct Lut {
    v8f lo, hi;
};
static inline Lut lut_make(float s, uint8_t z) {
    const v8f c = {0, 1, 2, 3, 4, 5, 6, 7};
    return {(c - (float)z) * s, (c + (8.0f - (float)z)) * s};
}
#ifdef __AVX512F__
static inline vr lut(const Lut& l, vri i) { return __builtin_shuffle(l.lo, l.hi, i); }
#else
static inline vr lut(const Lut& l, vri i) {
    return (i & 8) != 0 ? __builtin_shuffle(l.hi, i) : __builtin_shuffle(l.lo, i);
}
#endif
#endif

// The portable int4 rows: a block of R weight rows against G input rows. Per (row, group) a 16-entry table of its
// dequantised values (lut_make), so a code costs a widening and a lookup: no conversion to fp32, no multiply by the
// scale, no zero-point correction (4 vector operations per 32 codes and row where converting, scaling and correcting
// took 9). Each input vector is loaded once for the block's R rows. One accumulator per (row, input) takes every
// group: per 2 RL codes the low nibbles' products (even k), then the high ones', then a fixed-order lane sum. The
// weights are the dequantised matmul's, (q - z) s rounded once. CPG: 2 RL-code chunks per group (2, 4 or 8) where
// every group is whole, so a group's loop unrolls (the int4 level's layers 0.89-0.99x the time of a runtime count on the
// Cascade Lake VM, two runs); 0: counted per group.
template <int R, int G, int CPG>
static inline void block_dots_i4(const RowsInput& in, const uint8_t* q, const float* sc, const uint8_t* zr, int64_t K,
                                 int64_t gs, float* out) {
    const int64_t ng = (K + gs - 1) / gs, row = K / 2;
    vr acc[R][G];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) acc[r][g] = (vr){0};
    const uint8_t* qk = q;
    const float* xk = in.xd;
    for (int64_t grp = 0; grp < ng; grp++) {
        Lut t[R];
        for (int r = 0; r < R; r++) t[r] = lut_make(sc[r * ng + grp], zr[r * ng + grp]);
        const int64_t chunks = CPG > 0 ? CPG : ((grp + 1) * gs < K ? gs : K - grp * gs) / (2 * RL);
        for (int64_t c = 0; c < chunks; c++, qk += RL, xk += 2 * RL) {
            if (((qk - q) & 63) == 0)  // one line (128 codes) of each row per 128 codes, PREFETCH_BYTES ahead
                for (int r = 0; r < R; r++)
                    __builtin_prefetch(qk + r * row + PREFETCH_BYTES, 0, POLYSPEC_PREFETCH_LOCALITY);
            for (int h = 0; h < 2; h++) {  // the low nibbles (even k), then the high ones (odd k)
                vr wr[R];
                for (int r = 0; r < R; r++) {
                    const vri i = widen_codes(qk + r * row);
                    wr[r] = lut(t[r], h == 0 ? i : i >> 4);
                }
                for (int g = 0; g < G; g++) {
                    const vr xv = load_f32<vr>(xk + g * K + RL * h);
                    for (int r = 0; r < R; r++) acc[r][g] += wr[r] * xv;
                }
            }
        }
    }
    float sums[R * G];
    block_lane_sums(acc, sums);
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) out[r * 8 + g] = sums[r * G + g];
}

// The int4 rows on CPUs with AVX512-BF16 (Zen 4, Sapphire Rapids; built with -march=native), with bf16 activations
// (as torch's CPU int4 kernel takes them): per 128 codes of a group (64 bytes, 32 16-bit words; a masked load for a
// short group or tail), code s of each word (its 4-bit field s = 0..3) becomes the bf16 value 16 + code by one
// shift and one ternary-logic op ((field << 3) & 0x78 | 0x4180: 0x4180 is bf16 16, and 16..31 step 1 are exact in
// bf16's 7 mantissa bits), and vdpbf16ps multiplies 32 of them by x per instruction, accumulating in fp32 (the
// products are exact). The offset comes back out with the zero point: y = sum_g s_g (sum (16 + q) x - (16 + z_g)
// sum x), sum x taken over the bf16-rounded input. 9 vector ops per 128 codes for the first input row and 4 per
// further row, against ~40 and 8 to widen the codes to fp32, which this machine's vector units (not its memory)
// were limited by. The input is rounded to bf16 once per call (x's 24 mantissa bits -> 8; the weights carry 4), so
// this path agrees with the portable fp32 one to ~1e-3 relative, not bitwise. Per (m, n) the arithmetic is
// independent of M (passes of up to 4 rows, each row on its own registers): batch-invariant like the rest.
static inline uint16_t bf16_bits_rne(float f) {  // round to nearest even; not for NaNs
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if (defined(__AVX512BF16__) || defined(POLYSPEC_EMULATE_DPBF16)) && defined(__AVX512BW__) && \
    !defined(POLYSPEC_PORTABLE_ROWS)
#define POLYSPEC_DPBF16 1

#ifdef __AVX512BF16__
typedef __m512bh bh32;  // 32 bf16 words
static inline __m512 dpbf16(__m512 acc, bh32 a, bh32 b) { return _mm512_dpbf16_ps(acc, a, b); }
#else
// vdpbf16ps in AVX-512F, for the emulated build (POLYSPEC_PORTABLE_ROWS=bf16-emulated): the vdpbf16ps rows run and are
// tested on a CPU without the instruction. Lane i takes a[2i + 1] b[2i + 1], then a[2i] b[2i], each in one fused
// multiply-add: a product of two bf16 values is exact in fp32, so each step rounds once, as the instruction's do. The
// instruction also flushes denormal inputs and results to zero; this does not (the tests' values have none).
typedef __m512i bh32;
static inline __m512 dpbf16(__m512 acc, bh32 a, bh32 b) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    const __m512 ao = _mm512_castsi512_ps(_mm512_and_si512(a, high));
    acc = _mm512_fmadd_ps(ao, _mm512_castsi512_ps(_mm512_and_si512(b, high)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)),
                           acc);
}
#endif

// x [M, K] -> xb [M, xb_row] bf16 bits: per group, per 128-code chunk, 4 vectors of 32 words, word j of vector s
// holding x[k0 + 4j + s] (the code the kernel puts there), zero past the group's end; xs [M, ng] the group sums of
// the rounded values.
static int64_t i4b_prepare(const float* x, int64_t M, int64_t K, int64_t gs, std::vector<uint16_t>& xb, float* xs) {
    const int64_t ng = (K + gs - 1) / gs, cpg = (gs + 127) / 128, row = ng * cpg * 128;
    xb.assign(M * row, 0);
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ng; g++) {
            const int64_t ge = (g + 1) * gs < K ? (g + 1) * gs : K;
            float sum = 0.0f;
            for (int64_t k = g * gs; k < ge; k++) {
                const int64_t c = (k - g * gs) / 128, i = (k - g * gs) % 128;
                const uint16_t h = bf16_bits_rne(x[m * K + k]);
                xb[m * row + (g * cpg + c) * 128 + (i % 4) * 32 + i / 4] = h;
                sum += bf16_to_f32(h);
            }
            xs[m * ng + g] = sum;
        }
    return row;
}

template <int G>
static inline void row_dots_i4b(const RowsInput& in, const uint8_t* q, const float* sc, const uint8_t* zr, int64_t K,
                                int64_t gs, float* out) {
    const __m512i field = _mm512_set1_epi16(0x0078), b16 = _mm512_set1_epi16(0x4180);
    const int64_t ng = (K + gs - 1) / gs, cpg = (gs + 127) / 128;
    __m512 tot[G];
    float corr[G];
    for (int g = 0; g < G; g++) tot[g] = _mm512_setzero_ps(), corr[g] = 0.0f;
    for (int64_t grp = 0; grp < ng; grp++) {
        const int64_t gb = grp * gs, ge = gb + gs < K ? gb + gs : K;
        __m512 a0[G], a1[G];
        for (int g = 0; g < G; g++) a0[g] = a1[g] = _mm512_setzero_ps();
        for (int64_t c = 0; gb + c * 128 < ge; c++) {
            const int64_t k0 = gb + c * 128, r = ge - k0;
            const __mmask64 mk = r >= 128 ? ~(__mmask64)0 : (((__mmask64)1 << (r / 2)) - 1);
            const __m512i b = _mm512_maskz_loadu_epi8(mk, q + k0 / 2);
            // (A & B) | C: field s shifted to bits 3..6, masked, over bf16 16 -> bf16(16 + code)
            const bh32 w0 = (bh32)_mm512_ternarylogic_epi32(_mm512_slli_epi16(b, 3), field, b16, 0xea);
            const bh32 w1 = (bh32)_mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 1), field, b16, 0xea);
            const bh32 w2 = (bh32)_mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 5), field, b16, 0xea);
            const bh32 w3 = (bh32)_mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 9), field, b16, 0xea);
            const uint16_t* xc = in.xb + (grp * cpg + c) * 128;
            for (int g = 0; g < G; g++) {
                const uint16_t* xg = xc + g * in.xb_row;
                a0[g] = dpbf16(a0[g], w0, (bh32)_mm512_loadu_si512(xg));
                a1[g] = dpbf16(a1[g], w1, (bh32)_mm512_loadu_si512(xg + 32));
                a0[g] = dpbf16(a0[g], w2, (bh32)_mm512_loadu_si512(xg + 64));
                a1[g] = dpbf16(a1[g], w3, (bh32)_mm512_loadu_si512(xg + 96));
            }
        }
        const float s = sc[grp], sz = s * (16.0f + (float)zr[grp]);
        const __m512 sv = _mm512_set1_ps(s);
        for (int g = 0; g < G; g++) {
            tot[g] = _mm512_fmadd_ps(sv, _mm512_add_ps(a0[g], a1[g]), tot[g]);
            corr[g] += sz * in.xs[g * ng + grp];
        }
    }
    for (int g = 0; g < G; g++) {
        v16f t;
        memcpy(&t, &tot[g], sizeof(t));
        out[g] = lane_sum(t) - corr[g];
    }
}
#endif

#ifdef POLYSPEC_DPBF16
// x [M, K] -> xb [M, row] bf16 bits (round to nearest even), row = K rounded up to 32, zero past K.
static int64_t bf16_prepare(const float* x, int64_t M, int64_t K, std::vector<uint16_t>& xb) {
    const int64_t row = (K + 31) / 32 * 32;
    xb.assign(M * row, 0);
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) xb[m * row + k] = bf16_bits_rne(x[m * K + k]);
    return row;
}

// 32 weights of a chunk as bf16 (bf16 bits as they are); masked lanes read 0.
template <typename W>
static inline bh32 dp_chunk(const W* p, __mmask32 m);
template <>
inline bh32 dp_chunk<uint16_t>(const uint16_t* p, __mmask32 m) {
    return (bh32)(m == (__mmask32)~0u ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(m, p));
}

// R consecutive weight rows (one block of R K elements: pack_weights' row-major layout; bf16 bits)
// against G bf16 input rows on vdpbf16ps, lane i of a 32-word chunk accumulating the products of words 2i and 2i + 1.
// Per chunk the G input chunks are loaded once and each row's chunk once: R + G loads per R G products, where one row
// at a time took 2 + 2G per 2G and left a verification of 2-5 rows waiting on the load ports (docs/KERNELS.md, "The
// CPU fast path"). One accumulator per (row, input), the chunks in order, a masked last chunk (xb is zero past K), a
// fixed-order lane sum: every (row, input) pair gets the same sequence for every R and G, so the result is
// batch-invariant.
template <int R, int G, typename W>
static inline void block_dots_dp(const uint16_t* xb, int64_t xrow, const W* w, int64_t K, float* out) {
    __m512 acc[R][G];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_ps();
    const int64_t k32 = K - K % 32;
    const __mmask32 all = (__mmask32)~0u;
    for (int64_t k = 0; k < k32; k += 32) {
        // the block is read in address order as a whole, R chunks per step: prefetch that sweep, 128 bytes a call
        if (R % 2 == 0 || k % 64 == 0)
            for (int r = 0; r < R; r += 2) prefetch_ahead(w + k * R + r * 32);
        bh32 xs[G];
        for (int g = 0; g < G; g++) xs[g] = (bh32)_mm512_loadu_si512(xb + g * xrow + k);
        for (int r = 0; r < R; r++) {
            const bh32 wr = dp_chunk<W>(w + r * K + k, all);
            for (int g = 0; g < G; g++) acc[r][g] = dpbf16(acc[r][g], wr, xs[g]);
        }
    }
    if (k32 < K) {  // the last chunk, masked (xb is zero past K)
        const __mmask32 mk = ((__mmask32)1 << (K - k32)) - 1;
        for (int r = 0; r < R; r++) {
            const bh32 wr = dp_chunk<W>(w + r * K + k32, mk);
            for (int g = 0; g < G; g++)
                acc[r][g] = dpbf16(acc[r][g], wr, (bh32)_mm512_loadu_si512(xb + g * xrow + k32));
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            v16f t;
            memcpy(&t, &acc[r][g], sizeof(t));
            out[r * 8 + g] = lane_sum(t);
        }
}

// One block of R rows against all M input rows: passes of up to 5 (R G accumulators, G input chunks and a weight chunk
// fit the 32 registers; block_passes).
template <int R, typename W>
static void block_rows_dp(const uint16_t* xb, int64_t xrow, const W* w, const float* bias, int64_t M, int64_t K,
                          int64_t N, int64_t n, float* y) {
    block_passes<R, 5>(M, N, n, bias, y, [&](auto G, int64_t m0, float* out) {
        block_dots_dp<R, decltype(G)::value>(xb + m0 * xrow, xrow, w + n * K, K, out);
    });
}

// Rows n_begin..n_end-1 of a bf16 weight against the M prepared input rows in blocks of 4 rows (single rows at the
// end) from 4 inputs, single rows below (one address-ordered stream; blocks measured 0-8 % slower there, DECODE.md).
template <typename W>
static void rows_dp(const uint16_t* xb, int64_t xrow, const W* w, const float* bias, int64_t M, int64_t K, int64_t N,
                    int64_t n_begin, int64_t n_end, float* y) {
    int64_t n = n_begin;
    if (M >= 4)
        for (; n + 4 <= n_end; n += 4) block_rows_dp<4>(xb, xrow, w, bias, M, K, N, n, y);
    for (; n < n_end; n++) block_rows_dp<1>(xb, xrow, w, bias, M, K, N, n, y);
}

// bf16 inputs against the 16-row blocks on vdpbf16ps (the "blocks" choice on these CPUs, g_bf16_dot): a 32-bit lane
// of a block holds one row's words 2p (high half) and 2p + 1, and a broadcast word the input's, so one instruction
// takes both products of 16 rows, k = 2p first: per (row, input) one fp32 accumulator over k in input order, as the
// widened blocks sum (the products of bf16 values are exact, so each step rounds once either way), with no widening.
// x [M, K] -> per pass of G inputs from m0 (nk16_passes), per pair p, G words: input g's bf16 bits of x[2p] << 16 |
// x[2p + 1] (0 past K). In this thread's buffer.
static const uint32_t* nk16_prepare_dp(const float* x, int64_t M, int64_t K) {
    static thread_local std::vector<uint32_t> buf;
    const int64_t P = (K + 1) / 2;
    if ((int64_t)buf.size() < M * P) buf.resize(M * P);
    nk16_passes(M, [&](int64_t m0, int64_t G) {
        uint32_t* d = buf.data() + m0 * P;
        for (int64_t p = 0; p < P; p++)  // pair by pair: one ascending stream out (nk16_prepare)
            for (int64_t g = 0; g < G; g++) {
                const float* xr = x + (m0 + g) * K;
                const uint32_t odd = 2 * p + 1 < K ? bf16_bits_rne(xr[2 * p + 1]) : 0;
                d[p * G + g] = (uint32_t)bf16_bits_rne(xr[2 * p]) << 16 | odd;
            }
    });
    return buf.data();
}

template <int B, int G>
static inline void nk16_dots_dp(const uint32_t* xp, const uint32_t* wb, int64_t P, const BlockOut& o) {
    __m512 acc[B][G];
    for (int b = 0; b < B; b++)
        for (int g = 0; g < G; g++) acc[b][g] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; p++) {
        bh32 w[B];
        for (int b = 0; b < B; b++) {
            prefetch_block_line(wb + (b * P + p) * 16);
            w[b] = (bh32)_mm512_loadu_si512(wb + (b * P + p) * 16);
        }
        for (int g = 0; g < G; g++) {
            const bh32 xv = (bh32)_mm512_set1_epi32((int)xp[p * G + g]);
            for (int b = 0; b < B; b++) acc[b][g] = dpbf16(acc[b][g], w[b], xv);
        }
    }
    for (int g = 0; g < G; g++)
        for (int b = 0; b < B; b++) block_store(o, g, b * 16, (v16f)acc[b][g]);
}

static void rows_nk16_dp(const uint32_t* xe, const uint32_t* wb, const float* bias, int64_t M, int64_t K, int64_t N,
                         int64_t nb, int64_t ne, float* y) {
    const int64_t P = (K + 1) / 2;
    nk16_rows(wb, bias, M, K, N, nb, ne, y, [&](auto G, auto B, int64_t m0, const uint32_t* w, const BlockOut& o) {
        nk16_dots_dp<decltype(B)::value, decltype(G)::value>(xe + m0 * P, w, P, o);
    });
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// Int4 weights in 16-row blocks against int8 inputs (AVX512-VNNI's vpdpbusd; W4A8): an int4 level's rows where
// pack_weights made the blocks (polyspec_pack_i4v), and its lm_head as 8-bit codes (polyspec_pack_q8v). An int4
// level only proposes to the level above it, which checks every token it passes up (the target last), so its own
// arithmetic may round more than W4A16: the chain stays exact. Widening the codes to fp32 left the int4 level as slow
// as the bf16 target past 2 rows (its multiplies, not its bytes, were the limit); here one instruction multiplies a
// lane's 4 codes by 4 int8 inputs, exactly, in int32: per input and 16-row block 2 * 16 / RL vpdpbusd per 8 codes of
// a row, and 4 float operations per group. Layout per weight, ceil(N / 16) blocks one after the other, each words
// [K / 8][16] (4-bit: lane i of word w holds row 16b + i's codes 8w + j in the low nibble and 8w + 4 + j in the high
// one of byte j; 8-bit: [K / 4][16], codes 4w + j in byte j), then s [ng][16] fp32 scales and zs [ng][16] = z s (zero
// past N), so a block's scales follow its codes in the stream. The input, per row and group: a = max |x| / 127, xq =
// x / a rounded half to even (|xq| <= 127), as = a sum(xq). Then y = sum over groups of s (a acc) - zs as, acc the
// group's exact integer sum of q xq: per (row, input) the same sequence for every pass size and M (batch-invariant),
// and in every build (the 8-lane ones bitwise too).
// ---------------------------------------------------------------------------------------------------------------
static inline int64_t qv_groups(int64_t K, int64_t gs) { return (K + gs - 1) / gs; }
// A block's 32-bit words for K codes of BITS bits per row (16 rows): the codes, then s and z s per group.
static inline int64_t qv_block_words(int64_t K, int64_t gs, int bits) {
    return 16 * (K * bits / 32 + 2 * qv_groups(K, gs));
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define POLYSPEC_I4VNNI 1
#include <immintrin.h>

#if !defined(POLYSPEC_HALF_WIDTH)
static inline vri dpbusd(vri acc, vri codes, int32_t x4) {
    return (vri)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)codes, _mm512_set1_epi32(x4));
}
static inline vr fmadd(vr a, vr b, vr c) {  // a b + c, one rounding, in every pass size's code alike
    return (vr)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
#else
static inline vri dpbusd(vri acc, vri codes, int32_t x4) {
    return (vri)_mm256_dpbusd_epi32((__m256i)acc, (__m256i)codes, _mm256_set1_epi32(x4));
}
static inline vr fmadd(vr a, vr b, vr c) { return (vr)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#endif

#if !defined(POLYSPEC_HALF_WIDTH)
static inline vri round_even(vr v) { return (vri)_mm512_cvtps_epi32((__m512)v); }  // MXCSR's default rounding
static inline void store_bytes(int8_t* p, vri v) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8((__m512i)v)); }
#else
static inline vri round_even(vr v) { return (vri)_mm256_cvtps_epi32((__m256)v); }
static inline void store_bytes(int8_t* p, vri v) { _mm_storel_epi64((__m128i*)p, _mm256_cvtepi32_epi8((__m256i)v)); }
#endif

// One row's group x[0 .. n) -> q (x / a rounded half to even, a = max |x| / 127); returns a, *sum = sum(q).
static inline float qv_group(const float* x, int64_t n, int8_t* q, int32_t* sum) {
    const int64_t nv = n - n % RL;
    const vru mag = (vru){0} + 0x7fffffffu;
    vr mx = (vr){0};
    for (int64_t k = 0; k < nv; k += RL) {
        vru u;
        memcpy(&u, x + k, sizeof(u));
        u &= mag;
        vr v;
        memcpy(&v, &u, sizeof(v));
        mx = v > mx ? v : mx;
    }
    float amax = 0.0f;
    for (int i = 0; i < RL; i++) amax = mx[i] > amax ? mx[i] : amax;
    for (int64_t k = nv; k < n; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    const float a = amax / 127.0f;
    const float d = a > 0.0f ? a : 1.0f;  // an all-zero group: q = 0
    vri acc = (vri){0};
    for (int64_t k = 0; k < nv; k += RL) {
        vr v;
        memcpy(&v, x + k, sizeof(v));
        vri r = round_even(v / d);
        r = r > 127 ? 127 : r;
        r = r < -127 ? -127 : r;
        store_bytes(q + k, r);
        acc += r;
    }
    int32_t total = 0;
    for (int i = 0; i < RL; i++) total += acc[i];
    for (int64_t k = nv; k < n; k++) {
        const float r = nearbyintf(x[k] / d);
        q[k] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        total += q[k];
    }
    *sum = total;
    return a;
}

// x [M, K] -> xq [M, K] int8 (this thread's scratch), xa [M, ng] and xas [M, ng] (RowsInput).
static void qv_prepare(const float* x, int64_t M, int64_t K, int64_t gs, RowsInput& in) {
    const int64_t ng = qv_groups(K, gs);
    float* f = scratch(8, M * ng * 2 + (M * K + 3) / 4);
    in.xa = f, in.xas = f + M * ng, in.xq = (const int8_t*)(f + 2 * M * ng);
    int8_t* q = (int8_t*)(f + 2 * M * ng);
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ng; g++) {
            const int64_t k0 = g * gs, n = k0 + gs < K ? gs : K - k0;
            int32_t sum;
            const float a = qv_group(x + m * K + k0, n, q + m * K + k0, &sum);
            f[m * ng + g] = a;
            f[M * ng + m * ng + g] = a * (float)sum;
        }
}

// One 16-row block (words wb, scales sb, zs zb) against G prepared inputs: out[g * 16 + row], no bias. BITS 4: a word
// lane holds 8 codes (two dot products of 4), 8: 4 codes (one).
template <int BITS, int G>
static inline void qv_dots(const RowsInput& in, const uint32_t* wb, const float* sb, const float* zb, int64_t K,
                           int64_t gs, float* out) {
    constexpr int V = 16 / RL, KW = 32 / BITS;  // vectors per block, inputs per word
    const int64_t ng = qv_groups(K, gs), W = K / KW;
    const vri low = (vri){0} + 0x0f0f0f0f;
    vr o[V][G];
    for (int j = 0; j < V; j++)
        for (int g = 0; g < G; g++) o[j][g] = (vr){0};
    for (int64_t grp = 0; grp < ng; grp++) {
        vri acc[V][G];
        for (int j = 0; j < V; j++)
            for (int g = 0; g < G; g++) acc[j][g] = (vri){0};
        const int64_t w1 = (grp + 1) * gs / KW < W ? (grp + 1) * gs / KW : W;
        for (int64_t w = grp * gs / KW; w < w1; w++) {
            prefetch_block_line(wb + w * 16);
            vri lo[V], hi[V];
            for (int j = 0; j < V; j++) {
                memcpy(&lo[j], wb + w * 16 + j * RL, sizeof(vri));
                if (BITS == 4) hi[j] = (lo[j] >> 4) & low, lo[j] &= low;
            }
            for (int g = 0; g < G; g++) {
                int32_t xl, xh = 0;
                memcpy(&xl, in.xq + g * K + KW * w, 4);
                if (BITS == 4) memcpy(&xh, in.xq + g * K + KW * w + 4, 4);
                for (int j = 0; j < V; j++)
                    acc[j][g] = BITS == 4 ? dpbusd(dpbusd(acc[j][g], lo[j], xl), hi[j], xh)
                                          : dpbusd(acc[j][g], lo[j], xl);
            }
        }
        for (int j = 0; j < V; j++) {
            vr s, zs;
            memcpy(&s, sb + grp * 16 + j * RL, sizeof(s));
            memcpy(&zs, zb + grp * 16 + j * RL, sizeof(zs));
            for (int g = 0; g < G; g++) {
                const vr t = __builtin_convertvector(acc[j][g], vr) * in.xa[g * ng + grp];
                o[j][g] = fmadd(-zs, (vr){0} + in.xas[g * ng + grp], fmadd(s, t, o[j][g]));
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < V; j++) memcpy(out + g * 16 + j * RL, &o[j][g], sizeof(vr));
}

// Rows nb..ne-1 of a blocked weight of BITS-bit codes against the M prepared inputs, in balanced passes of up to 8
// (nk16_passes' sizes); rows outside nb..ne-1 or past N are computed and dropped (a slice may start mid-block).
template <int BITS>
static void rows_qv(const RowsInput& in, const uint32_t* blk, const float* bias, int64_t M, int64_t K, int64_t gs,
                    int64_t N, int64_t nb, int64_t ne, float* y) {
    const int64_t ng = qv_groups(K, gs), bw = qv_block_words(K, gs, BITS), bend = (ne + 15) / 16;
    float out[8 * 16];
    for (int64_t b = nb / 16; b < bend; b++) {
        const int64_t lo = b * 16 > nb ? b * 16 : nb, hi = (b + 1) * 16 < ne ? (b + 1) * 16 : ne;
        const uint32_t* wb = blk + b * bw;
        const float* sb = (const float*)(wb + 16 * (K * BITS / 32));
        for (int64_t q = 0, passes = (M + 7) / 8, m0 = 0; q < passes; q++) {
            const int64_t g = passes == 1 ? M : (M - m0) / (passes - q);
            RowsInput part = in;
            part.xq += m0 * K, part.xa += m0 * ng, part.xas += m0 * ng;
            by_pass<8>(g, [&](auto G) { qv_dots<BITS, decltype(G)::value>(part, wb, sb, sb + 16 * ng, K, gs, out); });
            for (int64_t i = 0; i < g; i++)
                for (int64_t n = lo; n < hi; n++)
                    y[(m0 + i) * N + n] = out[i * 16 + (n - b * 16)] + (bias ? bias[n] : 0.0f);
            m0 += g;
        }
    }
}
#endif

// Weight descriptors for run3: a dense fp32 or bf16 matrix [N, K], or an int4 one.
struct WF32 {
    const float* w;
};
struct WBF16 {
    const uint16_t* w;
    bool dot;             // a bf16 input: rounded to bf16 for vdpbf16ps where built; false: widened, fp32 inputs
    const uint32_t* blk;  // the 16-row blocks of w (pack_nk16) or NULL: the widened rows take them where present
};

// What a bf16 input takes on a vdpbf16ps build: the dot rows (true, the default) or, where the weight has them, its
// 16-row blocks on vdpbf16ps (false). One choice per process (polyspec_set_bf16_dot; cpu_kernels.py, bf16_rows:
// measured once per CPU), so a weight takes the same kernel at every width.
static bool g_bf16_dot = true;
struct WI4 {
    const uint8_t* q;   // [N, K / 2]
    const float* s;     // [N, ceil(K / gs)]
    const uint8_t* z;   // [N, ceil(K / gs)]
    int64_t gs;
    const uint32_t* blk;  // the 16-row blocks for int8 inputs (polyspec_pack_i4v) or NULL
};

static inline void rows_w(const float* x, const RowsInput&, const WF32& w, const float* bias, int64_t M, int64_t K,
                          int64_t N, int64_t nb, int64_t ne, float* y) {
    rows<float>(x, w.w, bias, M, K, N, nb, ne, y);
}
static inline void rows_w(const float* x, const RowsInput& in, const WBF16& w, const float* bias, int64_t M,
                          int64_t K, int64_t N, int64_t nb, int64_t ne, float* y) {
#ifdef POLYSPEC_DPBF16
    if (w.dot && w.blk && !g_bf16_dot) return rows_nk16_dp(in.xe, w.blk, bias, M, K, N, nb, ne, y);
    if (w.dot) return rows_dp<uint16_t>(in.xb, in.xb_row, w.w, bias, M, K, N, nb, ne, y);
#endif
    if (w.blk) return rows_nk16(in.xi, w.blk, bias, M, K, N, nb, ne, y);
    rows_wide(in.xd, w.w, bias, M, K, N, nb, ne, y);
}
#ifdef POLYSPEC_DPBF16
// One pass of G (up to 4) input rows from row m0 over an int4 weight row on the bf16 path.
static inline void rows_w(const float*, const RowsInput& in, const WI4& w, const float* bias, int64_t M, int64_t K,
                          int64_t N, int64_t nb, int64_t ne, float* y) {
#ifdef POLYSPEC_I4VNNI
    if (w.blk) return rows_qv<4>(in, w.blk, bias, M, K, w.gs, N, nb, ne, y);
#endif
    const int64_t ng = (K + w.gs - 1) / w.gs;
    float out[8];
    for (int64_t n = nb; n < ne; n++) {
        const uint8_t* q = w.q + n * (K / 2);
        const float* sc = w.s + n * ng;
        const uint8_t* zr = w.z + n * ng;
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t g = M - m0 >= 4 ? 4 : M - m0;
            by_pass<4>(g, [&](auto G) {
                constexpr int GV = decltype(G)::value;
                row_dots_i4b<GV>({nullptr, in.xs + m0 * ng, in.xb + m0 * in.xb_row, in.xb_row, nullptr}, q, sc, zr, K, w.gs,
                                 out);
            });
            for (int64_t i = 0; i < g; i++) y[(m0 + i) * N + n] = out[i] + b;
        }
    }
}
#else
// One block of R int4 rows (from row n) against all M input rows in passes of up to P (block_passes).
template <int R, int P>
static void block_rows_i4(const RowsInput& in, const WI4& w, const float* bias, int64_t M, int64_t K, int64_t N,
                          int64_t n, float* y) {
    const int64_t ng = (K + w.gs - 1) / w.gs;
    block_passes<R, P>(M, N, n, bias, y, [&](auto G, int64_t m0, float* out) {
        const RowsInput part = {in.xd + m0 * K, nullptr, nullptr, 0, nullptr};
        constexpr int GV = decltype(G)::value;
        const uint8_t* q = w.q + n * (K / 2);
        switch (K % w.gs == 0 ? w.gs / (2 * RL) : 0) {
            case 2: block_dots_i4<R, GV, 2>(part, q, w.s + n * ng, w.z + n * ng, K, w.gs, out); break;
            case 4: block_dots_i4<R, GV, 4>(part, q, w.s + n * ng, w.z + n * ng, K, w.gs, out); break;
            case 8: block_dots_i4<R, GV, 8>(part, q, w.s + n * ng, w.z + n * ng, K, w.gs, out); break;
            default: block_dots_i4<R, GV, 0>(part, q, w.s + n * ng, w.z + n * ng, K, w.gs, out); break;
        }
    });
}

// Rows nb..ne-1: blocks of 4 rows against passes of up to 5 inputs, of 3 rows against up to 8 from 6 inputs (3 rows:
// 0.93-0.99x the time of 2 at widths 6-8 on the Cascade Lake VM), single rows at the end; without AVX-512 (16
// registers) single rows against up to 8.
static inline void rows_w(const float*, const RowsInput& in, const WI4& w, const float* bias, int64_t M, int64_t K,
                          int64_t N, int64_t nb, int64_t ne, float* y) {
#ifdef POLYSPEC_I4VNNI
    if (w.blk) return rows_qv<4>(in, w.blk, bias, M, K, w.gs, N, nb, ne, y);
#endif
    int64_t n = nb;
#ifdef __AVX512F__
    if (M <= 5)
        for (; n + 4 <= ne; n += 4) block_rows_i4<4, 5>(in, w, bias, M, K, N, n, y);
    else
        for (; n + 3 <= ne; n += 3) block_rows_i4<3, 8>(in, w, bias, M, K, N, n, y);
    for (; n < ne; n++) block_rows_i4<1, 8>(in, w, bias, M, K, N, n, y);
#else
    if (M <= 5)
        for (; n + 2 <= ne; n += 2) block_rows_i4<2, 5>(in, w, bias, M, K, N, n, y);
    for (; n < ne; n++) block_rows_i4<1, 8>(in, w, bias, M, K, N, n, y);
#endif
}
#endif

#ifdef POLYSPEC_I4VNNI
struct WQ8 {  // 8-bit codes in 16-row blocks against int8 inputs (polyspec_pack_q8v): an int4 level's lm_head
    const uint32_t* blk;
    int64_t gs;
};
static inline void rows_w(const float*, const RowsInput& in, const WQ8& w, const float* bias, int64_t M, int64_t K,
                          int64_t N, int64_t nb, int64_t ne, float* y) {
    rows_qv<8>(in, w.blk, bias, M, K, w.gs, N, nb, ne, y);
}
static inline bool dot_rows(const WQ8&) { return false; }
static inline bool wide_rows(const WQ8&) { return false; }
static inline bool any_blocked(const WQ8*) { return true; }
static inline bool all_blocked(const WQ8*) { return true; }
static inline int64_t group_size_of(const WQ8& w) { return w.gs; }
#endif
static inline bool dot_rows(const WF32&) { return false; }
static inline bool dot_rows(const WBF16& w) { return w.dot; }
static inline bool dot_rows(const WI4&) { return false; }
static inline bool wide_rows(const WF32&) { return false; }
static inline bool wide_rows(const WI4&) { return false; }
#ifdef POLYSPEC_DPBF16
static inline bool wide_rows(const WBF16& w) { return !w.dot; }
#else
static inline bool wide_rows(const WBF16&) { return true; }
#endif
template <typename WT>
static inline bool any_blocked(const WT*) { return false; }
template <typename WT>
static inline bool all_blocked(const WT*) { return false; }
static inline bool any_blocked(const WBF16* ws) { return ws[0].blk || ws[1].blk || ws[2].blk; }
static inline bool all_blocked(const WBF16* ws) { return ws[0].blk && ws[1].blk && ws[2].blk; }
#ifdef POLYSPEC_I4VNNI  // (elsewhere no int4 weight has blocks: the generic false above)
static inline bool any_blocked(const WI4* ws) { return ws[0].blk || ws[1].blk || ws[2].blk; }
static inline bool all_blocked(const WI4* ws) { return ws[0].blk && ws[1].blk && ws[2].blk; }
#endif
static inline int64_t group_size_of(const WF32&) { return 0; }
static inline int64_t group_size_of(const WBF16&) { return 0; }
static inline int64_t group_size_of(const WI4& w) { return w.gs; }

// Rows 0..N-1 shared out among the threads in whole SPLIT_ROWS units. Each thread owns a contiguous share and takes
// its units in order, so its weights stream as one ascending run that the prefetch ahead carries from unit to unit
// (runs that shrank as the work did each started cold: 1.03-1.05x the layers' time, docs/BENCHMARKS.md). A thread
// done with its share takes what is left of the others', a unit at a time, so a thread slowed by a busy neighbour
// holds the other up by a unit at most. A row's arithmetic does not depend on which thread computes it or beside
// which rows, so results are bitwise those of any other split. Each thread taking part calls init() once, before its
// first unit, and passes what it returns to f(own, begin, end).
template <typename Init, typename F>
static void share_rows(int64_t N, int threads, Init&& init, F&& f) {
    const int64_t units = (N + SPLIT_ROWS - 1) / SPLIT_ROWS;
    const int T = threads < units ? threads : (int)units;
    if (T <= 1) {
        f(init(), 0, N);
        return;
    }
    struct alignas(64) Next {  // a share's next unit, one cache line each
        std::atomic<int64_t> u;
    };
    std::unique_ptr<Next[]> next(new Next[T]);
    for (int t = 0; t < T; t++) next[t].u.store(units * t / T, std::memory_order_relaxed);
#pragma omp parallel num_threads(T)
    {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        const auto own = init();
        for (int d = 0; d < T; d++) {  // its own share, then the others' (all of them where OpenMP gave fewer threads)
            const int v = (me + d) % T;
            const int64_t end = units * (v + 1) / T;
            for (int64_t u; (u = next[v].u.fetch_add(1, std::memory_order_relaxed)) < end;)
                f(own, u * SPLIT_ROWS, (u + 1) * SPLIT_ROWS < N ? (u + 1) * SPLIT_ROWS : N);
        }
    }
}

// The parts of a call's prepared input every thread reads, made once by the calling thread before the others start:
// the blocked int4 rows' int8 groups (made by each thread for itself they cost the int4 level 1.02-1.04x the time)
// and the vdpbf16ps paths' bf16 copies of x (in xs and xb, which the caller keeps).
template <typename WT>
static void shared_input(const float* x, const WT* ws, int64_t M, int64_t K, std::vector<float>& xs,
                         std::vector<uint16_t>& xb, RowsInput& in) {
    const int64_t gs = group_size_of(ws[0]);
#ifdef POLYSPEC_I4VNNI
    if (gs > 0 && any_blocked(ws)) qv_prepare(x, M, K, gs, in);  // int8 inputs for the blocked int4 rows
#endif
#ifdef POLYSPEC_DPBF16
    if (gs > 0 && !all_blocked(ws)) {  // the int4 rows: x split into bf16 parts, with its group sums
        xs.assign(M * ((K + gs - 1) / gs), 0.0f);
        in.xb_row = i4b_prepare(x, M, K, gs, xb, xs.data());
        in.xb = xb.data();
        in.xs = xs.data();
    }
    if (dot_rows(ws[0]) && (g_bf16_dot || !all_blocked(ws))) {  // the dot rows: x rounded to bf16 once
        in.xb_row = bf16_prepare(x, M, K, xb);
        in.xb = xb.data();
    }
#endif
    (void)x, (void)ws, (void)M, (void)K, (void)xs, (void)xb, (void)in, (void)gs;
}

// The copies of x each thread makes for itself in its own scratch (pairs order, blocks order, bf16 pairs): written
// where they are read, so none of their lines moves between cores. Made once by the calling thread while the others
// waited, they had cost the half-width layers 1.02x the time at 8 rows (docs/BENCHMARKS.md).
template <typename WT>
static RowsInput own_input(const float* x, const WT* ws, int64_t M, int64_t K, RowsInput in) {
    const int64_t gs = group_size_of(ws[0]);
#ifdef POLYSPEC_DPBF16
    if (dot_rows(ws[0]) && !g_bf16_dot && any_blocked(ws)) in.xe = nk16_prepare_dp(x, M, K);  // vdpbf16ps blocks
#else
    if (gs > 0 && !all_blocked(ws)) in.xd = pairs_prepare(x, M, K);  // the portable int4 rows
#endif
    if (wide_rows(ws[0])) {  // bf16 weights widened: in passes (16-row blocks) and / or in pairs order (rows)
        if (any_blocked(ws)) in.xi = nk16_prepare(x, M, K);
        if (!all_blocked(ws)) in.xd = pairs_prepare(x, M, K);
    }
    (void)gs;
    return in;
}

// f(own, b, e) for units of rows 0..N-1 shared out among the threads (share_rows), each thread with its own copies
// of the input x [M, K] against weights like ws (own_input), the copies all threads read made first (shared_input);
// one thread where the call's rows x inputs (work) are too few to share.
template <typename WT, typename F>
static void share_weight_rows(const float* x, const WT* ws, int64_t M, int64_t K, int64_t N, int64_t work,
                              int threads, F&& f) {
    std::vector<float> xs;
    std::vector<uint16_t> xb;
    RowsInput in = {nullptr, nullptr, nullptr, 0, nullptr};
    shared_input(x, ws, M, K, xs, xb, in);
    if (threads < 1) threads = 1;
    if (work * M < 64 * threads) threads = 1;
    share_rows(N, threads, [&] { return own_input(x, ws, M, K, in); }, f);
}

// Each value of y [n] rounded in place to the nearest bf16 (bf16_bits_rne; a NaN becomes the quiet NaN) and kept as
// fp32: what .to(bfloat16).float() gives. Branch-free, so the compiler vectorises it.
static void round_bf16_span(float* y, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, y + i, sizeof(u));
        u = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : (uint32_t)bf16_bits_rne(y[i]) << 16;
        memcpy(y + i, &u, sizeof(u));
    }
}

// Up to three weights side by side, y = [x w0^T | x w1^T | x w2^T] (+ biases), [M, n0 + n1 + n2] (q/k/v in one
// call). The concatenated rows are shared out among the threads. round_out: each unit's outputs rounded to bf16
// (round_bf16_span) by the thread that wrote them, while they are in its cache (a bf16 model's logits: a pass of its
// own over them after the call had cost the half-width build's lm_head ~0.15 ms at 8 rows, one thread reading
// lines the other wrote).
template <typename WT>
static void run3(const float* x, const WT* ws, const float* const* bs, const int64_t* ns, int64_t M, int64_t K,
                 float* y, int threads, bool round_out = false) {
    const int64_t N = ns[0] + ns[1] + ns[2];
    share_weight_rows(x, ws, M, K, N, N, threads, [&](const RowsInput& own, int64_t b, int64_t e) {
        int64_t off = 0;  // rows b..e-1 of the three weights side by side
        for (int s = 0; s < 3; s++) {
            const int64_t lo = b > off ? b - off : 0, hi = (e < off + ns[s] ? e : off + ns[s]) - off;
            if (lo < hi) rows_w(x, own, ws[s], bs[s], M, K, N, lo, hi, y + off);
            off += ns[s];
        }
        for (int64_t m = 0; round_out && m < M; m++) round_bf16_span(y + m * N + b, e - b);
    });
}

template <typename WT>
static void run1(const float* x, const WT& w, const float* bias, int64_t n, int64_t M, int64_t K, float* y,
                 int threads) {
    const WT ws[3] = {w, w, w};
    const float* bs[3] = {bias, nullptr, nullptr};
    const int64_t ns[3] = {n, 0, 0};
    run3(x, ws, bs, ns, M, K, y, threads);
}

// ---------------------------------------------------------------------------------------------------------------
// One whole pre-norm Llama decoder layer for a few positions of one sequence (fp32 activations, weights and cache),
// so a decode step makes one call per layer instead of ~35 torch ops. The same maths as decode/model.py's
// DecoderLayer, the reference: x += o(attn(rope(q), rope(k), v)) of rmsnorm(x); x += down(silu(gate) * up) of
// rmsnorm(x), each projection with an optional bias. cpu_kernels.py's LAYER_SUPPORT declares which of the reference's
// features this implements (change both together); tests/test_layer_parity.py holds every supported architecture to
// the reference. Every row's arithmetic is independent of T (batch-invariant, like the linears).
// ---------------------------------------------------------------------------------------------------------------

template <typename C>  // C: the cache's element type, float or bf16 bits (uint16_t)
static inline float dot(const float* a, const C* b, int64_t n) {
    const int64_t n16 = n - n % 16;
    v16f acc = (v16f){0};
    for (int64_t i = 0; i < n16; i += 16) acc += load_f32(a + i) * load_w<C>(b + i);
    float s = lane_sum(acc);
    for (int64_t i = n16; i < n; i++) s += a[i] * w_scalar(b + i);
    return s;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch rounds; NaN stays NaN
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void store_row(float* dst, const float* src, int64_t n) { memcpy(dst, src, n * sizeof(float)); }
static inline void store_row(uint16_t* dst, const float* src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

// exp of 16 floats (Cephes-style: x = n ln2 + r, a degree-6 polynomial for e^r, 2^n from the exponent bits),
// within ~2 ulp of expf; inputs clamped to [-87.3, 88.7]. Each lane is computed on its own, so a value's result does
// not depend on its neighbours.
static inline v16f exp16(v16f x) {
    const v16f lo = (v16f){0} - 87.3365447504f, hi = (v16f){0} + 88.3762626647949f;
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    const v16f magic = (v16f){0} + 12582912.0f;  // 1.5 * 2^23: adding and subtracting rounds to the nearest integer
    const v16f n = (x * 1.44269504088896341f + magic) - magic;
    const v16f r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    v16f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    v16f scale;
    memcpy(&scale, &e, sizeof(scale));
    return p * scale;
}

// y[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)), the sum of squares in double (fixed order).
typedef double v8d __attribute__((vector_size(64)));

// sum of x[h]^2 in fp64 (each square is exact there): four 8-lane accumulators over h = 0, 8, 16, 24 (mod 32), added
// in a fixed order, then the H % 32 tail in order. One add chain of H fp64 adds took ~0.7 us per row and norm (the
// layer's longest serial step); this order is the same for every row and width, so results stay width-invariant.
static inline double sum_squares(const float* x, int64_t H) {
    v8d a[4] = {};
    const int64_t h32 = H - H % 32;
    for (int64_t h = 0; h < h32; h += 32)
        for (int j = 0; j < 4; j++) {
            v8f f;
            memcpy(&f, x + h + 8 * j, sizeof(f));
            const v8d d = __builtin_convertvector(f, v8d);
            a[j] += d * d;
        }
    const v8d s = (a[0] + a[1]) + (a[2] + a[3]);
    double t = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
    for (int64_t h = h32; h < H; h++) t += (double)x[h] * x[h];
    return t;
}

static void rmsnorm(const float* x, const float* w, float eps, int64_t T, int64_t H, float* y) {
    for (int64_t t = 0; t < T; t++) {
        const float* xr = x + t * H;
        const double ss = sum_squares(xr, H);
        const float r = 1.0f / sqrtf((float)(ss / (double)H) + eps);
        for (int64_t h = 0; h < H; h++) y[t * H + h] = w[h] * (xr[h] * r);
    }
}

// In place on heads [T, nheads, D] (row stride ld): v * cos + rotate_half(v) * sin, cos/sin [T, D].
static void rope(float* v, int64_t ld, const float* cos_, const float* sin_, int64_t T, int64_t nheads, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < nheads; h++) {
            float* p = v + t * ld + h * D;
            const float* c = cos_ + t * D;
            const float* s = sin_ + t * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = p[i], b = p[i + half];
                p[i] = a * c[i] - b * s[i];
                p[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
}

// Attention: softmax(q k^T / sqrt(D)) v over the visible keys of one row, for the G query heads that share one K/V
// head, so each K and V row is read once for all of them. A head's arithmetic is the same whatever G is and wherever
// its keys' blocks start, and the sums over keys (the softmax's denominator, P V) run in key order over the visible
// keys only (masked keys add nothing), so a row's output is bitwise the same from a decode step, a wider
// verification, or a draft tree whose ancestors sit at other cache positions.

// 16 keys' per-lane partial dot products -> one vector whose lane i is p[i]'s lane sum, each key's lanes added in
// lane_sum's order (halves, quarters, ...): 30 two-source shuffles and 15 adds for 16 keys, not 16 lane sums.
static inline v16f reduce16(const v16f* p) {
    v16f a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                       27) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                                       29) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// A K or V row of ND 16-lane chunks, as attention holds it: an fp32 cache's in order; a bf16 cache's with each 32
// dims' words widened by one unpack with zeros per 16 (vpunpcklwd / vpunpckhwd, where a zero-extension and a shift
// took two instructions), so chunk 2h holds dims 32h + {0-3, 8-11, 16-19, 24-27} and chunk 2h + 1 the others
// (row_order puts a query's dims the same way and an output's back).
template <int ND>
static inline void load_row(const float* p, v16f (&r)[ND]) {
    for (int c = 0; c < ND; c++) r[c] = load_f32(p + 16 * c);
}
template <int ND>
static inline void load_row(const uint16_t* p, v16f (&r)[ND]) {
    for (int h = 0; h < ND / 2; h++) {
#ifdef __AVX512BW__
        const __m512i w = _mm512_loadu_si512(p + 32 * h), z = _mm512_setzero_si512();
        r[2 * h] = (v16f)_mm512_castsi512_ps(_mm512_unpacklo_epi16(z, w));
        r[2 * h + 1] = (v16f)_mm512_castsi512_ps(_mm512_unpackhi_epi16(z, w));
#else  // the same per 128-bit lane, in two 256-bit halves
        const __m256i w0 = _mm256_loadu_si256((const __m256i*)(p + 32 * h)), z = _mm256_setzero_si256();
        const __m256i w1 = _mm256_loadu_si256((const __m256i*)(p + 32 * h + 16));
        const __m256i lo[2] = {_mm256_unpacklo_epi16(z, w0), _mm256_unpacklo_epi16(z, w1)};
        const __m256i hi[2] = {_mm256_unpackhi_epi16(z, w0), _mm256_unpackhi_epi16(z, w1)};
        memcpy(&r[2 * h], lo, sizeof(lo));
        memcpy(&r[2 * h + 1], hi, sizeof(hi));
#endif
    }
}

// A vector's dims as load_row leaves a cache of type C's rows (a query's, before its scores), or back in order
// (an output's, after P V); fp32 caches need neither.
template <typename C, bool back, int ND>
static inline void row_order(v16f (&v)[ND]) {
    if constexpr (std::is_same<C, uint16_t>::value)
        for (int h = 0; h < ND / 2; h++) {
            const v16f a = v[2 * h], b = v[2 * h + 1];
            if constexpr (back) {
                v[2 * h] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
                v[2 * h + 1] = __builtin_shufflevector(a, b, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30,
                                                       31);
            } else {
                v[2 * h] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
                v[2 * h + 1] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                                       31);
            }
        }
}

// Scores of G heads against keys [j0, j0 + 16) (lanes past L or masked: -inf), into sc[g * ld + j0 ...].
template <int G, int ND, typename C>
static inline void score_block(const v16f (&q)[G][ND], const C* kc, int64_t j0, int64_t L, const uint8_t* mr,
                               float scale, float* sc, int64_t ld, v16f (&mx)[G]) {
    constexpr int64_t D = ND * 16;
    v16f part[G][16];
    v16f valid;
    for (int i = 0; i < 16; i++) {
        const int64_t j = j0 + i;
        const bool on = j < L && (!mr || mr[j]);
        valid[i] = on ? 1.0f : 0.0f;
        if (j >= L) {
            for (int g = 0; g < G; g++) part[g][i] = (v16f){0};
            continue;
        }
        v16f k[ND];
        load_row<ND>(kc + j * D, k);
        for (int g = 0; g < G; g++) {
            v16f acc = q[g][0] * k[0];
            for (int c = 1; c < ND; c++) acc += q[g][c] * k[c];
            part[g][i] = acc;
        }
    }
    const v16f ninf = (v16f){0} - INFINITY;
    for (int g = 0; g < G; g++) {
        v16f s = reduce16(part[g]) * scale;
        s = valid > 0.5f ? s : ninf;
        mx[g] = mx[g] > s ? mx[g] : s;
        memcpy(sc + g * ld + j0, &s, sizeof(s));
    }
}

template <int G, int ND, typename C>
static void attend(const float* q0, const C* kc, const C* vc, int64_t L, const uint8_t* mr, float scale, float* sc,
                   float* out) {
    constexpr int64_t D = ND * 16;
    const int64_t ld = L + 16;
    v16f q[G][ND], mxv[G];
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < ND; c++) q[g][c] = load_f32(q0 + g * D + 16 * c);
        row_order<C, false>(q[g]);
        mxv[g] = (v16f){0} - INFINITY;
    }
    for (int64_t j0 = 0; j0 < L; j0 += 16) score_block<G, ND, C>(q, kc, j0, L, mr, scale, sc, ld, mxv);
    float den[G];
    for (int g = 0; g < G; g++) {
        float mx = -INFINITY;
        for (int i = 0; i < 16; i++) mx = mxv[g][i] > mx ? mxv[g][i] : mx;
        float* s = sc + g * ld;
        for (int64_t j0 = 0; j0 < L; j0 += 16) {  // masked keys (-inf) become exactly 0
            const v16f x = load_f32(s + j0);
            v16f e = exp16(x - mx);
            e = x == -INFINITY ? (v16f){0} : e;
            memcpy(s + j0, &e, sizeof(e));
            memcpy(s + G * ld + j0, &e, sizeof(e));  // P V's denominator reads this copy (below)
        }
        den[g] = 0.0f;  // summed in the P V loop below, in key order over the visible keys as a decode step sums
    }                   // them (a masked key's 0 added nothing): its add chain then overlaps P V's work
    v16f acc[G][ND];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < ND; c++) acc[g][c] = (v16f){0};
    for (int64_t j = 0; j < L; j++) {
        if (mr && !mr[j]) continue;
        v16f v[ND];
        load_row<ND>(vc + j * D, v);
        for (int g = 0; g < G; g++) {  // p broadcast by its own load: read once for both, it took a shuffle a head
            const float p = sc[g * ld + j];
            den[g] += sc[(G + g) * ld + j];
            for (int c = 0; c < ND; c++) acc[g][c] += p * v[c];
        }
    }
    for (int g = 0; g < G; g++) {
        const float r = 1.0f / den[g];
        v16f y[ND];
        for (int c = 0; c < ND; c++) y[c] = acc[g][c] * r;
        row_order<C, true>(y);
        memcpy(out + g * D, y, sizeof(y));
    }
}

template <int ND, typename C>
static void attend_g(int64_t G, const float* q, const C* kc, const C* vc, int64_t L, const uint8_t* mr, float scale,
                     float* sc, float* out) {
    switch (G) {
        case 1: attend<1, ND, C>(q, kc, vc, L, mr, scale, sc, out); break;
        case 2: attend<2, ND, C>(q, kc, vc, L, mr, scale, sc, out); break;
        case 3: attend<3, ND, C>(q, kc, vc, L, mr, scale, sc, out); break;
        case 4: attend<4, ND, C>(q, kc, vc, L, mr, scale, sc, out); break;
        case 5: attend<5, ND, C>(q, kc, vc, L, mr, scale, sc, out); break;
        case 6: attend<6, ND, C>(q, kc, vc, L, mr, scale, sc, out); break;
        case 7: attend<7, ND, C>(q, kc, vc, L, mr, scale, sc, out); break;
        default: attend<8, ND, C>(q, kc, vc, L, mr, scale, sc, out); break;
    }
}

// G (1..8) heads of one row that share a K/V head; false when the head size has no vector path (then the caller's
// per-(head, row) loop runs).
template <typename C>
static bool attend_heads(int64_t D, int64_t G, const float* q, const C* kc, const C* vc, int64_t L,
                         const uint8_t* mr, float scale, float* sc, float* out) {
    switch (D) {
        case 32: attend_g<2, C>(G, q, kc, vc, L, mr, scale, sc, out); return true;
        case 64: attend_g<4, C>(G, q, kc, vc, L, mr, scale, sc, out); return true;
        case 128: attend_g<8, C>(G, q, kc, vc, L, mr, scale, sc, out); return true;
        default: return false;
    }
}

// One head of one row, for head sizes without a vector path: the dot products one by one, then the softmax and P V
// in key order.
template <typename C>
static void attend_scalar(const float* q, const C* kc, const C* vc, int64_t L, int64_t D, const uint8_t* mr,
                          float scale, float* sc, float* out) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < L; j++) {
        if (mr && !mr[j]) {
            sc[j] = 0.0f;
            continue;
        }
        sc[j] = dot(q, kc + j * D, D) * scale;
        mx = sc[j] > mx ? sc[j] : mx;
    }
    const int64_t L16 = L - L % 16;
    for (int64_t j = 0; j < L16; j += 16) {  // exponentials 16 at a time; masked keys set to exactly 0 after
        const v16f e = exp16(load_f32(sc + j) - mx);
        memcpy(sc + j, &e, sizeof(e));
    }
    if (L16 < L) {  // the tail through the same lane arithmetic (zero-padded)
        float tail[16] = {0};
        memcpy(tail, sc + L16, (L - L16) * sizeof(float));
        const v16f e = exp16(load_f32(tail) - mx);
        memcpy(sc + L16, &e, (L - L16) * sizeof(float));
    }
    float den = 0.0f;
    for (int64_t j = 0; j < L; j++) {  // in key order, as a decode step sums them (masked keys add 0)
        if (mr && !mr[j]) sc[j] = 0.0f;
        den += sc[j];
    }
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
    for (int64_t j = 0; j < L; j++) {
        if (mr && !mr[j]) continue;
        const float pj = sc[j] / den;
        const C* vr = vc + j * D;
        for (int64_t d = 0; d < D; d++) out[d] += pj * w_scalar(vr + d);
    }
}

template <typename C>
static void attention(const float* qkv, int64_t nqkv, const C* kcache, const C* vcache, int64_t S, int64_t L,
                      int64_t T, int64_t nh, int64_t nkv, int64_t D, const uint8_t* mask, int threads, float* att) {
    const float scale = 1.0f / sqrtf((float)D);
    const int64_t group = nh / nkv, nq = nh * D;
    const bool vec = (D == 32 || D == 64 || D == 128);
    const int64_t per = vec && group <= 8 ? group : 1;
    const int64_t items = nh / per * T;
    const int at = items >= 2 && threads > 1 ? threads : 1;
    auto item = [&](int64_t it, float* sc) {
        const int64_t h = it / T * per, t = it % T, g = h / group;
        const float* q = qkv + t * nqkv + h * D;
        const C* kc = kcache + g * S * D;
        const C* vc = vcache + g * S * D;
        const uint8_t* mr = mask ? mask + t * L : nullptr;
        int64_t lr = L;  // keys past the row's last visible one are skipped (they would add nothing)
        while (mr && lr > 0 && !mr[lr - 1]) lr--;
        float* out = att + t * nq + h * D;
        if (!vec || !attend_heads<C>(D, per, q, kc, vc, lr, mr, scale, sc, out))
            attend_scalar(q, kc, vc, lr, D, mr, scale, sc, out);
    };
#pragma omp parallel num_threads(at) if (at > 1)
    {
        std::vector<float> sc(2 * per * (L + 16));  // an item's scores, then its exponentials twice (attend)
        if (T > 16) {  // a prompt: causal rows grow, so deal the items out one by one
#pragma omp for schedule(static, 1)
            for (int64_t it = 0; it < items; it++) item(it, sc.data());
        } else {  // a step: a group's rows on one thread, which reads their K/V rows once
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items; it++) item(it, sc.data());
        }
    }
}

// a[i] = SiLU(g[i]) * u[i], 16 at a time; the tail through the same lane arithmetic, so each value is the same
// function of (g[i], u[i]) wherever a chunk starts.
static void silu_mul(const float* g, const float* u, int64_t n, float* a) {
    const int64_t n16 = n - n % 16;
    for (int64_t i = 0; i < n16; i += 16) {
        const v16f gv = load_f32(g + i);
        const v16f r = gv / (1.0f + exp16((v16f){0} - gv)) * load_f32(u + i);
        memcpy(a + i, &r, sizeof(r));
    }
    for (int64_t i = n16; i < n; i++) {
        const v16f gv = (v16f){0} + g[i];
        a[i] = (gv / (1.0f + exp16((v16f){0} - gv)))[0] * u[i];
    }
}

// gu = [x wg^T | x wu^T] (+ biases), [M, 2I], and act = SiLU(gate) * up, [M, I]: the threads share out units of
// gate's and up's rows together, and each unit's activations are computed by the thread that computed both halves
// (computed after all of gu, on the calling thread alone, the half-width layers took 1.016x the time at 8 rows).
template <typename WT>
static void gate_up(const float* x, const WT& wg, const WT& wu, const float* bg, const float* bu, int64_t M,
                    int64_t K, int64_t I, float* gu, float* act, int threads) {
    const WT ws[3] = {wg, wu, wu};
    share_weight_rows(x, ws, M, K, I, 2 * I, threads, [&](const RowsInput& own, int64_t b, int64_t e) {
        rows_w(x, own, wg, bg, M, K, 2 * I, b, e, gu);
        rows_w(x, own, wu, bu, M, K, 2 * I, b, e, gu + I);
        for (int64_t t = 0; t < M; t++) silu_mul(gu + t * 2 * I + b, gu + t * 2 * I + I + b, e - b, act + t * I + b);
    });
}

template <typename WT>
struct LayerWeights {  // q, k, v, o, gate, up, down; their biases (NULL = none); the two norm weights
    WT w[7];
    const float* b[7];
    const float* in_norm;
    const float* post_norm;
};

template <typename WT, typename C>
static int layer(float* x, const LayerWeights<WT>& w, float eps, int64_t T, int64_t H, int64_t nh, int64_t nkv,
                 int64_t D, int64_t I, const float* cos_, const float* sin_, C* kcache, C* vcache, int64_t S,
                 int64_t start, const uint8_t* mask, int threads) {
    const int64_t L = start + T, nq = nh * D, nk = nkv * D, nqkv = nq + 2 * nk;
    if (L > S || nh % nkv != 0 || D % 2 != 0) return 1;
    float *xn = scratch(0, T * H), *qkv = scratch(1, T * nqkv), *att = scratch(2, T * nq), *o = scratch(3, T * H),
          *gu = scratch(4, T * 2 * I), *act = scratch(5, T * I);

    rmsnorm(x, w.in_norm, eps, T, H, xn);
    {
        const int64_t ns[3] = {nq, nk, nk};
        run3(xn, w.w, w.b, ns, T, H, qkv, threads);
    }
    rope(qkv, nqkv, cos_, sin_, T, nh + nkv, D);  // q heads then k heads, side by side in each row
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < nkv; g++) {
            store_row(kcache + (g * S + start + t) * D, qkv + t * nqkv + nq + g * D, D);
            store_row(vcache + (g * S + start + t) * D, qkv + t * nqkv + nq + nk + g * D, D);
        }
    attention(qkv, nqkv, kcache, vcache, S, L, T, nh, nkv, D, mask, threads, att);
    run1(att, w.w[3], w.b[3], H, T, nq, o, threads);
    for (int64_t i = 0; i < T * H; i++) x[i] += o[i];
    rmsnorm(x, w.post_norm, eps, T, H, xn);
    gate_up(xn, w.w[4], w.w[5], w.b[4], w.b[5], T, H, I, gu, act, threads);
    run1(act, w.w[6], w.b[6], H, T, I, o, threads);
    for (int64_t i = 0; i < T * H; i++) x[i] += o[i];
    return 0;
}

// Dense layer weights from the pointer table: 7 weights of element type E, 7 fp32 biases (NULL = none), 2 fp32 norms.
template <typename WT, typename E>
static LayerWeights<WT> dense_weights(const void* const* ptrs) {
    LayerWeights<WT> w;
    for (int i = 0; i < 7; i++) w.w[i] = {(const E*)ptrs[i]};
    for (int i = 0; i < 7; i++) w.b[i] = (const float*)ptrs[7 + i];
    w.in_norm = (const float*)ptrs[14];
    w.post_norm = (const float*)ptrs[15];
    return w;
}

// A bf16 model's layer weights: its activations are bf16 at every matmul, so every projection takes vdpbf16ps;
// ptrs[16 + i]: projection i's 16-row blocks or NULL.
static LayerWeights<WBF16> bf16_layer_weights(const void* const* ptrs) {
    LayerWeights<WBF16> w = dense_weights<WBF16, uint16_t>(ptrs);
    for (int i = 0; i < 7; i++) w.w[i] = {w.w[i].w, true, (const uint32_t*)ptrs[16 + i]};
    return w;
}

// x rounded to bf16 in place (kept as fp32): where the module path stores a bf16 tensor.
static void round_to_bf16(float* x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

template <typename C>
static int attention_checked(const float* q, const C* k, const C* v, int64_t S, int64_t L, int64_t T, int64_t nh,
                             int64_t nkv, int64_t D, const uint8_t* mask, int threads, float* out) {
    if (nh % nkv != 0 || L > S) return 1;
    attention(q, nh * D, k, v, S, L, T, nh, nkv, D, mask, threads, out);
    return 0;
}

// Row n's scales and z s into its blocked weight (lane n % 16 of its block's s [ng][16] and zs [ng][16]; 0 past N).
static void qv_pack_scales(const float* s, const uint8_t* z, int64_t N, int64_t K, int64_t gs, int bits, int64_t n,
                           uint32_t* out) {
    const int64_t ng = qv_groups(K, gs);
    float* sc = (float*)(out + (n / 16) * qv_block_words(K, gs, bits) + 16 * (K * bits / 32));
    for (int64_t g = 0; g < ng; g++) {
        sc[g * 16 + n % 16] = n < N ? s[n * ng + g] : 0.0f;
        sc[(ng + g) * 16 + n % 16] = n < N ? (float)z[n * ng + g] * s[n * ng + g] : 0.0f;
    }
}

// Rows 0 .. ceil(N / 16) * 16 - 1 into blocks of BITS-bit codes (qv_block_words each): word(n, w) is row n's word w
// (n < N), then the row's scales and z s; rows past N are zero.
template <int BITS, typename Word>
static void qv_pack(const float* s, const uint8_t* z, int64_t N, int64_t K, int64_t gs, uint32_t* out, Word&& word) {
    for (int64_t n = 0; n < (N + 15) / 16 * 16; n++) {
        uint32_t* blk = out + (n / 16) * qv_block_words(K, gs, BITS);
        for (int64_t w = 0; w < K * BITS / 32; w++) blk[w * 16 + n % 16] = n < N ? word(n, w) : 0;
        qv_pack_scales(s, z, N, K, gs, BITS, n, out);
    }
}

extern "C" {

int polyspec_linear_abi(void) { return 17; }

// Which row kernels this build has for int4 and bf16 weights: 1 = AVX512-BF16 dot products on bf16 inputs (2: with
// vdpbf16ps emulated, POLYSPEC_EMULATE_DPBF16), 0 = the portable fp32 ones.
int polyspec_dot_path(void) {
#if defined(POLYSPEC_DPBF16) && !defined(__AVX512BF16__)
    return 2;
#elif defined(POLYSPEC_DPBF16)
    return 1;
#else
    return 0;
#endif
}

// bf16 inputs on a vdpbf16ps build: the dot rows (on = 1) or the 16-row blocks on vdpbf16ps (0; g_bf16_dot).
void polyspec_set_bf16_dot(int on) { g_bf16_dot = on != 0; }

// The portable row kernels' lanes per vector: 16, or 8 without AVX-512 and in the half-width build.
int polyspec_row_lanes(void) { return RL; }

// 1 where int4 weights take 16-row blocks against int8 inputs (AVX512-VNNI, polyspec_pack_i4v), else 0.
int polyspec_i4_vnni(void) {
#ifdef POLYSPEC_I4VNNI
    return 1;
#else
    return 0;
#endif
}

// fp32 weights, input, biases (NULL: none) and output.
void polyspec_linear3_f32(const float* x, const float* w0, const float* w1, const float* w2, const float* b0,
                          const float* b1, const float* b2, int64_t n0, int64_t n1, int64_t n2, int64_t M, int64_t K,
                          float* y, int threads) {
    const WF32 ws[3] = {{w0}, {w1}, {w2}};
    const float* bs[3] = {b0, b1, b2};
    const int64_t ns[3] = {n0, n1, n2};
    run3(x, ws, bs, ns, M, K, y, threads);
}

// bf16 weights (their uint16 bits); fp32 input, biases and output: the caller widens the tiny [M, K] input.
// flags bit 0 (dot): the input is bf16 (a bf16 model), so the vdpbf16ps rows take it where built (rounding it to
// bf16 is exact); clear: an fp32 input against widened weights (a 16-bit lm_head in an fp32 model). Bit 1: y rounded
// to bf16 values (run3's round_out; a bf16 model's logits, kept as fp32). blk0..blk2: each weight's 16-row blocks
// (polyspec_pack_nk16) or NULL.
void polyspec_linear3_bf16w(const float* x, const uint16_t* w0, const uint16_t* w1, const uint16_t* w2,
                            const float* b0, const float* b1, const float* b2, int64_t n0, int64_t n1, int64_t n2,
                            int64_t M, int64_t K, float* y, int threads, int flags, const uint32_t* blk0,
                            const uint32_t* blk1, const uint32_t* blk2) {
    const bool dot = (flags & 1) != 0;
    const WBF16 ws[3] = {{w0, dot, blk0}, {w1, dot, blk1}, {w2, dot, blk2}};
    const float* bs[3] = {b0, b1, b2};
    const int64_t ns[3] = {n0, n1, n2};
    run3(x, ws, bs, ns, M, K, y, threads, (flags & 2) != 0);
}

// y [n] fp32, each value rounded in place to the nearest bf16 (round_bf16_span, what polyspec_linear3_bf16w's flags
// bit 1 does inside the call): the tests check it against torch's on ties, infinities and NaNs.
void polyspec_round_bf16(float* y, int64_t n) { round_bf16_span(y, n); }

// w [N, K] bf16 -> its 16-row blocks, out [ceil(N / 16)][ceil(K / 2)][16] 32-bit words (the layout rows_nk16 reads).
void polyspec_pack_nk16(const uint16_t* w, int64_t N, int64_t K, uint32_t* out) {
    const int64_t P = (K + 1) / 2;
    for (int64_t b = 0; b < (N + 15) / 16; b++)
        for (int64_t i = 0; i < 16; i++) {
            const int64_t n = b * 16 + i;
            for (int64_t p = 0; p < P; p++) {
                const uint32_t even = n < N ? w[n * K + 2 * p] : 0;
                const uint32_t odd = n < N && 2 * p + 1 < K ? w[n * K + 2 * p + 1] : 0;
                out[(b * P + p) * 16 + i] = even << 16 | odd;  // vdpbf16ps takes the high half first
            }
        }
}

// Int4Linear buffers q [N, K / 2], s and z [N, ceil(K / gs)] -> the blocks rows_qv<4> reads, out: ceil(N / 16)
// qv_block_words(K, gs, 4) 32-bit words. Needs K and gs multiples of 8.
void polyspec_pack_i4v(const uint8_t* q, const float* s, const uint8_t* z, int64_t N, int64_t K, int64_t gs,
                       uint32_t* out) {
    qv_pack<4>(s, z, N, K, gs, out, [&](int64_t n, int64_t w) {
        uint32_t word = 0;
        for (int j = 0; j < 4; j++) {
            const int64_t k = 8 * w + j;  // codes k and k + 4: q's nibbles (even k low, odd k high)
            const uint32_t lo = (q[n * (K / 2) + k / 2] >> (4 * (k % 2))) & 15;
            const uint32_t hi = (q[n * (K / 2) + (k + 4) / 2] >> (4 * ((k + 4) % 2))) & 15;
            word |= (lo | hi << 4) << (8 * j);
        }
        return word;
    });
}

// 8-bit codes q [N, K] (w = (q - z) s per group of gs), s and z [N, ceil(K / gs)] -> the blocks rows_qv<8> reads,
// out: ceil(N / 16) qv_block_words(K, gs, 8) 32-bit words (lane i of word w: row 16b + i's codes 4w .. 4w + 3).
// Needs K and gs multiples of 4.
void polyspec_pack_q8v(const uint8_t* q, const float* s, const uint8_t* z, int64_t N, int64_t K, int64_t gs,
                       uint32_t* out) {
    qv_pack<8>(s, z, N, K, gs, out, [&](int64_t n, int64_t w) {
        uint32_t word;
        memcpy(&word, q + n * K + 4 * w, 4);
        return word;
    });
}

// x [M, K] fp32 against 8-bit codes in blocks (polyspec_pack_q8v) -> y [M, N] fp32 (+ bias), int8 inputs
// (rows_qv<8>). Returns 1 without AVX512-VNNI, or when K or gs is not a multiple of 4.
int polyspec_linear_q8v(const float* x, const uint32_t* blk, const float* bias, int64_t N, int64_t M, int64_t K,
                        int64_t gs, float* y, int threads) {
#ifdef POLYSPEC_I4VNNI
    if (gs <= 0 || gs % 4 != 0 || K % 4 != 0) return 1;
    run1(x, WQ8{blk, gs}, bias, N, M, K, y, threads);
    return 0;
#else
    (void)x, (void)blk, (void)bias, (void)N, (void)M, (void)K, (void)gs, (void)y, (void)threads;
    return 1;
#endif
}

// One int4 weight (Int4Linear buffers; blk: its polyspec_pack_i4v blocks or NULL); fp32 input, bias and output.
// Returns 1 when K or gs is not a multiple of 32.
int polyspec_linear_i4(const float* x, const uint8_t* q, const float* s, const uint8_t* z, const float* bias,
                       int64_t N, int64_t M, int64_t K, int64_t gs, float* y, int threads, const uint32_t* blk) {
    if (gs <= 0 || gs % 32 != 0 || K % 32 != 0) return 1;
    run1(x, WI4{q, s, z, gs, blk}, bias, N, M, K, y, threads);
    return 0;
}

// A decoder layer with fp32 weights: ptrs = 7 weights, 7 biases (NULL = none), 2 norm weights.
int polyspec_layer_f32(float* x, const void* const* ptrs, float eps, int64_t T, int64_t H, int64_t nh, int64_t nkv,
                       int64_t D, int64_t I, const float* cos_, const float* sin_, float* kcache, float* vcache,
                       int64_t S, int64_t start, const uint8_t* mask, int threads) {
    return layer(x, dense_weights<WF32, float>(ptrs), eps, T, H, nh, nkv, D, I, cos_, sin_, kcache, vcache, S, start,
                 mask, threads);
}

// A decoder layer with bf16 weights and a bf16 KV cache (a bf16 model): fp32 residual stream x (the caller widens and
// rounds it), fp32 biases and norm weights; ptrs as for polyspec_layer_f32.
int polyspec_layer_bf16(float* x, const void* const* ptrs, float eps, int64_t T, int64_t H, int64_t nh, int64_t nkv,
                        int64_t D, int64_t I, const float* cos_, const float* sin_, uint16_t* kcache,
                        uint16_t* vcache, int64_t S, int64_t start, const uint8_t* mask, int threads) {
    return layer(x, bf16_layer_weights(ptrs), eps, T, H, nh, nkv, D, I, cos_, sin_, kcache, vcache, S, start, mask,
                 threads);
}

// A decoder layer with int4 projections of group size gs: ptrs = (codes, scales, zeros) x 7, 7 biases, 2 norms, 7
// weights' polyspec_pack_i4v blocks (NULL: none).
int polyspec_layer_i4(float* x, const void* const* ptrs, int64_t gs, float eps, int64_t T, int64_t H, int64_t nh,
                      int64_t nkv, int64_t D, int64_t I, const float* cos_, const float* sin_, float* kcache,
                      float* vcache, int64_t S, int64_t start, const uint8_t* mask, int threads) {
    if (gs <= 0 || gs % 32 != 0 || H % 32 != 0 || (nh * D) % 32 != 0 || I % 32 != 0) return 2;
    LayerWeights<WI4> w;
    for (int i = 0; i < 7; i++)
        w.w[i] = {(const uint8_t*)ptrs[3 * i], (const float*)ptrs[3 * i + 1], (const uint8_t*)ptrs[3 * i + 2], gs,
                  (const uint32_t*)ptrs[30 + i]};
    for (int i = 0; i < 7; i++) w.b[i] = (const float*)ptrs[21 + i];
    w.in_norm = (const float*)ptrs[28];
    w.post_norm = (const float*)ptrs[29];
    return layer(x, w, eps, T, H, nh, nkv, D, I, cos_, sin_, kcache, vcache, S, start, mask, threads);
}

// A block's attention mask [T, start + T] (model.block_mask): all of the cache, then causal within the block (empty
// for one row: every key visible, layer() takes no mask then); or, for a draft tree, tree [T, W] over the last W
// positions with every earlier one visible.
static std::vector<uint8_t> block_mask(int64_t T, int64_t start, const uint8_t* tree, int64_t W) {
    std::vector<uint8_t> mask;
    if (tree) {
        const int64_t n = start + T;
        mask.assign(T * n, 1);
        for (int64_t t = 0; t < T; t++) memcpy(&mask[t * n + n - W], tree + t * W, W);
    } else if (T > 1) {
        mask.assign(T * (start + T), 1);
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = start + t + 1; j < start + T; j++) mask[t * (start + T) + j] = 0;
    }
    return mask;
}

// A block's RoPE rows from the table rope [2, S, D] (cos, sin): positions start .. start + T - 1 read in place, or a
// tree's positions[T] gathered into cs [2, T, D]. Returns 0, or 4 (a position outside the table).
static int block_rope(const float* rope, int64_t S, int64_t D, int64_t start, int64_t T, const int64_t* positions,
                      std::vector<float>& cs, const float*& cos_, const float*& sin_) {
    cos_ = rope + start * D;
    sin_ = rope + (S + start) * D;
    if (!positions) return 0;
    cs.resize(2 * T * D);
    for (int64_t t = 0; t < T; t++) {
        if (positions[t] < 0 || positions[t] >= S) return 4;
        memcpy(&cs[t * D], rope + positions[t] * D, D * sizeof(float));
        memcpy(&cs[(T + t) * D], rope + (S + positions[t]) * D, D * sizeof(float));
    }
    cos_ = cs.data();
    sin_ = cs.data() + T * D;
    return 0;
}

// The layers of a block in one call (decode/model.py: a decode step, a verification, a prompt's chunk, a draft tree):
// layer l runs as polyspec_layer_<kind> would with plans[l] and its caches kc[l], vc[l], in turn on x [T, H] fp32
// (kind 0: bf16, 1: f32, 2: int4 of group size gs). RoPE from the table rope [2, S, D] (cos, sin) at positions
// start .. start + T - 1, or positions[T]; each row sees the cache and the block's rows up to its own, or, under a
// tree's mask tree [T, W], the last W positions it marks and every earlier one. One call where a loop over the layers
// in Python paid ~20 us a layer for its own data, which each layer's weight stream leaves cold. Returns 0, 2 (start,
// W), 4 (a position outside the table), or 16 * l + the refusal code of layer l.
int polyspec_layers(int kind, int64_t gs, float* x, const void* const* const* plans, int64_t L, float eps, int64_t T,
                    int64_t H, int64_t nh, int64_t nkv, int64_t D, int64_t I, const float* rope, void* const* kc,
                    void* const* vc, int64_t S, int64_t start, const int64_t* positions, const uint8_t* tree,
                    int64_t W, int threads) {
    if (kind < 0 || kind > 2 || start < 0 || start + T > S || (tree && (W < T || W > start + T))) return 2;
    for (int64_t t = 0; tree && t < T; t++)
        if (!tree[t * W + W - T + t]) return 2;  // every row sees itself
    const std::vector<uint8_t> mask = block_mask(T, start, tree, W);
    std::vector<float> cs;
    const float *cos_, *sin_;
    if (block_rope(rope, S, D, start, T, positions, cs, cos_, sin_) != 0) return 4;
    const uint8_t* m = mask.empty() ? nullptr : mask.data();
    for (int64_t l = 0; l < L; l++) {
        int rc = 0;
        if (kind == 0)
            rc = polyspec_layer_bf16(x, plans[l], eps, T, H, nh, nkv, D, I, cos_, sin_, (uint16_t*)kc[l],
                                     (uint16_t*)vc[l], S, start, m, threads);
        else if (kind == 1)
            rc = polyspec_layer_f32(x, plans[l], eps, T, H, nh, nkv, D, I, cos_, sin_, (float*)kc[l], (float*)vc[l],
                                    S, start, m, threads);
        else
            rc = polyspec_layer_i4(x, plans[l], gs, eps, T, H, nh, nkv, D, I, cos_, sin_, (float*)kc[l],
                                   (float*)vc[l], S, start, m, threads);
        if (rc != 0) return (int)(16 * l + rc);
    }
    return 0;
}

// A bf16 model's final RMSNorm on the CPU (decode/model.py, Transformer._out whenever the kernels are on, so every
// forward of the model, in one call or not, normalises alike): per row of x [T, H] (a bf16-rounded residual, as fp32)
// r = 1 / sqrt(mean(x^2) + eps), the sum of squares in double as in the layers' norms, and y = bf16(w * bf16(x * r)):
// the module's two roundings (x32.to(bf16), then the bf16 product with the weight w, given as fp32).
static void final_norm_bf16(const float* x, const float* w, float eps, int64_t T, int64_t H, uint16_t* y) {
    for (int64_t t = 0; t < T; t++) {
        const float* xr = x + t * H;
        const float r = 1.0f / sqrtf((float)(sum_squares(xr, H) / (double)H) + eps);
        for (int64_t h = 0; h < H; h++) y[t * H + h] = f32_to_bf16(w[h] * bf16_to_f32(f32_to_bf16(xr[h] * r)));
    }
}

void polyspec_final_norm_bf16(const uint16_t* x, const float* w, float eps, int64_t T, int64_t H, uint16_t* y) {
    std::vector<float> xf(T * H);
    for (int64_t i = 0; i < T * H; i++) xf[i] = bf16_to_f32(x[i]);
    final_norm_bf16(xf.data(), w, eps, T, H, y);
}

// A bf16 model's forward over a block in one call (decode/model.py, Transformer.forward: a decode step, a
// verification, a draft tree's under positions and tree as polyspec_layers takes them): the embedding rows of ids
// widened, the layers as polyspec_layers (kind 0), the residual rounded to bf16, the final norm (final_norm_bf16) into
// hidden [T, H], and the lm_head's logits of rows from .. T - 1, rounded to bf16, into logits [T - from, V] (fp32), as
// kernel_linear computes them. Each step of the module path is one kernel call or torch op over the same values, so
// the results are bitwise its (tests/test_layer_parity.py); one call saves their Python, which a target forward's
// weight stream leaves cold. Returns 0, polyspec_layers' code, 3 (from), or 5 (a token id outside the embedding's
// n_embed rows).
int polyspec_forward_bf16(const int64_t* ids, const uint16_t* embed, int64_t n_embed, int64_t T, int64_t H,
                          const void* const* const* plans, int64_t L, float eps, int64_t nh, int64_t nkv, int64_t D,
                          int64_t I, const float* rope, void* const* kc, void* const* vc, int64_t S, int64_t start,
                          const int64_t* positions, const uint8_t* tree, int64_t W, const float* norm_w,
                          float norm_eps, const uint16_t* lm_w, const uint32_t* lm_blk, int64_t V, int64_t from,
                          uint16_t* hidden, float* logits, int threads) {
    if (from < 0 || from >= T) return 3;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= n_embed) return 5;
    std::vector<float> x(T * H);
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < H; i++) x[t * H + i] = bf16_to_f32(embed[ids[t] * H + i]);
    const int rc = polyspec_layers(0, 0, x.data(), plans, L, eps, T, H, nh, nkv, D, I, rope, kc, vc, S, start, positions,
                                   tree, W, threads);
    if (rc != 0) return rc;
    round_to_bf16(x.data(), T * H);
    final_norm_bf16(x.data(), norm_w, norm_eps, T, H, hidden);
    for (int64_t i = from * H; i < T * H; i++) x[i] = bf16_to_f32(hidden[i]);
    const WBF16 ws[3] = {{lm_w, true, lm_blk}, {lm_w, true, lm_blk}, {lm_w, true, lm_blk}};
    const float* bs[3] = {nullptr, nullptr, nullptr};
    const int64_t ns[3] = {V, 0, 0};
    run3(x.data() + from * H, ws, bs, ns, T - from, H, logits, threads, true);
    return 0;
}

// Attention alone for a block of T query rows (a prompt run through torch's matmuls): q [T, nh * D] fp32 (RoPE
// applied), the K/V cache (bf16 or fp32; kv heads S rows apart) holding positions 0 .. L - 1, mask [T, L] (NULL: all
// visible) -> out [T, nh * D] fp32, the layer kernel's own attention (a row's result is the same as in a step).
int polyspec_attention_bf16(const float* q, const uint16_t* k, const uint16_t* v, int64_t S, int64_t L, int64_t T,
                            int64_t nh, int64_t nkv, int64_t D, const uint8_t* mask, int threads, float* out) {
    return attention_checked(q, k, v, S, L, T, nh, nkv, D, mask, threads, out);
}

int polyspec_attention_f32(const float* q, const float* k, const float* v, int64_t S, int64_t L, int64_t T,
                           int64_t nh, int64_t nkv, int64_t D, const uint8_t* mask, int threads, float* out) {
    return attention_checked(q, k, v, S, L, T, nh, nkv, D, mask, threads, out);
}

// The draft head's step (decode/head.py, EagleHead with bf16 weights; one call where the module path makes ~25 torch
// ops and four kernel calls): rows t < T of x = fc(concat(embed[ids[t]], feat[t])) rounded to bf16, one bf16 decoder
// layer (causal within the block, or under tree_mask [T, start + T]: a draft tree's), hidden = its output rounded to
// bf16 (the head's predicted features), then the lm rows' logits of the last out_rows rows, rounded to bf16. RoPE
// from the table rope [2, S, D] (cos, sin) at positions start.. or, for a tree, positions[T]. With vocab_ids [V] (a
// draft vocabulary: the lm rows are those tokens') logits is [out_rows, full_V], every other token -inf; without,
// [out_rows, V]. The module path's roundings, in the same kernels (run1, layer), so the results are bitwise the
// module's (tests/test_cpu_kernels.py). Returns 0, or the layer's refusal code (1: shapes; 3: out_rows; 4: a
// position outside the table; 5: a token id outside the embedding's n_embed rows).
int polyspec_head_step_bf16(const int64_t* ids, const uint16_t* embed, int64_t n_embed, const uint16_t* feat,
                            int64_t T, int64_t H,
                            const uint16_t* fc_w, const float* fc_b, const void* const* layer_ptrs, float eps,
                            int64_t nh, int64_t nkv, int64_t D, int64_t I, const float* rope,
                            const int64_t* positions, uint16_t* kcache, uint16_t* vcache, int64_t S, int64_t start,
                            const uint8_t* tree_mask, const uint16_t* lm_w, int64_t V, const int64_t* vocab_ids,
                            int64_t full_V, int64_t out_rows, uint16_t* hidden, float* logits, int threads,
                            const uint32_t* fc_blk, const uint32_t* lm_blk) {
    if (out_rows < 0 || out_rows > T) return 3;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= n_embed) return 5;
    std::vector<float> cs;
    const float *cos_, *sin_;
    if (block_rope(rope, S, D, start, T, positions, cs, cos_, sin_) != 0) return 4;
    std::vector<float> x2(T * 2 * H), x(T * H);
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < H; i++) {
            x2[t * 2 * H + i] = bf16_to_f32(embed[ids[t] * H + i]);
            x2[t * 2 * H + H + i] = bf16_to_f32(feat[t * H + i]);
        }
    run1(x2.data(), WBF16{fc_w, true, fc_blk}, fc_b, H, T, 2 * H, x.data(), threads);
    round_to_bf16(x.data(), T * H);
    const std::vector<uint8_t> mask = tree_mask ? std::vector<uint8_t>() : block_mask(T, start, nullptr, 0);
    const int rc = layer(x.data(), bf16_layer_weights(layer_ptrs), eps, T, H, nh, nkv, D, I, cos_, sin_, kcache,
                         vcache, S, start, tree_mask ? tree_mask : T > 1 ? mask.data() : nullptr, threads);
    if (rc != 0) return rc;
    for (int64_t i = 0; i < T * H; i++) {
        hidden[i] = f32_to_bf16(x[i]);
        x[i] = bf16_to_f32(hidden[i]);
    }
    if (out_rows > 0) {
        std::vector<float> sub(vocab_ids ? out_rows * V : 0);
        float* y = vocab_ids ? sub.data() : logits;
        run1(x.data() + (T - out_rows) * H, WBF16{lm_w, true, lm_blk}, nullptr, V, out_rows, H, y, threads);
        round_to_bf16(y, out_rows * V);
        if (vocab_ids) {  // the draft vocabulary's logits among all tokens' (every other one -inf)
            std::fill(logits, logits + out_rows * full_V, -std::numeric_limits<float>::infinity());
            for (int64_t r = 0; r < out_rows; r++)
                for (int64_t j = 0; j < V; j++) logits[r * full_V + vocab_ids[j]] = y[r * V + j];
        }
    }
    return 0;
}
}
