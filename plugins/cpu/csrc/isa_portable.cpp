// The portable path: NEON on Arm, plain C++ elsewhere. Compiled without ISA flags.
#define DT_NS dt_isa_portable
#define DT_ISA_NAME "portable"
#include "vec_portable.h"
#include "kernels_impl.h"

extern "C" const dt_kernel_table* dt_table_portable(void) { return &DT_NS::kTable; }
