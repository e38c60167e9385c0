// AVX-512 with the AVX512-BF16 dot products (VDPBF16PS) for bf16 attention scores.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -mavx2 -mf16c.
#define DT_NS dt_isa_avx512_bf16
#define DT_ISA_NAME "avx512_bf16"
#define DT_HAS_BF16_DOT 1
#include "vec_avx512.h"
#include "kernels_impl.h"

extern "C" const dt_kernel_table* dt_table_avx512_bf16(void) { return &DT_NS::kTable; }
