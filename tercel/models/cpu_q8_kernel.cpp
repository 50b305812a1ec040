// y[M, N] = x[M, K] @ W^T with W in GGUF 4-bit blocks and x quantised per block of 32 to int8 (Q8),
// integer dot products per block, fp32 accumulation: the Q4 x Q8 scheme llama.cpp runs on CPUs.
// Built by tercel/models/cpu_q8.py (torch.utils.cpp_extension, -O3 -march=native) and registered as
// torch.ops.tercel_cpu_q8.q4q8_linear, and q8_linear for GGUF Q8_0 weights (the tied embedding as the head).
// Needs AVX2, FMA and F16C; the VNNI instructions are used when the
// compiler targets them (-march=native on a CPU that has them).
//
// Weight layout (made at load time by cpu_q8.py): rows in groups of 8 (N padded with zero rows), so one
// 256-bit vector holds 8 rows and each lane's 4 bytes are one row's 4 consecutive inputs; a dot product then
// gives the 8 rows' sums in the 8 lanes, with no horizontal reductions and the 8 rows' scales as one vector.
//   qs   uint8 [N / 8, nb, 4, 8, 4]  block b, chunk c, row r, byte t: q[r][32 b + 4 c + t] in the low nibble,
//                                    q[r][32 b + 16 + 4 c + t] in the high one
//   d, m fp16  [N / 8, nb, 8]        per block w = d * q + m (Q4_0: m = -8 d)
// Q8_0 (q8_linear): qs int8 [N / 8, nb, 16, 8, 2] (chunk c: q[r][32 b + 2 c + t]), d as above, against
// int16-quantised activations (the head's logits want them finer than Q8).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_q8_kernel.h"

namespace {

using namespace tercel_q8;

template <typename T, bool kBytes>
void run(const at::Tensor& x, const Weights& w, int64_t N, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  if constexpr (kBytes) {
    QuantizedRows16 q;
    q.quantize(xf.data_ptr<float>(), M, K);
    matmul_q8w(q.acts(), M, w, N, y.data_ptr<T>());
  } else {
    QuantizedRows q;
    q.quantize(xf.data_ptr<float>(), M, K);
    matmul_q8(q.acts(), M, w, N, y.data_ptr<T>());
  }
}

// y = x @ W^T for weights of `bytes_per_block` per 8-row group and block (128: Q4, 256: Q8_0); y in out_dtype
at::Tensor linear(const char* op, const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                  const at::Tensor& m, int64_t N, int64_t bytes_per_block, at::ScalarType out_dtype) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu(), op, ": x must be a 2-D CPU tensor, got ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat,
              op, ": x must be bfloat16 or float32, got ", x_in.scalar_type());
  TORCH_CHECK(qs.scalar_type() == (bytes_per_block == 128 ? at::kByte : at::kChar) && d.scalar_type() == at::kHalf &&
                  m.scalar_type() == at::kHalf,
              op, ": qs must be ", bytes_per_block == 128 ? "uint8" : "int8", " and d, m float16");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, op, ": K = ", K, " is not a multiple of ", kBlock);
  const int64_t nb = K / kBlock, groups = (N + 7) / 8;
  TORCH_CHECK(qs.is_contiguous() && qs.numel() == groups * nb * bytes_per_block, op, ": qs must hold [N / 8, K / 32, ",
              bytes_per_block, "] = [", groups, ", ", nb, ", ", bytes_per_block, "] bytes, got ", qs.sizes());
  TORCH_CHECK(d.is_contiguous() && m.is_contiguous() && d.numel() == groups * nb * 8 && m.numel() == d.numel(),
              op, ": d and m must be contiguous [N / 8, K / 32, 8] = [", groups, ", ", nb, ", 8], got ", d.sizes(),
              " and ", m.sizes());
  at::Tensor y = at::empty({M, N}, x.options().dtype(out_dtype));
  const Weights w{static_cast<const uint8_t*>(qs.data_ptr()), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
                  reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()), nb};
  const bool bytes = bytes_per_block == 256;
  if (out_dtype == at::kFloat)
    bytes ? run<float, true>(x, w, N, y) : run<float, false>(x, w, N, y);
  else
    bytes ? run<at::BFloat16, true>(x, w, N, y) : run<at::BFloat16, false>(x, w, N, y);
  return y;
}

// 4-bit weights; y in x's dtype
at::Tensor q4q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m, int64_t N) {
  return linear("q4q8_linear", x, qs, d, m, N, 128, x.scalar_type());
}

// Q8_0 weights (int8 q, fp16 d, m unused) against int16-quantised x (cpu_q8_kernel.h), e.g. a GGUF's tied embedding
// as the lm_head; y in fp32 (logits)
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m, int64_t N) {
  return linear("q8_linear", x, qs, d, m, N, 256, at::kFloat);
}

}  // namespace

// the schema here, the CPU kernel below; cpu_q8.py registers the shape-only (fake) kernel torch.compile traces
TORCH_LIBRARY(tercel_cpu_q8, lib) {
  lib.def("q4q8_linear(Tensor x, Tensor qs, Tensor d, Tensor m, int n) -> Tensor");
  lib.def("q8_linear(Tensor x, Tensor qs, Tensor d, Tensor m, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(tercel_cpu_q8, CPU, lib) {
  lib.impl("q4q8_linear", &q4q8_linear);
  lib.impl("q8_linear", &q8_linear);
}
