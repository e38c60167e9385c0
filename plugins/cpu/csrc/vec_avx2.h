// 8 float32 lanes in an AVX2 register (compiled with -mavx2 -mfma -mf16c): `Vec` of the AVX2 kernels, and the
// `StreamVec` of the AVX-512 ones (vec_avx512.h includes this file with DT_VEC_AVX512 defined).
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace DT_NS {

static inline __m256i dt_lane_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

struct Vec256 {
    static constexpr int W = 8;
    __m256 v;

    static inline Vec256 zero() { return {_mm256_setzero_ps()}; }
    static inline Vec256 set1(float x) { return {_mm256_set1_ps(x)}; }
    static inline Vec256 load(const float* p) { return {_mm256_loadu_ps(p)}; }
    static inline Vec256 load(const uint16_t* p) {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
    }
    static inline Vec256 load_n(const float* p, int n) { return {_mm256_maskload_ps(p, dt_lane_mask(n))}; }
    static inline Vec256 load_n(const uint16_t* p, int n) {
        alignas(32) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int i = 0; i < n; ++i) tmp[i] = p[i];
        return load(tmp);
    }
    inline void store(float* p) const { _mm256_storeu_ps(p, v); }
    inline void store(uint16_t* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16()); }
    inline void store_n(float* p, int n) const { _mm256_maskstore_ps(p, dt_lane_mask(n), v); }
    inline void store_n(uint16_t* p, int n) const {
        alignas(16) uint16_t tmp[8];
        _mm_store_si128(reinterpret_cast<__m128i*>(tmp), to_bf16());
        for (int i = 0; i < n; ++i) p[i] = tmp[i];
    }

    // Round to nearest even, as torch does (NaN becomes 0x7fc0).
    inline __m128i to_bf16() const {
        __m256i u = _mm256_castps_si256(v);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
        r = _mm256_srli_epi32(r, 16);
        __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit lane: a0..a3 a0..a3 | b0..b3 b0..b3
        packed = _mm256_permute4x64_epi64(packed, 0x08);
        return _mm256_castsi256_si128(packed);
    }

    friend inline Vec256 operator+(Vec256 a, Vec256 b) { return {_mm256_add_ps(a.v, b.v)}; }
    friend inline Vec256 operator-(Vec256 a, Vec256 b) { return {_mm256_sub_ps(a.v, b.v)}; }
    friend inline Vec256 operator*(Vec256 a, Vec256 b) { return {_mm256_mul_ps(a.v, b.v)}; }
    friend inline Vec256 operator/(Vec256 a, Vec256 b) { return {_mm256_div_ps(a.v, b.v)}; }
    static inline Vec256 fma(Vec256 a, Vec256 b, Vec256 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
    static inline Vec256 max(Vec256 a, Vec256 b) { return {_mm256_max_ps(a.v, b.v)}; }
    inline float reduce_add() const {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    inline float reduce_max() const {
        __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        s = _mm_max_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    inline Vec256 where_equal(Vec256 a, Vec256 b, Vec256 x) const {
        return {_mm256_blendv_ps(v, x.v, _mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ))};
    }

    // exp with ~1 ulp error on [-87, 88]; exactly 0 below -87.3 (so exp(-inf) == 0).
    static inline Vec256 exp(Vec256 x) {
        __m256 xv = _mm256_min_ps(x.v, _mm256_set1_ps(88.3762626647949f));
        __m256 tiny = _mm256_cmp_ps(xv, _mm256_set1_ps(-87.3365447505531f), _CMP_LT_OQ);
        xv = _mm256_max_ps(xv, _mm256_set1_ps(-87.3365447505531f));
        __m256 n = _mm256_round_ps(_mm256_mul_ps(xv, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xv);
        r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
        __m256 p = _mm256_set1_ps(1.9875691500e-4f);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
        p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
        // 2^n in two steps so that n = 128 (x near 88.7) does not overflow the exponent field.
        __m256i ni = _mm256_cvtps_epi32(n);
        __m256i half = _mm256_srai_epi32(ni, 1);
        __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
        __m256 s2 = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
        __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
        return {_mm256_andnot_ps(tiny, e)};
    }
};

// The vector of dot products that stream a weight from memory (decode-sized linear layers): 256-bit loads
// read it faster than 512-bit ones on Zen 4 (`benchmarks/kernels_cpu.py --decode-pass`; benchmarks/RESULTS.md).
typedef Vec256 StreamVec;
#ifndef DT_VEC_AVX512
typedef Vec256 Vec;
#endif

}  // namespace DT_NS
