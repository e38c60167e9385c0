// Weight-only FP8 GEMV for one token: y[n] = scale[n] * sum_k W[n, k] * x[k] (+ bias[n]), optionally with
// SiLU-and-mul fused: y[j] = silu(g[j]) * u[j] where g and u are the first and second halves of that product.
//
// W is e4m3, row-major with K contiguous; x, bias and y are bfloat16 or float16; scale is float32.
// Each group of SPLIT (1 or 2) warps (of blocks of 1-16 warps) owns ROWS outputs (with GATED, the gate row j and the up row
// N + j of each); its warps stream every SPLIT-th 512-byte step of those weight rows over K (16 bytes a lane),
// UNROLL steps of loads at a time, and sum their parts through shared memory. The weight
// loads do not depend on the previous kernel, so under programmatic dependent launch the first UNROLL
// steps are issued before griddepcontrol.wait; x (the previous kernel's output) is read after it.
// Products and sums are in float32; the warp's lanes are summed with shuffles, a group's warps through shared
// memory; no split-K across blocks, no scratch memory, no atomics.
//
// Measured on Hopper and left out: placing the e4m3 bits into a float16 instead of the conversion
// instructions, double-buffered loads, 4 steps at a time, 4 rows a warp, letting the next kernel
// launch at this one's start, and asking L2 to prefetch the next linear's weights (benchmarks/RESULTS.md). TRIGGER says when the next kernel on the stream may
// launch: 0 when this grid completes, 2 after the main loop, 3 once the last weight loads are issued.
//
// Compiled by dovetail_cuda.native with nvcc into a shared library loaded through ctypes; the C entry
// point at the end launches on the caller's stream (so CUDA graph capture records it).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ uint4 load_streaming(const uint8_t* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

template <typename T>
struct Activation;

template <>
struct Activation<__nv_bfloat16> {
  // Two bfloat16 in a word -> two floats (a bfloat16 is the top half of a float).
  __device__ __forceinline__ static float2 unpack(uint32_t word) {
    return make_float2(__uint_as_float(word << 16), __uint_as_float(word & 0xffff0000u));
  }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16(v); }
  __device__ __forceinline__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
};

template <>
struct Activation<__half> {
  __device__ __forceinline__ static float2 unpack(uint32_t word) {
    return __half22float2(*reinterpret_cast<const __half2*>(&word));
  }
  __device__ __forceinline__ static __half from_float(float v) { return __float2half_rn(v); }
  __device__ __forceinline__ static float to_float(__half v) { return __half2float(v); }
};

// Sum of 4 products: the e4m3 bytes of `word` (elements 0..3) times the 4 activations in x01, x23.
__device__ __forceinline__ float dot4(uint32_t word, float2 x01, float2 x23, float acc) {
  __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word & 0xffffu), __NV_E4M3);
  __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word >> 16), __NV_E4M3);
  const float2 w01 = __half22float2(*reinterpret_cast<__half2*>(&lo));
  const float2 w23 = __half22float2(*reinterpret_cast<__half2*>(&hi));
  acc = fmaf(w01.x, x01.x, acc);
  acc = fmaf(w01.y, x01.y, acc);
  acc = fmaf(w23.x, x23.x, acc);
  return fmaf(w23.y, x23.y, acc);
}

template <typename T, int ROWS, int UNROLL, int TRIGGER, bool GATED, int SPLIT>
__global__ void __launch_bounds__(512) fp8_gemv_kernel(const uint8_t* __restrict__ w, const T* __restrict__ x,
                                                       const float* __restrict__ scale, const T* __restrict__ bias,
                                                       T* __restrict__ y, int n, int k, long long ldw) {
  constexpr int STEP = 512;  // bytes of K a warp reads per step: 32 lanes x 16
  constexpr int LOADED = GATED ? 2 * ROWS : ROWS;  // weight rows a warp reads
  constexpr int STRIDE = SPLIT * STEP, BATCH = UNROLL * STRIDE;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int part = warp % SPLIT;  // which of the group's warps: steps part, part + SPLIT, ...
  const int out0 = (blockIdx.x * ((blockDim.x >> 5) / SPLIT) + warp / SPLIT) * ROWS;
  const uint8_t* rows[LOADED];
#pragma unroll
  for (int r = 0; r < LOADED; ++r) {
    const long long row = min(out0 + r % ROWS, n - 1) + (r >= ROWS ? n : 0);
    rows[r] = w + row * ldw + part * STEP + lane * 16;
  }
  const uint4* xs = reinterpret_cast<const uint4*>(x) + (part * STEP + lane * 16) / 8;  // 16 activations = 2 x 16 bytes
  float acc[LOADED];
#pragma unroll
  for (int r = 0; r < LOADED; ++r) acc[r] = 0.f;

  uint4 wv[UNROLL][LOADED];
  auto load_batch = [&](int base) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const bool inside = base + u * STRIDE + part * STEP + lane * 16 < k;
#pragma unroll
      for (int r = 0; r < LOADED; ++r)
        wv[u][r] = inside ? load_streaming(rows[r] + base + u * STRIDE) : make_uint4(0, 0, 0, 0);
    }
    if (TRIGGER == 3 && base + BATCH >= k) launch_dependents();  // the last weights are on their way
  };
  load_batch(0);
  grid_dependency_wait();  // x is the previous kernel's output
  for (int base = 0; base < k; base += BATCH) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (base + u * STRIDE + part * STEP + lane * 16 >= k) continue;
      const uint4* xp = xs + (base + u * STRIDE) / 8;
      const uint4 xa = xp[0], xb = xp[1];
      const uint32_t xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
      for (int r = 0; r < LOADED; ++r) {
        const uint32_t words[4] = {wv[u][r].x, wv[u][r].y, wv[u][r].z, wv[u][r].w};
#pragma unroll
        for (int j = 0; j < 4; ++j)
          acc[r] = dot4(words[j], Activation<T>::unpack(xw[2 * j]), Activation<T>::unpack(xw[2 * j + 1]), acc[r]);
      }
    }
    if (base + BATCH < k) load_batch(base + BATCH);
  }
  if (TRIGGER == 2) launch_dependents();
#pragma unroll
  for (int r = 0; r < LOADED; ++r) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], offset);
  }
  if constexpr (SPLIT > 1) {
    __shared__ float parts[16][LOADED];
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < LOADED; ++r) parts[warp][r] = acc[r];
    }
    __syncthreads();
    if (part != 0) return;
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < LOADED; ++r)
        for (int other = 1; other < SPLIT; ++other) acc[r] += parts[warp + other][r];
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int out = out0 + r;
      if (out >= n) continue;
      float v = acc[r] * scale[out];
      if (bias != nullptr) v += Activation<T>::to_float(bias[out]);
      if (GATED) {
        float up = acc[ROWS + r] * scale[n + out];
        if (bias != nullptr) up += Activation<T>::to_float(bias[n + out]);
        v = v / (1.f + __expf(-v)) * up;
      }
      y[out] = Activation<T>::from_float(v);
    }
  }
}

template <typename T, int ROWS, int UNROLL, int TRIGGER, bool GATED, int SPLIT>
cudaError_t launch(const void* w, const void* x, const void* scale, const void* bias, void* y, int n, int k,
                   long long ldw, int warps, int pdl, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  const int outputs = ROWS * (warps / SPLIT);  // a block's
  config.gridDim = dim3((n + outputs - 1) / outputs);
  config.blockDim = dim3(32 * warps);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, fp8_gemv_kernel<T, ROWS, UNROLL, TRIGGER, GATED, SPLIT>,
                            static_cast<const uint8_t*>(w), static_cast<const T*>(x),
                            static_cast<const float*>(scale), static_cast<const T*>(bias), static_cast<T*>(y), n, k,
                            ldw);
}

using Launcher = cudaError_t (*)(const void*, const void*, const void*, const void*, void*, int, int, long long, int,
                                 int, cudaStream_t);

template <typename T, int R, int U, int TRIGGER, bool G>
Launcher by_split(int split) {
  switch (split) {
    case 1: return launch<T, R, U, TRIGGER, G, 1>;
    case 2: return launch<T, R, U, TRIGGER, G, 2>;
    default: return nullptr;
  }
}

template <typename T, int R, int U, bool G>
Launcher by_trigger(int trigger, int split) {
  switch (trigger) {
    case 0: return by_split<T, R, U, 0, G>(split);
    case 2: return by_split<T, R, U, 2, G>(split);
    case 3: return by_split<T, R, U, 3, G>(split);
    default: return nullptr;
  }
}

template <typename T>
Launcher pick(int rows, int unroll, int trigger, int gated, int split) {
#define DOVETAIL_FP8_GEMV_CASE(R, U)                                                            \
  if (rows == R && unroll == U)                                                                 \
    return gated ? by_trigger<T, R, U, true>(trigger, split) : by_trigger<T, R, U, false>(trigger, split);
  DOVETAIL_FP8_GEMV_CASE(1, 1)
  DOVETAIL_FP8_GEMV_CASE(1, 2)
  DOVETAIL_FP8_GEMV_CASE(2, 1)
  DOVETAIL_FP8_GEMV_CASE(2, 2)
#undef DOVETAIL_FP8_GEMV_CASE
  return nullptr;
}

}  // namespace

// Launches the GEMV on `stream`; `split` (1 or 2, dividing `warps`) warps share each output's K. n is the
// number of outputs (with gated, the weight has 2n rows and scale and
// bias 2n entries). dtype: 0 bfloat16, 1 float16 (x, bias, y). Requires k % 16 == 0, ldw % 16 == 0 and 16-byte
// aligned w and x (the caller checks). Returns a cudaError_t; -1 for a configuration not compiled.
extern "C" int dovetail_fp8_gemv(const void* w, const void* x, const void* scale, const void* bias, void* y, int n,
                                 int k, long long ldw, int dtype, int rows, int unroll, int trigger, int gated,
                                 int warps, int split, int pdl, void* stream) {
  if (warps != 1 && warps != 2 && warps != 4 && warps != 8 && warps != 16) return -1;
  if ((split != 1 && split != 2) || warps % split != 0) return -1;
  Launcher launcher = dtype == 0 ? pick<__nv_bfloat16>(rows, unroll, trigger, gated, split)
                                 : pick<__half>(rows, unroll, trigger, gated, split);
  if (launcher == nullptr) return -1;
  return static_cast<int>(
      launcher(w, x, scale, bias, y, n, k, ldw, warps, pdl, static_cast<cudaStream_t>(stream)));
}
