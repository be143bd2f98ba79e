// The C-style interface between the pybind11 module (csrc/module.cpp), the thread pool and the
// per-instruction-set kernels (csrc/isa_*.cpp). Plain structs of integers and addresses: Python
// validates every tensor and passes data_ptr()s; nothing here knows about torch.
#pragma once

#include <cstdint>

namespace memopt_cpu {

// Ids shared with memopt_kernels_cpu/ops.py. Master and Moment ids are memopt_core.backends'
// kernel ids (the Triton kernels take the same); the Rule ids are this package's own.
enum Rule : int32_t { RULE_SGD = 0, RULE_ADAM = 1, RULE_LION = 2 };
enum Master : int32_t {
  MASTER_FP32 = 0,   // fp32 parameter is the master
  MASTER_BF16 = 1,   // "none" with bf16 parameters
  MASTER_FP16 = 2,   // "none" with fp16 parameters
  MASTER_ECC24 = 3,  // bf16 parameter + uint8 code
  MASTER_ECC32 = 4,  // bf16 parameter + int16 code
};
enum Moment : int32_t {
  FMT_FP32 = 0,
  FMT_BF16 = 1,
  FMT_E4M3 = 2,    // fp8_e4m3 and q8_signed (identical layout), blocks of 32 + E8M0 scale
  FMT_E5M2 = 3,    // fp8_e5m2, blocks of 32 + E8M0 scale
  FMT_Q8SQRT = 4,  // sqrt(v) in unsigned e4m4, blocks of 32 + E8M0 scale
  FMT_NONE = 5,    // no such state (SGD without momentum)
};
enum Grad : int32_t { GRAD_FP32 = 0, GRAD_BF16 = 1, GRAD_FP16 = 2 };

// One row of the slot table (9 x int64, built by ops.py): one tensor of the group.
struct SlotRow {
  int64_t param;         // address of the parameter's first element (contiguous)
  int64_t grad;          // address of the gradient's first element (contiguous, same numel)
  int64_t grad_kind;     // Grad
  int64_t tensor_id;     // key word 1 of the step's Philox block (memopt_core.rng.step_keys)
  int64_t numel;         // real elements
  int64_t padded;        // numel rounded up to the block size (elements numel..padded are padding)
  int64_t arena_offset;  // element offset of the tensor in the group's state arena
  int64_t staging;       // address of a bf16 output of the updated weights (numel entries), or 0
  int64_t index_base;    // stochastic-rounding index of the slot's element 0: element i
                         // (padding included) draws index index_base + i. 0 for a whole
                         // tensor; a shard's offset in its whole flattened tensor (FSDP2), so
                         // it draws the whole tensor's words. 0 <= index_base, index_base +
                         // padded < 2**62 (ops.py and module.cpp check)
};
static_assert(sizeof(SlotRow) == 9 * sizeof(int64_t), "ops.py's SLOT_COLUMNS mirror SlotRow");

// Everything one fused step of one group needs besides the slot table.
struct StepConfig {
  int32_t rule;    // Rule
  int32_t master;  // Master
  int32_t fmt1;    // Moment of the first state (exp_avg / momentum_buffer), FMT_NONE if absent
  int32_t fmt2;    // Moment of the second state (exp_avg_sq), FMT_NONE if absent
  int32_t block;   // padding unit of the arena: 1 or 32
  int32_t sr;      // stochastic rounding on
  int32_t maximize, has_l2, has_decay, nesterov, first_step, has_momentum;
  // Rule scalars, each rounded once from double to float (as memopt_core.reference.to_compute):
  //   adam: {one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bc2_sqrt, decay, l2}
  //   sgd:  {lr, momentum, one_minus_dampening, 0, 0, 0, decay, l2}
  //   lion: {lr, beta1, one_minus_beta1, beta2, one_minus_beta2, 0, decay, 0}
  float s[8];
  uint32_t seed;  // key word 0 of the step's Philox block (memopt_core.rng.step_keys)
  uint32_t step;  // counter word 0 of the step's Philox block (1-based step, low 32 bits)
  // Arena addresses (0 when absent): master code (total entries), first state codes/values and
  // per-block scales (total/32 entries), second state likewise.
  int64_t code, m, ms, v, vs;
};

// The kernels one instruction set provides (csrc/isa_<name>.cpp defines one table each).
struct IsaKernels {
  const char* name;
  // Update elements [begin, end) of the slot's padded range; begin is a multiple of cfg.block,
  // end is a multiple of cfg.block or the slot's padded length. Thread-safe for disjoint ranges.
  void (*step_range)(const StepConfig& cfg, const SlotRow& slot, int64_t begin, int64_t end);
  // Standalone codecs over n elements (blocked formats: n a multiple of 32). rand: n uniform
  // 32-bit words for stochastic rounding, or nullptr for round-to-nearest-even.
  void (*encode_moment)(int32_t fmt, const float* x, int64_t n, void* codes, uint8_t* scales,
                        const uint32_t* rand);
  void (*decode_moment)(int32_t fmt, const void* codes, const uint8_t* scales, int64_t n,
                        float* out);
  void (*encode_master)(int32_t master, const float* x, int64_t n, void* param, void* code,
                        const uint32_t* rand);
  void (*decode_master)(int32_t master, const void* param, const void* code, int64_t n,
                        float* out);
  // Stochastic-rounding words of elements index[0..n) (memopt_core.rng.stream_words):
  // out[k*n + i] = word of stream k (0 master, 1 first moment, 2 second moment) of element i.
  void (*stream_words)(uint32_t seed, uint32_t tensor_id, uint32_t step, const int64_t* index,
                       int64_t n, uint32_t* out);
};

extern const IsaKernels kernels_scalar;
#if defined(MEMOPT_HAVE_AVX2)
extern const IsaKernels kernels_avx2;
#endif
#if defined(MEMOPT_HAVE_AVX512)
extern const IsaKernels kernels_avx512;
#endif
#if defined(MEMOPT_HAVE_NEON)
extern const IsaKernels kernels_neon;
#endif

}  // namespace memopt_cpu
