// The Q4 x Q8 kernel's core, shared by cpu_q8_kernel.cpp (the linear op) and cpu_layer_kernel.cpp (the fused
// decoder layer): activation quantisation to Q8 blocks and the 8-row weight-group dot products. The layout and
// the scheme are described at the top of cpu_q8_kernel.cpp.
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace tercel_q8 {

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRows = 4;  // activation rows per pass over a weight tile (more rows: further passes)

// acc + per lane the sum of its 4 byte products w * x (w unsigned, x signed)
inline __m256i dot_acc(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  // |w * x| <= 15 * 128 * 2 per pair: maddubs cannot saturate
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

// One row of x -> int8 blocks q, scales d (= amax / 127) and d * sum(q) per block (llama.cpp's Q8_1).
inline void quantize_row(const float* x, int64_t nb, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const float* p = x + b * kBlock;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(p + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float mx = _mm_cvtss_f32(m4);
    const float scale = mx / 127.0f;
    const float inv = mx != 0.0f ? 127.0f / mx : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i iv[4];
    for (int i = 0; i < 4; ++i)  // round half to even, like torch.round in the tests' reference
      iv[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    // packs work within 128-bit lanes: the permute puts the 32 bytes back in order
    __m256i a = _mm256_packs_epi32(iv[0], iv[1]);
    __m256i c = _mm256_packs_epi32(iv[2], iv[3]);
    a = _mm256_packs_epi16(a, c);
    a = _mm256_permutevar8x32_epi32(a, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), a);
    d[b] = scale;
    s[b] = scale * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

struct Weights {
  const uint8_t* qs;
  const uint16_t* d;  // fp16 bits
  const uint16_t* m;
  int64_t nb;
};

struct Acts {
  const int8_t* q;  // [rows, nb * 32]
  const float* d;   // [rows, nb]
  const float* s;   // [rows, nb]
  int64_t nb;
};

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 8 weight rows (group g) against M activation rows r0..: 8 sums per activation row into out[m][8].
template <int M>
void group(const Weights& w, const Acts& a, int64_t g, int64_t r0, float (*out)[8]) {
  __m256 acc[M], accm[M];  // the d terms and the min terms: two chains, summed at the end
  for (int m = 0; m < M; ++m) acc[m] = accm[m] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int64_t bq = a.nb * kBlock;
  const uint8_t* qs = w.qs + g * a.nb * 128;
  const uint16_t* dp = w.d + g * a.nb * 8;
  const uint16_t* mp = w.m + g * a.nb * 8;
  for (int64_t b = 0; b < a.nb; ++b) {
    __m256i lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + b * 128 + c * 32));
      lo[c] = _mm256_and_si256(v, low);
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dp + b * 8)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mp + b * 8)));
    for (int m = 0; m < M; ++m) {
      const int8_t* x = a.q + (r0 + m) * bq + b * kBlock;
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        s0 = dot_acc(s0, lo[c], _mm256_set1_epi32(load4(x + 4 * c)));
        s1 = dot_acc(s1, hi[c], _mm256_set1_epi32(load4(x + 16 + 4 * c)));
      }
      const __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
      acc[m] = _mm256_fmadd_ps(p, _mm256_mul_ps(dw, _mm256_set1_ps(a.d[(r0 + m) * a.nb + b])), acc[m]);
      accm[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[(r0 + m) * a.nb + b]), accm[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(out[m], _mm256_add_ps(acc[m], accm[m]));
}

inline void group_any(int64_t m, const Weights& w, const Acts& a, int64_t g, int64_t r0, float (*out)[8]) {
  switch (m) {
    case 1: return group<1>(w, a, g, r0, out);
    case 2: return group<2>(w, a, g, r0, out);
    case 3: return group<3>(w, a, g, r0, out);
    default: return group<4>(w, a, g, r0, out);
  }
}

// ---- Q8_0 weights (a GGUF's head or tied embedding) against int16 activations ----
// The head's logits feed sampling directly, so its activations are quantised finer than Q8: int16 per block of
// 32 (scale amax / 32767, an error 256 times smaller), with madd_epi16's exact int32 pair sums. Weight layout:
// qs int8 [N / 8, nb, 16, 8, 2] (block b, chunk c, row r, byte t: q[r][32 b + 2 c + t]), d fp16 [N / 8, nb, 8].
struct Acts16 {
  const int16_t* q;  // [rows, nb * 32]
  const float* d;    // [rows, nb]
  int64_t nb;
};

inline int32_t load2x16(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <int M>
void group16(const Weights& w, const Acts16& a, int64_t g, int64_t r0, float (*out)[8]) {
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  const int8_t* qs = reinterpret_cast<const int8_t*>(w.qs) + g * a.nb * 256;
  const uint16_t* dp = w.d + g * a.nb * 8;
  for (int64_t b = 0; b < a.nb; ++b) {
    __m256i wv[16];
    for (int c = 0; c < 16; ++c)
      wv[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 256 + c * 16)));
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dp + b * 8)));
    for (int m = 0; m < M; ++m) {
      const int16_t* x = a.q + (r0 + m) * a.nb * kBlock + b * kBlock;
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      for (int c = 0; c < 16; c += 2) {  // |sum| <= 32 * 128 * 32767 < 2^31
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(wv[c], _mm256_set1_epi32(load2x16(x + 2 * c))));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(wv[c + 1], _mm256_set1_epi32(load2x16(x + 2 * c + 2))));
      }
      const __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
      acc[m] = _mm256_fmadd_ps(p, _mm256_mul_ps(dw, _mm256_set1_ps(a.d[(r0 + m) * a.nb + b])), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(out[m], acc[m]);
}

inline void group16_any(int64_t m, const Weights& w, const Acts16& a, int64_t g, int64_t r0, float (*out)[8]) {
  switch (m) {
    case 1: return group16<1>(w, a, g, r0, out);
    case 2: return group16<2>(w, a, g, r0, out);
    case 3: return group16<3>(w, a, g, r0, out);
    default: return group16<4>(w, a, g, r0, out);
  }
}

inline void store(float* y, int64_t i, float v) { y[i] = v; }
inline void store(at::BFloat16* y, int64_t i, float v) { y[i] = at::BFloat16(v); }  // round to nearest even

// Activations quantised once for all rows (serially: a few microseconds against the weight pass).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  int64_t nb = 0;

  void quantize(const float* x, int64_t M, int64_t K) {
    nb = K / kBlock;
    q.resize(M * K);
    d.resize(M * nb);
    s.resize(M * nb);
    for (int64_t r = 0; r < M; ++r) quantize_row(x + r * K, nb, q.data() + r * K, d.data() + r * nb, s.data() + r * nb);
  }
  Acts acts() const { return Acts{q.data(), d.data(), s.data(), nb}; }
};

struct QuantizedRows16 {
  std::vector<int16_t> q;
  std::vector<float> d;
  int64_t nb = 0;

  void quantize(const float* x, int64_t M, int64_t K) {
    nb = K / kBlock;
    q.resize(M * K);
    d.resize(M * nb);
    for (int64_t blk = 0; blk < M * nb; ++blk) {
      const float* p = x + blk * kBlock;
      float mx = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) mx = std::max(mx, std::fabs(p[i]));
      const float inv = mx != 0.0f ? 32767.0f / mx : 0.0f;
      for (int64_t i = 0; i < kBlock; ++i) q[blk * kBlock + i] = static_cast<int16_t>(std::nearbyint(p[i] * inv));
      d[blk] = mx / 32767.0f;
    }
  }
  Acts16 acts() const { return Acts16{q.data(), d.data(), nb}; }
};

// out[M, N] by groups of 8 weight rows, group_fn(rows, g, r0, part) giving rows r0.. of group g; a group runs
// all activation rows while its weights are in cache.
template <typename T, typename GroupFn>
void matmul_groups(int64_t M, int64_t N, GroupFn group_fn, T* out) {
  const int64_t groups = (N + 7) / 8;
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    alignas(32) float part[kMaxRows][8];
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
        const int64_t rows = std::min(kMaxRows, M - r0);
        group_fn(rows, g, r0, part);
        const int64_t n_end = std::min<int64_t>(8, N - g * 8);
        for (int64_t m = 0; m < rows; ++m)
          for (int64_t i = 0; i < n_end; ++i) store(out, (r0 + m) * N + g * 8 + i, part[m][i]);
      }
    }
  });
}

// out[M, N] = (Q8-quantised x) @ W^T for 4-bit W
template <typename T>
void matmul_q8(const Acts& a, int64_t M, const Weights& w, int64_t N, T* out) {
  matmul_groups(M, N, [&](int64_t rows, int64_t g, int64_t r0, float (*part)[8]) { group_any(rows, w, a, g, r0, part); },
                out);
}

// out[M, N] = (int16-quantised x) @ W^T for Q8_0 W
template <typename T>
void matmul_q8w(const Acts16& a, int64_t M, const Weights& w, int64_t N, T* out) {
  matmul_groups(M, N,
                [&](int64_t rows, int64_t g, int64_t r0, float (*part)[8]) { group16_any(rows, w, a, g, r0, part); },
                out);
}

}  // namespace tercel_q8
