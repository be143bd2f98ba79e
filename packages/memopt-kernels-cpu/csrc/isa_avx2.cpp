// The kernels compiled for the avx2 instruction set: the one implementation in kernels_impl.hpp,
// built in this translation unit with its own compiler flags (CMakeLists.txt), no fast-math and
// -ffp-contract=off so every backend rounds exactly like memopt-core's reference.
#define MEMOPT_ISA_NS avx2
#define MEMOPT_ISA_TABLE kernels_avx2
#include "kernels_impl.hpp"
