// AVX2 with FMA (8 float32 lanes). Compiled with -mavx2 -mfma -mf16c.
#define DT_NS dt_isa_avx2
#define DT_ISA_NAME "avx2"
#include "vec_avx2.h"
#include "kernels_impl.h"

extern "C" const dt_kernel_table* dt_table_avx2(void) { return &DT_NS::kTable; }
