// 16 float32 lanes in an AVX-512 register (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq).
#pragma once

#include <immintrin.h>
#include <stdint.h>

#define DT_VEC_AVX512 1
#include "vec_avx2.h"

namespace DT_NS {

struct Vec {
    static constexpr int W = 16;
    __m512 v;

    static inline Vec zero() { return {_mm512_setzero_ps()}; }
    static inline Vec set1(float x) { return {_mm512_set1_ps(x)}; }
    static inline Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
    static inline Vec load(const uint16_t* p) {
        __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
    }
    // The first n lanes (n < W); the others are zero.
    static inline Vec load_n(const float* p, int n) { return {_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p)}; }
    static inline Vec load_n(const uint16_t* p, int n) {
        __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
        return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
    }
    inline void store(float* p) const { _mm512_storeu_ps(p, v); }
    inline void store(uint16_t* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16()); }
    inline void store_n(float* p, int n) const { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }
    inline void store_n(uint16_t* p, int n) const {
        _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1), to_bf16());
    }

    // Round to nearest even, as torch does (NaN becomes 0x7fc0).
    inline __m256i to_bf16() const {
#ifdef DT_HAS_BF16_DOT
        return (__m256i)_mm512_cvtneps_pbh(v);
#else
        __m512i u = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc00000));
        return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
    }

    friend inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
    friend inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
    friend inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
    friend inline Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
    static inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
    static inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
    inline float reduce_add() const { return _mm512_reduce_add_ps(v); }
    inline float reduce_max() const { return _mm512_reduce_max_ps(v); }
    // Lanes where a == b take `x`, the others keep this vector's value.
    inline Vec where_equal(Vec a, Vec b, Vec x) const {
        return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ), v, x.v)};
    }

    // exp with ~1 ulp error on [-87, 88]; exactly 0 below -87.3 (so exp(-inf) == 0).
    static inline Vec exp(Vec x) {
        const __m512 hi = _mm512_set1_ps(88.3762626647949f);
        __m512 xv = _mm512_min_ps(x.v, hi);
        __mmask16 tiny = _mm512_cmp_ps_mask(xv, _mm512_set1_ps(-87.3365447505531f), _CMP_LT_OQ);
        __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xv, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xv);
        r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
        __m512 p = _mm512_set1_ps(1.9875691500e-4f);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
        p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
        __m512 e = _mm512_scalef_ps(p, n);
        return {_mm512_maskz_mov_ps((__mmask16)~tiny, e)};
    }
};

}  // namespace DT_NS
