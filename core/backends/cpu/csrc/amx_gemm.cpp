// y [M, N] = x [M, K] @ W.T (+ bias) in bfloat16 on Intel AMX tiles, for the rows of a step.
//
// oneDNN's AMX GEMM reaches 1.6-2.2 TFLOP/s on large prompt steps here but only 160-290 GFLOP/s at
// 16-32 rows, where a linear layer should be a read of its weights at memory speed. This kernel
// keeps W prepacked in the tile layout TDPBF16PS wants (see linears.pack_amx): for each panel
// of 32 output columns, for each 32-wide slice of K, two 16 x 16 tiles of bf16 pairs, so a panel
// is one contiguous run read front to back. Each thread takes a range of panels; for each panel it
// walks the rows 32 at a time (four accumulator tiles: 2 row tiles x 2 column tiles), reading the
// panel from memory on the first pass and from L2 on the others, while the next panel is
// prefetched. Rows are taken in chunks of ROW_CHUNK so a chunk of x stays in L2 on long prompts.
// Accumulation is in float32 (the tile unit's own), one rounding to bf16 at the end, bias added
// in float32 before it, as oneDNN does.
//
// Built only where the compiler targets AMX (-march=native on such a CPU); `amx_gemm_available()`
// also asks the kernel for permission to use the tile registers (Linux >= 5.16). Elsewhere the
// engine keeps oneDNN.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "amx_tiles.h"
#include "vec16.h"

#ifdef CONVEYOR_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace conveyor_amx_gemm {  // named: these files share a translation unit (kernels.py, _UNITS)
namespace {  // (internal linkage, as before the files shared a unit)

constexpr int64_t PANEL = 32;      // output columns per panel (two column tiles)
constexpr int64_t KSTEP = 32;      // bf16 values of K per tile row (64 bytes)
constexpr int64_t ROW_CHUNK = 256;  // rows of x per pass over the weights

#ifdef CONVEYOR_AMX

// Tiles (amx_tile_config): 0-3 accumulators C[row tile][column tile]; 4-5 x rows; 6-7 W columns.
// One output block of 16 or 32 rows x 32 columns. a0/a1: the rows' x (a1 unused when one tile),
// stride lda bytes; panel: K/32 slices of two 1 KiB W tiles. Results (float32) to c [32][32].
template <bool TWO>
inline void block(const c10::BFloat16* a0, const c10::BFloat16* a1, int64_t lda, const c10::BFloat16* panel,
                  int64_t ksteps, float* c, const char* pf, int64_t pf_lines_per_k) {
  _tile_zero(0);
  _tile_zero(1);
  if (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < ksteps; ++s) {
    if (pf != nullptr)
      for (int64_t l = 0; l < pf_lines_per_k; ++l) _mm_prefetch(pf + (s * pf_lines_per_k + l) * 64, _MM_HINT_T1);
    const c10::BFloat16* w = panel + s * 2 * 512;
    _tile_loadd(4, a0 + s * KSTEP, lda);
    _tile_loadd(6, w, 64);
    _tile_loadd(7, w + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (TWO) {
      _tile_loadd(5, a1 + s * KSTEP, lda);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, PANEL * 4);
  _tile_stored(1, c + 16, PANEL * 4);
  if (TWO) {
    _tile_stored(2, c + 16 * PANEL, PANEL * 4);
    _tile_stored(3, c + 16 * PANEL + 16, PANEL * 4);
  }
}

// c [rows][32] float (+ bias) -> y rows, bf16, columns [c0, c0 + cw).
inline void write_rows(const float* c, int64_t rows, const c10::BFloat16* bias, c10::BFloat16* y, int64_t N,
                       int64_t c0, int64_t cw, bool gelu) {
  const __mmask32 mask = cw >= 32 ? ~__mmask32(0) : ((__mmask32(1) << cw) - 1);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    alignas(64) float bf[32] = {};
    for (int64_t j = 0; j < cw; ++j) bf[j] = static_cast<float>(bias[c0 + j]);
    b0 = _mm512_load_ps(bf);
    b1 = _mm512_load_ps(bf + 16);
  }
  for (int64_t r = 0; r < rows; ++r) {
    __m512 lo = _mm512_add_ps(_mm512_loadu_ps(c + r * PANEL), b0);
    __m512 hi = _mm512_add_ps(_mm512_loadu_ps(c + r * PANEL + 16), b1);
    if (gelu) {  // GELU of the output as stored (rounded to bf16), as gelu_erf on the stored row
      lo = reinterpret_cast<__m512>(gelu_erf16(round16<c10::BFloat16>(reinterpret_cast<v16f>(lo))));
      hi = reinterpret_cast<__m512>(gelu_erf16(round16<c10::BFloat16>(reinterpret_cast<v16f>(hi))));
    }
    const __m512bh packed = _mm512_cvtne2ps_pbh(hi, lo);  // round to nearest even, as torch's casts
    _mm512_mask_storeu_epi16(y + r * N + c0, mask, reinterpret_cast<__m512i>(packed));
  }
}

void amx_gemm_impl(const c10::BFloat16* x, const c10::BFloat16* tail, const c10::BFloat16* packed,
                   const c10::BFloat16* bias, c10::BFloat16* y, int64_t M, int64_t N, int64_t K, bool gelu) {
  const int64_t ksteps = K / KSTEP, panels = (N + PANEL - 1) / PANEL;
  const int64_t panel_elems = ksteps * 2 * 512;
  const int64_t full_rows = M / 16 * 16;  // rows read from x; the rest (M % 16) from `tail`, zero-padded
  const int64_t lda = K * 2;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    amx_tile_config();
    alignas(64) float c[32 * PANEL];
    for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
      const int64_t r1 = std::min(M, r0 + ROW_CHUNK);
      const int64_t blocks = (r1 - r0 + 31) / 32;
      for (int64_t p = begin; p < end; ++p) {
        const c10::BFloat16* panel = packed + p * panel_elems;
        const int64_t c0 = p * PANEL, cw = std::min(PANEL, N - c0);
        // The next panel (K lines of 64 bytes), prefetched a slice per block, spread over its K steps.
        const char* next = (p + 1 < end) ? reinterpret_cast<const char*>(panel + panel_elems) : nullptr;
        const int64_t lines = K, slice = (lines + blocks - 1) / blocks, per_k = (slice + ksteps - 1) / ksteps;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t m0 = r0 + b * 32, rows = std::min<int64_t>(32, r1 - m0);
          const int64_t first = b * slice;
          const char* pf = (next != nullptr && first + per_k * ksteps <= lines) ? next + first * 64 : nullptr;
          const auto rows_at = [&](int64_t m) { return m < full_rows ? x + m * K : tail + (m - full_rows) * K; };
          if (rows > 16) {
            // two row tiles; the second may start in the tail buffer (each tile lies wholly on one side)
            block<true>(rows_at(m0), rows_at(m0 + 16), lda, panel, ksteps, c, pf, per_k);
          } else {
            block<false>(rows_at(m0), nullptr, lda, panel, ksteps, c, pf, per_k);
          }
          write_rows(c, rows, bias, y + m0 * N, N, c0, cw, gelu);
        }
      }
    }
    _tile_release();
  });
}

#endif  // CONVEYOR_AMX

}  // namespace
}  // namespace conveyor_amx_gemm

// CONVEYOR_NO_AMX=1 (read once per process) runs the routes of CPUs without tiles instead: AVX512-BF16
// pair products for bf16 linears and attention, so those routes can be checked on a CPU with AMX.
bool amx_gemm_available() {
#ifdef CONVEYOR_AMX
  static const bool ok = [] {
    const char* off = std::getenv("CONVEYOR_NO_AMX");
    if (off != nullptr && std::strcmp(off, "1") == 0) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// x [M, K] bf16 (K a multiple of 32), packed [ceil(N / 32), K / 32, 2, 16, 16, 2] (linears.pack_amx),
// bias [N] or None -> y [M, N] bf16; act 1: GELU (erf) of it, applied as each block is stored.
at::Tensor amx_gemm(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias, int64_t act) {
  using namespace conveyor_amx_gemm;
  TORCH_CHECK(amx_gemm_available(), "amx_gemm: this CPU or build has no AMX tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "amx_gemm: x [M, K] and packed weights in bfloat16");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % KSTEP == 0 && packed.is_contiguous() && packed.dim() == 6 && packed.size(1) == K / KSTEP &&
                  packed.size(0) == (N + PANEL - 1) / PANEL,
              "amx_gemm: packed weights do not match x [M, K] and N");
  auto y = x.new_empty({M, N});
  if (M == 0) return y;
#ifdef CONVEYOR_AMX
  auto xc = x.contiguous();
  const int64_t full_rows = M / 16 * 16;
  at::Tensor tail;  // the last M % 16 rows, zero-padded to a whole tile; only when there are some
  if (full_rows < M) {
    tail = x.new_zeros({16, K});
    std::memcpy(tail.data_ptr<c10::BFloat16>(), xc.data_ptr<c10::BFloat16>() + full_rows * K,
                (M - full_rows) * K * sizeof(c10::BFloat16));
  }
  c10::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kBFloat16, "amx_gemm: bias must be [N] bf16");
    b = bias->contiguous();
  }
  amx_gemm_impl(xc.data_ptr<c10::BFloat16>(), tail.defined() ? tail.data_ptr<c10::BFloat16>() : nullptr,
                packed.data_ptr<c10::BFloat16>(),
                b.has_value() ? b->data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>(), M, N, K,
                act == 1);
#endif
  return y;
}
