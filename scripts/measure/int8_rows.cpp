// bf16 weight rows (blocks of 4, as decode/cpu_kernels.cpp's rows) against int8 rows of the same shape, streamed
// from memory on two threads (stop 27, docs/BENCHMARKS.md "CPU, stop 27"). Standalone: nothing in polyspec calls it.
//
//   g++ -O3 -march=native -fopenmp -std=c++17 scripts/measure/int8_rows.cpp -o /tmp/int8_rows && /tmp/int8_rows 30
//
// bf16:  ~267 MB of bf16 rows (about the bf16 SmolLM2 target's per step), vdpbf16ps.
// w8a8:  the same rows as int8 codes (half the bytes) against u8 activations on vpdpbusd (activations quantised).
// w8a16: the int8 codes widened to bf16 in registers (decode/cpu_kernels.cpp's dp_chunk<int8_t>), then vdpbf16ps:
//        what decode/int8.py's Int8Linear runs. Variants rotate per repetition; medians and 25th percentiles.
// Needs AVX512-BF16 and AVX512-VNNI.
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <chrono>
#include <algorithm>
#include <functional>
#include <sys/mman.h>
static constexpr int64_t PF = 9216;
static inline void pf(const void* p) { const char* c = (const char*)p + PF; __builtin_prefetch(c, 0, 0); __builtin_prefetch(c + 64, 0, 0); }

template <int R, int G>
static void bf16_block(const uint16_t* x, const uint16_t* w, int64_t K, int64_t p0, int64_t p1, float* y) {
  const int64_t C = K / 32;
  for (int64_t p = p0; p < p1; p++) {
    const uint16_t* blk = w + p * R * K;
    __m512 acc[R][G];
    for (int r = 0; r < R; r++) for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; c++) {
      for (int r = 0; r < R; r += 2) pf(blk + c * R * 32 + r * 32);
      __m512bh xs[G];
      for (int g = 0; g < G; g++) xs[g] = (__m512bh)_mm512_loadu_si512(x + g * K + c * 32);
      for (int r = 0; r < R; r++) {
        __m512bh wr = (__m512bh)_mm512_loadu_si512(blk + r * K + c * 32);
        for (int g = 0; g < G; g++) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], wr, xs[g]);
      }
    }
    for (int r = 0; r < R; r++) for (int g = 0; g < G; g++) y[(g * 8 + p * R + r) & 4095] = _mm512_reduce_add_ps(acc[r][g]);
  }
}

// W8A8: K bytes per row, 64 per chunk; R rows per block; acc int32; per-channel scale applied at the end
template <int R, int G>
static void i8_block(const uint8_t* x, const int8_t* w, const float* sc, int64_t K, int64_t p0, int64_t p1, float* y) {
  const int64_t C = K / 64;
  for (int64_t p = p0; p < p1; p++) {
    const int8_t* blk = w + p * R * K;
    __m512i acc[R][G];
    for (int r = 0; r < R; r++) for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_si512();
    for (int64_t c = 0; c < C; c++) {
      if (c % 2 == 0) for (int r = 0; r < R; r += 2) pf(blk + c * R * 64 + r * 64);
      __m512i xs[G];
      for (int g = 0; g < G; g++) xs[g] = _mm512_loadu_si512(x + g * K + c * 64);
      for (int r = 0; r < R; r++) {
        __m512i wr = _mm512_loadu_si512(blk + r * K + c * 64);
        for (int g = 0; g < G; g++) acc[r][g] = _mm512_dpbusd_epi32(acc[r][g], xs[g], wr);
      }
    }
    for (int r = 0; r < R; r++) for (int g = 0; g < G; g++)
      y[(g * 8 + p * R + r) & 4095] = (float)_mm512_reduce_add_epi32(acc[r][g]) * sc[(p * R + r) & 1023];
  }
}

// W8A16: 32 int8 -> 32 bf16 (exact small integers) per chunk, then vdpbf16ps
static inline __m512bh i8_to_bf16(const int8_t* p) {
  __m512i v16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v16)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v16, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}
template <int R, int G>
static void i8a16_block(const uint16_t* x, const int8_t* w, const float* sc, int64_t K, int64_t p0, int64_t p1, float* y) {
  const int64_t C = K / 32;
  for (int64_t p = p0; p < p1; p++) {
    const int8_t* blk = w + p * R * K;
    __m512 acc[R][G];
    for (int r = 0; r < R; r++) for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; c++) {
      if (c % 2 == 0) for (int r = 0; r < R; r += 2) pf(blk + c * R * 32 + r * 32);
      __m512bh xs[G];
      for (int g = 0; g < G; g++) xs[g] = (__m512bh)_mm512_loadu_si512(x + g * K + c * 32);
      for (int r = 0; r < R; r++) {
        __m512bh wr = i8_to_bf16(blk + r * K + c * 32);
        for (int g = 0; g < G; g++) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], wr, xs[g]);
      }
    }
    for (int r = 0; r < R; r++) for (int g = 0; g < G; g++)
      y[(g * 8 + p * R + r) & 4095] = _mm512_reduce_add_ps(acc[r][g]) * sc[(p * R + r) & 1023];
  }
}

int main(int argc, char** argv) {
  const int64_t K = 576, N = 232 * 1024;
  const size_t b16 = (size_t)N * K * 2, b8 = (size_t)N * K;
  uint16_t* w = (uint16_t*)mmap(nullptr, b16, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  int8_t* q = (int8_t*)mmap(nullptr, b8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(w, b16, MADV_HUGEPAGE); madvise(q, b8, MADV_HUGEPAGE);
  for (size_t i = 0; i < (size_t)N * K; i++) { w[i] = 0x3f80 + (i % 7); q[i] = (int8_t)((i % 13) - 6); }
  std::vector<uint16_t> x(8 * K, 0x3f00);
  std::vector<uint8_t> xu(8 * K, 130);
  std::vector<float> y(4096 * 8), sc(1024, 0.01f);
  const int reps = argc > 1 ? atoi(argv[1]) : 15;
  struct V { const char* name; int G; size_t bytes; std::function<void(int)> fn; std::vector<double> t; };
  std::vector<V> vs;
  const int64_t P = N / 4;
#define BF(GG) vs.push_back({"bf16 block4 ", GG, b16, [&](int th) { bf16_block<4, GG>(x.data(), w, K, th * P / 2, (th + 1) * P / 2, y.data()); }, {}})
#define I8(GG) vs.push_back({"w8a8 block4 ", GG, b8, [&](int th) { i8_block<4, GG>(xu.data(), q, sc.data(), K, th * P / 2, (th + 1) * P / 2, y.data()); }, {}})
#define I16(GG) vs.push_back({"w8a16 block4", GG, b8, [&](int th) { i8a16_block<4, GG>(x.data(), q, sc.data(), K, th * P / 2, (th + 1) * P / 2, y.data()); }, {}})
  BF(1); I8(1); I16(1); BF(2); I8(2); I16(2); BF(3); I8(3); I16(3); BF(5); I8(5); I16(5);
  for (int r = 0; r < reps; r++)
    for (size_t k = 0; k < vs.size(); k++) {
      V& v = vs[(k + r) % vs.size()];
      auto s = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(2)
      { v.fn(omp_get_thread_num()); }
      v.t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s).count());
    }
  for (auto& v : vs) {
    std::sort(v.t.begin(), v.t.end());
    printf("%s G=%d  median %.3f ms  p25 %.3f  (%.1f GB/s)\n", v.name, v.G, v.t[reps / 2], v.t[reps / 4], v.bytes / v.t[reps / 2] / 1e6);
  }
}
