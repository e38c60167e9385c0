// Checks the kernels of the selected ISA against a naive double-precision reference, without Python or
// torch, so that paths this machine cannot run natively (NEON) can be run under an emulator:
//
//     tools/check_cross_arm.sh        # cross-compiles the portable (NEON) path and runs it in qemu-aarch64
//
// Usage: check_kernels [isa]; exits non-zero and names the first kernel and case that differ.

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <random>
#include <vector>

#include "../csrc/kernels.h"

namespace {

std::mt19937 rng(0);

float randn() { return std::normal_distribution<float>(0.0f, 1.0f)(rng); }

uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// A tensor held as float32 values that are exactly representable in its dtype.
struct Buf {
    int dtype;
    std::vector<float> f;
    std::vector<uint16_t> h;
    Buf(size_t n, int dtype_, bool random) : dtype(dtype_), f(n), h(n) {
        for (size_t i = 0; i < n; ++i) {
            float x = random ? randn() : 0.0f;
            if (dtype == DT_BFLOAT16) x = from_bf16(to_bf16(x));
            f[i] = x;
            h[i] = to_bf16(x);
        }
    }
    void* ptr() { return dtype == DT_BFLOAT16 ? (void*)h.data() : (void*)f.data(); }
    float at(size_t i) const { return dtype == DT_BFLOAT16 ? from_bf16(h[i]) : f[i]; }
};

int failures = 0;

void expect(const char* what, double err, double tol) {
    printf("  %-58s max error %.3g (tolerance %.3g) %s\n", what, err, tol, err <= tol ? "ok" : "FAILED");
    if (!(err <= tol)) ++failures;
}

void check_attention(int dtype, int D, int BS, int H, int Hkv, int window, float softcap) {
    const int seqs[][2] = {{1, 40}, {1, 3}, {1, 1}, {17, 17}, {9, 30}, {1, 70}};  // (query len, seq len)
    const int S = 6, g = H / Hkv;
    std::vector<int32_t> qsl(1, 0), lens, table;
    int blocks_per_seq = 0;
    for (auto& s : seqs) blocks_per_seq = blocks_per_seq > (s[1] + BS - 1) / BS ? blocks_per_seq : (s[1] + BS - 1) / BS;
    const int NB = S * blocks_per_seq + 2;
    std::vector<int32_t> perm(NB);
    for (int i = 0; i < NB; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int s = 0; s < S; ++s) {
        qsl.push_back(qsl.back() + seqs[s][0]);
        lens.push_back(seqs[s][1]);
        for (int b = 0; b < blocks_per_seq; ++b) table.push_back(perm[s * blocks_per_seq + b]);
    }
    const int T = qsl.back();
    std::vector<int64_t> slots;
    for (int s = 0; s < S; ++s)
        for (int p = lens[s] - seqs[s][0]; p < lens[s]; ++p)
            slots.push_back((int64_t)table[s * blocks_per_seq + p / BS] * BS + p % BS);
    Buf q(T * H * D, dtype, true), k(T * Hkv * D, dtype, true), v(T * Hkv * D, dtype, true);
    Buf kc(NB * BS * Hkv * D, dtype, true), vc(NB * BS * Hkv * D, dtype, true), out(T * H * D, dtype, false);
    const float scale = 1.0f / sqrtf((float)D);
    // Reference: write the new keys and values, then attend in double.
    std::vector<float> kref(kc.f), vref(vc.f);
    for (int t = 0; t < T; ++t)
        for (int i = 0; i < Hkv * D; ++i) {
            kref[slots[t] * Hkv * D + i] = k.at(t * Hkv * D + i);
            vref[slots[t] * Hkv * D + i] = v.at(t * Hkv * D + i);
        }
    dt_attention_args a = {};
    a.q = q.ptr(); a.k = k.ptr(); a.v = v.ptr(); a.out = out.ptr();
    a.key_cache = kc.ptr(); a.value_cache = vc.ptr(); a.slot_mapping = slots.data();
    a.block_table = table.data(); a.seq_lens = lens.data(); a.query_start_loc = qsl.data();
    a.q_stride = H * D; a.k_stride = Hkv * D; a.v_stride = Hkv * D; a.out_stride = H * D;
    a.block_table_stride = blocks_per_seq; a.num_tokens = T; a.num_seqs = S; a.num_heads = H;
    a.num_kv_heads = Hkv; a.head_size = D; a.block_size = BS; a.num_blocks = NB; a.sliding_window = window;
    a.scale = scale; a.softcap = softcap; a.dtype = dtype; a.cache_dtype = dtype; a.num_threads = 2;
    if (dt_attention(&a) != DT_OK) {
        printf("  attention returned an error status\n");
        ++failures;
        return;
    }
    double err = 0.0, cache_err = 0.0;
    for (size_t i = 0; i < kref.size(); ++i)
        cache_err = fmax(cache_err, fabs(kref[i] - kc.at(i)) + fabs(vref[i] - vc.at(i)));
    for (int s = 0; s < S; ++s) {
        int qlen = seqs[s][0], L = lens[s];
        for (int r = 0; r < qlen; ++r) {
            int t = qsl[s] + r, pos = L - qlen + r;
            for (int h = 0; h < H; ++h) {
                int kh = h / g;
                std::vector<double> sc(L, -INFINITY);
                double mx = -INFINITY;
                for (int j = 0; j <= pos; ++j) {
                    if (window > 0 && j <= pos - window) continue;
                    int64_t slot = (int64_t)table[s * blocks_per_seq + j / BS] * BS + j % BS;
                    double dot = 0;
                    for (int d = 0; d < D; ++d) dot += (double)q.at((t * H + h) * D + d) * kref[(slot * Hkv + kh) * D + d];
                    dot *= scale;
                    if (softcap > 0) dot = softcap * tanh(dot / softcap);
                    sc[j] = dot;
                    mx = fmax(mx, dot);
                }
                double sum = 0;
                for (int j = 0; j < L; ++j) sum += sc[j] == -INFINITY ? 0 : exp(sc[j] - mx);
                for (int d = 0; d < D; ++d) {
                    double o = 0;
                    for (int j = 0; j < L; ++j) {
                        if (sc[j] == -INFINITY) continue;
                        int64_t slot = (int64_t)table[s * blocks_per_seq + j / BS] * BS + j % BS;
                        o += exp(sc[j] - mx) / sum * vref[(slot * Hkv + kh) * D + d];
                    }
                    err = fmax(err, fabs(o - out.at((t * H + h) * D + d)));
                }
            }
        }
    }
    char what[160];
    snprintf(what, sizeof what, "attention %s D=%d block=%d heads=%d/%d window=%d softcap=%g",
             dtype == DT_BFLOAT16 ? "bf16" : "f32", D, BS, H, Hkv, window, softcap);
    expect(what, err, dtype == DT_BFLOAT16 ? 2e-2 : 1e-4);
    expect("  KV-cache write", cache_err, 0.0);
}

void check_fused(int dtype) {
    const int rows = 5, n = 200, half = 40, D = 96, rot = 80, H = 3, Hkv = 2, P = 50;
    const double tol = dtype == DT_BFLOAT16 ? 2e-2 : 2e-5;
    const char* name = dtype == DT_BFLOAT16 ? "bf16" : "f32";
    char what[120];
    Buf x(rows * n, dtype, true), res(rows * n, dtype, true), w(n, DT_FLOAT32, true);
    Buf out(rows * n, dtype, false), summed(rows * n, dtype, false);
    dt_add_rms_norm(x.ptr(), n, res.ptr(), n, w.ptr(), DT_FLOAT32, out.ptr(), summed.ptr(), rows, n, 1e-6f, dtype, 2);
    double err = 0.0;
    for (int r = 0; r < rows; ++r) {
        double ss = 0;
        std::vector<double> sv(n);
        for (int i = 0; i < n; ++i) {
            sv[i] = dtype == DT_BFLOAT16 ? from_bf16(to_bf16(x.at(r * n + i) + res.at(r * n + i)))
                                         : (double)(x.at(r * n + i) + res.at(r * n + i));
            ss += sv[i] * sv[i];
        }
        double inv = 1.0 / sqrt(ss / n + 1e-6);
        for (int i = 0; i < n; ++i) {
            err = fmax(err, fabs(sv[i] * inv * w.at(i) - out.at(r * n + i)));
            err = fmax(err, fabs(sv[i] - summed.at(r * n + i)));
        }
    }
    snprintf(what, sizeof what, "add_rms_norm %s", name);
    expect(what, err, tol * 4);

    Buf gu(rows * 2 * half, dtype, true), act(rows * half, dtype, false);
    dt_silu_and_mul(gu.ptr(), 2 * half, act.ptr(), rows, half, dtype, 2);
    err = 0.0;
    for (int r = 0; r < rows; ++r)
        for (int i = 0; i < half; ++i) {
            double a = gu.at(r * 2 * half + i), b = gu.at(r * 2 * half + half + i);
            err = fmax(err, fabs(a / (1 + exp(-a)) * b - act.at(r * half + i)));
        }
    snprintf(what, sizeof what, "silu_and_mul %s", name);
    expect(what, err, tol * 4);

    std::vector<float> cs(P * rot);
    for (int p = 0; p < P; ++p)
        for (int i = 0; i < rot / 2; ++i) {
            double f = p * pow(10000.0, -2.0 * i / rot);
            cs[p * rot + i] = (float)cos(f);
            cs[p * rot + rot / 2 + i] = (float)sin(f);
        }
    std::vector<int64_t> positions = {3, 0, 49, 17, 8};
    Buf qk(rows * (H + Hkv) * D, dtype, true), qo(rows * H * D, dtype, false), ko(rows * Hkv * D, dtype, false);
    const char* qin = static_cast<const char*>(qk.ptr());
    size_t elem = dtype == DT_BFLOAT16 ? 2 : 4;
    int status = dt_rotary_neox(positions.data(), P, qin, (H + Hkv) * D, qin + H * D * elem, (H + Hkv) * D, qo.ptr(),
                                ko.ptr(), cs.data(), rows, H, Hkv, D, rot, dtype, 2);
    err = status == DT_OK ? 0.0 : 1e9;
    for (int t = 0; t < rows; ++t)
        for (int h = 0; h < H + Hkv; ++h)
            for (int i = 0; i < D; ++i) {
                const int base = t * (H + Hkv) * D + h * D;
                double want;
                if (i < rot / 2) {
                    double c = cs[positions[t] * rot + i], s = cs[positions[t] * rot + rot / 2 + i];
                    want = qk.at(base + i) * c - qk.at(base + i + rot / 2) * s;
                } else if (i < rot) {
                    double c = cs[positions[t] * rot + i - rot / 2], s = cs[positions[t] * rot + i];
                    want = qk.at(base + i) * c + qk.at(base + i - rot / 2) * s;
                } else {
                    want = qk.at(base + i);
                }
                double got = h < H ? qo.at(t * H * D + h * D + i) : ko.at(t * Hkv * D + (h - H) * D + i);
                err = fmax(err, fabs(want - got));
            }
    snprintf(what, sizeof what, "rotary_neox %s (head 96, rotary 80, strided rows)", name);
    expect(what, err, tol * 4);
}

}  // namespace

int main(int argc, char** argv) {
    const char* isa = argc > 1 ? argv[1] : "auto";
    if (dt_set_isa(isa) != 0) {
        printf("cannot select ISA %s (this CPU runs: %s)\n", isa, dt_supported_isas());
        return 2;
    }
    printf("kernels: %s (compiled: %s; this CPU runs: %s)\n", dt_current_isa(), dt_compiled_isas(),
           dt_supported_isas());
    for (int dtype : {DT_FLOAT32, DT_BFLOAT16}) {
        check_attention(dtype, 64, 16, 8, 2, 0, 0.0f);
        check_attention(dtype, 80, 8, 4, 4, 0, 0.0f);
        check_attention(dtype, 128, 32, 8, 1, 7, 0.0f);
        check_attention(dtype, 256, 16, 4, 2, 0, 5.0f);
        check_fused(dtype);
    }
    printf(failures ? "%d check(s) FAILED\n" : "all checks passed\n", failures);
    return failures ? 1 : 0;
}
