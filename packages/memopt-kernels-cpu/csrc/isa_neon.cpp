// The kernels compiled for the neon instruction set: the one implementation in kernels_impl.hpp,
// built in this translation unit with its own compiler flags (CMakeLists.txt), no fast-math and
// -ffp-contract=off so every backend rounds exactly like memopt-core's reference.
#define MEMOPT_ISA_NS neon
#define MEMOPT_ISA_TABLE kernels_neon
#include "kernels_impl.hpp"
