// The bf16 weight rows of a verification, streamed from memory against G input rows, in two layouts (stop 25,
// docs/BENCHMARKS.md "CPU, stop 25"). Standalone: nothing in polyspec calls it.
//
//   g++ -O3 -march=native -fopenmp -std=c++17 scripts/measure/panel_rows.cpp -o /tmp/panel_rows && /tmp/panel_rows 40
//
// rows:   decode/cpu_kernels.cpp's rows_bf16 scheme: one weight row at a time (576 bf16), two accumulators per input
//         row, every input chunk loaded again for every weight row: 2 + 2G loads per 2G vdpbf16ps.
// panelR: R rows interleaved per 32-word chunk (row r of panel p, chunk c at ((p C + c) R + r) 32), one sequential
//         stream, R x G accumulators: R + G loads per R G vdpbf16ps.
// blockR: (stop 26, what decode/cpu_kernels.cpp's rows_bf16 now does from 4 inputs) R consecutive rows of today's
//         row-major layout per 32-word chunk, R + G loads per R G products, the block prefetched as one sweep.
// ~267 MB of weights (about the bf16 SmolLM2 target's per step), split between two OpenMP threads as the kernels do;
// the variants rotate per repetition, medians printed. Needs AVX512-BF16.
//
// With a second argument "int8" (stop 27): block4 bf16 rows against the same rows as int8 codes (half the bytes),
// widened to bf16 in registers two ways: w8a16 converts through fp32 (seven instructions per 32 codes), w7 takes
// 7-bit codes as the bf16 number v + 192 (three integer instructions: decode/cpu_kernels.cpp's dp_chunk<int8_t>).
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <chrono>
#include <algorithm>
#include <functional>
#include <string>
#include <sys/mman.h>
static constexpr int64_t PF = 9216;
static inline void pf(const void* p) { const char* c = (const char*)p + PF; __builtin_prefetch(c, 0, 0); __builtin_prefetch(c + 64, 0, 0); }
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
template <typename V> static inline void keep(V& a, V& b) { asm("" : "+v"(a), "+v"(b)); }

template <int G>
static void rows_a(const uint16_t* x, const uint16_t* w, int64_t K, int64_t n0, int64_t n1, float* y) {
  for (int64_t n = n0; n < n1; n++) {
    const uint16_t* row = w + n * K;
    __m512 a0[G], a1[G];
    for (int g = 0; g < G; g++) a0[g] = a1[g] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 64) {
      pf(row + k);
      __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k), w1 = (__m512bh)_mm512_loadu_si512(row + k + 32);
      keep(w0, w1);
      for (int g = 0; g < G; g++) {
        a0[g] = _mm512_dpbf16_ps(a0[g], w0, (__m512bh)_mm512_loadu_si512(x + g * K + k));
        a1[g] = _mm512_dpbf16_ps(a1[g], w1, (__m512bh)_mm512_loadu_si512(x + g * K + k + 32));
      }
    }
    for (int g = 0; g < G; g++) y[(g * 8 + n) & 4095] = hsum(_mm512_add_ps(a0[g], a1[g]));  // kept so the sums are not optimised away
  }
}

// panel layout: for panel p (rows p*R..p*R+R-1), chunk c (32 words), row r: w + ((p*C + c)*R + r)*32
template <int R, int G>
static void rows_b(const uint16_t* x, const uint16_t* w, int64_t K, int64_t p0, int64_t p1, float* y) {
  const int64_t C = K / 32;
  for (int64_t p = p0; p < p1; p++) {
    const uint16_t* pan = w + p * C * R * 32;
    __m512 acc[R][G];
    for (int r = 0; r < R; r++) for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; c++) {
      const uint16_t* blk = pan + c * R * 32;
      for (int b = 0; b < R * 64; b += 128) pf(blk + b / 2);  // every line of the block, PF bytes ahead
      __m512bh xs[G];
      for (int g = 0; g < G; g++) xs[g] = (__m512bh)_mm512_loadu_si512(x + g * K + c * 32);
      for (int r = 0; r < R; r++) {
        __m512bh wr = (__m512bh)_mm512_loadu_si512(blk + r * 32);
        for (int g = 0; g < G; g++) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], wr, xs[g]);
      }
    }
    for (int r = 0; r < R; r++) for (int g = 0; g < G; g++) y[(g * 8 + p * R + r) & 4095] = hsum(acc[r][g]);
  }
}

// 32 weights of a chunk as bf16: bf16 rows as they are; int8 codes widened two ways (the second argument "int8")
struct BF16 {
  static __m512bh chunk(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
};
struct W8A16 {
  static __m512bh chunk(const int8_t* p) {
    __m512i v16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v16)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v16, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
};
struct W7 {
  static __m512bh chunk(const int8_t* p) {
    __m256i c = _mm256_add_epi8(_mm256_loadu_si256((const __m256i*)p), _mm256_set1_epi8(64));
    return (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(c), _mm512_set1_epi16(0x4300));
  }
};

// row-major layout, R consecutive rows together per 32-weight chunk; the block [R K weights] prefetched as one sweep
// (R 32-weight chunks per step, 128 bytes a prefetch); the sums are not scaled or corrected: only the time counts
template <int R, int G, typename Conv, typename E>
static void rows_c(const uint16_t* x, const E* w, int64_t K, int64_t p0, int64_t p1, float* y) {
  const int64_t C = K / 32, step = R * 32 * sizeof(E);
  for (int64_t p = p0; p < p1; p++) {
    const E* blk = w + p * R * K;
    __m512 acc[R][G];
    for (int r = 0; r < R; r++) for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; c++) {
      for (int64_t b = c * step; b < (c + 1) * step; b += 128)
        if (b % 128 == 0) pf((const char*)blk + b);
      __m512bh xs[G];
      for (int g = 0; g < G; g++) xs[g] = (__m512bh)_mm512_loadu_si512(x + g * K + c * 32);
      for (int r = 0; r < R; r++) {
        __m512bh wr = Conv::chunk(blk + r * K + c * 32);
        for (int g = 0; g < G; g++) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], wr, xs[g]);
      }
    }
    for (int r = 0; r < R; r++) for (int g = 0; g < G; g++) y[(g * 8 + p * R + r) & 4095] = hsum(acc[r][g]);
  }
}

int main(int argc, char** argv) {
  const int64_t K = 576, N = 232 * 1024;  // ~267 MB of bf16
  const size_t bytes = (size_t)N * K * 2;
  uint16_t* w = (uint16_t*)mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(w, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < (size_t)N * K; i++) w[i] = 0x3f80 + (i % 7);
  std::vector<uint16_t> x(8 * K, 0x3f00);
  std::vector<float> y(4096 * 8);
  const int reps = argc > 1 ? atoi(argv[1]) : 15;
  auto run = [&](const char* name, int G, auto fn) {
    std::vector<double> t;
    for (int r = 0; r < reps; r++) {
      auto s = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(2)
      { fn(omp_get_thread_num()); }
      t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s).count());
    }
    std::sort(t.begin(), t.end());
    printf("%s G=%d  median %.3f ms  min %.3f  (%.1f GB/s)\n", name, G, t[reps / 2], t[0], bytes / t[reps / 2] / 1e6);
  };
  const int64_t half = N / 2;
  struct V { const char* name; int G; std::function<void(int)> fn; std::vector<double> t; size_t bytes = 0; };
  std::vector<V> vs;
#define A(GG) vs.push_back({"rows  ", GG, [&](int th) { rows_a<GG>(x.data(), w, K, th * half, (th + 1) * half, y.data()); }, {}})
#define B(RR, GG) vs.push_back({"panel" #RR, GG, [&](int th) { int64_t P = N / RR; rows_b<RR, GG>(x.data(), w, K, th * P / 2, (th + 1) * P / 2, y.data()); }, {}})
#define C(RR, GG) vs.push_back({"block" #RR, GG, [&](int th) { int64_t P = N / RR; rows_c<RR, GG, BF16>(x.data(), w, K, th * P / 2, (th + 1) * P / 2, y.data()); }, {}})
#define I8(NAME, CONV, GG) vs.push_back({NAME, GG, [&](int th) { int64_t P = N / 4; rows_c<4, GG, CONV>(x.data(), q, K, th * P / 2, (th + 1) * P / 2, y.data()); }, {}, bytes / 2})
  int8_t* q = nullptr;
  if (argc > 2 && std::string(argv[2]) == "int8") {
    q = (int8_t*)mmap(nullptr, bytes / 2, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    madvise(q, bytes / 2, MADV_HUGEPAGE);
    for (size_t i = 0; i < (size_t)N * K; i++) q[i] = (int8_t)((i % 13) - 6);
    C(4, 1); I8("w8a16 ", W8A16, 1); I8("w7    ", W7, 1); C(4, 2); I8("w8a16 ", W8A16, 2); I8("w7    ", W7, 2);
    C(4, 3); I8("w8a16 ", W8A16, 3); I8("w7    ", W7, 3); C(4, 5); I8("w8a16 ", W8A16, 5); I8("w7    ", W7, 5);
  } else {
    A(1); B(4, 1); B(8, 1); C(4, 1); A(2); B(4, 2); B(8, 2); C(4, 2); A(3); B(4, 3); C(4, 3); A(5); B(4, 5); C(4, 5);
  }
  for (int r = 0; r < reps; r++)
    for (size_t q = 0; q < vs.size(); q++) {
      V& v = vs[(q + r) % vs.size()];
      auto s = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(2)
      { v.fn(omp_get_thread_num()); }
      v.t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s).count());
    }
  for (auto& v : vs) {
    std::sort(v.t.begin(), v.t.end());
    const size_t b = v.bytes ? v.bytes : bytes;
    printf("%s G=%d  median %.3f ms  p25 %.3f  (%.1f GB/s)\n", v.name, v.G, v.t[reps / 2], v.t[reps / 4], b / v.t[reps / 2] / 1e6);
  }
}
