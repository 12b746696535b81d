// y = x W^T (+ bias) for a frozen weight held in panels of 32 output columns:
//
//     W [N, K]  ->  panels [P, K, 32],  panels[p, k, j] = W[32 p + j, k]  (P = ceil(N / 32),
//                                                       rows past N are zero)
//
// A panel is one contiguous stream of K x 32 weights. Each thread takes a run of panels; per
// panel, every tile of up to 8 rows of x is multiplied in registers: 8 rows x 32 columns =
// 16 vector accumulators, and per k two vector loads of the panel and one broadcast of x per
// row (GCC vector extensions; -march=native turns a 16-float vector into one AVX-512
// register, or two AVX ones). At a decode step's few rows the weight is read once from
// memory, which is the cost: the first tile's pass prefetches kPrefetchBytes ahead in the
// stream (the hardware prefetcher alone left a 2-core machine at ~14 GB/s of its ~24 at 8
// rows), later tiles of the same panel find it in L2.
//
// Weights in float32 or bfloat16 (widened to float32 in registers: bf16 is the top half of a
// float32); x, y and the accumulation in float32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int64_t kPanel = 32;  // output columns per panel: two vectors of 16
constexpr int kTileRows = 8;    // rows of x per register tile: 16 accumulators
constexpr int64_t kPrefetchBytes = 4096;

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f32x16 load16(const c10::BFloat16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

// rows [R] of x (row stride ldx) times one panel (K x 32) into y (row stride ldy), + bias
template <int R, bool Prefetch, typename W>
void tile(const float* __restrict x, int64_t ldx, const W* __restrict panel, int64_t K,
          const float* __restrict bias, float* __restrict y, int64_t ldy) {
  const f32x16 b0 = bias ? load16(bias) : f32x16{}, b1 = bias ? load16(bias + 16) : f32x16{};
  f32x16 a0[R], a1[R];
  for (int r = 0; r < R; ++r) {
    a0[r] = b0;
    a1[r] = b1;
  }
  constexpr int64_t ahead = kPrefetchBytes / sizeof(W);
  for (int64_t k = 0; k < K; ++k) {
    const W* w = panel + k * kPanel;
    if (Prefetch) {
      __builtin_prefetch(w + ahead, 0, 3);
      __builtin_prefetch(reinterpret_cast<const char*>(w + ahead) + 64, 0, 3);
    }
    const f32x16 w0 = load16(w), w1 = load16(w + 16);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      a0[r] += xv * w0;
      a1[r] += xv * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    std::memcpy(y + r * ldy, &a0[r], sizeof(f32x16));
    std::memcpy(y + r * ldy + 16, &a1[r], sizeof(f32x16));
  }
}

template <bool Prefetch, typename W, int R = kTileRows>
void tile_rows(int rows, const float* x, int64_t ldx, const W* panel, int64_t K,
               const float* bias, float* y, int64_t ldy) {
  if constexpr (R == 1) {
    tile<1, Prefetch>(x, ldx, panel, K, bias, y, ldy);
  } else {
    if (rows == R) return tile<R, Prefetch>(x, ldx, panel, K, bias, y, ldy);
    return tile_rows<Prefetch, W, R - 1>(rows, x, ldx, panel, K, bias, y, ldy);
  }
}

template <typename W>
void run(const float* x, int64_t M, int64_t K, const W* panels, int64_t P, const float* bias,
         int64_t N, float* y) {
  const int64_t ldy = P * kPanel;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {  // panels split among threads
    float last[kPanel] = {};  // the bias of a last, partial panel, zero-padded
    for (int64_t p = begin; p < end; ++p) {
      const W* panel = panels + p * K * kPanel;
      const float* b = bias ? bias + p * kPanel : nullptr;
      if (b && (p + 1) * kPanel > N) {
        std::memcpy(last, b, (N - p * kPanel) * sizeof(float));
        b = last;
      }
      for (int64_t m = 0; m < M; m += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m));
        float* out = y + m * ldy + p * kPanel;
        if (m == 0)
          tile_rows<true>(rows, x + m * K, K, panel, K, b, out, ldy);
        else
          tile_rows<false>(rows, x + m * K, K, panel, K, b, out, ldy);
      }
    }
  });
}

// x [M, K] float32 contiguous; panels [P, K, 32] float32 or bfloat16 contiguous; bias: none
// or [N] float32, N in ((P - 1) * 32, P * 32]. Returns y [M, P * 32] float32.
at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& panels,
                          const std::optional<at::Tensor>& bias_opt) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "blocked_linear: x must be a contiguous 2-d float32 tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  panels.size(1) == x.size(1),
              "blocked_linear: panels must be contiguous [P, K, 32] with K = x.size(1)");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  const bool has_bias = bias_opt.has_value() && bias_opt->defined();
  const at::Tensor bias = has_bias ? *bias_opt : at::Tensor();
  const int64_t N = has_bias ? bias.numel() : P * kPanel;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == at::kFloat && bias.is_contiguous() &&
                            N > (P - 1) * kPanel && N <= P * kPanel),
              "blocked_linear: bias must be none or float32 [N] for the panels' N");
  at::Tensor y = at::empty({M, P * kPanel}, x.options());
  const float* b = has_bias ? bias.data_ptr<float>() : nullptr;
  if (panels.scalar_type() == at::kFloat)
    run(x.data_ptr<float>(), M, K, panels.data_ptr<float>(), P, b, N, y.data_ptr<float>());
  else if (panels.scalar_type() == at::kBFloat16)
    run(x.data_ptr<float>(), M, K, panels.data_ptr<c10::BFloat16>(), P, b, N, y.data_ptr<float>());
  else
    TORCH_CHECK(false, "blocked_linear: panels must be float32 or bfloat16");
  return y;
}

}  // namespace

TORCH_LIBRARY(agent_rl_kernels, m) {
  m.def("blocked_linear(Tensor x, Tensor panels, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(agent_rl_kernels, CPU, m) { m.impl("blocked_linear", &blocked_linear); }
