// memopt_kernels_cpu._core: the pybind11 module. Plain integers, addresses and floats in, no
// torch: memopt_kernels_cpu/ops.py validates every tensor and passes data_ptr()s. Every function
// that touches memory releases the GIL and re-checks its integer arguments so a bad call raises
// ValueError instead of crashing. The instruction set is chosen at import (best supported, or
// MEMOPT_CPU_ISA) and can be changed with set_isa().
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpu_probe.hpp"
#include "memopt_cpu/kernel_api.hpp"
#include "pool.hpp"

#ifndef MEMOPT_VERSION
#error "MEMOPT_VERSION must be defined by the build (CMakeLists.txt passes the pyproject version)"
#endif

namespace py = pybind11;
using namespace memopt_cpu;

namespace {

// ------------------------------------------------------------------------------ instruction sets
struct IsaEntry {
  std::string name;
  const IsaKernels* kernels;
};

const std::vector<IsaEntry>& built_isas() {
  static const std::vector<IsaEntry> entries = {
      {"scalar", &kernels_scalar},
#if defined(MEMOPT_HAVE_AVX2)
      {"avx2", &kernels_avx2},
#endif
#if defined(MEMOPT_HAVE_AVX512)
      {"avx512", &kernels_avx512},
#endif
#if defined(MEMOPT_HAVE_NEON)
      {"neon", &kernels_neon},
#endif
  };
  return entries;
}

std::mutex g_isa_mu;
std::atomic<const IsaKernels*> g_kernels{&kernels_scalar};
std::string g_isa = "scalar";

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out.empty() ? "none" : out;
}

std::vector<std::string> built_names() {
  std::vector<std::string> out;
  for (const auto& e : built_isas()) out.push_back(e.name);
  return out;
}

// Built and runnable here, weakest first.
std::vector<std::string> supported_names() {
  std::vector<std::string> out;
  for (const auto& e : built_isas())
    if (cpu_supports_isa(e.name)) out.push_back(e.name);
  return out;
}

std::string normalize(const std::string& name) {
  std::string s;
  for (char c : name)
    if (!std::isspace(static_cast<unsigned char>(c)))
      s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Selects an instruction set; "auto" (or "") picks the best supported one. Returns its name.
std::string set_isa(const std::string& requested) {
  const std::string name = normalize(requested);
  const std::vector<std::string> ok = supported_names();
  std::string chosen = name;
  if (name.empty() || name == "auto") {
    chosen = ok.back();  // scalar is always built and supported
  } else {
    const auto& all = all_isa_names();
    if (std::find(all.begin(), all.end(), name) == all.end())
      throw std::invalid_argument("unknown instruction set '" + requested +
                                  "'; choose one of auto, " + join(all_isa_names()));
    const auto built = built_names();
    if (std::find(built.begin(), built.end(), name) == built.end())
      throw std::runtime_error("instruction set '" + name +
                               "' is not built into this memopt-kernels-cpu (built for this "
                               "architecture: " + join(built) + "); usable here: " + join(ok));
    if (!cpu_supports_isa(name))
      throw std::runtime_error("this CPU (or OS) does not support instruction set '" + name +
                               "' (avx2 needs avx2+fma+f16c, avx512 needs avx512f/bw/vl/dq); "
                               "usable here: " + join(ok));
  }
  for (const auto& e : built_isas()) {
    if (e.name == chosen) {
      std::lock_guard<std::mutex> lk(g_isa_mu);
      g_kernels.store(e.kernels);
      g_isa = chosen;
      return chosen;
    }
  }
  throw std::logic_error("set_isa: no kernel table for " + chosen);
}

std::string get_isa() {
  std::lock_guard<std::mutex> lk(g_isa_mu);
  return g_isa;
}

const IsaKernels& kernels() { return *g_kernels.load(); }

// ------------------------------------------------------------------------------ argument checks
[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument(msg); }

void check_range(const char* what, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi)
    bad(std::string(what) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
        "], got " + std::to_string(v));
}

// What is wrong with address `addr` of `what` ("" when nothing is). The kernels access whole
// elements through typed pointers, so an address must be a multiple of the element size `align`
// (a misaligned one is undefined behaviour, a fault where the compiler vectorizes with aligned
// loads).
std::string addr_problem(const char* what, int64_t addr, bool needed, int64_t align = 1) {
  if (addr < 0) return std::string(what) + ": negative address " + std::to_string(addr);
  if (needed && addr == 0) return std::string(what) + " is required here but the address is 0";
  if (addr % align != 0)
    return std::string(what) + ": address " + std::to_string(addr) + " is not a multiple of " +
           "its element size, " + std::to_string(align) + " bytes";
  return {};
}

void check_addr(const char* what, int64_t addr, bool needed) {
  const std::string problem = addr_problem(what, addr, needed);
  if (!problem.empty()) bad(problem);
}

template <class T>
T* ptr(int64_t addr) {
  return reinterpret_cast<T*>(static_cast<std::uintptr_t>(addr));
}

bool blocked(int32_t fmt) { return fmt == FMT_E4M3 || fmt == FMT_E5M2 || fmt == FMT_Q8SQRT; }

int64_t moment_code_bytes(int32_t fmt) {
  return fmt == FMT_FP32 ? 4 : (fmt == FMT_BF16 ? 2 : 1);
}

int64_t master_param_bytes(int32_t master) { return master == MASTER_FP32 ? 4 : 2; }

int64_t master_code_bytes(int32_t master) {
  return master == MASTER_ECC24 ? 1 : (master == MASTER_ECC32 ? 2 : 0);
}

void check_moment(const char* name, int32_t fmt, int64_t codes, const char* scales_name,
                  int64_t scales, int32_t block, bool needed) {
  if (fmt == FMT_NONE) return;
  check_addr(name, codes, needed);
  if (blocked(fmt)) {
    check_addr(scales_name, scales, needed);
    if (block != 32)
      bad(std::string(name) + ": blocked moment formats need block == 32, got " +
          std::to_string(block));
  }
}

// What is wrong with one slot-table row of a fused step ("" when nothing is).
std::string slot_row_problem(const SlotRow& r, int32_t master, int32_t want_param_kind,
                             int32_t block, int64_t arena_elements) {
  // bounded first: rounding numel near 2**63 up to the block would overflow
  if (r.numel < 0 || r.numel > (int64_t{1} << 62))
    return "numel " + std::to_string(r.numel) + " must be in [0, 2**62]";
  const int64_t want = (r.numel + block - 1) / block * block;
  if (r.padded != want)
    return "padded " + std::to_string(r.padded) + " is not numel " + std::to_string(r.numel) +
           " rounded up to the block of " + std::to_string(block);
  if (r.arena_offset < 0 || r.arena_offset % block != 0 ||
      r.arena_offset > arena_elements - r.padded)
    return "arena_offset " + std::to_string(r.arena_offset) + " (+ padded " +
           std::to_string(r.padded) + ") is not a block-aligned range of the arena of " +
           std::to_string(arena_elements) + " elements";
  // an fp32 master takes every gradient kind (widening is exact); others fp32 or their own
  if (r.grad_kind < GRAD_FP32 || r.grad_kind > GRAD_FP16 ||
      (master != MASTER_FP32 && r.grad_kind != GRAD_FP32 && r.grad_kind != want_param_kind))
    return "grad_kind " + std::to_string(r.grad_kind) +
           " must be GRAD_FP32 or the parameter's own dtype (fp32 parameters: any Grad)";
  const int64_t grad_bytes = r.grad_kind == GRAD_FP32 ? 4 : 2;
  std::string a = addr_problem("param", r.param, r.numel > 0, master_param_bytes(master));
  if (a.empty()) a = addr_problem("grad", r.grad, r.numel > 0, grad_bytes);
  if (a.empty()) a = addr_problem("staging", r.staging, false, 2);
  if (!a.empty()) return a;
  if (r.staging != 0 && master == MASTER_FP16)
    return "bf16 staging is for fp32 and bf16 parameters, not fp16 ones";
  // the rounding indices index_base .. index_base + padded stay far from int64 overflow
  if (r.index_base < 0 || r.index_base >= (int64_t{1} << 62) - r.padded)
    return "index_base " + std::to_string(r.index_base) + " (+ padded " +
           std::to_string(r.padded) + ") must be >= 0 and below 2**62";
  return {};
}

// ------------------------------------------------------------------------------ fused step
void fused_step(int64_t slot_table, int64_t n_slots, int32_t rule, int32_t master, int32_t fmt1,
                int32_t fmt2, int32_t block, bool sr, bool maximize, bool has_l2, bool has_decay,
                bool nesterov, bool first_step, bool has_momentum,
                const std::vector<double>& scalars, uint32_t seed, uint32_t step, int64_t code,
                int64_t m, int64_t ms, int64_t v, int64_t vs, int64_t arena_elements,
                const std::vector<double>& variants, int64_t row_variant) {
  check_range("rule", rule, RULE_SGD, RULE_LION);
  check_range("master", master, MASTER_FP32, MASTER_ECC32);
  check_range("fmt1", fmt1, FMT_FP32, FMT_NONE);
  check_range("fmt2", fmt2, FMT_FP32, FMT_NONE);
  if (block != 1 && block != 32) bad("block must be 1 or 32, got " + std::to_string(block));
  if (scalars.size() != 8)
    bad("scalars must hold 8 floats (kernel_api.hpp's StepConfig::s), got " +
        std::to_string(scalars.size()));
  if (n_slots < 0) bad("n_slots must be >= 0, got " + std::to_string(n_slots));
  if (arena_elements < 0) bad("arena_elements must be >= 0");
  check_addr("slot_table", slot_table, n_slots > 0);
  const bool needs1 = rule != RULE_SGD || has_momentum;
  if (needs1 != (fmt1 != FMT_NONE))
    bad(needs1 ? "fmt1 is FMT_NONE but this rule keeps a first state"
               : "fmt1 must be FMT_NONE for SGD without momentum");
  if ((rule == RULE_ADAM) != (fmt2 != FMT_NONE))
    bad(rule == RULE_ADAM ? "adam needs a second state (fmt2)" : "fmt2 must be FMT_NONE");
  if (nesterov && !has_momentum) bad("nesterov needs has_momentum");
  // arena addresses are needed only when there are elements (an empty arena has none)
  const bool work = arena_elements > 0;
  check_moment("m (first state)", fmt1, m, "ms (first state scales)", ms, block, work);
  check_moment("v (second state)", fmt2, v, "vs (second state scales)", vs, block, work);
  const bool ecc = master == MASTER_ECC24 || master == MASTER_ECC32;
  check_addr("code (ECC master code)", code, ecc && work);
  const int32_t want_param_kind =
      master == MASTER_FP32 ? GRAD_FP32 : (master == MASTER_FP16 ? GRAD_FP16 : GRAD_BF16);

  // Parameters at several step counts in one call (a MoE's experts that skipped steps): each
  // variant overrides what depends on the count, kVariantWords doubles each; row_variant is an
  // int32 per row naming its variant.
  constexpr std::size_t kVariantWords = 10;  // first_step, step, the 8 scalars
  if (variants.size() % kVariantWords)
    bad("variants must hold 10 numbers per variant (first_step, step, 8 scalars), got " +
        std::to_string(variants.size()));
  const int64_t n_variants = static_cast<int64_t>(variants.size() / kVariantWords);
  const std::string bad_rv = addr_problem("row_variant", row_variant, n_variants && n_slots, 4);
  if (!bad_rv.empty()) bad(bad_rv);
  if (n_variants == 0 && row_variant) bad("row_variant is given without variants");
  const int32_t* row_cfg = n_variants ? ptr<const int32_t>(row_variant) : nullptr;
  for (int64_t i = 0; row_cfg && i < n_slots; ++i)
    if (row_cfg[i] < 0 || row_cfg[i] >= n_variants)
      bad("row_variant[" + std::to_string(i) + "] is " + std::to_string(row_cfg[i]) +
          ", not the index of one of the " + std::to_string(n_variants) + " variants");
  for (std::size_t i = 0; i < variants.size(); i += kVariantWords) {
    const double st = variants[i + 1];
    if (!(st >= 0.0 && st <= 4294967295.0) || st != static_cast<double>(static_cast<uint32_t>(st)))
      bad("a variant's step must be an integer in [0, 2**32), got " + std::to_string(st));
  }

  const SlotRow* rows = ptr<const SlotRow>(slot_table);
  for (int64_t i = 0; i < n_slots; ++i) {
    // the message (and its allocations) only for a bad row: at thousands of small tensors,
    // building it for every row took most of a step's time outside the kernels
    const std::string problem = slot_row_problem(rows[i], master, want_param_kind, block,
                                                 arena_elements);
    if (!problem.empty()) bad("slot_table row " + std::to_string(i) + ": " + problem);
  }

  StepConfig cfg{};
  cfg.rule = rule;
  cfg.master = master;
  cfg.fmt1 = fmt1;
  cfg.fmt2 = fmt2;
  cfg.block = block;
  cfg.sr = sr;
  cfg.maximize = maximize;
  cfg.has_l2 = has_l2;
  cfg.has_decay = has_decay;
  cfg.nesterov = nesterov;
  cfg.first_step = first_step;
  cfg.has_momentum = has_momentum;
  for (int i = 0; i < 8; ++i) cfg.s[i] = static_cast<float>(scalars[i]);
  cfg.seed = seed;
  cfg.step = step;
  cfg.code = code;
  cfg.m = m;
  cfg.ms = ms;
  cfg.v = v;
  cfg.vs = vs;
  std::vector<StepConfig> cfgs(n_variants ? static_cast<std::size_t>(n_variants) : 1, cfg);
  for (int64_t k = 0; k < n_variants; ++k) {
    const double* w = variants.data() + k * static_cast<int64_t>(kVariantWords);
    StepConfig& c = cfgs[static_cast<std::size_t>(k)];
    c.first_step = w[0] != 0.0;
    c.step = static_cast<uint32_t>(w[1]);
    for (int i = 0; i < 8; ++i) c.s[i] = static_cast<float>(w[2 + i]);
  }
  run_step(kernels(), cfgs.data(), row_cfg, rows, n_slots);
}

// ------------------------------------------------------------------------------ standalone codecs
void encode_moment(int32_t fmt, int64_t x, int64_t n, int64_t codes, int64_t scales,
                   int64_t rand) {
  check_range("fmt", fmt, FMT_FP32, FMT_Q8SQRT);
  if (n < 0) bad("n must be >= 0");
  if (blocked(fmt) && n % 32)
    bad("blocked moment formats need n % 32 == 0, got n = " + std::to_string(n));
  check_addr("x", x, n > 0);
  check_addr("codes", codes, n > 0);
  check_addr("scales", scales, n > 0 && blocked(fmt));
  check_addr("rand", rand, false);
  const IsaKernels& k = kernels();
  const int64_t cb = moment_code_bytes(fmt);
  parallel_blocks(n, [&](int64_t b, int64_t e) {
    k.encode_moment(fmt, ptr<const float>(x) + b, e - b, ptr<char>(codes) + b * cb,
                    scales ? ptr<uint8_t>(scales) + b / 32 : nullptr,
                    rand ? ptr<const uint32_t>(rand) + b : nullptr);
  });
}

void decode_moment(int32_t fmt, int64_t codes, int64_t scales, int64_t n, int64_t out) {
  check_range("fmt", fmt, FMT_FP32, FMT_Q8SQRT);
  if (n < 0) bad("n must be >= 0");
  if (blocked(fmt) && n % 32)
    bad("blocked moment formats need n % 32 == 0, got n = " + std::to_string(n));
  check_addr("codes", codes, n > 0);
  check_addr("scales", scales, n > 0 && blocked(fmt));
  check_addr("out", out, n > 0);
  const IsaKernels& k = kernels();
  const int64_t cb = moment_code_bytes(fmt);
  parallel_blocks(n, [&](int64_t b, int64_t e) {
    k.decode_moment(fmt, ptr<const char>(codes) + b * cb,
                    scales ? ptr<const uint8_t>(scales) + b / 32 : nullptr, e - b,
                    ptr<float>(out) + b);
  });
}

void encode_master(int32_t master, int64_t x, int64_t n, int64_t param, int64_t code,
                   int64_t rand) {
  check_range("master", master, MASTER_FP32, MASTER_ECC32);
  if (n < 0) bad("n must be >= 0");
  check_addr("x", x, n > 0);
  check_addr("param", param, n > 0);
  const int64_t kb = master_code_bytes(master);
  check_addr("code", code, n > 0 && kb > 0);
  check_addr("rand", rand, false);
  const IsaKernels& k = kernels();
  const int64_t pb = master_param_bytes(master);
  parallel_blocks(n, [&](int64_t b, int64_t e) {
    k.encode_master(master, ptr<const float>(x) + b, e - b, ptr<char>(param) + b * pb,
                    code && kb ? ptr<char>(code) + b * kb : nullptr,
                    rand ? ptr<const uint32_t>(rand) + b : nullptr);
  });
}

void decode_master(int32_t master, int64_t param, int64_t code, int64_t n, int64_t out) {
  check_range("master", master, MASTER_FP32, MASTER_ECC32);
  if (n < 0) bad("n must be >= 0");
  check_addr("param", param, n > 0);
  const int64_t kb = master_code_bytes(master);
  check_addr("code", code, n > 0 && kb > 0);
  check_addr("out", out, n > 0);
  const IsaKernels& k = kernels();
  const int64_t pb = master_param_bytes(master);
  parallel_blocks(n, [&](int64_t b, int64_t e) {
    k.decode_master(master, ptr<const char>(param) + b * pb,
                    code && kb ? ptr<const char>(code) + b * kb : nullptr, e - b,
                    ptr<float>(out) + b);
  });
}

void stream_words(uint32_t seed, uint32_t tensor_id, uint32_t step, int64_t index, int64_t n,
                  int64_t out) {
  if (n < 0) bad("n must be >= 0");
  check_addr("index", index, n > 0);
  check_addr("out", out, n > 0);
  const IsaKernels& k = kernels();
  const int64_t* idx = ptr<const int64_t>(index);
  uint32_t* dst = ptr<uint32_t>(out);
  parallel_blocks(n, [&](int64_t b, int64_t e) {
    if (b == 0 && e == n) {
      k.stream_words(seed, tensor_id, step, idx, n, dst);
      return;
    }
    // out is [3, n]: a part writes its [3, e - b] block to a buffer, then its three row pieces
    const int64_t len = e - b;
    std::vector<uint32_t> buf(static_cast<std::size_t>(3 * len));
    k.stream_words(seed, tensor_id, step, idx + b, len, buf.data());
    for (int w = 0; w < 3; ++w)
      std::memcpy(dst + w * n + b, buf.data() + w * len, static_cast<std::size_t>(len) * 4);
  });
}

void first_touch_py(int64_t addr, int64_t nbytes) {
  if (nbytes < 0) bad("nbytes must be >= 0");
  check_addr("addr", addr, nbytes > 0);
  first_touch(ptr<void>(addr), static_cast<std::size_t>(nbytes));
}

// Test hook: runs one part per pool thread; each part reports its thread's id, part throw_part
// (if >= 0) throws instead. Shows the part -> thread mapping and that exceptions propagate.
std::vector<uint64_t> pool_probe(int throw_part) {
  const int n = get_num_threads();
  std::vector<uint64_t> ids(static_cast<std::size_t>(n), 0);
  parallel_run(n, [&](int p) {
    if (p == throw_part)
      throw std::runtime_error("pool probe: part " + std::to_string(p) + " failed");
    ids[static_cast<std::size_t>(p)] = std::hash<std::thread::id>()(std::this_thread::get_id());
  });
  return ids;
}

// Test hook: run_step's split of slots of the given padded sizes (first chunk of each part, then
// the chunk count).
std::vector<std::size_t> step_partition_py(const std::vector<int64_t>& padded, int64_t chunk_size,
                                           int threads) {
  if (chunk_size <= 0 || threads < 1)
    throw std::invalid_argument("_step_partition: chunk_size and threads must be positive");
  for (int64_t n : padded)
    if (n < 0) throw std::invalid_argument("_step_partition: sizes must be >= 0");
  return partition_step(padded.data(), static_cast<int64_t>(padded.size()), chunk_size, threads)
      .first;
}

py::dict cpu_features_py() {
  const CpuFeatures& f = cpu_features();
  py::dict d;
#if defined(__x86_64__) || defined(_M_X64)
  d["fma"] = f.fma;
  d["f16c"] = f.f16c;
  d["avx2"] = f.avx2;
  d["avx512f"] = f.avx512f;
  d["avx512bw"] = f.avx512bw;
  d["avx512vl"] = f.avx512vl;
  d["avx512dq"] = f.avx512dq;
  d["avx512bf16"] = f.avx512bf16;
  d["os_avx"] = f.os_avx;
  d["os_avx512"] = f.os_avx512;
#endif
#if defined(__aarch64__)
  d["neon"] = f.neon;
#endif
  return d;
}

}  // namespace

PYBIND11_MODULE(_core, mod) {
  mod.doc() =
      "memopt-kernels-cpu's private extension: the C++ kernels behind memopt_kernels_cpu.ops. "
      "Arguments are integers (addresses from Tensor.data_ptr(), sizes, format ids of "
      "kernel_api.hpp) and floats; nothing is checked against tensors here, so call the "
      "validated wrappers in memopt_kernels_cpu.ops instead.";
  mod.attr("__version__") = MEMOPT_VERSION;
  // int64 words per slot-table row (SlotRow): ops.py refuses a build with another layout
  mod.attr("SLOT_ROW_WORDS") = static_cast<int>(sizeof(SlotRow) / sizeof(int64_t));
  // the interface level of these kernels' bits (memopt_core.backends.KERNEL_API), so that a
  // stale build of the same package version is caught at import
  mod.attr("KERNEL_API") = 8;
  // fused_step takes per-row variants (variants, row_variant): ops.py refuses a build without
  mod.attr("STEP_VARIANTS") = true;
  using release = py::call_guard<py::gil_scoped_release>;

  mod.def("supported_isas", &supported_names,
          "Instruction sets built into this module and supported by this CPU, weakest first.");
  mod.def("built_isas", &built_names, "Instruction sets built into this module, weakest first.");
  mod.def("get_isa", &get_isa, "The instruction set the kernels run with.");
  mod.def("set_isa", &set_isa, py::arg("name"),
          "Select an instruction set ('auto': the best supported); returns the one chosen. "
          "ValueError for an unknown name, RuntimeError for one not built or not supported.");
  mod.def("cpu_features", &cpu_features_py, "The CPU features the probe found (name -> bool).");

  mod.def("default_num_threads", &default_num_threads,
          "CPUs this process may use (sched_getaffinity): the default thread count.");
  mod.def("set_num_threads", &set_num_threads, py::arg("n"), release(),
          "Threads of the pool (>= 1); the pool restarts with n threads at the next run.");
  mod.def("get_num_threads", &get_num_threads, release(),
          "Threads of the pool: set_num_threads' value, else default_num_threads().");
  mod.def("set_chunk_size", &set_chunk_size, py::arg("n"), release(),
          "Elements per chunk of a fused step: a positive multiple of 32.");
  mod.def("get_chunk_size", &get_chunk_size, release(),
          "Elements per chunk of a fused step: set_chunk_size's value, else 65536.");
  mod.def("first_touch", &first_touch_py, py::arg("addr"), py::arg("nbytes"), release(),
          "Zero-fill nbytes at addr with the pool's static partition (NUMA first touch).");
  mod.def("_pool_probe", &pool_probe, py::arg("throw_part") = -1, release(),
          "Test hook: the thread id that ran each part of a run over every pool thread; part "
          "throw_part raises instead.");
  mod.def("_step_partition", &step_partition_py, py::arg("padded"), py::arg("chunk_size"),
          py::arg("threads"),
          "Test hook: how a fused step over slots of these padded sizes is split for `threads` "
          "threads: the index of each part's first chunk, then the number of chunks.");

  mod.def("fused_step", &fused_step, py::arg("slot_table"), py::arg("n_slots"), py::kw_only(),
          py::arg("rule"), py::arg("master"), py::arg("fmt1"), py::arg("fmt2"), py::arg("block"),
          py::arg("sr"), py::arg("maximize"), py::arg("has_l2"), py::arg("has_decay"),
          py::arg("nesterov"), py::arg("first_step"), py::arg("has_momentum"),
          py::arg("scalars"), py::arg("seed"), py::arg("step"), py::arg("code"), py::arg("m"),
          py::arg("ms"), py::arg("v"), py::arg("vs"), py::arg("arena_elements"),
          py::arg("variants") = std::vector<double>{}, py::arg("row_variant") = 0, release(),
          "One fused optimizer step over n_slots rows of an int64 slot table (SlotRow). "
          "variants (10 numbers each: first_step, step, the 8 scalars) with row_variant (the "
          "address of an int32 variant index per row) give rows their own step count.");
  mod.def("encode_moment", &encode_moment, py::arg("fmt"), py::arg("x"), py::arg("n"),
          py::arg("codes"), py::arg("scales"), py::arg("rand"), release());
  mod.def("decode_moment", &decode_moment, py::arg("fmt"), py::arg("codes"), py::arg("scales"),
          py::arg("n"), py::arg("out"), release());
  mod.def("encode_master", &encode_master, py::arg("master"), py::arg("x"), py::arg("n"),
          py::arg("param"), py::arg("code"), py::arg("rand"), release());
  mod.def("decode_master", &decode_master, py::arg("master"), py::arg("param"), py::arg("code"),
          py::arg("n"), py::arg("out"), release());
  mod.def("stream_words", &stream_words, py::arg("seed"), py::arg("tensor_id"), py::arg("step"),
          py::arg("index"), py::arg("n"), py::arg("out"), release(),
          "Stochastic-rounding words of elements index[0..n) (memopt_core.rng.stream_words): "
          "out[k * n + i] = word of stream k (0 master, 1 first moment, 2 second moment) of "
          "element i.");

  // The instruction set: MEMOPT_CPU_ISA if set (an impossible request fails the import), else
  // the best one this CPU supports.
  const char* env = std::getenv("MEMOPT_CPU_ISA");
  const std::string requested = env ? env : "";
  try {
    set_isa(requested);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("MEMOPT_CPU_ISA='") + requested + "': " + e.what() +
                             "; unset MEMOPT_CPU_ISA or set it to auto");
  }
}
