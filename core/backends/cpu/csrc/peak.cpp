// The CPU's multiply-add peak as this build reaches it, for the kernel microbenchmark (benchmarks/kernels.py):
// every thread runs independent chains of 512-bit fused multiply-adds (float32) or VDPBF16PS pair products
// (bf16, where built in) on registers only, for about `seconds`; returns GFLOP/s over all threads (a pair product
// is 32 multiply-adds a vector, a float FMA 16). What the linears reach is read against it.
#include <ATen/Parallel.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "vec16.h"

namespace conveyor_peak {  // named: these files share a translation unit (kernels.py, _UNITS)
namespace {  // (internal linkage, as before the files shared a unit)

constexpr int CHAINS = 12;  // independent accumulators: more than the FMA latency x throughput of current cores
constexpr int64_t INNER = 1 << 14;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Multiply-adds per vector instruction, and one run of INNER x CHAINS of them (the result kept alive in `sink`).
template <bool BF16>
int64_t run(float* sink) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (BF16) {
    __m512 acc[CHAINS];
    for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
    const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3f803f80));  // (1, 1)
    const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x00010001));  // tiny: no overflow
    for (int64_t i = 0; i < INNER; ++i) {
#pragma GCC unroll 12
      for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
    }
    __m512 s = acc[0];
    for (int c = 1; c < CHAINS; ++c) s = _mm512_add_ps(s, acc[c]);
    *sink += _mm512_reduce_add_ps(s);
    return INNER * CHAINS * 32;
  }
#endif
  v16f acc[CHAINS];
  for (int c = 0; c < CHAINS; ++c) acc[c] = splat16(static_cast<float>(c));
  const v16f a = splat16(0.999999f), b = splat16(1e-7f);
  for (int64_t i = 0; i < INNER; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < CHAINS; ++c) acc[c] = fma16(acc[c], a, b);
  }
  for (int c = 0; c < CHAINS; ++c)
    for (int j = 0; j < 16; ++j) *sink += acc[c][j];
  return INNER * CHAINS * 16;
}

}  // namespace
}  // namespace conveyor_peak

bool peak_bf16_available() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

double fma_peak_gflops(double seconds, bool bf16) {
  using namespace conveyor_peak;
  const int threads = at::get_num_threads();
  std::vector<double> rate(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float sink = 0.f;
      int64_t madds = 0;
      const double t0 = now();
      double el = 0.0;
      do {
        madds += bf16 ? run<true>(&sink) : run<false>(&sink);
        el = now() - t0;
      } while (el < seconds);
      rate[t] = 2.0 * madds / el / 1e9 + (sink == 12345.f ? 1e-30 : 0.0);
    }
  });
  double total = 0.0;
  for (double r : rate) total += r;
  return total;
}
