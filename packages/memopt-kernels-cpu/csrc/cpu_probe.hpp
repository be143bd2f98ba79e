// What the CPU (and the OS, which must save the wide registers) supports, probed once with
// cpuid + xgetbv on x86-64 and getauxval on aarch64. Nothing here is compiled with ISA flags.
#pragma once

#include <string>
#include <vector>

namespace memopt_cpu {

struct CpuFeatures {
  // x86-64 (cpuid leaf 1 / leaf 7; os_* from XCR0: the OS saves YMM / ZMM state)
  bool fma = false, f16c = false, avx2 = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512bf16 = false;
  bool os_avx = false, os_avx512 = false;
  // aarch64 (Advanced SIMD, mandatory in the architecture; reported by HWCAP_ASIMD)
  bool neon = false;
};

// Probed once, then cached (thread-safe).
const CpuFeatures& cpu_features();

// Instruction sets this CPU and OS can run (regardless of what this build contains):
//   avx2:   avx2 + fma + f16c and the OS saves YMM
//   avx512: avx512f/bw/vl/dq (+ fma, f16c) and the OS saves ZMM (avx512bf16 is reported only)
//   neon:   aarch64 Advanced SIMD
bool cpu_supports_isa(const std::string& name);

// Every instruction-set name known to the package, weakest first.
const std::vector<std::string>& all_isa_names();

}  // namespace memopt_cpu
