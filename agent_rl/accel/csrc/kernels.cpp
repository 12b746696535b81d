// agent_rl's CPU kernels (agent_rl/kernels.py builds them): blocked_linear, the products of a
// packed rollout copy; rms_norm, a decode step's norms; sample, a decode step's draw.
//
// blocked_linear: y = x W^T (+ bias) for a frozen weight held in panels of 32 output columns:
//
//     W [N, K]  ->  panels [P, K, 32],  panels[p, k, j] = W[32 p + j, k]  (P = ceil(N / 32),
//                                                       rows past N are zero)
//
// A panel is one contiguous stream of K x 32 weights. Each thread takes a run of panels; per
// panel, every tile of up to 12 rows of x is multiplied in registers: 12 rows x 32 columns =
// 24 vector accumulators (of AVX-512's 32; 12 rows ran a GRPO rollout ~7% faster than 8:
// more work per weight byte streamed), and per k two vector loads of the panel and one
// broadcast of x per row (GCC vector extensions; -march=native turns a 16-float vector into
// one AVX-512 register, or two AVX ones). At a decode step's few rows the weight is read once from
// memory, which is the cost: each panel's first tile prefetches kPrefetchBytes ahead in its
// own stream (the hardware prefetcher alone left a 2-core machine at ~14 GB/s of its ~24 at 8
// rows), and every tile also prefetches the thread's next panel into L2, spread evenly over
// the panel's k steps of all its tiles, so that at 32 rows (three tiles, compute-bound) the
// weight streams in while the later tiles multiply from L2 instead of only during the first
// (a decode step at batch 32 ~8% faster, at 1 and 8 ~3%: steps alternated in one run).
//
// Weights in float32 or bfloat16 (widened to float32 in registers: bf16 is the top half of a
// float32); x, y and the accumulation in float32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int64_t kPanel = 32;  // output columns per panel: two vectors of 16
constexpr int kTileRows = 12;   // rows of x per register tile: 24 accumulators
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

// 16 floats into out[0..16): float32 as they are, bfloat16 rounded to nearest even
inline void store16(float* out, const f32x16 v) { std::memcpy(out, &v, sizeof v); }

inline void store16(c10::BFloat16* out, const f32x16 v) {
#if defined(__AVX512BF16__)
  __m512 w;
  std::memcpy(&w, &v, sizeof w);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(w));
#else
  for (int i = 0; i < 16; ++i) out[i] = c10::BFloat16(v[i]);
#endif
}

// rows [R] of x (row stride ldx) times one panel (K x 32) into y (row stride ldy), + bias
template <int R, bool Prefetch, typename W>
void tile(const float* __restrict x, int64_t ldx, const W* __restrict panel, int64_t K,
          const float* __restrict bias, float* __restrict y, int64_t ldy,
          const char* next, int64_t step) {
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
    if (next) {  // this tile's share of the next panel: step / 256 bytes per k, into L2
      const char* line = next + ((k * step) >> 8);
      __builtin_prefetch(line, 0, 2);
      if (step >= (128 << 8)) __builtin_prefetch(line + 64, 0, 2);
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
               const float* bias, float* y, int64_t ldy, const char* next, int64_t step) {
  if constexpr (R == 1) {
    tile<1, Prefetch>(x, ldx, panel, K, bias, y, ldy, next, step);
  } else {
    if (rows == R) return tile<R, Prefetch>(x, ldx, panel, K, bias, y, ldy, next, step);
    return tile_rows<Prefetch, W, R - 1>(rows, x, ldx, panel, K, bias, y, ldy, next, step);
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
      // the next panel of this thread's run (none after its last), prefetched over the k
      // steps of all tiles: tile t covers bytes [t, t + 1) * panel bytes / tiles of it
      const int64_t tiles = (M + kTileRows - 1) / kTileRows;
      const char* next = p + 1 < end ? reinterpret_cast<const char*>(panel + K * kPanel) : nullptr;
      const int64_t step = (K * kPanel * static_cast<int64_t>(sizeof(W)) << 8) / (tiles * K);
      for (int64_t m = 0; m < M; m += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m));
        float* out = y + m * ldy + p * kPanel;
        const char* share = next ? next + ((m / kTileRows) * K * step >> 8) : nullptr;
        // the first tile streams its own panel from memory when no earlier one prefetched
        // it into L2: a single tile (the next panel is one panel ahead), a run's first panel
        if (m == 0 && (tiles == 1 || p == begin))
          tile_rows<true>(rows, x + m * K, K, panel, K, b, out, ldy, share, step);
        else
          tile_rows<false>(rows, x + m * K, K, panel, K, b, out, ldy, share, step);
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

// rms_norm: y = weight * (x / sqrt(mean(x^2) + eps)) per row of x [M, H] (Llama's RMSNorm,
// in its order: x times the reciprocal root, then the weight), float32. What it replaces:
// F.rms_norm on the CPU runs as five ops (pow, mean, add, rsqrt, two muls), ~90 us at a
// decode step's 32 x 576, where reading and writing the rows takes a few. rstd, when given
// ([M]), receives each row's reciprocal root (what the backward needs).
template <typename Y>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, Y* ys, float* rstd) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rms_norm: x must be a contiguous 2-d float32 tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(0) == x.size(1),
              "rms_norm: weight must be contiguous float32 [H] with H = x.size(1)");
  const int64_t M = x.size(0), H = x.size(1);
  const float* xs = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = xs + m * H;
      Y* out = ys + m * H;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t h = 0; h < H; ++h) squares += row[h] * row[h];
      const float r = 1.0f / std::sqrt(squares / static_cast<float>(H) + static_cast<float>(eps));
      if (rstd != nullptr) rstd[m] = r;
      int64_t h = 0;
      for (; h + 16 <= H; h += 16) store16(out + h, load16(w + h) * (load16(row + h) * r));
      for (; h < H; ++h) out[h] = w[h] * (row[h] * r);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kFloat));  // x is checked inside
  rms_norm_rows(x, weight, eps, y.data_ptr<float>(), nullptr);
  return y;
}

// The trainer's RMSNorm (agent_rl.kernels.RMSNorm): the forward above, keeping each row's
// reciprocal root r, and its backward in one pass over the rows. With n = x r and
// dn = grad * weight:  dx = r (dn - n mean(dn n)),  dweight = sum over rows of grad * n
// (per-thread partial sums, added at the end). The tensor ops took ~4.3 ms for the forward
// and backward of 1000 x 576 rows (seven ops forward, more backward).
// y in `dtype`: float32, or bfloat16 rounded once (what a projection reads under bf16 autocast)
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight,
                                                    double eps, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rms_norm_forward: the result is float32 or bfloat16");
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(dtype));
  at::Tensor rstd = at::empty({x.size(0)}, x.options());
  if (dtype == at::kFloat)
    rms_norm_rows(x, weight, eps, y.data_ptr<float>(), rstd.data_ptr<float>());
  else
    rms_norm_rows(x, weight, eps, y.data_ptr<c10::BFloat16>(), rstd.data_ptr<float>());
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& x,
                                                     const at::Tensor& weight,
                                                     const at::Tensor& rstd) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  grad.sizes() == x.sizes() &&
                  (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16) &&
                  grad.is_contiguous(),
              "rms_norm_backward: x (float32) and grad (float32 or bfloat16) must be contiguous [M, H] alike");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(0) == x.size(1) && rstd.dim() == 1 &&
                  rstd.scalar_type() == at::kFloat && rstd.size(0) == x.size(0),
              "rms_norm_backward: weight must be float32 [H], rstd float32 [M]");
  const int64_t M = x.size(0), H = x.size(1);
  at::Tensor dx = at::empty({M, H}, x.options());
  const int threads = at::get_num_threads();
  std::vector<float> partial(static_cast<size_t>(threads) * H, 0.0f);
  const float* xs = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* rs = rstd.data_ptr<float>();
  float* dxs = dx.data_ptr<float>();
  std::vector<float> wide(grad.scalar_type() == at::kFloat ? 0 : static_cast<size_t>(threads) * H);
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    float* dw = partial.data() + static_cast<size_t>(at::get_thread_num()) * H;
    for (int64_t m = begin; m < end; ++m) {
      const float* row = xs + m * H;
      const float* g = grad.scalar_type() == at::kFloat ? grad.data_ptr<float>() + m * H : nullptr;
      if (g == nullptr) {  // a bfloat16 row, widened once
        float* to = wide.data() + static_cast<size_t>(at::get_thread_num()) * H;
        const c10::BFloat16* from = grad.data_ptr<c10::BFloat16>() + m * H;
        int64_t h = 0;
        for (; h + 16 <= H; h += 16) store16(to + h, load16(from + h));
        for (; h < H; ++h) to[h] = static_cast<float>(from[h]);
        g = to;
      }
      float* out = dxs + m * H;
      const float r = rs[m];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t h = 0; h < H; ++h) {
        const float n = row[h] * r;
        dot += g[h] * w[h] * n;
        dw[h] += g[h] * n;
      }
      const float mean = dot / static_cast<float>(H);
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) out[h] = r * (g[h] * w[h] - row[h] * r * mean);
    }
  });
  at::Tensor dweight = at::zeros({H}, x.options());
  float* dws = dweight.data_ptr<float>();
  for (int t = 0; t < threads; ++t) {
    const float* part = partial.data() + static_cast<size_t>(t) * H;
    for (int64_t h = 0; h < H; ++h) dws[h] += part[h];
  }
  return {dx, dweight};
}

// exp(x) for x <= 0 (below -87: 0, as -inf gives), 16 lanes: Cody-Waite reduction x = n ln2
// + r, a degree-6 polynomial for exp(r) (Cephes' expf coefficients, ~2 ulp), times 2^n built
// in the exponent bits.
inline f32x16 exp16(const f32x16 in) {
  typedef int32_t i32x16 __attribute__((vector_size(64)));
  f32x16 x = in < -87.0f ? f32x16{} - 87.0f : in;
  const f32x16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  x = x - n * 0.693359375f;
  x = x - n * -2.12194440e-4f;
  f32x16 y = x * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;  // 2^n
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return in < -87.0f ? f32x16{} : y * scale;
}

// 16 logits from x[v] on, scaled: x / T - shift; past V (the row's end): -inf
inline f32x16 scaled16(const float* x, int64_t v, int64_t V, float inv_t, float shift) {
  if (v + 16 <= V) return load16(x + v) * inv_t - shift;
  f32x16 out = f32x16{} - INFINITY;
  for (int64_t i = v; i < V; ++i) out[i - v] = x[i] * inv_t - shift;
  return out;
}

constexpr int64_t kSampleBlock = 256;  // tokens per partial sum (16 vectors)

// sample: one token per row of logits [B, V] by inverse CDF under softmax(logits / T), T > 0,
// with the row's uniform u in [0, 1): the first token whose cumulative weight exceeds u times
// the total, and its log-prob. Per row: the max; exp((x - max) / T) summed per block of 256
// tokens; the block where the running sum passes the target, then its tokens one by one.
// About two reads of the row, where the tensor ops (log-softmax, exp, cumsum, searchsorted)
// write three [B, V] tensors and cumsum runs one token at a time.
std::tuple<at::Tensor, at::Tensor> sample(const at::Tensor& logits, const at::Tensor& uniforms,
                                          double temperature) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "sample: logits must be a contiguous 2-d float32 tensor");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.scalar_type() == at::kFloat &&
                  uniforms.size(0) == logits.size(0) && uniforms.is_contiguous(),
              "sample: uniforms must be contiguous float32 [B]");
  TORCH_CHECK(temperature > 0, "sample: temperature must be > 0");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "sample: an empty vocabulary");
  at::Tensor token = at::empty({B}, logits.options().dtype(at::kLong));
  at::Tensor logp = at::empty({B}, logits.options());
  const float* xs = logits.data_ptr<float>();
  const float* us = uniforms.data_ptr<float>();
  int64_t* tokens = token.data_ptr<int64_t>();
  float* logps = logp.data_ptr<float>();
  const float inv_t = static_cast<float>(1.0 / temperature);
  const int64_t blocks = (V + kSampleBlock - 1) / kSampleBlock;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(blocks);
    for (int64_t b = begin; b < end; ++b) {
      const float* x = xs + b * V;
      f32x16 most = f32x16{} - INFINITY;
      for (int64_t v = 0; v < V; v += 16) {
        const f32x16 c = scaled16(x, v, V, 1.0f, 0.0f);
        most = c > most ? c : most;
      }
      float top = most[0];
      for (int i = 1; i < 16; ++i) top = std::max(top, most[i]);
      const float shift = top * inv_t;  // every weight exp(x / T - shift) <= 1
      float total = 0.0f;
      for (int64_t k = 0; k < blocks; ++k) {
        f32x16 acc{};
        for (int64_t v = k * kSampleBlock; v < std::min(V, (k + 1) * kSampleBlock); v += 16)
          acc += exp16(scaled16(x, v, V, inv_t, shift));
        float sum = 0.0f;
        for (int i = 0; i < 16; ++i) sum += acc[i];
        sums[k] = sum;
        total += sum;
      }
      const float target = us[b] * total;
      float seen = 0.0f;
      int64_t k = 0;
      while (k < blocks - 1 && seen + sums[k] <= target) seen += sums[k++];
      while (k > 0 && sums[k] == 0.0f) --k;  // rounding ran past the last weight: back to it
      // the block's tokens one by one: the first past the target, else (rounding) its last
      // token with any weight
      int64_t pick = -1, last = k * kSampleBlock;
      for (int64_t v = k * kSampleBlock; v < std::min(V, (k + 1) * kSampleBlock) && pick < 0; v += 16) {
        const f32x16 w = exp16(scaled16(x, v, V, inv_t, shift));
        for (int i = 0; i < 16 && v + i < V; ++i) {
          if (w[i] <= 0.0f) continue;
          last = v + i;
          seen += w[i];
          if (seen > target) {
            pick = v + i;
            break;
          }
        }
      }
      if (pick < 0) pick = last;
      tokens[b] = pick;
      const float t = static_cast<float>(temperature);  // log-softmax's rounding: x / T
      // at most 0: a contracted multiply-add can leave the top token's weight a rounding
      // error under 1, and the total under 1 with it
      logps[b] = std::min(0.0f, x[pick] / t - top / t - std::log(total));
    }
  });
  return {token, logp};
}


typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

inline float hsum16(const f32x16 v) {
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// One (row, KV head) of decode_attention: G queries of V x 16 floats over S positions, the
// first S1 at k1/v1 (position stride ld1), the rest at k2/v2 (stride ld2). While reading a
// position's key (value) it prefetches, into L2, the matching lines of the next item's
// (next1/next2: its first and second parts, null for none): the next item streams in while
// this one computes.
template <int V, int G>
void attend_one(const float* __restrict q, const float* k1, const float* v1, int64_t ld1,
                const float* k2, const float* v2, int64_t ld2, int64_t S1, int64_t S,
                const bool* attend, float scale, float* __restrict scores, float* __restrict out,
                const float* nk1, const float* nv1, const float* nk2, const float* nv2) {
  f32x16 query[G][V];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < V; ++c) query[j][c] = load16(q + (j * V + c) * 16) * scale;
  auto fetch = [&](const float* n1, const float* n2, int64_t s) {
    const float* line = s < S1 ? (n1 ? n1 + s * ld1 : nullptr) : (n2 ? n2 + (s - S1) * ld2 : nullptr);
    if (line)
      for (int c = 0; c < V; ++c) __builtin_prefetch(line + 16 * c, 0, 2);  // V lines
  };
  float top[G];
  for (int j = 0; j < G; ++j) top[j] = -INFINITY;
  for (int64_t s = 0; s < S; ++s) {
    fetch(nk1, nk2, s);
    if (!attend[s]) {
      for (int j = 0; j < G; ++j) scores[j * S + s] = -INFINITY;
      continue;
    }
    const float* key = s < S1 ? k1 + s * ld1 : k2 + (s - S1) * ld2;
    f32x16 kv[V];
    for (int c = 0; c < V; ++c) kv[c] = load16(key + 16 * c);
    for (int j = 0; j < G; ++j) {
      f32x16 acc = query[j][0] * kv[0];
      for (int c = 1; c < V; ++c) acc += query[j][c] * kv[c];
      const float x = hsum16(acc);
      scores[j * S + s] = x;
      top[j] = std::max(top[j], x);
    }
  }
  float inv[G];
  for (int j = 0; j < G; ++j) {  // exp(score - max), summed
    float* row = scores + j * S;
    f32x16 sum{};
    int64_t s = 0;
    for (; s + 16 <= S; s += 16) {
      const f32x16 w = exp16(load16(row + s) - top[j]);
      std::memcpy(row + s, &w, sizeof w);
      sum += w;
    }
    float total = hsum16(sum);
    for (; s < S; ++s) {
      f32x16 one = f32x16{} - INFINITY;
      one[0] = row[s] - top[j];
      row[s] = exp16(one)[0];
      total += row[s];
    }
    inv[j] = total > 0.0f ? 1.0f / total : 0.0f;  // no position attended: zeros
  }
  f32x16 acc[G][V] = {};
  for (int64_t s = 0; s < S; ++s) {
    fetch(nv1, nv2, s);
    if (!attend[s]) continue;
    const float* value = s < S1 ? v1 + s * ld1 : v2 + (s - S1) * ld2;
    f32x16 vv[V];
    for (int c = 0; c < V; ++c) vv[c] = load16(value + 16 * c);
    for (int j = 0; j < G; ++j) {
      const float w = scores[j * S + s];
      for (int c = 0; c < V; ++c) acc[j][c] += w * vv[c];
    }
  }
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < V; ++c) {
      const f32x16 r = acc[j][c] * inv[j];
      std::memcpy(out + (j * V + c) * 16, &r, sizeof r);
    }
}

using AttendOne = void (*)(const float*, const float*, const float*, int64_t, const float*,
                           const float*, int64_t, int64_t, int64_t, const bool*, float, float*,
                           float*, const float*, const float*, const float*, const float*);

template <int V>
AttendOne attend_for_group(int64_t g) {
  switch (g) {
    case 1: return &attend_one<V, 1>;
    case 2: return &attend_one<V, 2>;
    case 3: return &attend_one<V, 3>;
    case 4: return &attend_one<V, 4>;
    case 5: return &attend_one<V, 5>;
    case 6: return &attend_one<V, 6>;
    case 7: return &attend_one<V, 7>;
    case 8: return &attend_one<V, 8>;
    default: return nullptr;
  }
}

// decode_attention: one decode step's attention, each row's query group per KV head over its
// keys and values, read once, in place. q [A, kvh, g, d] contiguous; the keys and values in
// two parts: the first [U, kvh, S1, d] (a prompt's, held once per prompt: row a reads its
// prompt rows1[a]'s; or the rows' own buffers, rows1 = 0..A-1), the second [A, kvh, S2, d]
// (the generated positions; S2 may be 0); both with d contiguous, other strides free (a
// slice of a larger buffer). mask [A, S1 + S2] bool (true: attend). Per (row, KV head): the
// g scores of each position (one pass over the keys), softmax per query, then the weighted
// sum of the values (one pass), prefetching the next (row, KV head)'s keys and values.
// head_dim 64 or 128, up to 8 queries per KV head. What it replaces:
// F.scaled_dot_product_attention (at a decode step's shapes about twice the time of reading
// the cache) and, for prompts held once, ~10 tensor ops per layer.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k1, const at::Tensor& v1,
                            const at::Tensor& rows1, const at::Tensor& k2, const at::Tensor& v2,
                            const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "decode_attention: q must be contiguous float32 [A, kv_heads, group, head_dim]");
  const int64_t A = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const AttendOne one = D == 64 ? attend_for_group<4>(G) : D == 128 ? attend_for_group<8>(G) : nullptr;
  TORCH_CHECK(one != nullptr, "decode_attention: head_dim must be 64 or 128 and at most 8 queries a KV head");
  for (const at::Tensor* t : {&k1, &v1, &k2, &v2})
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == at::kFloat && t->size(1) == H &&
                    t->size(3) == D && t->stride(3) == 1,
                "decode_attention: keys and values must be float32 [*, kv_heads, S, head_dim], head_dim contiguous");
  TORCH_CHECK(v1.sizes() == k1.sizes() && v1.strides() == k1.strides() && v2.sizes() == k2.sizes() &&
                  v2.strides() == k2.strides() && k2.size(0) == A,
              "decode_attention: values must match keys (sizes and strides), the second part one per row");
  const int64_t S1 = k1.size(2), S2 = k2.size(2), U = k1.size(0);
  TORCH_CHECK(rows1.dim() == 1 && rows1.size(0) == A && rows1.scalar_type() == at::kLong &&
                  rows1.is_contiguous(),
              "decode_attention: rows1 must be contiguous int64 [A]");
  TORCH_CHECK(mask.dim() == 2 && mask.size(0) == A && mask.size(1) == S1 + S2 &&
                  mask.scalar_type() == at::kBool && mask.is_contiguous(),
              "decode_attention: mask must be contiguous bool [A, S1 + S2]");
  const int64_t* which = rows1.data_ptr<int64_t>();
  for (int64_t a = 0; a < A; ++a)
    TORCH_CHECK(which[a] >= 0 && which[a] < U, "decode_attention: rows1 out of range");
  at::Tensor out = at::empty({A, H, G, D}, q.options());
  const float* qs = q.data_ptr<float>();
  const bool* ms = mask.data_ptr<bool>();
  float* os = out.data_ptr<float>();
  const float *k1s = k1.data_ptr<float>(), *v1s = v1.data_ptr<float>();
  const float *k2s = k2.data_ptr<float>(), *v2s = v2.data_ptr<float>();
  const int64_t S = S1 + S2;
  auto first = [&](const float* base, int64_t item) {  // the item's first part, second part
    return base + which[item / H] * k1.stride(0) + (item % H) * k1.stride(1);
  };
  auto second = [&](const float* base, int64_t item) {
    return base + (item / H) * k2.stride(0) + (item % H) * k2.stride(1);
  };
  at::parallel_for(0, A * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * S);
    for (int64_t item = begin; item < end; ++item) {
      const bool more = item + 1 < end;
      one(qs + item * G * D, first(k1s, item), first(v1s, item), k1.stride(2), second(k2s, item),
          second(v2s, item), k2.stride(2), S1, S, ms + (item / H) * S, static_cast<float>(scale),
          scores.data(), os + item * G * D, more ? first(k1s, item + 1) : nullptr,
          more ? first(v1s, item + 1) : nullptr, more ? second(k2s, item + 1) : nullptr,
          more ? second(v2s, item + 1) : nullptr);
    }
  });
  return out;
}


// rotary_write: a decode step's rotary embedding and cache write, one pass instead of ~8
// tensor ops a layer. q [A, nh * d], k and v [A, kvh * d] (rows of a larger product: row
// stride free, columns contiguous); cos, sin [A, d] contiguous, sin with its first half
// negated, so that rotate_half(x) * sin == roll(x, d / 2) * sin_signed: x' = x cos + roll(x)
// sin_signed (Llama's rotation). Returns the rotated q [A, nh * d]; writes the rotated k and
// v into keys[a, h, slot] and values[a, h, slot] (keys, values [>= A, kvh, S, d], d
// contiguous).
at::Tensor rotary_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
                        const at::Tensor& values, int64_t slot) {
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary_write: cos and sin must be contiguous float32 [A, head_dim]");
  const int64_t A = cos.size(0), D = cos.size(1), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "rotary_write: head_dim must be even");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == A && t->size(1) % D == 0 && t->stride(1) == 1 &&
                    t->scalar_type() == at::kFloat,
                "rotary_write: q, k and v must be float32 [A, heads * head_dim], columns contiguous");
  TORCH_CHECK(v.size(1) == k.size(1), "rotary_write: k and v must have the same heads");
  const int64_t NH = q.size(1) / D, KVH = k.size(1) / D;
  for (const at::Tensor* t : {&keys, &values})
    TORCH_CHECK(t->dim() == 4 && t->size(0) >= A && t->size(1) == KVH && t->size(3) == D &&
                    t->stride(3) == 1 && t->scalar_type() == at::kFloat,
                "rotary_write: keys and values must be float32 [>= A, kv_heads, S, head_dim], head_dim contiguous");
  TORCH_CHECK(slot >= 0 && slot < keys.size(2) && slot < values.size(2), "rotary_write: slot out of range");
  at::Tensor out = at::empty({A, NH * D}, q.options());
  const float *cs = cos.data_ptr<float>(), *ss = sin.data_ptr<float>();
  const float *qs = q.data_ptr<float>(), *ks = k.data_ptr<float>(), *vs = v.data_ptr<float>();
  float *os = out.data_ptr<float>(), *kd = keys.data_ptr<float>(), *vd = values.data_ptr<float>();
  auto rotate = [&](const float* x, const float* c, const float* sn, float* y) {
    for (int64_t i = 0; i < D; ++i) y[i] = x[i] * c[i] + x[i < half ? i + half : i - half] * sn[i];
  };
  at::parallel_for(0, A, 16, [&](int64_t begin, int64_t end) {
    for (int64_t a = begin; a < end; ++a) {
      const float *c = cs + a * D, *sn = ss + a * D;
      for (int64_t h = 0; h < NH; ++h) rotate(qs + a * q.stride(0) + h * D, c, sn, os + (a * NH + h) * D);
      for (int64_t h = 0; h < KVH; ++h) {
        rotate(ks + a * k.stride(0) + h * D, c, sn,
               kd + a * keys.stride(0) + h * keys.stride(1) + slot * keys.stride(2));
        std::memcpy(vd + a * values.stride(0) + h * values.stride(1) + slot * values.stride(2),
                    vs + a * v.stride(0) + h * D, D * sizeof(float));
      }
    }
  });
  return out;
}

// silu_mul: silu(gate) * up, a SwiGLU MLP's middle, one pass instead of two ops and a
// tensor between them. gate, up [M, N] float32 or bfloat16 (both alike, the result too),
// columns contiguous, row strides free (halves of one product). silu(x) = x sigmoid(x),
// sigmoid from exp(-|x|) (exp16 takes x <= 0); float32 inside, bfloat16 rounded once.
inline f32x16 sigmoid16(const f32x16 x) {
  const f32x16 e = exp16(x < 0 ? x : -x);  // exp(-|x|)
  const f32x16 d = 1.0f + e;
#if defined(__AVX512F__)
  // 1 / d as AVX-512's 14-bit reciprocal and one Newton step (~1 ulp; vdivps' throughput is a
  // quarter of it)
  __m512 dv, rv;
  std::memcpy(&dv, &d, sizeof dv);
  rv = _mm512_rcp14_ps(dv);
  f32x16 r;
  std::memcpy(&r, &rv, sizeof r);
  r = r * (2.0f - d * r);
  return (x < 0 ? e : f32x16{} + 1.0f) * r;
#else
  return (x < 0 ? e : f32x16{} + 1.0f) / d;
#endif
}

inline float sigmoid1(float x) { return 1.0f / (1.0f + std::exp(-x)); }

template <typename X>
void silu_mul_rows(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const int64_t M = gate.size(0), N = gate.size(1);
  const X *gs = gate.data_ptr<X>(), *us = up.data_ptr<X>();
  X* os = out.data_ptr<X>();
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const X *g = gs + m * gate.stride(0), *u = us + m * up.stride(0);
      X* o = os + m * N;
      int64_t n = 0;
      for (; n + 16 <= N; n += 16) {
        const f32x16 x = load16(g + n);
        store16(o + n, x * sigmoid16(x) * load16(u + n));
      }
      for (; n < N; ++n) {
        const float x = g[n];
        o[n] = x * sigmoid1(x) * static_cast<float>(u[n]);
      }
    }
  });
}

void check_silu_mul(const char* name, const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && gate.stride(1) == 1 && up.stride(1) == 1 &&
                  gate.scalar_type() == up.scalar_type() &&
                  (gate.scalar_type() == at::kFloat || gate.scalar_type() == at::kBFloat16),
              name, ": gate and up must be float32 or bfloat16 [M, N] of one shape and dtype, columns contiguous");
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_silu_mul("silu_mul", gate, up);
  at::Tensor out = at::empty({gate.size(0), gate.size(1)}, gate.options());
  if (gate.scalar_type() == at::kFloat)
    silu_mul_rows<float>(gate, up, out);
  else
    silu_mul_rows<c10::BFloat16>(gate, up, out);
  return out;
}

// silu_mul_backward: with s = sigmoid(gate), d/dgate = grad up s (1 + gate (1 - s)) and
// d/dup = grad gate s, one pass over the three inputs (contiguous [M, N] grad).
template <typename X>
void silu_mul_grad_rows(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, at::Tensor& dgate,
                        at::Tensor& dup) {
  const int64_t M = gate.size(0), N = gate.size(1);
  const X *ds = grad.data_ptr<X>(), *gs = gate.data_ptr<X>(), *us = up.data_ptr<X>();
  X *dgs = dgate.data_ptr<X>(), *dus = dup.data_ptr<X>();
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const X *d = ds + m * N, *g = gs + m * gate.stride(0), *u = us + m * up.stride(0);
      X *dg = dgs + m * N, *du = dus + m * N;
      int64_t n = 0;
      for (; n + 16 <= N; n += 16) {
        const f32x16 x = load16(g + n), dy = load16(d + n), sig = sigmoid16(x);
        store16(dg + n, dy * load16(u + n) * sig * (1.0f + x * (1.0f - sig)));
        store16(du + n, dy * x * sig);
      }
      for (; n < N; ++n) {
        const float x = g[n], dy = d[n], sig = sigmoid1(x);
        dg[n] = dy * static_cast<float>(u[n]) * sig * (1.0f + x * (1.0f - sig));
        du[n] = dy * x * sig;
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& grad, const at::Tensor& gate,
                                                     const at::Tensor& up) {
  check_silu_mul("silu_mul_backward", gate, up);
  TORCH_CHECK(grad.sizes() == gate.sizes() && grad.scalar_type() == gate.scalar_type() && grad.is_contiguous(),
              "silu_mul_backward: grad must be contiguous, of gate's shape and dtype");
  at::Tensor dgate = at::empty({gate.size(0), gate.size(1)}, gate.options());
  at::Tensor dup = at::empty({gate.size(0), gate.size(1)}, gate.options());
  if (gate.scalar_type() == at::kFloat)
    silu_mul_grad_rows<float>(grad, gate, up, dgate, dup);
  else
    silu_mul_grad_rows<c10::BFloat16>(grad, gate, up, dgate, dup);
  return {dgate, dup};
}


// add_into: dst += src, float32 dst, float32 or bfloat16 src, both contiguous and of one
// size, in one pass: at::add_ first writes a bfloat16 src out as a float32 temporary (a
// fresh allocation each time, its pages faulted in). The same sums to the bit.
template <typename X>
void add_rows(float* dst, const X* src, int64_t n) {
  at::parallel_for(0, (n + 4095) / 4096, 16, [&](int64_t begin, int64_t end) {
    const int64_t stop = std::min(n, end * 4096);
    int64_t i = begin * 4096;
    for (; i + 16 <= stop; i += 16) store16(dst + i, load16(dst + i) + load16(src + i));
    for (; i < stop; ++i) dst[i] += static_cast<float>(src[i]);
  });
}

void add_into(at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.scalar_type() == at::kFloat && dst.is_contiguous() && src.is_contiguous() &&
                  (src.scalar_type() == at::kFloat || src.scalar_type() == at::kBFloat16) &&
                  dst.sizes() == src.sizes() && dst.device().is_cpu() && src.device().is_cpu(),
              "add_into: dst float32, src float32 or bfloat16, both contiguous, of one shape, on the CPU");
  if (src.scalar_type() == at::kFloat)
    add_rows(dst.data_ptr<float>(), src.data_ptr<float>(), dst.numel());
  else
    add_rows(dst.data_ptr<float>(), src.data_ptr<c10::BFloat16>(), dst.numel());
}

// chunk_attention: the trainer's blocked attention (agent_rl/attention.py) in bfloat16, one
// call a layer. A batch's query chunks each attend to their own keys (positions gathered from
// the row) under their own additive mask; a task is one chunk of one head. Products take
// bfloat16 inputs and accumulate in float32 (AVX-512 BF16's dot product of pairs, vdpbf16ps):
// the scores and the softmax are float32, the probabilities (and in backward their gradients)
// are rounded to bfloat16 for the products with V (and with K and Q), as flash attention does
// on a GPU. Without AVX-512 BF16 the same products run as scalar float32 loops. Each query
// comes with its extent (the plan's, one past its last key the mask does not rule out): the
// products skip the keys past it in tiles of 6 queries x 16 keys (a chunk cut from a causal
// segment: a Relay-v0 step's score products cover 24% fewer pairs), the same outputs and dQ
// to the bit (dK and dV to float32 rounding: chunks that share keys add into them in
// whichever order the threads take them, run to run alike).
//
// A product C[M, N] (+)= A[M, K] B[K, N] takes A as rows of bfloat16 pairs along K (a row of
// K bfloat16 read as K/2 uint32) and B packed as pairs, B2[p][n] = (B[2p][n], B[2p+1][n]) (low
// half first), N padded to a multiple of 16 with zeros. Register tiles of up to 6 rows x 64
// columns (24 accumulators; 4 rows measured ~5% slower at attention's shapes).

inline uint32_t bf16_bits(float x) { return c10::BFloat16(x).x; }

template <int R, int NV>
void bf16_tile(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, int64_t P, float* C,
               int64_t ldc, int last, bool accumulate) {
#if defined(__AVX512BF16__)
  __m512 c[R][NV];
  const __mmask16 tail = last >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << last) - 1);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      c[r][v] = accumulate ? _mm512_maskz_loadu_ps(v == NV - 1 ? tail : (__mmask16)0xFFFF, C + r * ldc + 16 * v)
                           : _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + p * ldb + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32((int)A[r * lda + p]);
      for (int v = 0; v < NV; ++v) c[r][v] = _mm512_dpbf16_ps(c[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      _mm512_mask_storeu_ps(C + r * ldc + 16 * v, v == NV - 1 ? tail : (__mmask16)0xFFFF, c[r][v]);
#else
  const int N = 16 * (NV - 1) + last;
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) {
      float acc = accumulate ? C[r * ldc + n] : 0.0f;
      for (int64_t p = 0; p < P; ++p) {
        const uint32_t a = A[r * lda + p], b = B[p * ldb + n];
        float a0, a1, b0, b1;
        const uint32_t bits[4] = {a << 16, a & 0xFFFF0000u, b << 16, b & 0xFFFF0000u};
        std::memcpy(&a0, bits, 4), std::memcpy(&a1, bits + 1, 4);
        std::memcpy(&b0, bits + 2, 4), std::memcpy(&b1, bits + 3, 4);
        acc += a0 * b0 + a1 * b1;
      }
      C[r * ldc + n] = acc;
    }
#endif
}

template <int R>
void bf16_tile_cols(int nv, const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, int64_t P,
                    float* C, int64_t ldc, int last, bool accumulate) {
  switch (nv) {
    case 1: return bf16_tile<R, 1>(A, lda, B, ldb, P, C, ldc, last, accumulate);
    case 2: return bf16_tile<R, 2>(A, lda, B, ldb, P, C, ldc, last, accumulate);
    case 3: return bf16_tile<R, 3>(A, lda, B, ldb, P, C, ldc, last, accumulate);
    default: return bf16_tile<R, 4>(A, lda, B, ldb, P, C, ldc, last, accumulate);
  }
}

constexpr int64_t kGemmRows = 6;  // rows of A per register tile: up to 24 accumulators

// What a product may skip where the operands are known zero (a query's keys past its extent,
// masked): `ext` per row of A (keys a query sees, those after are masked); `ext_cols`: a row
// tile computes only the columns its rows see (C's columns past are left as they were),
// else only the pairs of the sum they see (A's pairs past are zero); `from` per 64 columns
// of C: the first pair of the sum that is not zero (the rows of B before it are zero there).
struct Skip {
  const int64_t* ext = nullptr;
  bool ext_cols = false;
  const int64_t* from = nullptr;
};

// C[M, N] (row stride ldc) (+)= A (M rows of P pairs, row stride lda) . B2 (P x ldb pairs,
// ldb >= N rounded up to 16, zero past N), skipping what `skip` says is zero
void bf16_gemm(int64_t M, int64_t N, int64_t P, const uint32_t* A, int64_t lda, const uint32_t* B,
               int64_t ldb, float* C, int64_t ldc, bool accumulate, const Skip& skip = {}) {
  for (int64_t j = 0; j < N; j += 64) {
    const int64_t p0 = skip.from ? std::min(skip.from[j / 64], P) : 0;
    for (int64_t i = 0; i < M; i += kGemmRows) {
      const int64_t rows = std::min<int64_t>(kGemmRows, M - i);
      int64_t n = N, p = P;
      if (skip.ext) {
        const int64_t e = *std::max_element(skip.ext + i, skip.ext + i + rows);
        if (skip.ext_cols)
          n = std::min(N, e);
        else
          p = std::min(P, (e + 1) / 2);
      }
      if (j >= n) continue;
      const int64_t cols = std::min<int64_t>(64, n - j);
      const int nv = (int)((cols + 15) / 16), last = (int)(cols - 16 * (nv - 1));
      const uint32_t* a = A + i * lda + p0;
      const uint32_t* b = B + p0 * ldb + j;
      float* c = C + i * ldc + j;
      const int64_t depth = std::max<int64_t>(p - p0, 0);
      switch (rows) {
        case 1: bf16_tile_cols<1>(nv, a, lda, b, ldb, depth, c, ldc, last, accumulate); break;
        case 2: bf16_tile_cols<2>(nv, a, lda, b, ldb, depth, c, ldc, last, accumulate); break;
        case 3: bf16_tile_cols<3>(nv, a, lda, b, ldb, depth, c, ldc, last, accumulate); break;
        case 4: bf16_tile_cols<4>(nv, a, lda, b, ldb, depth, c, ldc, last, accumulate); break;
        case 5: bf16_tile_cols<5>(nv, a, lda, b, ldb, depth, c, ldc, last, accumulate); break;
        default: bf16_tile_cols<6>(nv, a, lda, b, ldb, depth, c, ldc, last, accumulate);
      }
    }
  }
}

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

#if defined(__AVX512F__)
// r[0..16) as a 16 x 16 matrix of 32-bit lanes, transposed in place: r[j] lane i = old r[i] lane j
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}
#endif

// out[c][r] = rows[r][c] (32-bit) for r < n, c < m: rows are pointers (strides free), out row
// c at out + c * ld; lanes r in [n, n rounded up to 16) of out are written zero when `pad`
// (out's rows must hold them), else left alone. 16 x 16 blocks in registers with AVX-512.
template <typename Row>
void transpose_rows(int64_t n, int64_t m, Row row, uint32_t* out, int64_t ld, bool pad) {
  int64_t r0 = 0;
#if defined(__AVX512F__)
  for (; r0 < n; r0 += 16) {
    const int rows = (int)std::min<int64_t>(16, n - r0);
    const __mmask16 keep = pad ? (__mmask16)0xFFFF : (__mmask16)((1u << rows) - 1);
    for (int64_t c0 = 0; c0 < m; c0 += 16) {
      const int cols = (int)std::min<int64_t>(16, m - c0);
      const __mmask16 take = (__mmask16)((1u << cols) - 1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < rows ? _mm512_maskz_loadu_epi32(take, row(r0 + i) + c0) : _mm512_setzero_si512();
      transpose16(r);
      for (int j = 0; j < cols; ++j) _mm512_mask_storeu_epi32(out + (c0 + j) * ld + r0, keep, r[j]);
    }
  }
#else
  for (; r0 < n; ++r0)
    for (int64_t c = 0; c < m; ++c) out[c * ld + r0] = row(r0)[c];
  if (pad)
    for (int64_t c = 0; c < m; ++c) std::fill(out + c * ld + n, out + c * ld + round16(n), 0u);
#endif
}

// rows[i] (D bfloat16 each) as B2 of a product over D: out[p][i] = pair p of row i, [D/2][ld],
// zero past n (ld a multiple of 16)
template <typename Row>
void pack_transposed(int64_t n, int64_t D, Row row, uint32_t* out, int64_t ld) {
  for (int64_t p = 0; p < D / 2; ++p) std::fill(out + p * ld + round16(n), out + (p + 1) * ld, 0u);
  transpose_rows(n, D / 2, [&](int64_t i) { return reinterpret_cast<const uint32_t*>(row(i)); }, out, ld, true);
}

// rows[i] (D bfloat16 each, D a multiple of 16) as B2 of a product over i: out[k][d] = (row
// 2k [d], row 2k+1 [d])
template <typename Row>
void pack_pairs(int64_t n, int64_t D, Row row, uint32_t* out) {
  for (int64_t k = 0; 2 * k < n; ++k) {
    const uint16_t* r0 = reinterpret_cast<const uint16_t*>(row(2 * k));
    const uint16_t* r1 = 2 * k + 1 < n ? reinterpret_cast<const uint16_t*>(row(2 * k + 1)) : nullptr;
    for (int64_t d = 0; d < D; d += 16) {
      u16x16 lo, hi{};
      std::memcpy(&lo, r0 + d, sizeof lo);
      if (r1) std::memcpy(&hi, r1 + d, sizeof hi);
      const u32x16 pair = __builtin_convertvector(lo, u32x16) | __builtin_convertvector(hi, u32x16) << 16;
      std::memcpy(out + k * D + d, &pair, sizeof pair);
    }
  }
}

// float32 x[n] rounded to bfloat16 into out[n] (then zeros up to `padded`)
void to_bf16(const float* x, int64_t n, uint16_t* out, int64_t padded) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) out[i] = bf16_bits(x[i]);
  for (; i < padded; ++i) out[i] = 0;
}

struct ChunkBatch {  // a batch's tensors and plan, as the tasks read them
  const c10::BFloat16 *q, *k, *v;
  int64_t qsR, qsH, qsT, ksR, ksH, ksT, vsR, vsH, vsT;  // element strides (the last is 1)
  int64_t H, Hkv, T, D;
  const int64_t *chunks, *keys;  // chunks [C, 5]: row, first query, queries, first key, keys
  const float* mask;             // each chunk's [queries, keys] additive mask, chunk after chunk
  const int64_t* ext;            // each query's extent: its mask rules out the keys from there on
  std::vector<int64_t> mask_at, query_at;  // where each chunk's mask and extents start
  float scale;

  const c10::BFloat16* qrow(int64_t b, int64_t h, int64_t t) const { return q + b * qsR + h * qsH + t * qsT; }
  const c10::BFloat16* krow(int64_t b, int64_t h, int64_t t) const { return k + b * ksR + h * ksH + t * ksT; }
  const c10::BFloat16* vrow(int64_t b, int64_t h, int64_t t) const { return v + b * vsR + h * vsH + t * vsT; }
};

ChunkBatch chunk_batch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& chunks,
                       const at::Tensor& keys, const at::Tensor& mask, const at::Tensor& extents, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kBFloat16 &&
                  k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "chunk_attention: q [R, H, T, D], k and v [R, H_kv, T, D], all bfloat16");
  const int64_t R = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == R && k.size(2) == T && k.size(3) == D && H % Hkv == 0,
              "chunk_attention: k and v must be [R, H_kv, T, D] with H a multiple of H_kv");
  TORCH_CHECK(D % 32 == 0 && q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && q.stride(2) % 2 == 0 &&
                  k.stride(2) % 2 == 0 && v.stride(2) % 2 == 0 && q.stride(1) % 2 == 0 && k.stride(1) % 2 == 0 &&
                  v.stride(1) % 2 == 0 && q.stride(0) % 2 == 0 && k.stride(0) % 2 == 0 && v.stride(0) % 2 == 0,
              "chunk_attention: head size must be a multiple of 32, heads contiguous, other strides even");
  TORCH_CHECK(chunks.dim() == 2 && chunks.size(1) == 5 && chunks.scalar_type() == at::kLong && chunks.is_contiguous() &&
                  keys.scalar_type() == at::kLong && keys.is_contiguous() && mask.scalar_type() == at::kFloat &&
                  mask.is_contiguous() && extents.scalar_type() == at::kLong && extents.is_contiguous(),
              "chunk_attention: chunks [C, 5] int64, keys int64, mask float32, extents int64, all contiguous");
  ChunkBatch cb{q.data_ptr<c10::BFloat16>(), k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>(),
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), H, Hkv, T, D,
                chunks.data_ptr<int64_t>(), keys.data_ptr<int64_t>(), mask.data_ptr<float>(),
                extents.data_ptr<int64_t>(), {}, {}, (float)scale};
  const int64_t C = chunks.size(0);
  int64_t at = 0, queries = 0;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t* ch = cb.chunks + 5 * c;
    TORCH_CHECK(ch[0] >= 0 && ch[0] < R && ch[1] >= 0 && ch[2] > 0 && ch[1] + ch[2] <= T && ch[3] >= 0 &&
                    ch[4] > 0 && ch[3] + ch[4] <= keys.numel(),
                "chunk_attention: chunk ", c, " is out of the batch's bounds");
    cb.mask_at.push_back(at);
    cb.query_at.push_back(queries);
    at += ch[2] * ch[4];
    queries += ch[2];
  }
  TORCH_CHECK(at == mask.numel(), "chunk_attention: the mask holds ", mask.numel(), " entries, the chunks need ", at);
  TORCH_CHECK(queries == R * T, "chunk_attention: the chunks cover ", queries, " queries of ", R * T);
  TORCH_CHECK(extents.numel() == queries, "chunk_attention: ", extents.numel(), " extents for ", queries, " queries");
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < cb.chunks[5 * c + 2]; ++i) {
      const int64_t e = cb.ext[cb.query_at[c] + i];
      TORCH_CHECK(e >= 1 && e <= cb.chunks[5 * c + 4], "chunk_attention: query ", i, " of chunk ", c,
                  " has extent ", e, ", outside 1..", cb.chunks[5 * c + 4], " (its keys)");
    }
  const int64_t* kp = cb.keys;
  for (int64_t i = 0; i < keys.numel(); ++i)
    TORCH_CHECK(kp[i] >= 0 && kp[i] < T, "chunk_attention: key position ", kp[i], " is outside the row");
  return cb;
}

// run(chunk, kv head, thread) for every chunk and kv head, largest chunks first, each
// thread taking the next task
template <typename F>
void for_tasks(const ChunkBatch& cb, int64_t C, F run) {
  std::vector<int64_t> order(C);
  for (int64_t c = 0; c < C; ++c) order[c] = c;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return cb.chunks[5 * a + 2] * cb.chunks[5 * a + 4] > cb.chunks[5 * b + 2] * cb.chunks[5 * b + 4];
  });
  std::atomic<int64_t> next{0};
  const int64_t tasks = C * cb.Hkv;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) run(order[t / cb.Hkv], t % cb.Hkv, at::get_thread_num());
  });
}

struct Scratch {  // a thread's buffers, reused task after task
  std::vector<uint32_t> kt, vt, kp, vp, a, b, c, d, e;
  std::vector<float> s, tmp, acc;
};

// one chunk's keys as products read them: K transposed (B2 of S = Q K^T), V (B2 of O = P V);
// with `backward`, also V transposed (of dP = dO V^T) and K (of dQ = dS K)
void pack_keys(const ChunkBatch& cb, int64_t c, int64_t hk, bool backward, Scratch& w) {
  const int64_t *ch = cb.chunks + 5 * c, b = ch[0], nk = ch[4], D = cb.D, ld = round16(nk);
  const int64_t* keys = cb.keys + ch[3];
  w.kt.resize(D / 2 * ld);
  pack_transposed(nk, D, [&](int64_t i) { return cb.krow(b, hk, keys[i]); }, w.kt.data(), ld);
  w.vp.resize((nk + 1) / 2 * D);
  pack_pairs(nk, D, [&](int64_t i) { return cb.vrow(b, hk, keys[i]); }, w.vp.data());
  if (!backward) return;
  w.vt.resize(D / 2 * ld);
  pack_transposed(nk, D, [&](int64_t i) { return cb.vrow(b, hk, keys[i]); }, w.vt.data(), ld);
  w.kp.resize((nk + 1) / 2 * D);
  pack_pairs(nk, D, [&](int64_t i) { return cb.krow(b, hk, keys[i]); }, w.kp.data());
}

// head h's scores of chunk c, S = scale Q K^T + mask, into w.s [nq][round16(nk)]: each
// query's only up to its extent, -inf from there on (as its mask is; the product skips them)
void chunk_scores(const ChunkBatch& cb, int64_t c, int64_t h, Scratch& w) {
  const int64_t *ch = cb.chunks + 5 * c, b = ch[0], q0 = ch[1], nq = ch[2], nk = ch[4], D = cb.D;
  const int64_t ld = round16(nk);
  const int64_t* ext = cb.ext + cb.query_at[c];
  w.s.resize(nq * ld);
  bf16_gemm(nq, nk, D / 2, reinterpret_cast<const uint32_t*>(cb.qrow(b, h, q0)), cb.qsT / 2, w.kt.data(), ld,
            w.s.data(), ld, false, Skip{ext, true});
  const float* m = cb.mask + cb.mask_at[c];
  for (int64_t i = 0; i < nq; ++i) {
    float* s = w.s.data() + i * ld;
    const float* mi = m + i * nk;
    const int64_t e = ext[i];
    int64_t j = 0;
    for (; j + 16 <= e; j += 16) {
      const f32x16 x = load16(s + j) * cb.scale + load16(mi + j);
      std::memcpy(s + j, &x, sizeof x);
    }
    for (; j < e; ++j) s[j] = s[j] * cb.scale + mi[j];
    for (; j < ld; ++j) s[j] = -INFINITY;  // whole vectors on: exp16 gives 0 there
  }
}

inline float hsum(const f32x16 v) {
  float t = 0.0f;
  for (int l = 0; l < 16; ++l) t += v[l];
  return t;
}

inline float hmax(const f32x16 v) {
  float t = v[0];
  for (int l = 1; l < 16; ++l) t = std::max(t, v[l]);
  return t;
}

// out [R, T, H, D] in `dtype` (float32, or bfloat16 rounded once from float32 sums)
std::tuple<at::Tensor, at::Tensor> chunk_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& chunks, const at::Tensor& keys,
                                                   const at::Tensor& mask, const at::Tensor& extents, double scale,
                                                   at::ScalarType dtype) {
  const ChunkBatch cb = chunk_batch(q, k, v, chunks, keys, mask, extents, scale);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "chunk_attention: the result is float32 or bfloat16");
  const int64_t R = q.size(0), H = cb.H, T = cb.T, D = cb.D, group = H / cb.Hkv;
  at::Tensor out = at::empty({R, T, H, D}, q.options().dtype(dtype));  // [R, T, H, D]
  at::Tensor lse = at::empty({R, H, T}, q.options().dtype(at::kFloat));
  float* ls = lse.data_ptr<float>();
  const bool wide = dtype == at::kFloat;
  std::vector<Scratch> scratch(at::get_num_threads());
  for_tasks(cb, chunks.size(0), [&](int64_t c, int64_t hk, int thread) {
    Scratch& w = scratch[thread];
    const int64_t *ch = cb.chunks + 5 * c, b = ch[0], q0 = ch[1], nq = ch[2], nk = ch[4];
    const int64_t ld = round16(nk), np = (nk + 1) / 2;
    const int64_t* ext = cb.ext + cb.query_at[c];  // each query's keys: the products skip the rest
    pack_keys(cb, c, hk, false, w);
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      chunk_scores(cb, c, h, w);
      w.a.resize(nq * np);  // probabilities, bfloat16 pairs
      uint16_t* pb = reinterpret_cast<uint16_t*>(w.a.data());
      for (int64_t i = 0; i < nq; ++i) {
        float* s = w.s.data() + i * ld;
        const int64_t e = round16(ext[i]);  // zero from there on
        f32x16 vmax = f32x16{} - INFINITY;
        for (int64_t j = 0; j < e; j += 16) vmax = vmax > load16(s + j) ? vmax : load16(s + j);
        const float mx = hmax(vmax);
        f32x16 vsum{};
        for (int64_t j = 0; j < e; j += 16) {
          const f32x16 x = exp16(load16(s + j) - mx);
          std::memcpy(s + j, &x, sizeof x);
          vsum += x;
        }
        const float sum = hsum(vsum), inv = 1.0f / sum;
        for (int64_t j = 0; j < e; j += 16) {
          const f32x16 p = load16(s + j) * inv;
          std::memcpy(s + j, &p, sizeof p);
        }
        std::fill(s + e, s + ld, 0.0f);
        to_bf16(s, nk, pb + i * 2 * np, 2 * np);
        ls[(b * H + h) * T + q0 + i] = mx + std::log(sum);
      }
      const int64_t at_row = ((b * T + q0) * H + h) * D;  // query i's row at at_row + i H D
      if (wide) {
        bf16_gemm(nq, D, np, w.a.data(), np, w.vp.data(), D, out.data_ptr<float>() + at_row, H * D, false,
                  Skip{ext, false});
        continue;
      }
      w.tmp.resize(nq * D);
      bf16_gemm(nq, D, np, w.a.data(), np, w.vp.data(), D, w.tmp.data(), D, false, Skip{ext, false});
      uint16_t* ob = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()) + at_row;
      for (int64_t i = 0; i < nq; ++i) to_bf16(w.tmp.data() + i * D, D, ob + i * H * D, D);
    }
  });
  return {out, lse};
}

// rows x[n][ld] (float32, `cols` used) as bfloat16 pairs of adjacent rows: out[i][j] =
// (x[2i][j], x[2i+1][j]), [ceil(n/2)][ld_out], zero past n rows and `cols` columns
void pair_rows(const float* x, int64_t n, int64_t cols, int64_t ld, uint32_t* out, int64_t ld_out) {
  for (int64_t i = 0; 2 * i < n; ++i) {
    const float *r0 = x + 2 * i * ld, *r1 = 2 * i + 1 < n ? r0 + ld : nullptr;
    uint32_t* o = out + i * ld_out;
    int64_t j = 0;
    for (; j + 16 <= cols; j += 16) {
      u32x16 lo, hi{};
#if defined(__AVX512BF16__)
      const __m256i a = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r0 + j));
      lo = (u32x16)_mm512_cvtepu16_epi32(a);
      if (r1) hi = (u32x16)_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r1 + j)));
#else
      for (int l = 0; l < 16; ++l) lo[l] = bf16_bits(r0[j + l]), hi[l] = r1 ? bf16_bits(r1[j + l]) : 0u;
#endif
      const u32x16 pair = lo | hi << 16;
      std::memcpy(o + j, &pair, sizeof pair);
    }
    for (; j < cols; ++j) o[j] = bf16_bits(r0[j]) | (r1 ? uint32_t(bf16_bits(r1[j])) << 16 : 0u);
    std::fill(o + cols, o + ld_out, 0u);
  }
}

// chunk_attention's backward: dq [R, T, H, D], dk and dv [R, T, H_kv, D], float32, from dout
// [R, T, H, D] (float32, heads contiguous), the forward's out and lse. First one sweep over
// all queries: rowsum(dO out) and dO in bfloat16. Then per chunk and head: the
// scores again, P = exp(S - lse), dP = dO V^T, dS = scale P (dP - rowsum(dO out)), dQ = dS K,
// and (transposed, so that the products' pairs run along the queries) dK^T += Q^T dS and
// dV^T += dO^T P over the heads of the kv head, added into dK, dV at the chunk's key
// positions under a lock per row and kv head (chunks share keys).
std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& chunks, const at::Tensor& keys, const at::Tensor& mask,
    const at::Tensor& extents, double scale) {
  const ChunkBatch cb = chunk_batch(q, k, v, chunks, keys, mask, extents, scale);
  const int64_t R = q.size(0), H = cb.H, Hkv = cb.Hkv, T = cb.T, D = cb.D, group = H / Hkv;
  const auto wide = [](const at::Tensor& t) { return t.scalar_type() == at::kFloat; };
  TORCH_CHECK((wide(dout) || dout.scalar_type() == at::kBFloat16) && (wide(out) || out.scalar_type() == at::kBFloat16) &&
                  dout.is_contiguous() && out.is_contiguous() && dout.sizes() == out.sizes() && out.dim() == 4 &&
                  out.size(0) == R && out.size(1) == T && out.size(2) == H && out.size(3) == D &&
                  lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == R * H * T,
              "chunk_attention_backward: dout and out float32 or bfloat16 [R, T, H, D], lse float32 [R, H, T], "
              "contiguous");
  const int threads = at::get_num_threads();
  const at::TensorOptions f32 = q.options().dtype(at::kFloat);
  at::Tensor dq = at::empty({R, T, H, D}, f32);
  at::Tensor dkv = at::zeros({2, R, T, Hkv, D}, f32);  // dK, dV
  std::vector<std::mutex> locks(R * Hkv);
  const float* ls = lse.data_ptr<float>();
  float *dqs = dq.data_ptr<float>(), *dkvs = dkv.data_ptr<float>();
  // once for all chunks, one sweep: rowsum(dO out) per query and head, and dO in bfloat16
  // (the A of dP = dO V^T, read in place: dout itself when bfloat16; the tasks' strided reads
  // of float32 dO and out stalled on memory)
  at::Tensor delta = at::empty({R, T, H}, f32);
  at::Tensor dout16 = wide(dout) ? at::empty({R, T, H, D}, q.options()) : dout;
  float* deltas = delta.data_ptr<float>();
  uint16_t* dob = reinterpret_cast<uint16_t*>(dout16.data_ptr<c10::BFloat16>());
  auto sweep = [&](const auto* dos, const auto* outs) {
    at::parallel_for(0, R * T * H, 256, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const auto *g = dos + r * D, *o = outs + r * D;
        f32x16 dot{};
        for (int64_t d = 0; d < D; d += 16) dot += load16(g + d) * load16(o + d);
        deltas[r] = hsum(dot);
        if constexpr (std::is_same_v<std::remove_const_t<std::remove_pointer_t<decltype(g)>>, float>)
          to_bf16(g, D, dob + r * D, D);
      }
    });
  };
  if (wide(dout) && wide(out))
    sweep(dout.data_ptr<float>(), out.data_ptr<float>());
  else if (wide(dout))
    sweep(dout.data_ptr<float>(), out.data_ptr<c10::BFloat16>());
  else if (wide(out))
    sweep(dout.data_ptr<c10::BFloat16>(), out.data_ptr<float>());
  else
    sweep(dout.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  std::vector<Scratch> scratch(threads);
  for_tasks(cb, chunks.size(0), [&](int64_t c, int64_t hk, int thread) {
    Scratch& w = scratch[thread];
    const int64_t *ch = cb.chunks + 5 * c, b = ch[0], q0 = ch[1], nq = ch[2], nk = ch[4];
    const int64_t* keys = cb.keys + ch[3];
    const int64_t ld = round16(nk), np = (nk + 1) / 2, nqp = (nq + 1) / 2;
    const int64_t* ext = cb.ext + cb.query_at[c];  // each query's keys: the products skip the rest
    // dK^T and dV^T sum over the queries: per 64 keys, from the first pair of queries that sees one
    std::vector<int64_t> from((nk + 63) / 64, nqp);
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t jb = 0; 64 * jb < ext[i]; ++jb) from[jb] = std::min(from[jb], i / 2);
    pack_keys(cb, c, hk, true, w);
    w.acc.assign(2 * D * ld, 0.0f);  // dK^T, dV^T [D][ld] over the group's heads
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      chunk_scores(cb, c, h, w);  // w.s: S
      // dO rows as bfloat16 (A of dP), dO^T and Q^T as bfloat16 pairs along the queries (A
      // of dV^T and dK^T), rowsum(dO out) from the sweep above
      w.d.resize(D * nqp);
      w.e.resize(D * nqp);
      const uint16_t* dorow = dob + ((b * T + q0) * H + h) * D;  // row i at i H D
      w.b.resize(nqp * D);  // pairs of rows, [nqp][D], then transposed: [D][nqp]
      pack_pairs(nq, D, [&](int64_t i) { return dorow + i * H * D; }, w.b.data());
      transpose_rows(nqp, D, [&](int64_t p) { return w.b.data() + p * D; }, w.d.data(), nqp, false);
      pack_pairs(nq, D, [&](int64_t i) { return cb.qrow(b, h, q0 + i); }, w.b.data());
      transpose_rows(nqp, D, [&](int64_t p) { return w.b.data() + p * D; }, w.e.data(), nqp, false);
      // dP = dO V^T, its columns past nk zeroed (whole vectors below)
      w.tmp.resize(nq * ld);
      bf16_gemm(nq, nk, D / 2, reinterpret_cast<const uint32_t*>(dorow), H * D / 2, w.vt.data(), ld, w.tmp.data(),
                ld, false, Skip{ext, true});
      for (int64_t i = 0; i < nq; ++i) std::fill(w.tmp.data() + i * ld + ext[i], w.tmp.data() + (i + 1) * ld, 0.0f);
      // P and dS (into w.s and w.tmp), then as bfloat16: dS rows (A of dQ), dS and P in pairs
      // of rows (B2 of dK^T and dV^T)
      const float* l = ls + (b * H + h) * T + q0;
      const float* di = deltas + (b * T + q0) * H + h;  // query i's at i H
      for (int64_t i = 0; i < nq; ++i) {
        float *s = w.s.data() + i * ld, *dp = w.tmp.data() + i * ld;
        const f32x16 li = f32x16{} + l[i], gi = f32x16{} + di[i * H];
        const int64_t e = round16(ext[i]);  // zero from there on
        for (int64_t j = 0; j < e; j += 16) {
          const f32x16 p = exp16(load16(s + j) - li);
          const f32x16 ds = p * (load16(dp + j) - gi) * cb.scale;
          std::memcpy(s + j, &p, sizeof p);
          std::memcpy(dp + j, &ds, sizeof ds);
        }
        std::fill(s + e, s + ld, 0.0f);  // dS is zero there already: dP was, from the extent on
      }
      w.a.resize(nq * np);
      uint16_t* dsb = reinterpret_cast<uint16_t*>(w.a.data());
      for (int64_t i = 0; i < nq; ++i) to_bf16(w.tmp.data() + i * ld, nk, dsb + i * 2 * np, 2 * np);
      w.c.resize(2 * nqp * ld);
      pair_rows(w.tmp.data(), nq, nk, ld, w.c.data(), ld);
      pair_rows(w.s.data(), nq, nk, ld, w.c.data() + nqp * ld, ld);
      // dQ = dS K
      bf16_gemm(nq, D, np, w.a.data(), np, w.kp.data(), D, dqs + ((b * T + q0) * H + h) * D, H * D, false,
                Skip{ext, false});
      // dK^T += Q^T dS, dV^T += dO^T P
      bf16_gemm(D, nk, nqp, w.e.data(), nqp, w.c.data(), ld, w.acc.data(), ld, true, Skip{nullptr, false, from.data()});
      bf16_gemm(D, nk, nqp, w.d.data(), nqp, w.c.data() + nqp * ld, ld, w.acc.data() + D * ld, ld, true,
                Skip{nullptr, false, from.data()});
    }
    // dK^T and dV^T [D][ld] transposed to rows [ld][D]
    w.tmp.resize(2 * ld * D);
    uint32_t* rows = reinterpret_cast<uint32_t*>(w.tmp.data());
    const uint32_t* acc = reinterpret_cast<const uint32_t*>(w.acc.data());
    transpose_rows(2 * D, nk, [&](int64_t d) { return acc + d * ld; }, rows, 2 * D, false);
    std::lock_guard<std::mutex> hold(locks[b * Hkv + hk]);
    for (int64_t part = 0; part < 2; ++part)
      for (int64_t j = 0; j < nk; ++j) {
        float* to = dkvs + (((part * R + b) * T + keys[j]) * Hkv + hk) * D;
        const float* from = w.tmp.data() + j * 2 * D + part * D;
        for (int64_t d = 0; d < D; d += 16) store16(to + d, load16(to + d) + load16(from + d));
      }
  });
  return {dq, dkv[0], dkv[1]};
}

// rotary: Llama's rotary embedding of x [R, H, T, D] (float32 or bfloat16, strides free but
// the last: contiguous) by cos, sin [R, T, D] (float32, contiguous), into a contiguous
// [R, H, T, D] of `dtype` (float32 or bfloat16, rounded once): with x = (a, b) and cos = (c1,
// c2), sin = (s1, s2) halves, out = (a c1 - b s1, b c2 + a s2) (x cos + rotate_half(x) sin).
// transpose: the gradient's map instead, (a c1 + b s2, b c2 - a s1). One pass where the tensor
// ops take ten (four products, two halves' copies, a negation, two sums, the cast).
template <typename X, typename Y>
void rotary_rows(const at::Tensor& x, const float* cs, const float* ss, Y* out, bool transpose) {
  const int64_t R = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), h = D / 2;
  const X* xs = x.data_ptr<X>();
  const float sign = transpose ? -1.0f : 1.0f;
  at::parallel_for(0, R * H * T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / (H * T), hh = (i / T) % H, t = i % T;
      const X* a = xs + r * x.stride(0) + hh * x.stride(1) + t * x.stride(2);
      const X* b = a + h;
      const float *c = cs + (r * T + t) * D, *sn = ss + (r * T + t) * D;
      Y* o = out + i * D;
      int64_t j = 0;
      for (; j + 16 <= h; j += 16) {
        const f32x16 va = load16(a + j), vb = load16(b + j);
        // forward: s1 on b's term, s2 on a's; transpose: s2 on b's, s1 on a's, signs flipped
        const f32x16 sb = load16(sn + (transpose ? h : 0) + j), sa = load16(sn + (transpose ? 0 : h) + j);
        store16(o + j, va * load16(c + j) - sign * vb * sb);
        store16(o + h + j, vb * load16(c + h + j) + sign * va * sa);
      }
      for (; j < h; ++j) {
        const float va = a[j], vb = b[j];
        const float sb = sn[(transpose ? h : 0) + j], sa = sn[(transpose ? 0 : h) + j];
        o[j] = va * c[j] - sign * vb * sb;
        o[h + j] = vb * c[h + j] + sign * va * sa;
      }
    }
  });
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::ScalarType dtype,
                  bool transpose) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rotary: x must be float32 or bfloat16 [R, H, T, D], the last dimension contiguous");
  const int64_t R = x.size(0), T = x.size(2), D = x.size(3);
  TORCH_CHECK(D % 2 == 0, "rotary: the head size ", D, " is odd");
  for (const at::Tensor* c : {&cos, &sin})
    TORCH_CHECK(c->dim() == 3 && c->size(0) == R && c->size(1) == T && c->size(2) == D &&
                    c->scalar_type() == at::kFloat && c->is_contiguous(),
                "rotary: cos and sin must be contiguous float32 [R, T, D] of x's rows, positions and head size");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rotary: the result is float32 or bfloat16");
  at::Tensor out = at::empty({x.size(0), x.size(1), T, D}, x.options().dtype(dtype));
  const float *cs = cos.data_ptr<float>(), *ss = sin.data_ptr<float>();
  const bool wide = x.scalar_type() == at::kFloat;
  if (dtype == at::kFloat) {
    if (wide) rotary_rows<float>(x, cs, ss, out.data_ptr<float>(), transpose);
    else rotary_rows<c10::BFloat16>(x, cs, ss, out.data_ptr<float>(), transpose);
  } else {
    if (wide) rotary_rows<float>(x, cs, ss, out.data_ptr<c10::BFloat16>(), transpose);
    else rotary_rows<c10::BFloat16>(x, cs, ss, out.data_ptr<c10::BFloat16>(), transpose);
  }
  return out;
}

// token_logprobs: per row n of logits [N, V] (float32 or bfloat16, contiguous) under
// softmax(x / T): the log-prob of targets[n], the entropy, and the log normaliser lse (what
// the backward needs). Two reads of the row: its max, then exp(x / T - shift) summed beside
// its products with x / T - shift (one exp a logit); H = log s - sum(e y) / s. The tensor ops
// (log-softmax, exp, product, sum) write three [N, V] float32 tensors and read them back.
template <typename X>
void logprob_rows(const X* xs, int64_t N, int64_t V, const int64_t* targets, float t, float* logp,
                  float* ent, float* lse) {
  const float inv_t = 1.0f / t;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const X* x = xs + n * V;
      f32x16 most = f32x16{} - INFINITY;
      int64_t v = 0;
      for (; v + 16 <= V; v += 16) {
        const f32x16 c = load16(x + v);
        most = c > most ? c : most;
      }
      float top = -INFINITY;
      for (int i = 0; i < 16; ++i) top = std::max(top, most[i]);
      for (; v < V; ++v) top = std::max(top, static_cast<float>(x[v]));
      const float shift = top * inv_t;  // every exp(x / T - shift) <= 1
      f32x16 s{}, sy{};
      for (v = 0; v + 16 <= V; v += 16) {
        const f32x16 y = load16(x + v) * inv_t - shift;
        const f32x16 e = exp16(y);
        s += e;
        sy += y >= -87.0f ? e * y : f32x16{};  // a -inf logit weighs 0 (0 x -inf is NaN)
      }
      float sum = hsum16(s), sumy = hsum16(sy);
      for (; v < V; ++v) {
        const float y = static_cast<float>(x[v]) * inv_t - shift, e = std::exp(y);
        sum += e;
        sumy += e > 0.0f ? e * y : 0.0f;
      }
      const float logz = std::log(sum);
      lse[n] = shift + logz;
      // log-softmax's rounding (x / T - max / T - log s), at most 0 as in sample
      logp[n] = std::min(0.0f, static_cast<float>(x[targets[n]]) / t - top / t - logz);
      ent[n] = logz - sumy / sum;
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprobs(const at::Tensor& logits, const at::Tensor& targets,
                                                              double temperature) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "token_logprobs: logits must be a contiguous 2-d float32 or bfloat16 tensor");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(targets.dim() == 1 && targets.scalar_type() == at::kLong && targets.size(0) == N &&
                  targets.is_contiguous(),
              "token_logprobs: targets must be contiguous int64 [N], one per row of logits");
  TORCH_CHECK(temperature > 0, "token_logprobs: temperature must be > 0");
  TORCH_CHECK(V > 0 || N == 0, "token_logprobs: an empty vocabulary");
  const int64_t* ts = targets.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(ts[n] >= 0 && ts[n] < V, "token_logprobs: target ", ts[n], " of row ", n,
                " is outside the vocabulary of ", V);
  auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor logp = at::empty({N}, f32), ent = at::empty({N}, f32), lse = at::empty({N}, f32);
  const float t = static_cast<float>(temperature);
  if (logits.scalar_type() == at::kFloat)
    logprob_rows(logits.data_ptr<float>(), N, V, ts, t, logp.data_ptr<float>(), ent.data_ptr<float>(),
                 lse.data_ptr<float>());
  else
    logprob_rows(logits.data_ptr<c10::BFloat16>(), N, V, ts, t, logp.data_ptr<float>(),
                 ent.data_ptr<float>(), lse.data_ptr<float>());
  return {logp, ent, lse};
}

// token_logprobs_backward: d logp[n] / d x[n, v] = (onehot(v == target) - p[n, v]) / T, with
// p = exp(x / T - lse): one read of the row, one write of the gradient in the logits' dtype.
template <typename X>
void logprob_grad_rows(const float* grad, const X* xs, int64_t N, int64_t V, const int64_t* targets,
                       const float* lse, float t, X* out) {
  const float inv_t = 1.0f / t;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const X* x = xs + n * V;
      X* o = out + n * V;
      const float g = grad[n] * inv_t, l = lse[n];
      int64_t v = 0;
      for (; v + 16 <= V; v += 16) store16(o + v, exp16(load16(x + v) * inv_t - l) * -g);
      for (; v < V; ++v) o[v] = -g * std::exp(static_cast<float>(x[v]) * inv_t - l);
      const int64_t k = targets[n];
      o[k] = g * (1.0f - std::exp(static_cast<float>(x[k]) * inv_t - l));
    }
  });
}

// token_logprobs_backward_into: the same gradient written into `out` (contiguous [N, V], the
// logits' dtype): memory the caller keeps, where a new [N, V] tensor's pages are faulted in
// on the first write.
void token_logprobs_backward_into(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& targets,
                                  const at::Tensor& lse, double temperature, at::Tensor& out) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "token_logprobs_backward: logits must be a contiguous 2-d float32 or bfloat16 tensor");
  const int64_t N = logits.size(0), V = logits.size(1);
  for (const at::Tensor* r : {&grad, &lse})
    TORCH_CHECK(r->dim() == 1 && r->scalar_type() == at::kFloat && r->size(0) == N && r->is_contiguous(),
                "token_logprobs_backward: grad and lse must be contiguous float32 [N]");
  TORCH_CHECK(targets.dim() == 1 && targets.scalar_type() == at::kLong && targets.size(0) == N &&
                  targets.is_contiguous(),
              "token_logprobs_backward: targets must be contiguous int64 [N]");
  TORCH_CHECK(temperature > 0, "token_logprobs_backward: temperature must be > 0");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == V && out.is_contiguous() &&
                  out.scalar_type() == logits.scalar_type() && out.device() == logits.device(),
              "token_logprobs_backward: out must be a contiguous [N, V] tensor of the logits' dtype");
  const int64_t* ts = targets.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(ts[n] >= 0 && ts[n] < V, "token_logprobs_backward: target ", ts[n], " of row ", n,
                " is outside the vocabulary of ", V);
  const float t = static_cast<float>(temperature);
  if (logits.scalar_type() == at::kFloat)
    logprob_grad_rows(grad.data_ptr<float>(), logits.data_ptr<float>(), N, V, ts, lse.data_ptr<float>(), t,
                      out.data_ptr<float>());
  else
    logprob_grad_rows(grad.data_ptr<float>(), logits.data_ptr<c10::BFloat16>(), N, V, ts, lse.data_ptr<float>(),
                      t, out.data_ptr<c10::BFloat16>());
}

at::Tensor token_logprobs_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& targets,
                                   const at::Tensor& lse, double temperature) {
  at::Tensor out = at::empty(logits.sizes(), logits.options());
  token_logprobs_backward_into(grad, logits, targets, lse, temperature, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(agent_rl_kernels, m) {
  m.def("blocked_linear(Tensor x, Tensor panels, Tensor? bias) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_forward(Tensor x, Tensor weight, float eps, ScalarType dtype) -> (Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)");
  m.def("sample(Tensor logits, Tensor uniforms, float temperature) -> (Tensor, Tensor)");
  m.def("rotary_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor keys, Tensor values, int slot) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("silu_mul_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("add_into(Tensor(a!) dst, Tensor src) -> ()");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, ScalarType dtype, bool transpose) -> Tensor");
  m.def("chunk_attention(Tensor q, Tensor k, Tensor v, Tensor chunks, Tensor keys, Tensor mask, Tensor extents, float scale, ScalarType dtype) -> (Tensor, Tensor)");
  m.def("chunk_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor chunks, Tensor keys, Tensor mask, Tensor extents, float scale) -> (Tensor, Tensor, Tensor)");
  m.def("token_logprobs(Tensor logits, Tensor targets, float temperature) -> (Tensor, Tensor, Tensor)");
  m.def("token_logprobs_backward(Tensor grad, Tensor logits, Tensor targets, Tensor lse, float temperature) -> Tensor");
  m.def("token_logprobs_backward_into(Tensor grad, Tensor logits, Tensor targets, Tensor lse, float temperature, Tensor(a!) out) -> ()");
  m.def("decode_attention(Tensor q, Tensor k1, Tensor v1, Tensor rows1, Tensor k2, Tensor v2, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(agent_rl_kernels, CPU, m) {
  m.impl("blocked_linear", &blocked_linear);
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_forward", &rms_norm_forward);
  m.impl("rms_norm_backward", &rms_norm_backward);
  m.impl("sample", &sample);
  m.impl("decode_attention", &decode_attention);
  m.impl("rotary_write", &rotary_write);
  m.impl("silu_mul", &silu_mul);
  m.impl("silu_mul_backward", &silu_mul_backward);
  m.impl("add_into", &add_into);
  m.impl("rotary", &rotary);
  m.impl("chunk_attention", &chunk_attention);
  m.impl("chunk_attention_backward", &chunk_attention_backward);
  m.impl("token_logprobs", &token_logprobs);
  m.impl("token_logprobs_backward", &token_logprobs_backward);
  m.impl("token_logprobs_backward_into", &token_logprobs_backward_into);
}
