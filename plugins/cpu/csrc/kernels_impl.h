// The kernels, written once over a vector type `Vec` and instantiated per ISA.
//
// Each isa_*.cpp defines DT_NS (a namespace of its own, so that no inline function compiled with one
// ISA's flags is merged with another's at link time), includes its vec_*.h, then this file. Nothing
// here instantiates a standard-library template for the same reason; threads and scratch memory come
// from dispatch.cpp, which is compiled without ISA flags.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

namespace DT_NS {

typedef uint16_t bf16_t;

static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }
static inline int64_t lmin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

static inline float to_f32(float x) { return x; }
static inline float to_f32(bf16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline bf16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7fc0;
    return (bf16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
static inline void put(float* p, float f) { *p = f; }
static inline void put(bf16_t* p, float f) { *p = bf16_round(f); }
// The value `f` takes once stored as T (what torch computes when an op's result is in T).
static inline float as_stored(float f, const float*) { return f; }
static inline float as_stored(float f, const bf16_t*) { return to_f32(bf16_round(f)); }
static inline Vec as_stored(Vec v, const float*) { return v; }
static inline Vec as_stored(Vec v, const bf16_t*) {
    alignas(64) bf16_t tmp[Vec::W];
    v.store(tmp);
    return Vec::load(tmp);
}

static const float kNegInf = -INFINITY;

// Ask for a row of the cache ahead of use: blocks are scattered, so the hardware cannot guess them.
static inline void prefetch_row(const void* p, int bytes) {
    const char* c = static_cast<const char*>(p);
    for (int i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// ---------------------------------------------------------------------------------------------------
// Paged attention
// ---------------------------------------------------------------------------------------------------

// Query rows of one sequence and one KV head attended together (a "tile"); M = rows * group queries.
struct AttnItem {
    int32_t seq, kv_head, row0, row1;
};

struct AttnCtx {
    const dt_attention_args* a;
    const AttnItem* items;
    int64_t num_items;
    int group;        // query heads per KV head
    int nsplit;       // key ranges per item (split-KV for few, long items)
    int max_m;        // largest M of any item
    float* partial;   // [num_items * nsplit][max_m][head_size + 2] when nsplit > 1
};

static inline int key_chunk(int head_size) {
    int kc = 4096 / head_size;
    return kc < 16 ? 16 : (kc > 64 ? 64 : kc);
}

// Transposed queries: scores of Mp queries against one key as Mp/W vectors (no horizontal sums).
// Tq: the queries' type, Tc: the cache's.
template <typename Tq, typename Tc>
struct QueryPack {
    // f32: [D][Mp] with lane m = query m; prepared once per item.
    static void prepare(float* qt, const Tq* const* qrows, int M, int Mp, int D) {
        for (int d = 0; d < D; ++d)
            for (int m = 0; m < Mp; ++m) qt[(int64_t)d * Mp + m] = m < M ? to_f32(qrows[m][d]) : 0.0f;
    }
    // Scores of KB keys at once (independent accumulators keep both FMA pipes busy).
    template <int MV, int KB>
    static inline void scores(const float* qt, const Tc* const* k, int D, float scale, float* out, int64_t stride) {
        Vec acc[KB][MV];
        for (int b = 0; b < KB; ++b)
            for (int v = 0; v < MV; ++v) acc[b][v] = Vec::zero();
        for (int d = 0; d < D; ++d) {
            Vec q[MV];
            const float* row = qt + (int64_t)d * MV * Vec::W;
            for (int v = 0; v < MV; ++v) q[v] = Vec::load(row + v * Vec::W);
            for (int b = 0; b < KB; ++b) {
                Vec kv = Vec::set1(to_f32(k[b][d]));
                for (int v = 0; v < MV; ++v) acc[b][v] = Vec::fma(q[v], kv, acc[b][v]);
            }
        }
        Vec s = Vec::set1(scale);
        for (int b = 0; b < KB; ++b)
            for (int v = 0; v < MV; ++v) (acc[b][v] * s).store(out + b * stride + v * Vec::W);
    }
};

#ifdef DT_HAS_BF16_DOT
// bf16 with AVX512-BF16: lanes hold (q[d], q[d+1]) pairs and VDPBF16PS adds both products at once.
template <>
struct QueryPack<bf16_t, bf16_t> {
    static void prepare(float* qt, const bf16_t* const* qrows, int M, int Mp, int D) {
        uint32_t* pairs = reinterpret_cast<uint32_t*>(qt);
        for (int d = 0; d < D; d += 2)
            for (int m = 0; m < Mp; ++m)
                pairs[(int64_t)(d / 2) * Mp + m] =
                    m < M ? ((uint32_t)qrows[m][d] | ((uint32_t)qrows[m][d + 1] << 16)) : 0u;
    }
    template <int MV, int KB>
    static inline void scores(const float* qt, const bf16_t* const* k, int D, float scale, float* out,
                              int64_t stride) {
        __m512 acc[KB][MV];
        for (int b = 0; b < KB; ++b)
            for (int v = 0; v < MV; ++v) acc[b][v] = _mm512_setzero_ps();
        const uint32_t* pairs = reinterpret_cast<const uint32_t*>(qt);
        for (int d = 0; d < D; d += 2) {
            __m512bh q[MV];
            const uint32_t* row = pairs + (int64_t)(d / 2) * MV * 16;
            for (int v = 0; v < MV; ++v) q[v] = (__m512bh)_mm512_loadu_si512(row + v * 16);
            for (int b = 0; b < KB; ++b) {
                uint32_t kk;
                memcpy(&kk, k[b] + d, 4);
                __m512bh kv = (__m512bh)_mm512_set1_epi32((int)kk);
                for (int v = 0; v < MV; ++v) acc[b][v] = _mm512_dpbf16_ps(acc[b][v], q[v], kv);
            }
        }
        __m512 s = _mm512_set1_ps(scale);
        for (int b = 0; b < KB; ++b)
            for (int v = 0; v < MV; ++v) _mm512_storeu_ps(out + b * stride + v * 16, _mm512_mul_ps(acc[b][v], s));
    }
};
#endif

// Scores of keys [0, n) for MV vectors of transposed queries, into S[j * Mp + m].
template <typename Tq, typename Tc, int MV>
static inline void transposed_scores(const float* qt, const Tc* const* krows, int n, int D, float scale, float* S) {
    constexpr int KB = MV == 1 ? 8 : MV == 2 ? 4 : MV <= 4 ? 2 : 1;
    typedef QueryPack<Tq, Tc> Pack;
    const int64_t stride = MV * Vec::W;
    int j = 0;
    for (; j + KB <= n; j += KB) Pack::template scores<MV, KB>(qt, krows + j, D, scale, S + j * stride, stride);
    for (; j < n; ++j) Pack::template scores<MV, 1>(qt, krows + j, D, scale, S + j * stride, stride);
}

// Direct dot products, for items with few queries (decode): one horizontal sum per (query, key).
static inline float dot(const float* q, const float* k, int D) {
    Vec a0 = Vec::zero(), a1 = Vec::zero();
    int d = 0;
    for (; d + 2 * Vec::W <= D; d += 2 * Vec::W) {
        a0 = Vec::fma(Vec::load(q + d), Vec::load(k + d), a0);
        a1 = Vec::fma(Vec::load(q + d + Vec::W), Vec::load(k + d + Vec::W), a1);
    }
    for (; d < D; d += Vec::W) a0 = Vec::fma(Vec::load(q + d), Vec::load(k + d), a0);
    return (a0 + a1).reduce_add();
}
static inline float dot(const float* q, const bf16_t* k, int D) {
    Vec a0 = Vec::zero(), a1 = Vec::zero();
    int d = 0;
    for (; d + 2 * Vec::W <= D; d += 2 * Vec::W) {
        a0 = Vec::fma(Vec::load(q + d), Vec::load(k + d), a0);
        a1 = Vec::fma(Vec::load(q + d + Vec::W), Vec::load(k + d + Vec::W), a1);
    }
    for (; d < D; d += Vec::W) a0 = Vec::fma(Vec::load(q + d), Vec::load(k + d), a0);
    return (a0 + a1).reduce_add();
}
#ifdef DT_HAS_BF16_DOT
static inline float dot(const bf16_t* q, const bf16_t* k, int D) {
    __m512 acc = _mm512_setzero_ps();
    int d = 0;
    for (; d + 32 <= D; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
    if (d < D) {  // 16 left (head sizes are multiples of 16)
        __m256 half = _mm256_dpbf16_ps(_mm256_setzero_ps(), (__m256bh)_mm256_loadu_si256((const __m256i*)(q + d)),
                                       (__m256bh)_mm256_loadu_si256((const __m256i*)(k + d)));
        acc = _mm512_add_ps(acc, _mm512_zextps256_ps512(half));
    }
    return _mm512_reduce_add_ps(acc);
}
#endif

// acc[m][:] += sum_j p(m, j) * V[j][:], p(m, j) = S[m * sm + j * sj], for j < n. Two queries at a time
// share each loaded value row; eight accumulators keep both FMA pipes busy.
template <typename T>
static inline void accumulate_pv(float* acc, int M, int D, const float* S, int64_t sm, int64_t sj,
                                 const T* const* vrows, int n) {
    constexpr int W = Vec::W;
    int m = 0;
    for (; m + 2 <= M; m += 2) {
        float* a = acc + (int64_t)m * D;
        float* b = a + D;
        const float* pa = S + m * sm;
        const float* pb = pa + sm;
        int d = 0;
        for (; d + 4 * W <= D; d += 4 * W) {
            Vec x0 = Vec::load(a + d), x1 = Vec::load(a + d + W), x2 = Vec::load(a + d + 2 * W),
                x3 = Vec::load(a + d + 3 * W);
            Vec y0 = Vec::load(b + d), y1 = Vec::load(b + d + W), y2 = Vec::load(b + d + 2 * W),
                y3 = Vec::load(b + d + 3 * W);
            for (int j = 0; j < n; ++j) {
                const T* v = vrows[j] + d;
                Vec v0 = Vec::load(v), v1 = Vec::load(v + W), v2 = Vec::load(v + 2 * W), v3 = Vec::load(v + 3 * W);
                Vec p = Vec::set1(pa[j * sj]), q = Vec::set1(pb[j * sj]);
                x0 = Vec::fma(p, v0, x0);
                x1 = Vec::fma(p, v1, x1);
                x2 = Vec::fma(p, v2, x2);
                x3 = Vec::fma(p, v3, x3);
                y0 = Vec::fma(q, v0, y0);
                y1 = Vec::fma(q, v1, y1);
                y2 = Vec::fma(q, v2, y2);
                y3 = Vec::fma(q, v3, y3);
            }
            x0.store(a + d);
            x1.store(a + d + W);
            x2.store(a + d + 2 * W);
            x3.store(a + d + 3 * W);
            y0.store(b + d);
            y1.store(b + d + W);
            y2.store(b + d + 2 * W);
            y3.store(b + d + 3 * W);
        }
        for (; d < D; d += W) {
            Vec x = Vec::load(a + d), y = Vec::load(b + d);
            for (int j = 0; j < n; ++j) {
                Vec v = Vec::load(vrows[j] + d);
                x = Vec::fma(Vec::set1(pa[j * sj]), v, x);
                y = Vec::fma(Vec::set1(pb[j * sj]), v, y);
            }
            x.store(a + d);
            y.store(b + d);
        }
    }
    if (m < M) {
        float* a = acc + (int64_t)m * D;
        const float* pa = S + m * sm;
        int d = 0;
        for (; d + 4 * W <= D; d += 4 * W) {
            Vec x0 = Vec::load(a + d), x1 = Vec::load(a + d + W), x2 = Vec::load(a + d + 2 * W),
                x3 = Vec::load(a + d + 3 * W);
            for (int j = 0; j < n; ++j) {
                Vec p = Vec::set1(pa[j * sj]);
                const T* v = vrows[j] + d;
                x0 = Vec::fma(p, Vec::load(v), x0);
                x1 = Vec::fma(p, Vec::load(v + W), x1);
                x2 = Vec::fma(p, Vec::load(v + 2 * W), x2);
                x3 = Vec::fma(p, Vec::load(v + 3 * W), x3);
            }
            x0.store(a + d);
            x1.store(a + d + W);
            x2.store(a + d + 2 * W);
            x3.store(a + d + 3 * W);
        }
        for (; d < D; d += W) {
            Vec x = Vec::load(a + d);
            for (int j = 0; j < n; ++j) x = Vec::fma(Vec::set1(pa[j * sj]), Vec::load(vrows[j] + d), x);
            x.store(a + d);
        }
    }
}

static inline void softcap(float* s, int64_t n, float cap) {
    // cap * tanh(s / cap) with tanh(x) = 1 - 2 / (exp(2x) + 1)
    Vec two_over = Vec::set1(2.0f / cap), one = Vec::set1(1.0f), two = Vec::set1(2.0f), c = Vec::set1(cap);
    int64_t i = 0;
    for (; i + Vec::W <= n; i += Vec::W) {
        Vec e = Vec::exp(Vec::load(s + i) * two_over);
        (c * (one - two / (e + one))).store(s + i);
    }
    for (; i < n; ++i) s[i] = cap * tanhf(s[i] / cap);
}

template <typename Tq, typename Tc>
static void attend_item(const AttnCtx& c, int64_t index) {
    const dt_attention_args& a = *c.a;
    const AttnItem it = c.items[index / c.nsplit];
    const int split = (int)(index % c.nsplit);
    const int D = a.head_size, g = c.group, Hkv = a.num_kv_heads, BS = a.block_size;
    const int qs = a.query_start_loc[it.seq];
    const int qlen = a.query_start_loc[it.seq + 1] - qs;
    const int first = a.seq_lens[it.seq] - qlen;  // position of query row 0
    const int M = (it.row1 - it.row0) * g;
    const int window = a.sliding_window;
    int kbeg = window > 0 ? imax(0, first + it.row0 - window + 1) : 0;
    int kend = first + it.row1;
    if (c.nsplit > 1) {
        int per = (kend - kbeg + c.nsplit - 1) / c.nsplit;
        kbeg = kbeg + split * per;
        kend = imin(kend, kbeg + per);
    }
    const bool transposed = 2 * M >= Vec::W && M <= 8 * Vec::W;
    const int Mp = round_up(M, Vec::W);
    const int MV = Mp / Vec::W;
    const int KC = key_chunk(D);
    const int KCp = round_up(KC, Vec::W);
    const int row_bytes = D * (int)sizeof(Tc);
    const int kAhead = 6;  // keys to prefetch ahead in the decode loop
    const Tc* kc = static_cast<const Tc*>(a.key_cache);
    const Tc* vc = static_cast<const Tc*>(a.value_cache);
    const int32_t* table = a.block_table + (int64_t)it.seq * a.block_table_stride;

    // Scratch, in 64-byte aligned parts: acc [M][D] | mx, l, alpha [Mp] | S | queries | row pointers
    const int64_t s_size = transposed ? (int64_t)KC * Mp : (int64_t)M * KCp;
    const int64_t q_size = transposed ? (int64_t)D * Mp : (int64_t)M * D;
    const int64_t part[] = {(int64_t)M * D, Mp, Mp, Mp, s_size, q_size};
    int64_t floats = 0;
    for (int64_t n : part) floats += (n + 15) / 16 * 16;
    char* base = static_cast<char*>(dt_scratch(0, sizeof(float) * floats + sizeof(void*) * (2 * KC + M)));
    float* carve[6];
    for (int i = 0, offset = 0; i < 6; offset += (int)((part[i] + 15) / 16 * 16), ++i)
        carve[i] = reinterpret_cast<float*>(base) + offset;
    float *acc = carve[0], *mx = carve[1], *l = carve[2], *alpha = carve[3], *S = carve[4], *qbuf = carve[5];
    const Tc** krows = reinterpret_cast<const Tc**>(base + sizeof(float) * floats);
    const Tc** vrows = krows + KC;
    const Tq** qrows = reinterpret_cast<const Tq**>(vrows + KC);

    for (int m = 0; m < M; ++m) {
        int r = it.row0 + m / g, h = it.kv_head * g + m % g;
        qrows[m] = static_cast<const Tq*>(a.q) + (int64_t)(qs + r) * a.q_stride + (int64_t)h * D;
    }
    memset(acc, 0, sizeof(float) * (int64_t)M * D);
    for (int m = 0; m < Mp; ++m) {
        mx[m] = kNegInf;
        l[m] = 0.0f;
    }
    if (transposed) {
        QueryPack<Tq, Tc>::prepare(qbuf, qrows, M, Mp, D);
    } else {
        for (int m = 0; m < M; ++m)
            for (int d = 0; d < D; ++d) qbuf[(int64_t)m * D + d] = to_f32(qrows[m][d]);
    }
    // Visible keys of query m: lo_m <= j <= hi_m.
    const int hi_min = first + it.row0, hi_max = first + it.row1 - 1;
    const int lo_max = window > 0 ? hi_max - window + 1 : 0;
    const int64_t sm = transposed ? 1 : KCp, sj = transposed ? Mp : 1;

    for (int c0 = kbeg; c0 < kend; c0 += KC) {
        const int n = imin(KC, kend - c0);
        for (int j = 0; j < n; ++j) {
            int pos = c0 + j;
            int64_t slot = (int64_t)table[pos / BS] * BS + pos % BS;
            krows[j] = kc + (slot * Hkv + it.kv_head) * D;
            vrows[j] = vc + (slot * Hkv + it.kv_head) * D;
        }
        // Scores.
        if (transposed) {
            for (int j = 0; j < n; ++j) {
                prefetch_row(krows[j], row_bytes);
                prefetch_row(vrows[j], row_bytes);
            }
            switch (MV) {
                case 1: transposed_scores<Tq, Tc, 1>(qbuf, krows, n, D, a.scale, S); break;
                case 2: transposed_scores<Tq, Tc, 2>(qbuf, krows, n, D, a.scale, S); break;
                case 3: transposed_scores<Tq, Tc, 3>(qbuf, krows, n, D, a.scale, S); break;
                case 4: transposed_scores<Tq, Tc, 4>(qbuf, krows, n, D, a.scale, S); break;
                case 5: transposed_scores<Tq, Tc, 5>(qbuf, krows, n, D, a.scale, S); break;
                case 6: transposed_scores<Tq, Tc, 6>(qbuf, krows, n, D, a.scale, S); break;
                case 7: transposed_scores<Tq, Tc, 7>(qbuf, krows, n, D, a.scale, S); break;
                default: transposed_scores<Tq, Tc, 8>(qbuf, krows, n, D, a.scale, S); break;
            }
        } else {
            for (int j = 0; j < imin(kAhead, n); ++j) prefetch_row(krows[j], row_bytes);
            for (int j = 0; j < n; ++j) {
                if (j + kAhead < n) prefetch_row(krows[j + kAhead], row_bytes);
                prefetch_row(vrows[j], row_bytes);  // read after this chunk's softmax
                for (int m = 0; m < M; ++m) {
#ifdef DT_HAS_BF16_DOT
                    if (sizeof(Tq) == 2 && sizeof(Tc) == 2) {
                        S[(int64_t)m * KCp + j] = dot(reinterpret_cast<const bf16_t*>(qrows[m]),
                                                      reinterpret_cast<const bf16_t*>(krows[j]), D) * a.scale;
                        continue;
                    }
#endif
                    S[(int64_t)m * KCp + j] = dot(qbuf + (int64_t)m * D, krows[j], D) * a.scale;
                }
            }
            for (int m = 0; m < M; ++m)
                for (int j = n; j < KCp; ++j) S[(int64_t)m * KCp + j] = kNegInf;
        }
        if (a.softcap > 0.0f) {
            if (transposed) softcap(S, (int64_t)n * Mp, a.softcap);
            else for (int m = 0; m < M; ++m) softcap(S + (int64_t)m * KCp, n, a.softcap);
        }
        // Causal and sliding-window masks, only where this chunk crosses a boundary.
        if (c0 + n - 1 > hi_min || c0 < lo_max) {
            for (int m = 0; m < M; ++m) {
                int hi = first + it.row0 + m / g, lo = window > 0 ? hi - window + 1 : 0;
                for (int j = 0; j < n; ++j)
                    if (c0 + j > hi || c0 + j < lo) S[m * sm + j * sj] = kNegInf;
            }
        }
        // Online softmax: new running max, rescale factors, probabilities in place of the scores.
        bool rescale = false;
        if (transposed) {
            const Vec ninf = Vec::set1(kNegInf), zero = Vec::zero();
            for (int v = 0; v < MV; ++v) {
                Vec cm = ninf;
                for (int j = 0; j < n; ++j) cm = Vec::max(cm, Vec::load(S + (int64_t)j * Mp + v * Vec::W));
                Vec old = Vec::load(mx + v * Vec::W);
                Vec mnew = Vec::max(old, cm);
                Vec safe = mnew.where_equal(mnew, ninf, zero);
                Vec al = Vec::exp(old - safe);
                Vec sum = zero;
                for (int j = 0; j < n; ++j) {
                    float* sp = S + (int64_t)j * Mp + v * Vec::W;
                    Vec p = Vec::exp(Vec::load(sp) - safe);
                    p.store(sp);
                    sum = sum + p;
                }
                (Vec::load(l + v * Vec::W) * al + sum).store(l + v * Vec::W);
                mnew.store(mx + v * Vec::W);
                al.store(alpha + v * Vec::W);
            }
            for (int m = 0; m < M; ++m) rescale |= alpha[m] != 1.0f;
        } else {
            for (int m = 0; m < M; ++m) {
                float* row = S + (int64_t)m * KCp;
                Vec cmv = Vec::set1(kNegInf);
                for (int j = 0; j < KCp; j += Vec::W) cmv = Vec::max(cmv, Vec::load(row + j));
                float mnew = mx[m] > cmv.reduce_max() ? mx[m] : cmv.reduce_max();
                float safe = mnew == kNegInf ? 0.0f : mnew;
                alpha[m] = expf(mx[m] - safe);
                Vec sum = Vec::zero(), sv = Vec::set1(safe);
                for (int j = 0; j < KCp; j += Vec::W) {
                    Vec p = Vec::exp(Vec::load(row + j) - sv);
                    p.store(row + j);
                    sum = sum + p;
                }
                l[m] = l[m] * alpha[m] + sum.reduce_add();
                mx[m] = mnew;
                rescale |= alpha[m] != 1.0f;
            }
        }
        if (rescale) {
            for (int m = 0; m < M; ++m) {
                if (alpha[m] == 1.0f) continue;
                Vec al = Vec::set1(alpha[m]);
                float* am = acc + (int64_t)m * D;
                for (int d = 0; d < D; d += Vec::W) (Vec::load(am + d) * al).store(am + d);
            }
        }
        accumulate_pv<Tc>(acc, M, D, S, sm, sj, vrows, n);
    }

    if (c.nsplit > 1) {
        float* part = c.partial + (int64_t)index * c.max_m * (D + 2);
        for (int m = 0; m < M; ++m) {
            float* pm = part + (int64_t)m * (D + 2);
            pm[0] = mx[m];
            pm[1] = l[m];
            memcpy(pm + 2, acc + (int64_t)m * D, sizeof(float) * D);
        }
        return;
    }
    for (int m = 0; m < M; ++m) {
        int r = it.row0 + m / g, h = it.kv_head * g + m % g;
        Tq* o = static_cast<Tq*>(a.out) + (int64_t)(qs + r) * a.out_stride + (int64_t)h * D;
        Vec inv = Vec::set1(1.0f / l[m]);
        const float* am = acc + (int64_t)m * D;
        for (int d = 0; d < D; d += Vec::W) (Vec::load(am + d) * inv).store(o + d);
    }
}

// Merge the split-KV partial results of one item.
template <typename T>
static void combine_item(const AttnCtx& c, int64_t item) {
    const dt_attention_args& a = *c.a;
    const AttnItem it = c.items[item];
    const int D = a.head_size, g = c.group, M = (it.row1 - it.row0) * g;
    const int qs = a.query_start_loc[it.seq];
    float* sum = static_cast<float*>(dt_scratch(1, sizeof(float) * D));
    for (int m = 0; m < M; ++m) {
        float gmax = kNegInf;
        for (int s = 0; s < c.nsplit; ++s) {
            float v = c.partial[((item * c.nsplit + s) * c.max_m + m) * (int64_t)(D + 2)];
            gmax = v > gmax ? v : gmax;
        }
        float total = 0.0f;
        for (int d = 0; d < D; ++d) sum[d] = 0.0f;
        for (int s = 0; s < c.nsplit; ++s) {
            const float* pm = c.partial + ((item * c.nsplit + s) * c.max_m + m) * (int64_t)(D + 2);
            if (pm[1] == 0.0f) continue;
            float w = expf(pm[0] - gmax);
            total += pm[1] * w;
            Vec wv = Vec::set1(w);
            for (int d = 0; d < D; d += Vec::W) Vec::fma(Vec::load(pm + 2 + d), wv, Vec::load(sum + d)).store(sum + d);
        }
        int r = it.row0 + m / g, h = it.kv_head * g + m % g;
        T* o = static_cast<T*>(a.out) + (int64_t)(qs + r) * a.out_stride + (int64_t)h * D;
        Vec inv = Vec::set1(1.0f / total);
        for (int d = 0; d < D; d += Vec::W) (Vec::load(sum + d) * inv).store(o + d);
    }
}

// Copy one row of n elements, converting (rounding to nearest even) when the cache's type differs.
static inline void copy_row(float* dst, const float* src, int64_t n) { memcpy(dst, src, sizeof(float) * n); }
static inline void copy_row(bf16_t* dst, const bf16_t* src, int64_t n) { memcpy(dst, src, sizeof(bf16_t) * n); }
template <typename Td, typename Ts>
static inline void copy_row(Td* dst, const Ts* src, int64_t n) {
    for (int64_t i = 0; i < n; i += Vec::W) Vec::load(src + i).store(dst + i);  // n: a multiple of 16
}

template <typename Tq, typename Tc>
static int kv_cache_write_impl(const dt_attention_args* a) {
    if (!a->k || !a->v || !a->slot_mapping) return DT_OK;
    const int64_t row = (int64_t)a->num_kv_heads * a->head_size;
    const int64_t num_slots = (int64_t)a->num_blocks * a->block_size;
    for (int64_t t = 0; t < a->num_tokens; ++t)
        if (a->slot_mapping[t] >= num_slots) return DT_BAD_SLOT;
    struct Ctx {
        const dt_attention_args* a;
        int64_t row, per;
    } ctx = {a, row, 0};
    const int64_t tokens = a->num_tokens;
    auto body = [](void* p, int64_t chunk, int32_t) {
        const Ctx& c = *static_cast<const Ctx*>(p);
        const dt_attention_args& a = *c.a;
        int64_t end = lmin((chunk + 1) * c.per, a.num_tokens);
        for (int64_t t = chunk * c.per; t < end; ++t) {
            int64_t slot = a.slot_mapping[t];
            if (slot < 0) continue;
            copy_row(static_cast<Tc*>(a.key_cache) + slot * c.row, static_cast<const Tq*>(a.k) + t * a.k_stride, c.row);
            copy_row(static_cast<Tc*>(a.value_cache) + slot * c.row, static_cast<const Tq*>(a.v) + t * a.v_stride,
                     c.row);
        }
    };
    if (tokens * row < 65536 || a->num_threads <= 1) {
        ctx.per = tokens;
        body(&ctx, 0, 0);
    } else {
        ctx.per = (tokens + 4 * a->num_threads - 1) / (4 * a->num_threads);
        dt_parallel_for((tokens + ctx.per - 1) / ctx.per, a->num_threads, body, &ctx);
    }
    return DT_OK;
}

// Every sequence's query rows lie within its context, and every block it reads exists.
static int check_batch(const dt_attention_args* a) {
    if (a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads || a->head_size % 16 || a->block_size <= 0)
        return DT_BAD_BATCH;
    if (a->query_start_loc[0] != 0 || a->query_start_loc[a->num_seqs] != a->num_tokens) return DT_BAD_BATCH;
    for (int s = 0; s < a->num_seqs; ++s) {
        int qlen = a->query_start_loc[s + 1] - a->query_start_loc[s], len = a->seq_lens[s];
        if (qlen < 0 || len < qlen) return DT_BAD_BATCH;
        if (qlen == 0) continue;
        int blocks = (len + a->block_size - 1) / a->block_size;
        if (blocks > a->block_table_stride) return DT_BAD_BLOCK;
        const int32_t* row = a->block_table + (int64_t)s * a->block_table_stride;
        for (int b = 0; b < blocks; ++b)
            if (row[b] < 0 || row[b] >= a->num_blocks) return DT_BAD_BLOCK;
    }
    return DT_OK;
}

template <typename Tq, typename Tc>
static int attention_impl(const dt_attention_args* a) {
    int status = check_batch(a);
    if (status == DT_OK) status = kv_cache_write_impl<Tq, Tc>(a);
    if (status != DT_OK) return status;
    const int g = a->num_heads / a->num_kv_heads;
    // Rows per tile: enough queries to fill a vector of scores when prefilling; one row when decoding.
    const int tile_rows = imax(1, Vec::W / g);
    int64_t num_items = 0;
    for (int s = 0; s < a->num_seqs; ++s) {
        int qlen = a->query_start_loc[s + 1] - a->query_start_loc[s];
        num_items += (int64_t)((qlen + tile_rows - 1) / tile_rows) * a->num_kv_heads;
    }
    if (num_items == 0) return DT_OK;
    AttnItem* items = static_cast<AttnItem*>(dt_scratch(2, sizeof(AttnItem) * num_items));
    int64_t n = 0;
    int max_m = 0, max_keys = 0;
    // Longest tiles first, so that dynamic scheduling ends with short ones.
    for (int s = a->num_seqs - 1; s >= 0; --s) {
        int qlen = a->query_start_loc[s + 1] - a->query_start_loc[s];
        for (int r1 = qlen; r1 > 0; r1 -= tile_rows) {
            int r0 = imax(0, r1 - tile_rows);
            max_m = imax(max_m, (r1 - r0) * g);
            max_keys = imax(max_keys, a->seq_lens[s]);
            for (int h = 0; h < a->num_kv_heads; ++h) items[n++] = AttnItem{s, h, r0, r1};
        }
    }
    AttnCtx c = {a, items, n, g, 1, max_m, nullptr};
    if (n < a->num_threads && max_keys >= 512) {
        c.nsplit = imin((2 * a->num_threads + (int)n - 1) / (int)n, max_keys / 256);
        c.partial = static_cast<float*>(dt_scratch(3, sizeof(float) * n * c.nsplit * max_m * (a->head_size + 2)));
    }
    dt_parallel_for(n * c.nsplit, a->num_threads,
                    [](void* p, int64_t i, int32_t) { attend_item<Tq, Tc>(*static_cast<AttnCtx*>(p), i); }, &c);
    if (c.nsplit > 1)
        dt_parallel_for(n, a->num_threads,
                        [](void* p, int64_t i, int32_t) { combine_item<Tq>(*static_cast<AttnCtx*>(p), i); }, &c);
    return DT_OK;
}

static int attention(const dt_attention_args* a) {
    const bool q16 = a->dtype == DT_BFLOAT16, c16 = a->cache_dtype == DT_BFLOAT16;
    return q16 ? (c16 ? attention_impl<bf16_t, bf16_t>(a) : attention_impl<bf16_t, float>(a))
               : (c16 ? attention_impl<float, bf16_t>(a) : attention_impl<float, float>(a));
}

static int kv_cache_write(const dt_attention_args* a) {
    const bool q16 = a->dtype == DT_BFLOAT16, c16 = a->cache_dtype == DT_BFLOAT16;
    return q16 ? (c16 ? kv_cache_write_impl<bf16_t, bf16_t>(a) : kv_cache_write_impl<bf16_t, float>(a))
               : (c16 ? kv_cache_write_impl<float, bf16_t>(a) : kv_cache_write_impl<float, float>(a));
}

// ---------------------------------------------------------------------------------------------------
// Fused elementwise operations (row-parallel)
// ---------------------------------------------------------------------------------------------------

// Runs body(ctx, row) for every row, in parallel when the work is large enough to pay for threads.
template <typename F>
static void for_rows(int64_t rows, int64_t work_per_row, int32_t num_threads, F& body) {
    if (rows <= 1 || num_threads <= 1 || rows * work_per_row < 32768) {
        for (int64_t r = 0; r < rows; ++r) body(r);
        return;
    }
    struct Ctx {
        F* body;
        int64_t rows, per;
    } ctx = {&body, rows, (rows + 4 * num_threads - 1) / (4 * num_threads)};
    dt_parallel_for((rows + ctx.per - 1) / ctx.per, num_threads, [](void* p, int64_t chunk, int32_t) {
        Ctx& c = *static_cast<Ctx*>(p);
        int64_t end = lmin((chunk + 1) * c.per, c.rows);
        for (int64_t r = chunk * c.per; r < end; ++r) (*c.body)(r);
    }, &ctx);
}

static inline Vec load_any(const void* p, int32_t dtype, int64_t i) {
    return dtype == DT_BFLOAT16 ? Vec::load(static_cast<const bf16_t*>(p) + i) : Vec::load(static_cast<const float*>(p) + i);
}
static inline Vec load_any_n(const void* p, int32_t dtype, int64_t i, int n) {
    return dtype == DT_BFLOAT16 ? Vec::load_n(static_cast<const bf16_t*>(p) + i, n)
                                : Vec::load_n(static_cast<const float*>(p) + i, n);
}

// out = normalized(x) * w as torch's FusedOps.rms_norm computes it: with a float32 weight the product is
// taken in float32 and rounded once; otherwise the normalized value is rounded to T first.
template <typename T>
static inline void rms_row(const T* x, const void* w, int32_t wdtype, T* out, int64_t n, float eps) {
    Vec ss = Vec::zero();
    int64_t i = 0;
    for (; i + Vec::W <= n; i += Vec::W) {
        Vec v = Vec::load(x + i);
        ss = Vec::fma(v, v, ss);
    }
    float sum = ss.reduce_add();
    for (; i < n; ++i) sum += to_f32(x[i]) * to_f32(x[i]);
    const float r = 1.0f / sqrtf(sum / (float)n + eps);
    const Vec rv = Vec::set1(r);
    const bool f32w = wdtype == DT_FLOAT32;
    for (i = 0; i + Vec::W <= n; i += Vec::W) {
        Vec y = Vec::load(x + i) * rv;
        Vec wv = load_any(w, wdtype, i);
        (f32w ? y * wv : as_stored(as_stored(y, x) * wv, x)).store(out + i);
    }
    if (i < n) {
        int k = (int)(n - i);
        Vec y = Vec::load_n(x + i, k) * rv;
        Vec wv = load_any_n(w, wdtype, i, k);
        (f32w ? y * wv : as_stored(as_stored(y, x) * wv, x)).store_n(out + i, k);
    }
}

template <typename T>
static void rms_norm_impl(const void* x, int64_t xs, const void* w, int32_t wdtype, void* out, int64_t os,
                          int64_t rows, int64_t n, float eps, int32_t threads) {
    auto body = [&](int64_t r) {
        rms_row<T>(static_cast<const T*>(x) + r * xs, w, wdtype, static_cast<T*>(out) + r * os, n, eps);
    };
    for_rows(rows, n, threads, body);
}

template <typename T>
static void add_rms_norm_impl(const void* x, int64_t xs, const void* res, int64_t rs, const void* w,
                              int32_t wdtype, void* out, void* res_out, int64_t rows, int64_t n, float eps,
                              int32_t threads) {
    auto body = [&](int64_t r) {
        const T* xr = static_cast<const T*>(x) + r * xs;
        const T* rr = static_cast<const T*>(res) + r * rs;
        T* sr = static_cast<T*>(res_out) + r * n;
        int64_t i = 0;
        for (; i + Vec::W <= n; i += Vec::W) (Vec::load(xr + i) + Vec::load(rr + i)).store(sr + i);
        if (i < n) (Vec::load_n(xr + i, (int)(n - i)) + Vec::load_n(rr + i, (int)(n - i))).store_n(sr + i, (int)(n - i));
        rms_row<T>(sr, w, wdtype, static_cast<T*>(out) + r * n, n, eps);
    };
    for_rows(rows, n, threads, body);
}

static inline Vec silu(Vec a) { return a / (Vec::set1(1.0f) + Vec::exp(Vec::zero() - a)); }

template <typename T>
static void silu_and_mul_impl(const void* x, int64_t xs, void* out, int64_t rows, int64_t d, int32_t threads) {
    auto body = [&](int64_t r) {
        const T* gate = static_cast<const T*>(x) + r * xs;
        const T* up = gate + d;
        T* o = static_cast<T*>(out) + r * d;
        int64_t i = 0;
        for (; i + Vec::W <= d; i += Vec::W)
            (as_stored(silu(Vec::load(gate + i)), gate) * Vec::load(up + i)).store(o + i);
        if (i < d) {
            int k = (int)(d - i);
            (as_stored(silu(Vec::load_n(gate + i, k)), gate) * Vec::load_n(up + i, k)).store_n(o + i, k);
        }
    };
    for_rows(rows, 6 * d, threads, body);
}

// One head: out[:h] = x1*c - x2*s, out[h:rot] = x2*c + x1*s, out[rot:] = x[rot:], h = rot/2, with each
// product and sum rounded to T as torch computes them (no fused multiply-add).
template <typename T>
static inline void rotate_head(const T* x, T* out, const float* cosv, const float* sinv, int half, int rot, int D) {
    const T* tag = x;
    int i = 0;
    for (; i < half; i += Vec::W) {
        int k = imin(Vec::W, half - i);
        Vec c = as_stored(Vec::load_n(cosv + i, k), tag), s = as_stored(Vec::load_n(sinv + i, k), tag);
        Vec x1 = Vec::load_n(x + i, k), x2 = Vec::load_n(x + half + i, k);
        Vec o1 = as_stored(as_stored(x1 * c, tag) - as_stored(x2 * s, tag), tag);
        Vec o2 = as_stored(as_stored(x2 * c, tag) + as_stored(x1 * s, tag), tag);
        if (k == Vec::W) {
            o1.store(out + i);
            o2.store(out + half + i);
        } else {
            o1.store_n(out + i, k);
            o2.store_n(out + half + i, k);
        }
    }
    if (rot < D) memcpy(out + rot, x + rot, sizeof(T) * (D - rot));
}

template <typename T>
static int rotary_impl(const int64_t* positions, int64_t num_positions, const void* q, int64_t qs, const void* k, int64_t ks, void* q_out,
                        void* k_out, const float* cos_sin, int64_t tokens, int32_t H, int32_t Hkv, int32_t D,
                        int32_t rot, int32_t threads) {
    const int half = rot / 2;
    for (int64_t t = 0; t < tokens; ++t)
        if (positions[t] < 0 || positions[t] >= num_positions) return DT_BAD_POSITION;
    auto body = [&](int64_t t) {
        const float* cosv = cos_sin + positions[t] * rot;
        const float* sinv = cosv + half;
        const T* qt = static_cast<const T*>(q) + t * qs;
        T* qo = static_cast<T*>(q_out) + t * (int64_t)H * D;
        for (int h = 0; h < H; ++h) rotate_head<T>(qt + (int64_t)h * D, qo + (int64_t)h * D, cosv, sinv, half, rot, D);
        const T* kt = static_cast<const T*>(k) + t * ks;
        T* ko = static_cast<T*>(k_out) + t * (int64_t)Hkv * D;
        for (int h = 0; h < Hkv; ++h) rotate_head<T>(kt + (int64_t)h * D, ko + (int64_t)h * D, cosv, sinv, half, rot, D);
    };
    for_rows(tokens, (int64_t)(H + Hkv) * D, threads, body);
    return DT_OK;
}

static void rms_norm(const void* x, int64_t xs, const void* w, int32_t wdtype, void* out, int64_t os, int64_t rows,
                     int64_t n, float eps, int32_t dtype, int32_t threads) {
    if (dtype == DT_BFLOAT16) rms_norm_impl<bf16_t>(x, xs, w, wdtype, out, os, rows, n, eps, threads);
    else rms_norm_impl<float>(x, xs, w, wdtype, out, os, rows, n, eps, threads);
}

static void add_rms_norm(const void* x, int64_t xs, const void* res, int64_t rs, const void* w, int32_t wdtype,
                         void* out, void* res_out, int64_t rows, int64_t n, float eps, int32_t dtype, int32_t threads) {
    if (dtype == DT_BFLOAT16) add_rms_norm_impl<bf16_t>(x, xs, res, rs, w, wdtype, out, res_out, rows, n, eps, threads);
    else add_rms_norm_impl<float>(x, xs, res, rs, w, wdtype, out, res_out, rows, n, eps, threads);
}

static void silu_and_mul(const void* x, int64_t xs, void* out, int64_t rows, int64_t d, int32_t dtype, int32_t threads) {
    if (dtype == DT_BFLOAT16) silu_and_mul_impl<bf16_t>(x, xs, out, rows, d, threads);
    else silu_and_mul_impl<float>(x, xs, out, rows, d, threads);
}

static int rotary_neox(const int64_t* positions, int64_t num_positions, const void* q, int64_t qs, const void* k,
                       int64_t ks, void* q_out, void* k_out, const float* cos_sin, int64_t tokens, int32_t H,
                       int32_t Hkv, int32_t D, int32_t rot, int32_t dtype, int32_t threads) {
    return dtype == DT_BFLOAT16
               ? rotary_impl<bf16_t>(positions, num_positions, q, qs, k, ks, q_out, k_out, cos_sin, tokens, H, Hkv,
                                     D, rot, threads)
               : rotary_impl<float>(positions, num_positions, q, qs, k, ks, q_out, k_out, cos_sin, tokens, H, Hkv,
                                    D, rot, threads);
}

// ---------------------------------------------------------------------------------------------------
// Linear layers at small batch (decode): a memory-bound matrix-vector product over all threads
// ---------------------------------------------------------------------------------------------------

struct LinearCtx {
    const float* x;  // [m][k] float32 (converted once)
    const void* w;
    const void* bias;
    void* out;
    int64_t m, n, k, rows_per_chunk;
    int32_t dtype;
};

// A float32 row against a weight row in float32 or bfloat16 (StreamVec::load widens either). Four independent
// accumulators keep enough loads in flight to stream the weight at the memory's bandwidth.
template <typename Tw>
static inline float dot_n(const float* x, const Tw* w, int64_t k) {
    typedef StreamVec V;
    V a0 = V::zero(), a1 = V::zero(), a2 = V::zero(), a3 = V::zero();
    int64_t i = 0;
    for (; i + 4 * V::W <= k; i += 4 * V::W) {
        a0 = V::fma(V::load(x + i), V::load(w + i), a0);
        a1 = V::fma(V::load(x + i + V::W), V::load(w + i + V::W), a1);
        a2 = V::fma(V::load(x + i + 2 * V::W), V::load(w + i + 2 * V::W), a2);
        a3 = V::fma(V::load(x + i + 3 * V::W), V::load(w + i + 3 * V::W), a3);
    }
    for (; i + V::W <= k; i += V::W) a0 = V::fma(V::load(x + i), V::load(w + i), a0);
    if (i < k) a1 = V::fma(V::load_n(x + i, (int)(k - i)), V::load_n(w + i, (int)(k - i)), a1);
    return ((a0 + a1) + (a2 + a3)).reduce_add();
}

// Weight rows per register tile: 4 x-rows by kLinearTileN weight rows of accumulators (16 of 32 registers
// with AVX-512, 8 of 16 with AVX2), so each weight load feeds four FMAs and each x load kLinearTileN.
constexpr int kLinearTileN = sizeof(Vec) >= 64 ? 4 : 2;

template <typename V, int MR, int NR, typename Tw>
static inline void linear_tile(const float* x, int64_t k, const Tw* const* rows, float* sums) {
    V acc[MR][NR];
    for (int a = 0; a < MR; ++a)
        for (int b = 0; b < NR; ++b) acc[a][b] = V::zero();
    for (int64_t i = 0; i < k; i += V::W) {
        V wv[NR];
        for (int b = 0; b < NR; ++b) wv[b] = V::load(rows[b] + i);
        for (int a = 0; a < MR; ++a) {
            V xv = V::load(x + a * k + i);
            for (int b = 0; b < NR; ++b) acc[a][b] = V::fma(xv, wv[b], acc[a][b]);
        }
    }
    for (int a = 0; a < MR; ++a)
        for (int b = 0; b < NR; ++b) sums[a * NR + b] = acc[a][b].reduce_add();
}

// Up to four rows of x (decode at batch 1-4): one weight row at a time, each thread streaming one contiguous
// share of the weight (linear_impl), which the hardware prefetchers follow best; the weight is read once.
template <typename T, typename Tw>
static void linear_chunk_narrow(const LinearCtx& c, int64_t chunk) {
    const int64_t n0 = chunk * c.rows_per_chunk, n1 = lmin(n0 + c.rows_per_chunk, c.n);
    const Tw* w = static_cast<const Tw*>(c.w);
    const T* bias = static_cast<const T*>(c.bias);
    T* out = static_cast<T*>(c.out);
    for (int64_t r = n0; r < n1; ++r) {
        const Tw* row = w + r * c.k;
        const float b = bias ? to_f32(bias[r]) : 0.0f;
        if (c.m == 4 && c.k % StreamVec::W == 0) {
            float sums[4];
            const Tw* rows[1] = {row};
            linear_tile<StreamVec, 4, 1>(c.x, c.k, rows, sums);
            for (int a = 0; a < 4; ++a) put(out + a * c.n + r, sums[a] + b);
            continue;
        }
        for (int64_t m = 0; m < c.m; ++m) put(out + m * c.n + r, dot_n(c.x + m * c.k, row, c.k) + b);
    }
}

// More rows of x: tiles of 4 x-rows by kLinearTileN weight rows.
template <typename T, typename Tw>
static void linear_chunk(const LinearCtx& c, int64_t chunk) {
    const int64_t n0 = chunk * c.rows_per_chunk, n1 = lmin(n0 + c.rows_per_chunk, c.n);
    const Tw* w = static_cast<const Tw*>(c.w);
    const T* bias = static_cast<const T*>(c.bias);
    T* out = static_cast<T*>(c.out);
    auto bias_at = [&](int64_t r) { return bias ? to_f32(bias[r]) : 0.0f; };
    int64_t r = n0;
    if (c.k % Vec::W == 0) {
        for (; r + kLinearTileN <= n1; r += kLinearTileN) {
            const Tw* rows[kLinearTileN];
            for (int b = 0; b < kLinearTileN; ++b) rows[b] = w + (r + b) * c.k;
            if (r + 2 * kLinearTileN <= n1) prefetch_row(rows[0] + kLinearTileN * c.k, (int)(kLinearTileN * c.k * sizeof(Tw)));
            float sums[4 * kLinearTileN];
            int64_t m = 0;
            for (; m + 4 <= c.m; m += 4) {
                linear_tile<Vec, 4, kLinearTileN>(c.x + m * c.k, c.k, rows, sums);
                for (int a = 0; a < 4; ++a)
                    for (int b = 0; b < kLinearTileN; ++b) put(out + (m + a) * c.n + r + b, sums[a * kLinearTileN + b] + bias_at(r + b));
            }
            for (; m < c.m; ++m) {
                linear_tile<Vec, 1, kLinearTileN>(c.x + m * c.k, c.k, rows, sums);
                for (int b = 0; b < kLinearTileN; ++b) put(out + m * c.n + r + b, sums[b] + bias_at(r + b));
            }
        }
    }
    for (; r < n1; ++r)
        for (int64_t m = 0; m < c.m; ++m) put(out + m * c.n + r, dot_n(c.x + m * c.k, w + r * c.k, c.k) + bias_at(r));
}

template <typename T>
static void linear_impl(const void* x, int64_t xs, const void* w, int32_t wdtype, const void* bias, void* out,
                        int64_t m, int64_t n, int64_t k, int32_t threads) {
    float* xf = static_cast<float*>(dt_scratch(2, sizeof(float) * m * k));
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < k; ++j) xf[i * k + j] = to_f32(static_cast<const T*>(x)[i * xs + j]);
    // Decode (m <= 4) is bound by memory bandwidth: one contiguous share of the rows per thread streams
    // fastest (interleaved chunks measured slower). Otherwise chunks small enough to balance
    // threads, large enough to stream the weight in long runs.
    const int64_t parts = m <= 4 ? imax(1, threads) : 8 * (int64_t)threads;
    int64_t per = imax(16, (int)((n + parts - 1) / parts));
    LinearCtx c = {xf, w, bias, out, m, n, k, per, 0};
    void (*body)(void*, int64_t, int32_t);
    if (m <= 4)
        body = wdtype == DT_BFLOAT16 ? [](void* p, int64_t i, int32_t) { linear_chunk_narrow<T, bf16_t>(*static_cast<LinearCtx*>(p), i); }
                                     : [](void* p, int64_t i, int32_t) { linear_chunk_narrow<T, float>(*static_cast<LinearCtx*>(p), i); };
    else
        body = wdtype == DT_BFLOAT16 ? [](void* p, int64_t i, int32_t) { linear_chunk<T, bf16_t>(*static_cast<LinearCtx*>(p), i); }
                                     : [](void* p, int64_t i, int32_t) { linear_chunk<T, float>(*static_cast<LinearCtx*>(p), i); };
    dt_parallel_for((n + per - 1) / per, threads, body, &c);
}

static void linear(const void* x, int64_t xs, const void* w, int32_t wdtype, const void* bias, void* out, int64_t m,
                   int64_t n, int64_t k, int32_t dtype, int32_t threads) {
    if (dtype == DT_BFLOAT16) linear_impl<bf16_t>(x, xs, w, wdtype, bias, out, m, n, k, threads);
    else linear_impl<float>(x, xs, w, wdtype, bias, out, m, n, k, threads);
}

static const dt_kernel_table kTable = {
    DT_ISA_NAME, attention, kv_cache_write, rms_norm, add_rms_norm, silu_and_mul, rotary_neox, linear,
};

}  // namespace DT_NS
