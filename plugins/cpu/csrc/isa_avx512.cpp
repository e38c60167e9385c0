// AVX-512 (F, BW, VL, DQ) without BF16 instructions; bf16 is widened to float32.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mavx2 -mf16c.
#define DT_NS dt_isa_avx512
#define DT_ISA_NAME "avx512"
#include "vec_avx512.h"
#include "kernels_impl.h"

extern "C" const dt_kernel_table* dt_table_avx512(void) { return &DT_NS::kTable; }
