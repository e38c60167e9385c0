// 16-bit linears y[m, n] = x[m, k] @ w[n, k]^T through cuBLASLt with a chosen algorithm.
//
// torch's F.linear runs cuBLASLt's first heuristic choice. On the H200 another of the heuristic's
// candidates is up to 21% faster on some of llama-3.1-8b's decode shapes (benchmarks/cublaslt_algos.cu);
// dovetail_cuda/lt_linear.py times the candidates once per shape and calls the fastest through here.
//
// dovetail_lt_algos prepares a shape's plan (descriptors and up to max_algos candidates, kept for the
// process's life) and returns how many candidates there are; dovetail_lt_matmul runs candidate `algo`
// of a prepared plan on the caller's stream, so CUDA graph capture records it like any kernel.
// Both return a negative value on failure: -1 no such plan or candidate, else -(cublasStatus_t) - 100.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace {

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, y = nullptr;
  std::vector<cublasLtMatmulAlgo_t> algos;
};

using Key = std::tuple<int, int, int, int, int>;  // device, dtype (0 bf16, 1 fp16), m, n, k

std::mutex mutex;
std::map<int, cublasLtHandle_t> handles;
std::map<Key, Plan> plans;

int failed(cublasStatus_t status) { return -static_cast<int>(status) - 100; }

cublasStatus_t make_plan(int dtype, int m, int n, int k, int max_algos, size_t workspace_bytes,
                         cublasLtHandle_t handle, Plan& plan) {
  const cudaDataType_t type = dtype == 0 ? CUDA_R_16BF : CUDA_R_16F;
  cublasStatus_t status = cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose));
  cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep));
  // Column-major view of the row-major tensors: w is k x n (transposed in the product), x k x m, y n x m.
  if ((status = cublasLtMatrixLayoutCreate(&plan.w, type, k, n, k)) != CUBLAS_STATUS_SUCCESS) return status;
  if ((status = cublasLtMatrixLayoutCreate(&plan.x, type, k, m, k)) != CUBLAS_STATUS_SUCCESS) return status;
  if ((status = cublasLtMatrixLayoutCreate(&plan.y, type, n, m, n)) != CUBLAS_STATUS_SUCCESS) return status;
  cublasLtMatmulPreference_t preference;
  if ((status = cublasLtMatmulPreferenceCreate(&preference)) != CUBLAS_STATUS_SUCCESS) return status;
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                       sizeof(workspace_bytes));
  std::vector<cublasLtMatmulHeuristicResult_t> results(max_algos);
  int returned = 0;
  status = cublasLtMatmulAlgoGetHeuristic(handle, plan.op, plan.w, plan.x, plan.y, plan.y, preference, max_algos,
                                          results.data(), &returned);
  cublasLtMatmulPreferenceDestroy(preference);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  for (int i = 0; i < returned; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS) plan.algos.push_back(results[i].algo);
  }
  return plan.algos.empty() ? CUBLAS_STATUS_NOT_SUPPORTED : CUBLAS_STATUS_SUCCESS;
}

}  // namespace

extern "C" int dovetail_lt_algos(int device, int dtype, int m, int n, int k, int max_algos,
                                 unsigned long long workspace_bytes) {
  std::lock_guard<std::mutex> lock(mutex);
  const Key key{device, dtype, m, n, k};
  auto found = plans.find(key);
  if (found != plans.end()) return static_cast<int>(found->second.algos.size());
  auto handle = handles.find(device);
  if (handle == handles.end()) {
    cublasLtHandle_t created;
    cublasStatus_t status = cublasLtCreate(&created);
    if (status != CUBLAS_STATUS_SUCCESS) return failed(status);
    handle = handles.emplace(device, created).first;
  }
  Plan plan;
  cublasStatus_t status = make_plan(dtype, m, n, k, max_algos, workspace_bytes, handle->second, plan);
  if (status != CUBLAS_STATUS_SUCCESS) {
    if (plan.w) cublasLtMatrixLayoutDestroy(plan.w);
    if (plan.x) cublasLtMatrixLayoutDestroy(plan.x);
    if (plan.y) cublasLtMatrixLayoutDestroy(plan.y);
    if (plan.op) cublasLtMatmulDescDestroy(plan.op);
    return failed(status);
  }
  const int count = static_cast<int>(plan.algos.size());
  plans.emplace(key, plan);
  return count;
}

extern "C" int dovetail_lt_matmul(int device, int dtype, int m, int n, int k, int algo, const void* w, const void* x,
                                  void* y, void* workspace, unsigned long long workspace_bytes, void* stream) {
  const Plan* plan;
  cublasLtHandle_t handle;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = plans.find(Key{device, dtype, m, n, k});
    if (found == plans.end() || algo < 0 || algo >= static_cast<int>(found->second.algos.size())) return -1;
    plan = &found->second;  // std::map nodes stay put; plans are never erased
    handle = handles.at(device);
  }
  const float one = 1.0f, zero = 0.0f;
  cublasStatus_t status = cublasLtMatmul(handle, plan->op, &one, w, plan->w, x, plan->x, &zero, y, plan->y, y,
                                         plan->y, &plan->algos[algo], workspace, workspace_bytes,
                                         static_cast<cudaStream_t>(stream));
  return status == CUBLAS_STATUS_SUCCESS ? 0 : failed(status);
}
