// The portable vector: NEON (4 float32 lanes) on Arm, else 8 lanes of plain C++ the compiler may vectorize.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__ARM_NEON) || defined(__ARM_NEON__)
#include <arm_neon.h>
#define DT_PORTABLE_NEON 1
#endif

namespace DT_NS {

static inline float dt_exp_scalar_poly(float x) {
    if (x < -87.3365447505531f) return 0.0f;
    if (x > 88.3762626647949f) x = 88.3762626647949f;
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    return ldexpf(p, (int)n);
}

#ifdef DT_PORTABLE_NEON

struct Vec {
    static constexpr int W = 4;
    float32x4_t v;

    static inline Vec zero() { return {vdupq_n_f32(0.0f)}; }
    static inline Vec set1(float x) { return {vdupq_n_f32(x)}; }
    static inline Vec load(const float* p) { return {vld1q_f32(p)}; }
    static inline Vec load(const uint16_t* p) {
        return {vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16))};
    }
    static inline Vec load_n(const float* p, int n) {
        float tmp[4] = {0, 0, 0, 0};
        memcpy(tmp, p, sizeof(float) * n);
        return load(tmp);
    }
    static inline Vec load_n(const uint16_t* p, int n) {
        uint16_t tmp[4] = {0, 0, 0, 0};
        memcpy(tmp, p, sizeof(uint16_t) * n);
        return load(tmp);
    }
    inline void store(float* p) const { vst1q_f32(p, v); }
    inline void store(uint16_t* p) const { vst1_u16(p, to_bf16()); }
    inline void store_n(float* p, int n) const {
        float tmp[4];
        vst1q_f32(tmp, v);
        memcpy(p, tmp, sizeof(float) * n);
    }
    inline void store_n(uint16_t* p, int n) const {
        uint16_t tmp[4];
        vst1_u16(tmp, to_bf16());
        memcpy(p, tmp, sizeof(uint16_t) * n);
    }
    inline uint16x4_t to_bf16() const {
        uint32x4_t u = vreinterpretq_u32_f32(v);
        uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
        uint32x4_t r = vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7fff)));
        uint32x4_t is_num = vceqq_f32(v, v);
        r = vbslq_u32(is_num, r, vdupq_n_u32(0x7fc00000));
        return vshrn_n_u32(r, 16);
    }
    friend inline Vec operator+(Vec a, Vec b) { return {vaddq_f32(a.v, b.v)}; }
    friend inline Vec operator-(Vec a, Vec b) { return {vsubq_f32(a.v, b.v)}; }
    friend inline Vec operator*(Vec a, Vec b) { return {vmulq_f32(a.v, b.v)}; }
    friend inline Vec operator/(Vec a, Vec b) { return {vdivq_f32(a.v, b.v)}; }
    static inline Vec fma(Vec a, Vec b, Vec c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
    static inline Vec max(Vec a, Vec b) { return {vmaxq_f32(a.v, b.v)}; }
    inline float reduce_add() const { return vaddvq_f32(v); }
    inline float reduce_max() const { return vmaxvq_f32(v); }
    inline Vec where_equal(Vec a, Vec b, Vec x) const { return {vbslq_f32(vceqq_f32(a.v, b.v), x.v, v)}; }

    static inline Vec exp(Vec x) {
        float32x4_t xv = vminq_f32(x.v, vdupq_n_f32(88.3762626647949f));
        uint32x4_t tiny = vcltq_f32(xv, vdupq_n_f32(-87.3365447505531f));
        xv = vmaxq_f32(xv, vdupq_n_f32(-87.3365447505531f));
        float32x4_t n = vrndnq_f32(vmulq_f32(xv, vdupq_n_f32(1.44269504088896341f)));
        float32x4_t r = vfmsq_f32(xv, n, vdupq_n_f32(0.693359375f));
        r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
        float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
        p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
        p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
        p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
        p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
        p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
        p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
        int32x4_t ni = vcvtq_s32_f32(n);
        int32x4_t half = vshrq_n_s32(ni, 1);
        float32x4_t s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(half, vdupq_n_s32(127)), 23));
        float32x4_t s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vsubq_s32(ni, half), vdupq_n_s32(127)), 23));
        float32x4_t e = vmulq_f32(vmulq_f32(p, s1), s2);
        return {vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(e), tiny))};
    }
};

#else

struct Vec {
    static constexpr int W = 8;
    float v[8];

    static inline Vec zero() { return set1(0.0f); }
    static inline Vec set1(float x) {
        Vec r;
        for (int i = 0; i < W; ++i) r.v[i] = x;
        return r;
    }
    static inline Vec load(const float* p) {
        Vec r;
        memcpy(r.v, p, sizeof(r.v));
        return r;
    }
    static inline Vec load(const uint16_t* p) {
        Vec r;
        for (int i = 0; i < W; ++i) {
            uint32_t u = (uint32_t)p[i] << 16;
            memcpy(&r.v[i], &u, 4);
        }
        return r;
    }
    static inline Vec load_n(const float* p, int n) {
        Vec r = zero();
        memcpy(r.v, p, sizeof(float) * n);
        return r;
    }
    static inline Vec load_n(const uint16_t* p, int n) {
        uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        memcpy(tmp, p, sizeof(uint16_t) * n);
        return load(tmp);
    }
    static inline uint16_t bf16(float f) {
        uint32_t u;
        memcpy(&u, &f, 4);
        if (f != f) return 0x7fc0;
        return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
    inline void store(float* p) const { memcpy(p, v, sizeof(v)); }
    inline void store(uint16_t* p) const {
        for (int i = 0; i < W; ++i) p[i] = bf16(v[i]);
    }
    inline void store_n(float* p, int n) const { memcpy(p, v, sizeof(float) * n); }
    inline void store_n(uint16_t* p, int n) const {
        for (int i = 0; i < n; ++i) p[i] = bf16(v[i]);
    }
#define DT_LANEWISE(expr)               \
    Vec r;                              \
    for (int i = 0; i < W; ++i) r.v[i] = expr; \
    return r;
    friend inline Vec operator+(Vec a, Vec b) { DT_LANEWISE(a.v[i] + b.v[i]) }
    friend inline Vec operator-(Vec a, Vec b) { DT_LANEWISE(a.v[i] - b.v[i]) }
    friend inline Vec operator*(Vec a, Vec b) { DT_LANEWISE(a.v[i] * b.v[i]) }
    friend inline Vec operator/(Vec a, Vec b) { DT_LANEWISE(a.v[i] / b.v[i]) }
    static inline Vec fma(Vec a, Vec b, Vec c) { DT_LANEWISE(a.v[i] * b.v[i] + c.v[i]) }
    static inline Vec max(Vec a, Vec b) { DT_LANEWISE(a.v[i] > b.v[i] ? a.v[i] : b.v[i]) }
    inline Vec where_equal(Vec a, Vec b, Vec x) const { DT_LANEWISE(a.v[i] == b.v[i] ? x.v[i] : v[i]) }
    static inline Vec exp(Vec x) { DT_LANEWISE(dt_exp_scalar_poly(x.v[i])) }
#undef DT_LANEWISE
    inline float reduce_add() const {
        float s = 0.0f;
        for (int i = 0; i < W; ++i) s += v[i];
        return s;
    }
    inline float reduce_max() const {
        float m = v[0];
        for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
        return m;
    }
};

#endif

typedef Vec StreamVec;

}  // namespace DT_NS
