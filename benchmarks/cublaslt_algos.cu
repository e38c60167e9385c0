// How much faster than cuBLASLt's first heuristic choice (the one torch's F.linear runs) its other
// algorithms are on llama-3.1-8b's bf16 linears at decode batch sizes.
//
//   nvcc -O2 -std=c++17 -o /tmp/cublaslt_algos benchmarks/cublaslt_algos.cu -lcublasLt && /tmp/cublaslt_algos
//
// For y[m, n] = x[m, k] @ w[n, k]^T (torch's layout: cuBLAS "TN"), it asks the heuristic for up to 32
// algorithms (32 MiB workspace) and times each over calls rotating through enough weight copies (at least
// 256 MiB) that none stays in L2. Prints, per shape and M, the first choice's time, the fastest and its rank.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK_CUDA(x) do { cudaError_t error_ = (x); if (error_ != cudaSuccess) { \
  std::printf("CUDA %s at %s:%d\n", cudaGetErrorString(error_), __FILE__, __LINE__); std::exit(1); } } while (0)
#define CHECK_LT(x) do { cublasStatus_t status_ = (x); if (status_ != CUBLAS_STATUS_SUCCESS) { \
  std::printf("cuBLASLt status %d at %s:%d\n", int(status_), __FILE__, __LINE__); std::exit(1); } } while (0)

struct Shape { const char* name; int n; int k; };

static float time_algo(cublasLtHandle_t lt, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                       cublasLtMatrixLayout_t c, const cublasLtMatmulAlgo_t* algo, const std::vector<void*>& weights,
                       void* x, void* y, void* workspace, size_t workspace_size, int calls) {
  const float one = 1.0f, zero = 0.0f;
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) {
    if (cublasLtMatmul(lt, op, &one, weights[i % weights.size()], a, x, b, &zero, y, c, y, c, algo, workspace,
                       workspace_size, 0) != CUBLAS_STATUS_SUCCESS) return -1.0f;
  }
  float best = 1e30f;
  for (int repeat = 0; repeat < 5; ++repeat) {
    CHECK_CUDA(cudaEventRecord(start));
    for (int i = 0; i < calls; ++i)
      cublasLtMatmul(lt, op, &one, weights[i % weights.size()], a, x, b, &zero, y, c, y, c, algo, workspace,
                     workspace_size, 0);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    best = std::min(best, ms * 1000.0f / calls);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  return best;
}

int main(int argc, char** argv) {
  const Shape shapes[] = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 28672, 4096}, {"down", 4096, 14336},
                          {"lm_head", 128256, 4096}};
  std::vector<int> ms = {1, 16, 64, 128, 144, 160, 176, 192, 208, 224, 240, 256};
  cublasLtHandle_t lt;
  CHECK_LT(cublasLtCreate(&lt));
  const size_t workspace_size = 32u << 20;
  void* workspace;
  CHECK_CUDA(cudaMalloc(&workspace, workspace_size));
  void *x, *y;
  CHECK_CUDA(cudaMalloc(&x, size_t(256) * 14336 * 2));
  CHECK_CUDA(cudaMalloc(&y, size_t(256) * 128256 * 2));
  CHECK_CUDA(cudaMemset(x, 0x3c, size_t(256) * 14336 * 2));
  for (const Shape& s : shapes) {
    const size_t bytes = size_t(s.n) * s.k * 2;
    const int copies = std::max<int>(2, int(((256u << 20) + bytes - 1) / bytes));
    std::vector<void*> weights(copies);
    for (auto& w : weights) {
      CHECK_CUDA(cudaMalloc(&w, bytes));
      CHECK_CUDA(cudaMemset(w, 0x3c, bytes));
    }
    double first_total = 0, best_total = 0;
    for (int m : ms) {
      cublasLtMatmulDesc_t op;
      CHECK_LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
      CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)));
      CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)));
      cublasLtMatrixLayout_t a, b, c;
      CHECK_LT(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, s.k, s.n, s.k));
      CHECK_LT(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, s.k, m, s.k));
      CHECK_LT(cublasLtMatrixLayoutCreate(&c, CUDA_R_16BF, s.n, m, s.n));
      cublasLtMatmulPreference_t pref;
      CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
      CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_size,
                                                    sizeof(workspace_size)));
      cublasLtMatmulHeuristicResult_t results[32];
      int returned = 0;
      CHECK_LT(cublasLtMatmulAlgoGetHeuristic(lt, op, a, b, c, c, pref, 32, results, &returned));
      const int calls = std::max(8, 2 * copies);
      float first = -1, best = 1e30f;
      int best_rank = -1;
      for (int i = 0; i < returned; ++i) {
        if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
        float us = time_algo(lt, op, a, b, c, &results[i].algo, weights, x, y, workspace, workspace_size, calls);
        if (us < 0) continue;
        if (i == 0) first = us;
        if (us < best) { best = us; best_rank = i; }
      }
      first_total += first;
      best_total += best;
      std::printf("%-8s M=%4d: first %7.1f us, best %7.1f us (rank %2d of %2d): %5.1f%% faster\n", s.name, m, first,
                  best, best_rank, returned, 100.0 * (first - best) / first);
      std::fflush(stdout);
      cublasLtMatmulPreferenceDestroy(pref);
      cublasLtMatrixLayoutDestroy(a);
      cublasLtMatrixLayoutDestroy(b);
      cublasLtMatrixLayoutDestroy(c);
      cublasLtMatmulDescDestroy(op);
    }
    std::printf("%-8s summed over the Ms: first %.1f us, best %.1f us\n", s.name, first_total, best_total);
    for (auto w : weights) cudaFree(w);
  }
  return 0;
}
