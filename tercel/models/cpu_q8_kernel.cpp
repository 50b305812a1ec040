// y[M, N] = x[M, K] @ W^T with W in GGUF 4-bit blocks and x quantised per block of 32 to int8 (Q8),
// integer dot products per block, fp32 accumulation: the Q4 x Q8 scheme llama.cpp runs on CPUs.
// Built by tercel/models/cpu_q8.py (torch.utils.cpp_extension, -O3 -march=native) and registered as
// torch.ops.tercel_cpu_q8.q4q8_linear. Needs AVX2, FMA and F16C; the VNNI instructions are used when the
// compiler targets them (-march=native on a CPU that has them).
//
// Weight layout (made at load time by cpu_q8.py): rows in groups of 8 (N padded with zero rows), so one
// 256-bit vector holds 8 rows and each lane's 4 bytes are one row's 4 consecutive inputs; a dot product then
// gives the 8 rows' sums in the 8 lanes, with no horizontal reductions and the 8 rows' scales as one vector.
//   qs   uint8 [N / 8, nb, 4, 8, 4]  block b, chunk c, row r, byte t: q[r][32 b + 4 c + t] in the low nibble,
//                                    q[r][32 b + 16 + 4 c + t] in the high one
//   d, m fp16  [N / 8, nb, 8]        per block w = d * q + m (Q4_0: m = -8 d)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

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
void quantize_row(const float* x, int64_t nb, int8_t* q, float* d, float* s) {
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

void group_any(int64_t m, const Weights& w, const Acts& a, int64_t g, int64_t r0, float (*out)[8]) {
  switch (m) {
    case 1: return group<1>(w, a, g, r0, out);
    case 2: return group<2>(w, a, g, r0, out);
    case 3: return group<3>(w, a, g, r0, out);
    default: return group<4>(w, a, g, r0, out);
  }
}

inline void store(float* y, int64_t i, float v) { y[i] = v; }
inline void store(at::BFloat16* y, int64_t i, float v) { y[i] = at::BFloat16(v); }  // round to nearest even

template <typename T>
void run(const at::Tensor& x, const Weights& w, int64_t N, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  // quantise x once (all rows), serially: a few microseconds against the weight pass
  std::vector<float> xf(K);
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  const T* xp = x.data_ptr<T>();
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t k = 0; k < K; ++k) xf[k] = static_cast<float>(xp[r * K + k]);
    quantize_row(xf.data(), nb, xq.data() + r * K, xd.data() + r * nb, xs.data() + r * nb);
  }
  const Acts a{xq.data(), xd.data(), xs.data(), nb};
  T* out = y.data_ptr<T>();
  const int64_t groups = (N + 7) / 8;
  // over N by groups of 8 rows; a group runs all activation rows while its weights are in cache
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    alignas(32) float part[kMaxRows][8];
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
        const int64_t rows = std::min(kMaxRows, M - r0);
        group_any(rows, w, a, g, r0, part);
        const int64_t n_end = std::min<int64_t>(8, N - g * 8);
        for (int64_t m = 0; m < rows; ++m)
          for (int64_t i = 0; i < n_end; ++i) store(out, (r0 + m) * N + g * 8 + i, part[m][i]);
      }
    }
  });
}

at::Tensor q4q8_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                       int64_t N) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu(), "q4q8_linear: x must be a 2-D CPU tensor, got ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat,
              "q4q8_linear: x must be bfloat16 or float32, got ", x_in.scalar_type());
  TORCH_CHECK(qs.scalar_type() == at::kByte && d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf,
              "q4q8_linear: qs must be uint8 and d, m float16");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "q4q8_linear: K = ", K, " is not a multiple of ", kBlock);
  const int64_t nb = K / kBlock, groups = (N + 7) / 8;
  TORCH_CHECK(qs.is_contiguous() && qs.numel() == groups * nb * 128,
              "q4q8_linear: qs must hold [N / 8, K / 32, 128] = [", groups, ", ", nb, ", 128] bytes, got ", qs.sizes());
  TORCH_CHECK(d.is_contiguous() && m.is_contiguous() && d.numel() == groups * nb * 8 && m.numel() == d.numel(),
              "q4q8_linear: d and m must be contiguous [N / 8, K / 32, 8] = [", groups, ", ", nb, ", 8], got ",
              d.sizes(), " and ", m.sizes());
  at::Tensor y = at::empty({M, N}, x.options());
  const Weights w{qs.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
                  reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()), nb};
  if (x.scalar_type() == at::kFloat)
    run<float>(x, w, N, y);
  else
    run<at::BFloat16>(x, w, N, y);
  return y;
}

}  // namespace

// the schema here, the CPU kernel below; cpu_q8.py registers the shape-only (fake) kernel torch.compile traces
TORCH_LIBRARY(tercel_cpu_q8, lib) {
  lib.def("q4q8_linear(Tensor x, Tensor qs, Tensor d, Tensor m, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(tercel_cpu_q8, CPU, lib) {
  lib.impl("q4q8_linear", &q4q8_linear);
}
