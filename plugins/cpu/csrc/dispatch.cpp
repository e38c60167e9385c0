// Run-time ISA dispatch, threads and scratch memory. Compiled without ISA flags, so it runs on any CPU
// of the architecture and decides which of the ISA translation units may be called.

#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define DT_X86 1
#endif

#include "kernels.h"

extern "C" {
#ifdef DT_WITH_AVX512_BF16
const dt_kernel_table* dt_table_avx512_bf16(void);
#endif
#ifdef DT_WITH_AVX512
const dt_kernel_table* dt_table_avx512(void);
#endif
#ifdef DT_WITH_AVX2
const dt_kernel_table* dt_table_avx2(void);
#endif
const dt_kernel_table* dt_table_portable(void);
}

namespace {

struct Isa {
    const char* name;
    const dt_kernel_table* (*table)(void);
    bool (*supported)(void);
};

#ifdef DT_X86
struct CpuFeatures {
    bool avx2 = false, fma = false, f16c = false, avx512 = false, avx512_bf16 = false;
    CpuFeatures() {
        unsigned a, b, c, d;
        if (!__get_cpuid(1, &a, &b, &c, &d)) return;
        const bool osxsave = c & (1u << 27), avx = c & (1u << 28);
        fma = c & (1u << 12);
        f16c = c & (1u << 29);
        if (!osxsave || !avx) return;
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        const bool ymm_state = (lo & 0x6) == 0x6;
        const bool zmm_state = (lo & 0xe6) == 0xe6;
        if (!ymm_state || __get_cpuid_max(0, nullptr) < 7) return;
        __cpuid_count(7, 0, a, b, c, d);
        avx2 = b & (1u << 5);
        const bool f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
        avx512 = zmm_state && f && dq && bw && vl && avx2 && fma;
        __cpuid_count(7, 1, a, b, c, d);
        avx512_bf16 = avx512 && (a & (1u << 5));
    }
};
const CpuFeatures& features() {
    static CpuFeatures f;
    return f;
}
bool has_avx512_bf16() { return features().avx512_bf16; }
bool has_avx512() { return features().avx512; }
bool has_avx2() { return features().avx2 && features().fma && features().f16c; }
#endif
bool always() { return true; }

const std::vector<Isa>& isas() {
    static const std::vector<Isa> list = {
#ifdef DT_WITH_AVX512_BF16
        {"avx512_bf16", dt_table_avx512_bf16, has_avx512_bf16},
#endif
#ifdef DT_WITH_AVX512
        {"avx512", dt_table_avx512, has_avx512},
#endif
#ifdef DT_WITH_AVX2
        {"avx2", dt_table_avx2, has_avx2},
#endif
        {"portable", dt_table_portable, always},
    };
    return list;
}

const dt_kernel_table* best_table() {
    for (const Isa& isa : isas())
        if (isa.supported()) return isa.table();
    return dt_table_portable();
}

std::atomic<const dt_kernel_table*> g_table{nullptr};

const dt_kernel_table* table() {
    const dt_kernel_table* t = g_table.load(std::memory_order_acquire);
    if (!t) {
        t = best_table();
        g_table.store(t, std::memory_order_release);
    }
    return t;
}

std::string join(bool only_supported) {
    std::string out;
    for (const Isa& isa : isas()) {
        if (only_supported && !isa.supported()) continue;
        if (!out.empty()) out += ",";
        out += isa.name;
    }
    return out;
}

struct Scratch {
    void* ptr[DT_SCRATCH_SLOTS] = {};
    size_t size[DT_SCRATCH_SLOTS] = {};
    ~Scratch() {
        for (void* p : ptr) free(p);
    }
};

}  // namespace

extern "C" {

void dt_parallel_for(int64_t n, int32_t num_threads, void (*fn)(void*, int64_t, int32_t), void* ctx) {
    if (n <= 0) return;
    int64_t threads = num_threads < n ? num_threads : n;
    if (threads <= 1) {
        for (int64_t i = 0; i < n; ++i) fn(ctx, i, 0);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)threads) schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) fn(ctx, i, omp_get_thread_num());
#else
    std::atomic<int64_t> next{0};
    auto worker = [&](int32_t tid) {
        for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(ctx, i, tid);
    };
    std::vector<std::thread> pool;
    for (int32_t t = 1; t < threads; ++t) pool.emplace_back(worker, t);
    worker(0);
    for (std::thread& t : pool) t.join();
#endif
}

void* dt_scratch(int32_t slot, size_t bytes) {
    static thread_local Scratch scratch;
    if (bytes > scratch.size[slot]) {
        free(scratch.ptr[slot]);
        size_t size = (bytes + bytes / 2 + 63) / 64 * 64;
        scratch.ptr[slot] = aligned_alloc(64, size);
        scratch.size[slot] = scratch.ptr[slot] ? size : 0;
    }
    return scratch.ptr[slot];
}

const char* dt_supported_isas(void) {
    static const std::string s = join(true);
    return s.c_str();
}

const char* dt_compiled_isas(void) {
    static const std::string s = join(false);
    return s.c_str();
}

int dt_set_isa(const char* name) {
    if (!name || !strcmp(name, "auto")) {
        g_table.store(best_table(), std::memory_order_release);
        return 0;
    }
    for (const Isa& isa : isas()) {
        if (strcmp(isa.name, name)) continue;
        if (!isa.supported()) return -2;
        g_table.store(isa.table(), std::memory_order_release);
        return 0;
    }
    return -1;
}

const char* dt_current_isa(void) { return table()->name; }

int dt_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int dt_attention(const dt_attention_args* args) { return table()->attention(args); }

int dt_kv_cache_write(const dt_attention_args* args) { return table()->kv_cache_write(args); }

void dt_rms_norm(const void* x, int64_t x_stride, const void* weight, int32_t weight_dtype, void* out,
                 int64_t out_stride, int64_t rows, int64_t n, float eps, int32_t dtype, int32_t num_threads) {
    table()->rms_norm(x, x_stride, weight, weight_dtype, out, out_stride, rows, n, eps, dtype, num_threads);
}

void dt_add_rms_norm(const void* x, int64_t x_stride, const void* residual, int64_t residual_stride,
                     const void* weight, int32_t weight_dtype, void* out, void* residual_out, int64_t rows, int64_t n,
                     float eps, int32_t dtype, int32_t num_threads) {
    table()->add_rms_norm(x, x_stride, residual, residual_stride, weight, weight_dtype, out, residual_out, rows, n,
                          eps, dtype, num_threads);
}

void dt_silu_and_mul(const void* x, int64_t x_stride, void* out, int64_t rows, int64_t d, int32_t dtype,
                     int32_t num_threads) {
    table()->silu_and_mul(x, x_stride, out, rows, d, dtype, num_threads);
}

int dt_rotary_neox(const int64_t* positions, int64_t num_positions, const void* q, int64_t q_stride, const void* k, int64_t k_stride,
                    void* q_out, void* k_out, const float* cos_sin, int64_t tokens, int32_t num_heads,
                    int32_t num_kv_heads, int32_t head_size, int32_t rot_dim, int32_t dtype, int32_t num_threads) {
    return table()->rotary_neox(positions, num_positions, q, q_stride, k, k_stride, q_out, k_out, cos_sin, tokens, num_heads, num_kv_heads,
                         head_size, rot_dim, dtype, num_threads);
}

void dt_linear(const void* x, int64_t x_stride, const void* weight, int32_t weight_dtype, const void* bias, void* out,
               int64_t m, int64_t n, int64_t k, int32_t dtype, int32_t num_threads) {
    table()->linear(x, x_stride, weight, weight_dtype, bias, out, m, n, k, dtype, num_threads);
}

}  // extern "C"
