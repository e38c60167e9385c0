// The C ABI of Dovetail's CPU kernels (called from Python with ctypes on tensors' data pointers).
//
// Every kernel exists once per instruction set (avx512_bf16, avx512, avx2, portable), each compiled in
// its own translation unit with its own -m flags; dispatch.cpp picks one at run time from the CPU's
// features (or DOVETAIL_CPU_ISA) and the exported dt_* functions call through its table.
#pragma once

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__) || defined(__clang__)
#define DT_API __attribute__((visibility("default")))
#else
#define DT_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum dt_dtype { DT_FLOAT32 = 0, DT_BFLOAT16 = 1 };

// Status codes of the kernels that read indices.
enum dt_status { DT_OK = 0, DT_BAD_SLOT = 1, DT_BAD_BLOCK = 2, DT_BAD_BATCH = 3, DT_BAD_POSITION = 4 };

// Paged attention over a mixed prefill/decode batch, with the KV-cache write first.
// Layouts: q [tokens, num_heads, head_size] and k, v [tokens, num_kv_heads, head_size], each with its own
// token stride (in elements); out [tokens, num_heads, head_size] with out_stride; key_cache and
// value_cache [num_blocks, block_size, num_kv_heads, head_size], contiguous. k, v or slot_mapping NULL:
// no write. Semantics: dovetail/attention/backend.py (REFERENCE is the oracle).
typedef struct dt_attention_args {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    void* key_cache;
    void* value_cache;
    const int64_t* slot_mapping;
    const int32_t* block_table;
    const int32_t* seq_lens;
    const int32_t* query_start_loc;
    int64_t q_stride;
    int64_t k_stride;
    int64_t v_stride;
    int64_t out_stride;
    int64_t block_table_stride;
    int32_t num_tokens;
    int32_t num_seqs;
    int32_t num_heads;
    int32_t num_kv_heads;
    int32_t head_size;
    int32_t block_size;
    int32_t num_blocks;      // of each cache, to check slots and block ids
    int32_t sliding_window;  // 0: none
    float scale;
    float softcap;  // 0: none
    int32_t dtype;        // enum dt_dtype, of q, k, v and out
    int32_t num_threads;
    int32_t cache_dtype;  // enum dt_dtype, of key_cache and value_cache (k, v are rounded to it)
} dt_attention_args;

// The kernels of one instruction set.
typedef struct dt_kernel_table {
    const char* name;
    int (*attention)(const dt_attention_args* args);
    int (*kv_cache_write)(const dt_attention_args* args);
    // out[r] = rms_norm(x[r]) * w; x and out rows of n elements with their own row strides.
    void (*rms_norm)(const void* x, int64_t x_stride, const void* weight, int32_t weight_dtype, void* out,
                     int64_t out_stride, int64_t rows, int64_t n, float eps, int32_t dtype, int32_t num_threads);
    // summed = x + residual (written to residual_out), out = rms_norm(summed) * w.
    void (*add_rms_norm)(const void* x, int64_t x_stride, const void* residual, int64_t residual_stride,
                         const void* weight, int32_t weight_dtype, void* out, void* residual_out, int64_t rows,
                         int64_t n, float eps, int32_t dtype, int32_t num_threads);
    // out[r] = silu(x[r, :d]) * x[r, d:2d]; out contiguous [rows, d].
    void (*silu_and_mul)(const void* x, int64_t x_stride, void* out, int64_t rows, int64_t d, int32_t dtype,
                         int32_t num_threads);
    // NeoX rotary: q_out/k_out [tokens, heads * head_size] contiguous; cos_sin float32 [positions, rot_dim].
    int (*rotary_neox)(const int64_t* positions, int64_t num_positions, const void* q, int64_t q_stride, const void* k,
                        int64_t k_stride, void* q_out, void* k_out, const float* cos_sin, int64_t tokens,
                        int32_t num_heads, int32_t num_kv_heads, int32_t head_size, int32_t rot_dim,
                        int32_t dtype, int32_t num_threads);
    // out[m] = W x[m] (+ bias) for a few rows m: W [n, k] row-major (float32 or bfloat16), streamed once by
    // all threads together; x rows strided, out contiguous [m, n], bias (may be NULL) and out in dtype.
    void (*linear)(const void* x, int64_t x_stride, const void* weight, int32_t weight_dtype, const void* bias,
                   void* out, int64_t m, int64_t n, int64_t k, int32_t dtype, int32_t num_threads);
} dt_kernel_table;

// -- provided by dispatch.cpp to the ISA translation units (compiled without ISA flags) --------------

// Calls fn(ctx, i, thread) for i in [0, n) on up to num_threads threads (OpenMP, else std::thread).
void dt_parallel_for(int64_t n, int32_t num_threads, void (*fn)(void* ctx, int64_t i, int32_t thread), void* ctx);
// A buffer of at least `bytes`, 64-byte aligned, private to the calling OS thread; `slot` names one of
// a few buffers per thread (DT_SCRATCH_SLOTS). Valid until the same thread asks for the same slot again.
void* dt_scratch(int32_t slot, size_t bytes);
#define DT_SCRATCH_SLOTS 4

// -- the exported API -----------------------------------------------------------------------------

// ISAs this CPU can run, best first, comma separated (e.g. "avx512_bf16,avx512,avx2,portable").
DT_API const char* dt_supported_isas(void);
// ISAs compiled into this library, comma separated.
DT_API const char* dt_compiled_isas(void);
// Select an ISA by name ("auto" = the best supported); returns 0, or -1 (not compiled), -2 (CPU lacks it).
DT_API int dt_set_isa(const char* name);
DT_API const char* dt_current_isa(void);
// Whether the library was built with OpenMP.
DT_API int dt_has_openmp(void);

DT_API int dt_attention(const dt_attention_args* args);
DT_API int dt_kv_cache_write(const dt_attention_args* args);
DT_API void dt_rms_norm(const void* x, int64_t x_stride, const void* weight, int32_t weight_dtype, void* out,
                 int64_t out_stride, int64_t rows, int64_t n, float eps, int32_t dtype, int32_t num_threads);
DT_API void dt_add_rms_norm(const void* x, int64_t x_stride, const void* residual, int64_t residual_stride,
                     const void* weight, int32_t weight_dtype, void* out, void* residual_out, int64_t rows,
                     int64_t n, float eps, int32_t dtype, int32_t num_threads);
DT_API void dt_silu_and_mul(const void* x, int64_t x_stride, void* out, int64_t rows, int64_t d, int32_t dtype,
                     int32_t num_threads);
DT_API void dt_linear(const void* x, int64_t x_stride, const void* weight, int32_t weight_dtype, const void* bias,
                      void* out, int64_t m, int64_t n, int64_t k, int32_t dtype, int32_t num_threads);
DT_API int dt_rotary_neox(const int64_t* positions, int64_t num_positions, const void* q, int64_t q_stride, const void* k, int64_t k_stride,
                    void* q_out, void* k_out, const float* cos_sin, int64_t tokens, int32_t num_heads,
                    int32_t num_kv_heads, int32_t head_size, int32_t rot_dim, int32_t dtype, int32_t num_threads);

#ifdef __cplusplus
}
#endif
