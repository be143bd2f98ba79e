// CPU probe: cpuid + xgetbv on x86-64, getauxval(AT_HWCAP) on aarch64 Linux. Compiled without
// any ISA flag so it runs on every CPU of the target architecture.
#include "cpu_probe.hpp"

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define MEMOPT_X86 1
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#endif

namespace memopt_cpu {
namespace {

#if defined(MEMOPT_X86)
uint64_t xgetbv0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}
#endif

CpuFeatures probe() {
  CpuFeatures f;
#if defined(MEMOPT_X86)
  unsigned a = 0, b = 0, c = 0, d = 0;
  const unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 1 || !__get_cpuid(1, &a, &b, &c, &d)) return f;
  f.fma = (c >> 12) & 1;
  const bool osxsave = (c >> 27) & 1;
  const bool avx = (c >> 28) & 1;
  f.f16c = (c >> 29) & 1;
  if (osxsave && avx) {
    const uint64_t xcr0 = xgetbv0();
    f.os_avx = (xcr0 & 0x6) == 0x6;         // XMM + YMM state
    f.os_avx512 = (xcr0 & 0xE6) == 0xE6;    // + opmask, ZMM_Hi256, Hi16_ZMM
  }
  if (max_leaf >= 7 && __get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    f.avx2 = (b >> 5) & 1;
    f.avx512f = (b >> 16) & 1;
    f.avx512dq = (b >> 17) & 1;
    f.avx512bw = (b >> 30) & 1;
    f.avx512vl = (b >> 31) & 1;
    const unsigned sub = a;  // highest subleaf of leaf 7
    if (sub >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d)) f.avx512bf16 = (a >> 5) & 1;
  }
#elif defined(__aarch64__)
#if defined(__linux__)
  f.neon = (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0;
#else
  f.neon = true;  // Advanced SIMD is mandatory on AArch64
#endif
#endif
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = probe();  // C++11 magic static: probed once
  return features;
}

bool cpu_supports_isa(const std::string& name) {
  const CpuFeatures& f = cpu_features();
  if (name == "scalar") return true;
  if (name == "avx2") return f.os_avx && f.avx2 && f.fma && f.f16c;
  if (name == "avx512")
    return f.os_avx && f.os_avx512 && f.avx2 && f.fma && f.f16c && f.avx512f && f.avx512bw &&
           f.avx512vl && f.avx512dq;
  if (name == "neon") return f.neon;
  return false;
}

const std::vector<std::string>& all_isa_names() {
  static const std::vector<std::string> names = {"scalar", "avx2", "avx512", "neon"};
  return names;
}

}  // namespace memopt_cpu
