// One Llama-family decoder layer on the CPU in one call: the decode / verify step's whole layer (RMSNorm, the
// fused q/k/v projection, optional q/k RMSNorm, RoPE, the K/V store, attention over the paged cache, the output
// projection and residual add, RMSNorm, gate/up, SwiGLU, down and residual add) as C++ loops around the Q4 x Q8
// matmuls of cpu_q8_kernel.h. An eager layer is ~60 torch ops and their Python; at a 135M model's size that,
// not the matmuls, was most of a CPU token. Built with cpu_q8_kernel.cpp (tercel/models/cpu_q8.py) and
// registered as torch.ops.tercel_cpu_q8.decoder_layer; tercel/models/cpu_fused.py calls it.
//
// Numerics: the residual stream and every activation stay fp32 (the eager bf16 path rounds to bf16 after each
// op); the matmul inputs are quantised to Q8 as in q4q8_linear; K/V are stored in the cache's dtype. Dense fp32
// weights instead (an fp32 model) run exact fp32 matmuls: the same layer as the eager fp32 forward up to the order
// of its sums, which is how its logic is checked on the real model. Each row's
// result depends on its own row and the cache only, so a verify of t rows computes what t decodes would.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_q8_kernel.h"

namespace {

using namespace tercel_q8;

// Where each weight sits in the layer's tensor list (cpu_fused.py builds it in this order); an absent bias or
// q/k norm is an empty tensor.
enum Slot : int {
  kNorm1, kQkvQs, kQkvD, kQkvM, kQkvBias, kQNorm, kKNorm, kOQs, kOD, kOM, kOBias,
  kNorm2, kGuQs, kGuD, kGuM, kGuBias, kDnQs, kDnD, kDnM, kDnBias, kNumSlots
};
// dims: hidden, num_heads, num_kv_heads, head_dim, intermediate, sliding_window (0: none)
enum Dim : int { kHidden, kHeads, kKvHeads, kHeadDim, kInter, kWindow, kNumDims };

struct Proj {
  Weights w;
  int64_t n;
  const float* bias;  // null: none
  at::Tensor dense;   // defined: an fp32 [n, k] weight multiplied exactly (the fp32 check path), w unused
};

const float* optional_f32(const at::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

// A projection's four tensors from slot qs on: Q4 x Q8 (uint8 qs, fp16 d and m) or a dense fp32 weight (then d
// and m empty), and the bias.
Proj proj(at::TensorList t, int qs, int64_t k, int64_t n) {
  if (t[qs].scalar_type() == at::kFloat) {
    TORCH_CHECK(t[qs].dim() == 2 && t[qs].size(0) == n && t[qs].size(1) == k,
                "decoder_layer: weight ", qs, " must be a dense fp32 [", n, ", ", k, "] matrix, got ", t[qs].sizes());
    return Proj{Weights{}, n, optional_f32(t[qs + 3]), t[qs]};
  }
  const int64_t nb = k / kBlock, groups = (n + 7) / 8;
  TORCH_CHECK(k % kBlock == 0 && t[qs].scalar_type() == at::kByte && t[qs].numel() == groups * nb * 128 &&
                  t[qs + 1].numel() == groups * nb * 8 && t[qs + 2].numel() == groups * nb * 8,
              "decoder_layer: weight ", qs, " does not hold a [", n, ", ", k, "] Q4 matrix");
  return Proj{Weights{t[qs].data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(t[qs + 1].data_ptr<at::Half>()),
                      reinterpret_cast<const uint16_t*>(t[qs + 2].data_ptr<at::Half>()), nb},
              n, optional_f32(t[qs + 3]), at::Tensor()};
}

// y[M, n] = x[M, k] @ W^T (+ bias)
void project(float* x, int64_t M, int64_t k, const Proj& p, QuantizedRows& q, float* y) {
  if (p.dense.defined()) {
    at::Tensor out = at::from_blob(y, {M, p.n}, at::kFloat);
    at::mm_out(out, at::from_blob(x, {M, k}, at::kFloat), p.dense.t());
  } else {
    q.quantize(x, M, k);
    matmul_q8(q.acts(), M, p.w, p.n, y);
  }
  if (p.bias)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t i = 0; i < p.n; ++i) y[r * p.n + i] += p.bias[i];
}

void rms_norm(const float* x, int64_t n, const float* w, float eps, float* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// HF's rotate-half RoPE in place on one head: x * cos + cat(-x2, x1) * sin
void rope(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

inline float to_f32(float v) { return v; }
inline float to_f32(at::BFloat16 v) {  // the bit shift spelled out, so the loops below vectorise
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct Rows {  // the step's rows: which request, how many keys each sees, the rotary rows
  const int64_t* slots;    // [M] KV slot each row's K/V goes to
  const int64_t* req;      // [M] the row's request
  const int64_t* kv_len;   // [M] keys the row sees: positions [kv_len - window, kv_len) of its request
  const int64_t* tables;   // [B, W] block tables
  int64_t table_width, block_size;
  const float* cos_sin;    // [M, 2 * head_dim]
};

// 8 consecutive cache values as fp32 (bf16: the bits shifted into place)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp of 8 floats (Cephes' expf: 2^n exp(r), |r| <= ln2 / 2, a polynomial): within 1 ulp of std::exp on [-87, 0],
// the softmax's range (checked at 2e7 points).
// Vectorised because the softmax runs over every key of every head in every layer.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));  // 2^n stays normal
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts: r exact enough
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

// sc[0, n) <- softmax(sc)
inline void softmax(float* sc, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sc[j]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vmx));
    _mm256_storeu_ps(sc + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum(vsum);
  for (; j < n; ++j) sum += (sc[j] = std::exp(sc[j] - mx));
  const float inv = 1.0f / sum;
  for (j = 0; j < n; ++j) sc[j] *= inv;
}

constexpr int64_t kMaxVecDim = 256;  // head dims up to this, in multiples of 8, take the vector path

// q . key for the `group` query heads sharing one KV head: scores[g * stride + j]
template <typename C>
inline void dot_heads(const float* q, const C* key, int64_t group, int64_t D, float scale, float* scores,
                      int64_t stride, int64_t j) {
  if (D % 8 == 0 && D <= kMaxVecDim) {
    __m256 k[kMaxVecDim / 8];
    for (int64_t c = 0; c < D / 8; ++c) k[c] = load8(key + 8 * c);  // the key converted once for every head
    for (int64_t g = 0; g < group; ++g) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t c = 0; c < D / 8; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 8 * c), k[c], acc);
      scores[g * stride + j] = hsum(acc) * scale;
    }
    return;
  }
  for (int64_t g = 0; g < group; ++g) {
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s += q[g * D + d] * to_f32(key[d]);
    scores[g * stride + j] = s * scale;
  }
}

// o[g * D ..] += p[g] * value for the `group` heads
template <typename C>
inline void add_value(const C* value, int64_t group, int64_t D, const float* p, float* o) {
  if (D % 8 == 0 && D <= kMaxVecDim) {
    for (int64_t c = 0; c < D / 8; ++c) {
      const __m256 v = load8(value + 8 * c);
      for (int64_t g = 0; g < group; ++g) {
        float* dst = o + g * D + 8 * c;
        _mm256_storeu_ps(dst, _mm256_fmadd_ps(_mm256_set1_ps(p[g]), v, _mm256_loadu_ps(dst)));
      }
    }
    return;
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < D; ++d) o[g * D + d] += p[g] * to_f32(value[d]);
}

// out[M, H * D] = attention of q over each row's keys in the paged cache (fp32 scores and sums)
template <typename C>
void attend(const float* qkv, int64_t M, const int64_t* dims, float scale, const Rows& rows, const C* k_cache,
            const C* v_cache, float* out) {
  const int64_t H = dims[kHeads], Hkv = dims[kKvHeads], D = dims[kHeadDim], window = dims[kWindow];
  const int64_t group = H / Hkv, width = (H + 2 * Hkv) * D;
  int64_t longest = 1;
  for (int64_t r = 0; r < M; ++r) longest = std::max(longest, rows.kv_len[r]);
  // one item per (row, KV head): its query heads read each key and value once; short contexts stay on one thread
  const int64_t grain = std::max<int64_t>(1, 16384 / (longest * D * group));
  at::parallel_for(0, M * Hkv, grain, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> scores, p;  // reused across calls: no allocation per layer
    scores.resize(group * longest);
    p.resize(group);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t r = item / Hkv, kh = item % Hkv;
      const int64_t end = rows.kv_len[r], start = window > 0 ? std::max<int64_t>(0, end - window) : 0;
      const int64_t n = end - start;
      const int64_t* table = rows.tables + rows.req[r] * rows.table_width;
      const float* q = qkv + r * width + kh * group * D;  // the group's query heads, side by side
      // keys in position order, block by block (no division per key: it cost more than the key's arithmetic)
      const int64_t bs = rows.block_size;
      auto for_each_slot = [&](auto&& fn) {
        int64_t blk = start / bs, off = start % bs;
        for (int64_t j = 0; j < n; ++j) {
          fn(j, ((table[blk] * bs + off) * Hkv + kh) * D);
          if (++off == bs) off = 0, ++blk;
        }
      };
      for_each_slot([&](int64_t j, int64_t at) { dot_heads(q, k_cache + at, group, D, scale, scores.data(), n, j); });
      for (int64_t g = 0; g < group; ++g) softmax(scores.data() + g * n, n);
      float* o = out + r * H * D + kh * group * D;
      std::fill(o, o + group * D, 0.f);
      for_each_slot([&](int64_t j, int64_t at) {
        for (int64_t g = 0; g < group; ++g) p[g] = scores[g * n + j];
        add_value(v_cache + at, group, D, p.data(), o);
      });
    }
  });
}

template <typename C>
void layer(float* h, int64_t M, at::TensorList t, const int64_t* dims, float eps, float scale,
           const Rows& rows, C* k_cache, C* v_cache) {
  const int64_t Hd = dims[kHidden], H = dims[kHeads], Hkv = dims[kKvHeads], D = dims[kHeadDim], I = dims[kInter];
  const int64_t width = (H + 2 * Hkv) * D;
  const Proj qkv = proj(t, kQkvQs, Hd, width), o = proj(t, kOQs, H * D, Hd);
  const Proj gate_up = proj(t, kGuQs, Hd, 2 * I), down = proj(t, kDnQs, I, Hd);
  const float *norm1 = t[kNorm1].data_ptr<float>(), *norm2 = t[kNorm2].data_ptr<float>();
  const float *q_norm = optional_f32(t[kQNorm]), *k_norm = optional_f32(t[kKNorm]);
  // scratch reused across calls (30+ calls a token): no allocation per layer
  thread_local std::vector<float> x, y, act;
  thread_local QuantizedRows q;
  x.resize(M * std::max(Hd, H * D));
  y.resize(M * std::max(width, 2 * I));
  act.resize(M * I);

  // attention: h += o_proj(attn(rope(qkv(norm(h)))))
  for (int64_t r = 0; r < M; ++r) rms_norm(h + r * Hd, Hd, norm1, eps, x.data() + r * Hd);
  project(x.data(), M, Hd, qkv, q, y.data());
  for (int64_t r = 0; r < M; ++r) {
    float* row = y.data() + r * width;
    const float *cos = rows.cos_sin + r * 2 * D, *sin = cos + D;
    for (int64_t head = 0; head < H + Hkv; ++head) {  // q heads, then k heads
      float* v = row + head * D;
      if (q_norm) rms_norm(v, D, head < H ? q_norm : k_norm, eps, v);
      rope(v, cos, sin, D);
    }
    C* kd = k_cache + rows.slots[r] * Hkv * D;
    C* vd = v_cache + rows.slots[r] * Hkv * D;
    for (int64_t i = 0; i < Hkv * D; ++i) {
      kd[i] = static_cast<C>(row[H * D + i]);
      vd[i] = static_cast<C>(row[(H + Hkv) * D + i]);
    }
  }
  attend(y.data(), M, dims, scale, rows, k_cache, v_cache, x.data());
  project(x.data(), M, H * D, o, q, y.data());
  for (int64_t i = 0; i < M * Hd; ++i) h[i] += y[i];

  // MLP: h += down(silu(gate) * up), gate/up of norm(h)
  for (int64_t r = 0; r < M; ++r) rms_norm(h + r * Hd, Hd, norm2, eps, x.data() + r * Hd);
  project(x.data(), M, Hd, gate_up, q, y.data());
  for (int64_t r = 0; r < M; ++r)
    for (int64_t i = 0; i < I; ++i) {
      const float g = y[r * 2 * I + i], u = y[r * 2 * I + I + i];
      act[r * I + i] = g / (1.0f + std::exp(-g)) * u;
    }
  project(act.data(), M, I, down, q, y.data());
  for (int64_t i = 0; i < M * Hd; ++i) h[i] += y[i];
}

void decoder_layer(at::Tensor& h, at::TensorList weights, at::IntArrayRef dims, double eps,
                   double scale, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                   const at::Tensor& req, const at::Tensor& kv_len, const at::Tensor& tables,
                   const at::Tensor& cos_sin, int64_t block_size) {
  TORCH_CHECK(weights.size() == kNumSlots, "decoder_layer: expected ", int(kNumSlots), " weight tensors, got ",
              weights.size());
  TORCH_CHECK(dims.size() == kNumDims, "decoder_layer: expected ", int(kNumDims), " dims, got ", dims.size());
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.is_contiguous() && h.dim() == 2 && h.size(1) == dims[kHidden],
              "decoder_layer: h must be a contiguous fp32 [M, ", dims[kHidden], "] tensor, got ", h.sizes(), " ",
              h.scalar_type());
  const int64_t M = h.size(0), Hkv = dims[kKvHeads], D = dims[kHeadDim];
  TORCH_CHECK(dims[kHeads] % Hkv == 0 && D % 2 == 0, "decoder_layer: bad head layout");
  for (const at::Tensor* t : {&slots, &req, &kv_len})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == M,
                "decoder_layer: slots, req and kv_len must be contiguous int64 [", M, "]");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2,
              "decoder_layer: tables must be contiguous int64 [B, W]");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.numel() == M * 2 * D,
              "decoder_layer: cos_sin must be contiguous fp32 [M, ", 2 * D, "]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  k_cache.numel() % (Hkv * D) == 0,
              "decoder_layer: k_cache and v_cache must be contiguous [slots, ", Hkv, ", ", D, "] of one dtype");
  const Rows rows{slots.data_ptr<int64_t>(), req.data_ptr<int64_t>(), kv_len.data_ptr<int64_t>(),
                  tables.data_ptr<int64_t>(), tables.size(1), block_size, cos_sin.data_ptr<float>()};
  for (const at::Tensor& t : weights)
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "decoder_layer: every weight must be a contiguous CPU tensor");
  const at::TensorList w = weights;
  if (k_cache.scalar_type() == at::kBFloat16)
    layer(h.data_ptr<float>(), M, w, dims.data(), float(eps), float(scale), rows, k_cache.data_ptr<at::BFloat16>(),
          v_cache.data_ptr<at::BFloat16>());
  else if (k_cache.scalar_type() == at::kFloat)
    layer(h.data_ptr<float>(), M, w, dims.data(), float(eps), float(scale), rows, k_cache.data_ptr<float>(),
          v_cache.data_ptr<float>());
  else
    TORCH_CHECK(false, "decoder_layer: the KV cache must be bfloat16 or float32, got ", k_cache.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tercel_cpu_q8, lib) {
  lib.def("decoder_layer(Tensor(a!) h, Tensor[] weights, int[] dims, float eps, float scale, Tensor(b!) k_cache, "
          "Tensor(c!) v_cache, Tensor slots, Tensor req, Tensor kv_len, Tensor tables, Tensor cos_sin, "
          "int block_size) -> ()");
}

TORCH_LIBRARY_IMPL(tercel_cpu_q8, CPU, lib) {
  lib.impl("decoder_layer", &decoder_layer);
}
