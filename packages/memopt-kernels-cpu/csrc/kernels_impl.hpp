// The fused update kernels and standalone codecs, written once and compiled once per instruction
// set: csrc/isa_<name>.cpp defines MEMOPT_ISA_NS / MEMOPT_ISA_TABLE and includes this file with
// its own -m flags. Vector code comes from the compiler's auto-vectorizer over small L1-resident
// tiles, so every instruction set executes the same IEEE operations in the same order:
//  - float work is only + - * / and sqrt (all correctly rounded in scalar and SIMD forms),
//    never contracted into FMAs (-ffp-contract=off) nor reassociated (no fast-math);
//  - every format conversion is integer arithmetic on bit patterns mirroring memopt_core.formats
//    (bits.py, float_moments.py, block_fp8.py, q8.py, ecc.py), or an exact float operation (an
//    8-bit code's value times the block's power of two);
//  - stochastic rounding words are memopt_core.rng's: a Philox4x32-10 block of keys per tensor
//    and step, a lowbias32 hash per element and stream.
// So results are bit-identical to the reference on every instruction set and thread count.
//
// A step processes a slot range tile by tile: decode the master weights, gradients and moments of
// TILE elements into fp32 arrays, draw the rounding words, run the rule, encode and store. Each
// stage is a simple loop the compiler vectorizes; the tile stays in L1.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "memopt_cpu/kernel_api.hpp"

namespace memopt_cpu {
namespace MEMOPT_ISA_NS {
namespace {

// Elements per tile, a multiple of the 32-element block. step_range's tile arrays take 34 B per
// element: 256 keeps them (8.5 KiB) well inside a 32-48 KiB L1d with room for the streams, where
// 1024 (34 KiB) did not; on the H200's 16-core host, 256 ran the generic ECC-24 paths 6-19% and
// the bf16 path 3-13% faster (docs/benchmarks/2026-11-30-paired-e2e-and-tiles.md).
constexpr int64_t TILE = 256;
constexpr uint32_t F32_INF = 0x7F800000u;
constexpr uint32_t F32_MAG = 0x7FFFFFFFu;
constexpr uint32_t F32_QNAN = 0x7FC00000u;

// By-value min/max: GCC 12 does not if-convert std::min/std::max (they return references) in
// some of these loops, which then stay scalar.
template <class T>
inline T vmin(T a, T b) {
  return b < a ? b : a;
}
template <class T>
inline T vmax(T a, T b) {
  return a < b ? b : a;
}

// IEEE arithmetic for the duration of a kernel call: the caller's thread may have flush-to-zero
// or denormals-are-zero set (torch.set_flush_denormal(True) does: MXCSR's FTZ/DAZ on x86, FPCR's
// FZ on AArch64), which would change subnormal results, or another rounding direction
// (fesetround; MXCSR's RC, FPCR's RMode), which would change every rounded result; either would
// also make them depend on which thread ran a part (pool threads keep the default). Round to
// nearest even, no flushing; restored on exit. [[maybe_unused]]: elsewhere the class is empty.
class IeeeMode {
 public:
#if defined(__x86_64__) || defined(_M_X64)
  // FTZ (0x8000), DAZ (0x0040), RC (0x6000; 0 is round to nearest even)
  IeeeMode() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~(0x8000u | 0x0040u | 0x6000u)); }
  ~IeeeMode() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#elif defined(__aarch64__)
  // FZ (bit 24), RMode (bits 22-23; 0 is round to nearest even)
  IeeeMode() : saved_(read_fpcr()) { write_fpcr(saved_ & ~(uint64_t{7} << 22)); }
  ~IeeeMode() { write_fpcr(saved_); }

 private:
  static uint64_t read_fpcr() {
    uint64_t v;
    __asm__ volatile("mrs %0, fpcr" : "=r"(v));
    return v;
  }
  static void write_fpcr(uint64_t v) { __asm__ volatile("msr fpcr, %0" : : "r"(v)); }
  uint64_t saved_;
#endif
};

// ------------------------------------------------------------------------------ bit views
inline uint32_t f2u(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float u2f(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// floor(log2(v)) for integers 1 <= v < 2**24: the exponent of the exact int -> float conversion
// (vectorizes everywhere, unlike count-leading-zeros).
inline int32_t floor_log2(int32_t v) {
  return static_cast<int32_t>((f2u(static_cast<float>(v)) >> 23) & 0xFF) - 127;
}

// bits.compose_f32: pattern of sig * 2**e (0 <= sig < 2**24), exact when representable.
inline uint32_t compose_f32(int32_t sig, int32_t e) {
  const int32_t s = vmax(sig, 1);
  const int32_t msb = floor_log2(s);
  const int32_t te = e + msb;
  uint32_t normal = (static_cast<uint32_t>(te + 127) << 23) |
                    ((static_cast<uint32_t>(s) << vmax(23 - msb, 0)) & 0x7FFFFFu);
  const uint32_t subnormal = static_cast<uint32_t>(s) << vmin(vmax(e + 149, 0), 23);
  normal = te > 127 ? F32_INF : normal;
  const uint32_t out = te >= -126 ? normal : subnormal;
  return sig > 0 ? out : 0u;
}

// bits.round_drop_bits: mag >> DROP rounded to nearest even, or stochastically with word r, as
// one addition before the shift. SR rounds up iff (r >> 8) < rem << (24 - DROP), that is iff
// r >> (32 - DROP) < rem: adding 2**DROP - 1 less that carries exactly then. Nearest even adds
// half less one, plus the kept last bit. (mag < 2**31: the sum does not wrap.)
template <int DROP, bool SR>
inline uint32_t round_drop_bits(uint32_t mag, uint32_t r) {
  uint32_t up;
  if constexpr (SR) {
    up = ((1u << DROP) - 1u) - (r >> (32 - DROP));
  } else {
    up = ((1u << (DROP - 1)) - 1u) + ((mag >> DROP) & 1u);
  }
  return (mag + up) >> DROP;
}

// bits.bf16_round: bf16 pattern of fp32 pattern u (NaN stays a quiet NaN).
template <bool SR>
inline uint32_t bf16_round(uint32_t u, uint32_t r) {
  const uint32_t mag = u & F32_MAG;
  uint32_t top = round_drop_bits<16, SR>(mag, r);
  top = mag > F32_INF ? ((mag >> 16) | 0x40u) : top;
  return ((u >> 31) << 15) | top;
}

// Rounding modes of the minifloat encoders: nearest even, stochastic, and (mf8_round only) none:
// FRACTION returns t = code << 24 | frac24, the truncated code and the fraction below it.
enum Mode { RNE = 0, STOCH = 1, FRACTION = 2 };

// bits.minifloat_encode with k = 0 on fp16's grid (the 8-bit grids take mf8_round): magnitude
// code of value(mag) for a finite mag. mag's own exponent and 24-bit significand stand in for the
// reference's normalization: a normal mag is exact, and a subnormal one (below 2**-126) rounds to
// code 0 on this grid either way, stochastically too (its frac24 is 0). The reference computes in
// int64 with d <= 50 dropped bits; here sig < 2**24 lets 32-bit lanes give the same integers
// (64-bit variable shifts do not vectorize): for d >= 25 both n and frac24 are 0 anyway.
template <int MAN, int EMIN, int MODE>
inline int32_t minifloat_encode(uint32_t mag, uint32_t r) {
  const int32_t ey = static_cast<int32_t>(mag >> 23) - 127;
  const int32_t sig = static_cast<int32_t>(mag & 0x7FFFFF) | 0x800000;
  const int32_t d = vmin(vmax(EMIN - ey, 0) + (23 - MAN), 48);  // dropped low bits of sig
  const int32_t kept = sig >> vmin(d, 31);
  int32_t n;
  static_assert(MODE != FRACTION, "mf8_round only");
  if constexpr (MODE == RNE) {
    const int32_t d2 = vmin(d, 25);
    n = (sig + ((1 << (d2 - 1)) - 1) + (kept & 1)) >> d2;
  } else {
    const int32_t rem = sig - (kept << vmin(d, 31));
    const int32_t frac24 = d <= 24 ? (rem << vmax(24 - d, 0)) : (rem >> vmin(d - 24, 31));
    n = kept + (static_cast<int32_t>(r >> 8) < frac24 ? 1 : 0);
  }
  return ((vmax(ey, EMIN) - EMIN) << MAN) + n;
}

// fp32 value of 8-bit magnitude codes mag (no specials): exact. A code shifted to fp32's
// mantissa position is an fp32 pattern worth value * 2**-(126 + EMIN) (the grid's exponent field,
// bias 1 - EMIN, sits where fp32's does; its subnormals land on fp32 subnormals), so one exact
// multiply by a power of two rescales it.
template <int MAN, int EMIN>
inline float mf_value(int32_t mag) {
  const float rescale = u2f(static_cast<uint32_t>(253 + EMIN) << 23);  // 2**(126 + EMIN)
  return u2f(static_cast<uint32_t>(mag) << (23 - MAN)) * rescale;
}

// bits.minifloat_decode: fp32 pattern of magnitude code * 2**k (exact).
template <int MAN, int EMIN>
inline uint32_t minifloat_decode(int32_t code, int32_t k) {
  const int32_t ef = code >> MAN;
  const int32_t mant = code & ((1 << MAN) - 1);
  const int32_t sig = ef > 0 ? (mant | (1 << MAN)) : mant;
  const int32_t e = vmax(ef, 1) - 1 + EMIN - MAN + k;
  return compose_f32(sig, e);
}

// bits.minifloat_encode for a grid whose codes stay below 2**8 (y at most its largest value: the
// blocked formats), on the fp32 value y = |x| * 2**-k itself: either exact or below 2**-126
// (which rounds to code 0 on every such grid, stochastically too: its frac24 is 0). Works on
// t = code << 24 | frac24 (the code and the 24 bits below its last place, truncated as the
// reference's frac24 is). At or above 2**EMIN the pattern minus the grid's exponent bias, shifted
// left by MAN + 1, is t (the code's exponent and mantissa fields follow fp32's). Below it t is y
// in units of 2**(EMIN - MAN - 24): an exact product under 2**(MAN + 24), truncated by the int
// conversion; the other lanes' products (and NaN, where y is not finite) are capped at 2**30
// first, since converting a float outside int32's range is undefined. Rounding is then one
// addition: 2**24 - 1 - (r >> 8) carries into the code iff (r >> 8) < frac24 (sr_round_up);
// nearest even adds 2**23 - 1 plus the code's last bit.
template <int MAN, int EMIN, int MODE>
inline int32_t mf8_round(float y, uint32_t r) {
  constexpr int32_t normal = (127 + EMIN) << 23;  // pattern of 2**EMIN
  const float unit = u2f(static_cast<uint32_t>(151 + MAN - EMIN) << 23);  // 2**(MAN + 24 - EMIN)
  constexpr float cap = 1073741824.0f;  // 2**30
  const int32_t yb = static_cast<int32_t>(f2u(y));
  const uint32_t tn = static_cast<uint32_t>(yb - ((126 + EMIN) << 23)) << (MAN + 1);
  const float p = y * unit;
  const uint32_t ts = static_cast<uint32_t>(static_cast<int32_t>(p < cap ? p : cap));
  uint32_t t = yb >= normal ? tn : ts;
  if constexpr (MODE == FRACTION) {
    return static_cast<int32_t>(t);
  } else if constexpr (MODE == RNE) {
    t += 0x7FFFFFu + ((t >> 24) & 1u);
  } else {
    t += 0xFFFFFFu - (r >> 8);
  }
  return static_cast<int32_t>(t >> 24);
}

// E8M0 scale byte k + 127 of the smallest k >= -127 with value(mmax) * 2**-k <= fmax (mmax the
// largest finite magnitude pattern of a block, a signed int: 0 gives byte 0): the reference's
// pow2_block_exponent for the maxima the blocked formats meet (see block_scale_of: k stays below
// 127 by itself). On normal patterns k = ceil((mmax - fmax) / 2**23) (exponent difference, plus
// one when the mantissa is larger). The same arithmetic on a subnormal (or 0) mmax is no
// logarithm, but with fmax >= 2 such a maximum needs k <= -127 and the formula (monotone in mmax)
// gives at most -134, so the floor at 0 settles it; q8_sqrt's square roots (fmax 1.875) are never
// subnormal.
template <uint32_t FMAX>
inline int32_t block_scale(int32_t mmax) {
  constexpr int32_t offset = static_cast<int32_t>(FMAX) - 0x7FFFFF - (127 << 23);
  return vmax(mmax - offset, 0) >> 23;
}

// ------------------------------------------------------------------------------ fp16
// ecc.LowPrecisionMaster (float16): IEEE binary16 rounding with overflow to inf.
template <bool SR>
inline uint32_t fp16_round(uint32_t u, uint32_t r) {
  const uint32_t mag = u & F32_MAG;
  const bool finite = mag < F32_INF;
  // the reference encodes 0 in place of a non-finite magnitude; its code is replaced below
  // either way, and passing mag itself keeps GCC from branching on the zero case
  int32_t code = minifloat_encode<10, -14, SR ? STOCH : RNE>(mag, r);
  code = vmin(code, 0x7C00);
  code = finite ? code : (mag == F32_INF ? 0x7C00 : 0x7E00);
  return ((u >> 31) << 15) | static_cast<uint32_t>(code);
}

// ecc._fp16_widen: exact; inf stays inf; NaN quiet with its payload.
inline uint32_t fp16_widen(uint32_t p) {
  const uint32_t mag = p & 0x7FFFu;
  uint32_t out = minifloat_decode<10, -14>(static_cast<int32_t>(vmin(mag, 0x7BFFu)), 0);
  out = mag >= 0x7C00u ? (F32_INF | ((mag & 0x3FFu) << 13)) : out;
  out = mag > 0x7C00u ? (out | 0x400000u) : out;
  return out | ((p >> 15) << 31);
}

// ------------------------------------------------------------------------------ rounding words
// memopt_core.rng: one Philox4x32-10 block per tensor and step gives keys K0..K3; stream s of
// the element at index idx takes lowbias32(y ^ Ks) with y = lo(idx) * INDEX_M + hi(idx) * K3
// (mod 2**32), lowbias32(x): x ^= x >> 16; x *= MIX_M0; x ^= x >> 15; x *= MIX_M1; x ^= x >> 16.
constexpr uint32_t PHILOX_M0 = 0xD2511F53u, PHILOX_M1 = 0xCD9E8D57u;
constexpr uint32_t PHILOX_W0 = 0x9E3779B9u, PHILOX_W1 = 0xBB67AE85u;
constexpr uint32_t INDEX_M = 0x9E3779B9u, MIX_M0 = 0x7FEB352Du, MIX_M1 = 0x846CA68Bu;

// K0..K3 of one tensor at one step (memopt_core.rng.step_keys).
struct StepKeys {
  uint32_t k[4];
};

// Philox4x32-10 of counter (step, 0, 0, 0) and key (seed, tid): computed once per call of a
// step or of stream_words, so plain scalar code.
inline StepKeys step_keys(uint32_t seed, uint32_t tid, uint32_t step) {
  uint32_t x0 = step, x1 = 0, x2 = 0, x3 = 0, k0 = seed, k1 = tid;
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += PHILOX_W0;
      k1 += PHILOX_W1;
    }
    const uint64_t p0 = static_cast<uint64_t>(x0) * PHILOX_M0;
    const uint64_t p1 = static_cast<uint64_t>(x2) * PHILOX_M1;
    const uint32_t y0 = static_cast<uint32_t>(p1 >> 32) ^ x1 ^ k0;
    const uint32_t y2 = static_cast<uint32_t>(p0 >> 32) ^ x3 ^ k1;
    x1 = static_cast<uint32_t>(p1);
    x3 = static_cast<uint32_t>(p0);
    x0 = y0;
    x2 = y2;
  }
  return {{x0, x1, x2, x3}};
}

// The words of streams 0, 1 and 2 of elements idx0 .. idx0+n of one tensor (element i draws
// index idx0 + i); a stream is computed only when its output is given, so a step pays only for
// the streams its formats round. Works in blocks of at most TILE elements within one high word
// of the index (a tile crossing a multiple of 2**32 is cut there): inside one, y advances by
// INDEX_M per element, an addition. lowbias32's first step takes x = y ^ Ks to x ^ x >> 16 =
// u ^ (Ks ^ Ks >> 16) with u = y ^ y >> 16 (the shift distributes over the XOR), so u is computed
// once for every stream. Both loops vectorize (vpmulld on x86-64, mul on NEON); on AVX2 and
// AVX-512 they ran as fast as hand-written intrinsics, bound by the two multiplies per stream.
void sr_words_tile(const StepKeys& key, int64_t idx0, int64_t n, uint32_t* w0, uint32_t* w1,
                   uint32_t* w2) {
  alignas(64) uint32_t u[TILE];
  uint32_t* const out[3] = {w0, w1, w2};
  for (int64_t i = 0; i < n;) {
    const uint64_t idx = static_cast<uint64_t>(idx0) + static_cast<uint64_t>(i);
    const uint32_t lo = static_cast<uint32_t>(idx), hi = static_cast<uint32_t>(idx >> 32);
    const int64_t len = vmin(vmin(n - i, TILE), static_cast<int64_t>((uint64_t{1} << 32) - lo));
    uint32_t y = lo * INDEX_M + hi * key.k[3];
    for (int64_t j = 0; j < len; ++j, y += INDEX_M) u[j] = y ^ (y >> 16);
    for (int s = 0; s < 3; ++s) {
      if (!out[s]) continue;
      uint32_t* __restrict w = out[s] + i;
      const uint32_t kc = key.k[s] ^ (key.k[s] >> 16);
      for (int64_t j = 0; j < len; ++j) {
        uint32_t x = (u[j] ^ kc) * MIX_M0;
        x = (x ^ (x >> 15)) * MIX_M1;
        w[j] = x ^ (x >> 16);
      }
    }
    i += len;
  }
}

// ------------------------------------------------------------------------------ moments
// Parameters of the block-scaled 8-bit formats (block_fp8.py, q8.py).
struct E4M3 {
  static constexpr int MAN = 3, EMIN = -6;
  static constexpr uint32_t FMAX = 0x43E00000u;
  static constexpr int32_t MAXC = 0x7E, NANC = 0x7F, INFC = -1, SIGN = 0x80;
  static constexpr bool KEEPS_NONZERO = false;
};
struct E5M2 {
  static constexpr int MAN = 2, EMIN = -14;
  static constexpr uint32_t FMAX = 0x47600000u;
  static constexpr int32_t MAXC = 0x7B, NANC = 0x7E, INFC = 0x7C, SIGN = 0x80;
  // BlockFp8Codec.keeps_nonzero: a finite non-zero element never gets magnitude code 0
  static constexpr bool KEEPS_NONZERO = true;
};
struct Q8Sqrt {
  static constexpr int MAN = 4, EMIN = -14;
  static constexpr uint32_t FMAX = 0x3FF00000u;
  static constexpr int32_t MAXC = 0xFE, NANC = 0xFF, INFC = -1, SIGN = 0;
  static constexpr bool KEEPS_NONZERO = false;  // encode_q8sqrt floors positive v itself
};

// BlockMinifloatCodec._encode_codes of blocks of 32, in two parts: block_scale_of gives a
// block's scale byte k + 127, block_code an element's code (before the uint8 store). |x| * 2**-k
// is one exact multiply (or lands below 2**-126, see mf8_round). The inputs keep k where the
// reference never clamps it at 127: e4m3 and e5m2 need at most 120 and 113 for the largest fp32,
// and q8_sqrt encodes square roots of fp32 values (0, or in [2**-75, 2**64]: k is -127 or in
// [-75, 64]). So 2**-k is a normal number, every scaled block maximum is at most fmax and no code
// passes the largest finite one (the reference's saturation never acts).
template <class F>
inline int32_t block_scale_of(const float* __restrict x) {
  int32_t mmax = 0;  // signed: GCC vectorizes signed max reductions, not unsigned ones
  for (int i = 0; i < 32; ++i) {
    const int32_t mag = static_cast<int32_t>(f2u(x[i]) & F32_MAG);
    const int32_t magf = mag < static_cast<int32_t>(F32_INF) ? mag : 0;
    mmax = mmax > magf ? mmax : magf;
  }
  return block_scale<F::FMAX>(mmax);
}

// The code of element x given its block's 2**-k (inv_scale) and rounding word r; MODE FRACTION
// gives t = code << 24 | frac24 (mf8_round) for a finite x, the NaN code with fraction 0
// otherwise (a format with an inf code has no such caller).
template <class F, int MODE>
inline int32_t block_code(float x, float inv_scale, uint32_t r) {
  const uint32_t u = f2u(x);
  const uint32_t mag = u & F32_MAG;
  const bool finite = mag < F32_INF;
  // a non-finite magnitude (the reference encodes 0 in its place) gets some code, replaced below
  int32_t c = mf8_round<F::MAN, F::EMIN, MODE>(u2f(mag) * inv_scale, r);
  if constexpr (F::KEEPS_NONZERO) c |= static_cast<int32_t>((c == 0) & (mag != 0u));
  static_assert(MODE != FRACTION || F::INFC < 0, "FRACTION codes carry no inf code");
  int32_t special = MODE == FRACTION ? static_cast<int32_t>(uint32_t{F::NANC} << 24) : F::NANC;
  if constexpr (F::INFC >= 0) special = mag == F32_INF ? F::INFC : F::NANC;
  c = finite ? c : special;
  if constexpr (F::SIGN != 0) c |= static_cast<int32_t>(u >> 31) * F::SIGN;
  return c;
}

// The encoders take a tile's blocks (at most TILE / 32) at a time. They compute the blocks'
// scales first, in a loop of their own: a block's maximum is a reduction, a chain of dependent
// shuffles, which its codes had to wait for; over separate blocks the reductions overlap
// (measured on one thread of the 2-vCPU EPYC, AVX-512: fp8-moment step 1.80 -> 1.70 ns per
// parameter, q8 1.98 -> 1.84). The codes are then one loop over the tile, each element with its
// block's 2**-k from a per-element array: GCC vectorized a loop over one block's 32 elements
// with 256-bit vectors only, even for AVX-512, and the tile's loop with 512-bit ones (e4m3 and
// e5m2 encoders 12-17% faster on one EPYC thread with AVX-512; 2026-12-04).
constexpr int64_t TILE_BLOCKS = TILE / 32;

// Scale bytes of the nb blocks at x (stored to scales) and each element's 2**-k (inv).
template <class F>
inline void tile_scales(const float* __restrict x, int64_t nb, uint8_t* __restrict scales,
                        float* __restrict inv) {
  int32_t sb[TILE_BLOCKS];
  for (int64_t b = 0; b < nb; ++b) sb[b] = block_scale_of<F>(x + 32 * b);
  for (int64_t b = 0; b < nb; ++b) {
    const float inv_scale = u2f(static_cast<uint32_t>(254 - sb[b]) << 23);  // 2**-k
    for (int i = 0; i < 32; ++i) inv[32 * b + i] = inv_scale;
    scales[b] = static_cast<uint8_t>(sb[b]);
  }
}

template <class F, bool SR>
void encode_blocked(const float* __restrict x, int64_t n, uint8_t* __restrict codes,
                    uint8_t* __restrict scales, const uint32_t* __restrict r) {
  alignas(64) float inv[TILE];
  for (int64_t b0 = 0; b0 < n / 32; b0 += TILE_BLOCKS) {
    const int64_t nb = vmin(TILE_BLOCKS, n / 32 - b0), e0 = 32 * b0;
    const float* __restrict xt = x + e0;
    tile_scales<F>(xt, nb, scales + b0, inv);
#if defined(__AVX512F__)
    uint8_t* __restrict out = codes + e0;
    if constexpr (SR) {
      const uint32_t* __restrict rt = r + e0;
      for (int64_t i = 0; i < 32 * nb; ++i)
        out[i] = static_cast<uint8_t>(block_code<F, STOCH>(xt[i], inv[i], rt[i]));
    } else {
      for (int64_t i = 0; i < 32 * nb; ++i)
        out[i] = static_cast<uint8_t>(block_code<F, RNE>(xt[i], inv[i], 0u));
    }
#else
    // per block, through 32-bit codes: with AVX2 the tile's loop made fp8-moment steps 1.5-3%
    // slower on the EPYC (q8_sqrt's encoder below runs over the tile for every instruction set:
    // its q8 steps were 4% faster with AVX2 too)
    for (int64_t b = 0; b < nb; ++b) {
      alignas(64) int32_t c[32];
      const float* __restrict xb = xt + 32 * b;
      const float inv_scale = inv[32 * b];
      for (int i = 0; i < 32; ++i)
        c[i] = block_code<F, SR ? STOCH : RNE>(xb[i], inv_scale, SR ? r[e0 + 32 * b + i] : 0u);
      for (int i = 0; i < 32; ++i) codes[e0 + 32 * b + i] = static_cast<uint8_t>(c[i]);
    }
#endif
  }
}

// Q8SqrtCodec._floored: a positive v (s > 0; NaN s compares false) whose code is 0 gets code 1.
inline int32_t floor_code(int32_t code, float s) {
  return code | static_cast<int32_t>((code == 0) & (s > 0.0f));
}

// Q8SqrtCodec.encode: s = sqrt(v) on the e4m4 grid; SR keeps v (not s) unbiased. root: the
// correctly rounded sqrt(v) where the caller has it (the fused step's update took it for its
// denominator: taking it again cost a tenth of a q8 step), else nullptr.
template <bool SR>
void encode_q8sqrt(const float* __restrict v, const float* __restrict root, int64_t n,
                   uint8_t* __restrict codes, uint8_t* __restrict scales,
                   const uint32_t* __restrict r) {
  alignas(64) float sq[TILE];
  alignas(64) float inv[TILE];
  for (int64_t b0 = 0; b0 < n / 32; b0 += TILE_BLOCKS) {
    const int64_t nb = vmin(TILE_BLOCKS, n / 32 - b0), e0 = 32 * b0;
    if (!root)
      for (int64_t i = 0; i < 32 * nb; ++i) sq[i] = std::sqrt(v[e0 + i]);  // correctly rounded
    const float* __restrict s = root ? root + e0 : sq;
    tile_scales<Q8Sqrt>(s, nb, scales + b0, inv);
    uint8_t* __restrict out = codes + e0;
    if constexpr (!SR) {
      for (int64_t i = 0; i < 32 * nb; ++i)
        out[i] = static_cast<uint8_t>(floor_code(block_code<Q8Sqrt, RNE>(s[i], inv[i], 0u), s[i]));
    } else {
      // t = lo << 24 | f24: the code below s and the first 24 bits of s's fraction of the way to
      // the next one. With L = lo / spacing (an integer: 16 + mantissa, or the mantissa of a
      // subnormal code), E[q*q] = s*s takes P(up) = f (2L + f) / (2L + 1): round up iff
      // r24 * (2L + 1) < 2L * f24 + (f24 * f24 >> 24) (KERNEL_API 7), exact in 32 bits (both
      // sides below 2**30). f24 * f24 >> 24 from f24's 12-bit halves a and b, as
      // a * a + ((2 * a * b + (b * b >> 12)) >> 12) (each floor taken of an integer: exact), in
      // 32-bit lanes (a 64-bit product took two 64-bit multiplies per 16 lanes and their
      // shuffles). The NaN code has f24 = 0, and so has the largest code (s is at most its
      // value): neither rounds up.
      const uint32_t* __restrict rt = r + e0;
      for (int64_t i = 0; i < 32 * nb; ++i) {
        const int32_t t = block_code<Q8Sqrt, FRACTION>(s[i], inv[i], 0u);
        const int32_t lo = static_cast<int32_t>(static_cast<uint32_t>(t) >> 24);
        const int32_t f24 = t & 0xFFFFFF;
        const int32_t two_l = ((lo & 15) | (vmin(lo, 16) & 16)) << 1;
        const int32_t a = f24 >> 12, b = f24 & 0xFFF;
        const int32_t sq24 = a * a + ((2 * a * b + ((b * b) >> 12)) >> 12);
        const int32_t r24 = static_cast<int32_t>(rt[i] >> 8);
        const int32_t c = lo + (r24 * (two_l + 1) < two_l * f24 + sq24 ? 1 : 0);
        out[i] = static_cast<uint8_t>(floor_code(c, s[i]));
      }
    }
  }
}

// Moment codec encode over n elements (n a multiple of 32 for blocked formats).
// root: for q8_sqrt, sqrt(x) (correctly rounded) where the caller has it, else nullptr.
void enc_moment(int32_t fmt, const float* __restrict x, int64_t n, void* codes, uint8_t* scales,
                const uint32_t* __restrict r, const float* __restrict root = nullptr) {
  switch (fmt) {
    case FMT_FP32:
      std::memcpy(codes, x, static_cast<size_t>(n) * 4);
      return;
    case FMT_BF16: {
      auto* out = static_cast<uint16_t*>(codes);
      if (r) {
        for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint16_t>(bf16_round<true>(f2u(x[i]), r[i]));
      } else {
        for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint16_t>(bf16_round<false>(f2u(x[i]), 0));
      }
      return;
    }
    case FMT_E4M3:
      r ? encode_blocked<E4M3, true>(x, n, static_cast<uint8_t*>(codes), scales, r)
        : encode_blocked<E4M3, false>(x, n, static_cast<uint8_t*>(codes), scales, r);
      return;
    case FMT_E5M2:
      r ? encode_blocked<E5M2, true>(x, n, static_cast<uint8_t*>(codes), scales, r)
        : encode_blocked<E5M2, false>(x, n, static_cast<uint8_t*>(codes), scales, r);
      return;
    case FMT_Q8SQRT:
      r ? encode_q8sqrt<true>(x, root, n, static_cast<uint8_t*>(codes), scales, r)
        : encode_q8sqrt<false>(x, root, n, static_cast<uint8_t*>(codes), scales, r);
      return;
    default:
      return;
  }
}

// 2**(s - 127) as fp32 for E8M0 scale bytes s in [0, 254]: the exponent field is s except at 0,
// where a max puts the subnormal 2**-127.
inline float scale_factor(int32_t s) {
  return u2f(static_cast<uint32_t>(vmax(s << 23, 0x00400000)));
}

// The decoded pattern of code c whose value (times its scale) has pattern u: a special code's
// pattern in its place, and the sign.
template <class F>
inline uint32_t with_specials(int32_t c, uint32_t u) {
  const int32_t mag = F::SIGN != 0 ? (c & (F::SIGN - 1)) : c;
  if constexpr (F::INFC >= 0) {
    u = mag == F::INFC ? F32_INF : u;
    u = mag > F::INFC ? F32_QNAN : u;
  } else {
    u = mag > F::MAXC ? F32_QNAN : u;
  }
  if constexpr (F::SIGN != 0) u |= static_cast<uint32_t>(c >> 7) << 31;
  return u;
}

// BlockMinifloatCodec._decode_codes, and Q8SqrtCodec.decode's square where SQUARE. A code's value
// times the block's 2**k is one multiply that is exact because every value the formats decode to
// is representable (the smallest is 2**-145), and that overflows to inf exactly where
// bits.compose_f32 does. Special codes take their patterns after the arithmetic (so a NaN keeps
// the decoder's pattern, as the reference's NaN check before squaring does).
//
// The loops run over RUN elements, each with its block's factor from sc: GCC vectorizes a loop
// over one block's 32 code bytes with 256-bit vectors even for AVX-512, and one over the tile
// with 512-bit ones (measured per element: e4m3 0.32 -> 0.22 ns); for AVX2 the per-block loops
// are faster (the factor is then the same for the whole run).
template <class F, bool SQUARE>
void decode_blocked(const uint8_t* __restrict codes, const uint8_t* __restrict scales, int64_t n,
                    float* __restrict out) {
#if defined(__AVX512F__)
  constexpr int64_t RUN = TILE;
#else
  constexpr int64_t RUN = 32;
#endif
  alignas(64) float sc[RUN];
  for (int64_t r0 = 0; r0 < n; r0 += RUN) {
    const uint8_t* __restrict cr = codes + r0;
    float* __restrict o = out + r0;
    if constexpr (RUN == 32) {
      const float scale = scale_factor(scales[r0 / 32]);
      for (int i = 0; i < 32; ++i) sc[i] = scale;
    } else {
      for (int64_t b = 0; b < vmin(RUN, n - r0) / 32; ++b) {
        const float scale = scale_factor(scales[r0 / 32 + b]);
        for (int i = 0; i < 32; ++i) sc[32 * b + i] = scale;
      }
    }
    const int64_t len = vmin(RUN, n - r0);
    auto value = [&](int64_t i) {
      const int32_t c = cr[i];
      const float q = mf_value<F::MAN, F::EMIN>(F::SIGN != 0 ? (c & (F::SIGN - 1)) : c) * sc[i];
      return SQUARE ? q * q : q;
    };
#if defined(__AVX512F__)
    // one loop: AVX-512's masks if-convert the selects (a second pass over the stored products
    // took 2-4% of an fp8-moment step on the EPYC, 2026-12-04)
    for (int64_t i = 0; i < len; ++i) o[i] = u2f(with_specials<F>(cr[i], f2u(value(i))));
#else
    // two loops: in one, GCC would compute the product only for the codes that keep it, a
    // conditional float operation that only AVX-512's masks can if-convert (trapping math)
    for (int64_t i = 0; i < len; ++i) o[i] = value(i);
    for (int64_t i = 0; i < len; ++i) o[i] = u2f(with_specials<F>(cr[i], f2u(o[i])));
#endif
  }
}

// Moment codec decode over n elements.
void dec_moment(int32_t fmt, const void* codes, const uint8_t* scales, int64_t n,
                float* __restrict out) {
  switch (fmt) {
    case FMT_FP32:
      std::memcpy(out, codes, static_cast<size_t>(n) * 4);
      return;
    case FMT_BF16: {
      const auto* c = static_cast<const uint16_t*>(codes);
      for (int64_t i = 0; i < n; ++i) out[i] = u2f(static_cast<uint32_t>(c[i]) << 16);
      return;
    }
    case FMT_E4M3:
      decode_blocked<E4M3, false>(static_cast<const uint8_t*>(codes), scales, n, out);
      return;
    case FMT_E5M2:
      decode_blocked<E5M2, false>(static_cast<const uint8_t*>(codes), scales, n, out);
      return;
    case FMT_Q8SQRT:
      decode_blocked<Q8Sqrt, true>(static_cast<const uint8_t*>(codes), scales, n, out);
      return;
    default:
      return;
  }
}

// ------------------------------------------------------------------------------ masters
// ecc.Ecc24Master's split of fp32 pattern u: top24 (sign, exponent and 15 mantissa bits, rounded
// to nearest even, or stochastically with word r; finite values saturate below inf, NaN stays
// quiet), whose low byte is the code, and the bf16 parameter. The parameter is top16 +
// (mid8 >= 0x80) as one rounding addition (no carry reaches the sign: top24's magnitude is at
// most 0x7F8000); NaN keeps its top16.
struct Ecc24 {
  uint32_t top24, param;
};
template <bool SR>
inline Ecc24 ecc24_encode(uint32_t u, uint32_t r) {
  const uint32_t mag = u & F32_MAG;
  uint32_t top24 = round_drop_bits<8, SR>(mag, r);
  top24 = mag < F32_INF ? vmin(top24, 0x7F7FFFu) : (mag >> 8);
  top24 = mag > F32_INF ? ((mag >> 8) | 0x4000u) : top24;
  top24 |= (u >> 31) << 23;
  return {top24, (top24 + (mag > F32_INF ? 0u : 0x80u)) >> 8};
}

// ecc.Ecc24Master / Ecc32Master decode of parameter pattern pv and code c: top16 - carry, then
// the code below it, as one addition of the code read as a signed value. The sum keeps top16's
// sign except where a +-0 parameter meets a carrying code (no encode makes one: a weight zeroed
// in place after its code was written): that decodes to the zero (KERNEL_API 6) instead of
// borrowing through the sign into a NaN.
inline uint32_t ecc_decode(uint32_t pv, uint32_t low) {
  const uint32_t top = pv << 16, x = top + low;
  return ((x ^ top) & 0x80000000u) ? top : x;
}
inline uint32_t ecc24_decode(uint32_t pv, uint8_t c) {
  return ecc_decode(pv, static_cast<uint32_t>(static_cast<int8_t>(c)) << 8);
}
inline uint32_t ecc32_decode(uint32_t pv, uint16_t c) {
  return ecc_decode(pv, static_cast<uint32_t>(static_cast<int16_t>(c)));
}

// Master decode of n elements; parameter entries at and after `real` read as 0 (padding),
// codes are read for all n (the arena holds codes for the padding too).
void dec_master(int32_t master, const void* param, const void* code, int64_t n, int64_t real,
                float* __restrict x) {
  switch (master) {
    case MASTER_FP32: {
      std::memcpy(x, param, static_cast<size_t>(real) * 4);
      break;
    }
    case MASTER_BF16: {
      const auto* p = static_cast<const uint16_t*>(param);
      for (int64_t i = 0; i < real; ++i) x[i] = u2f(static_cast<uint32_t>(p[i]) << 16);
      break;
    }
    case MASTER_FP16: {
      const auto* p = static_cast<const uint16_t*>(param);
      for (int64_t i = 0; i < real; ++i) x[i] = u2f(fp16_widen(p[i]));
      break;
    }
    case MASTER_ECC24: {
      const auto* p = static_cast<const uint16_t*>(param);
      const auto* c = static_cast<const uint8_t*>(code);
      for (int64_t i = 0; i < n; ++i) {
        x[i] = u2f(ecc24_decode(i < real ? p[i] : 0u, c[i]));  // padding: a zero parameter
      }
      return;
    }
    case MASTER_ECC32: {
      const auto* p = static_cast<const uint16_t*>(param);
      const auto* c = static_cast<const uint16_t*>(code);
      for (int64_t i = 0; i < n; ++i) {
        x[i] = u2f(ecc32_decode(i < real ? p[i] : 0u, c[i]));
      }
      return;
    }
    default:
      return;
  }
  for (int64_t i = real; i < n; ++i) x[i] = 0.0f;  // padding of code-less masters
}

// Master encode: parameter entries for i < real, codes for all n, optional bf16 staging copy of
// the new weights for i < real. r: stream-0 words or nullptr (nearest even).
template <bool SR>
void enc_master_t(int32_t master, const float* __restrict x, int64_t n, int64_t real, void* param,
                  void* code, uint16_t* __restrict staging, const uint32_t* __restrict r) {
  switch (master) {
    case MASTER_FP32: {
      if (param != x) std::memcpy(param, x, static_cast<size_t>(real) * 4);  // else updated in place
      if (staging) {
        for (int64_t i = 0; i < real; ++i) staging[i] = static_cast<uint16_t>(bf16_round<false>(f2u(x[i]), 0));
      }
      return;
    }
    case MASTER_BF16: {
      auto* p = static_cast<uint16_t*>(param);
      for (int64_t i = 0; i < real; ++i) p[i] = static_cast<uint16_t>(bf16_round<SR>(f2u(x[i]), SR ? r[i] : 0u));
      break;
    }
    case MASTER_FP16: {
      auto* p = static_cast<uint16_t*>(param);
      for (int64_t i = 0; i < real; ++i) p[i] = static_cast<uint16_t>(fp16_round<SR>(f2u(x[i]), SR ? r[i] : 0u));
      return;  // staging is refused for fp16 parameters (ops.py)
    }
    case MASTER_ECC24: {
      auto* p = static_cast<uint16_t*>(param);
      auto* c = static_cast<uint8_t*>(code);
      for (int64_t i = 0; i < n; ++i) {
        const Ecc24 e = ecc24_encode<SR>(f2u(x[i]), SR ? r[i] : 0u);
        c[i] = static_cast<uint8_t>(e.top24);
        if (i < real) p[i] = static_cast<uint16_t>(e.param);
      }
      break;
    }
    case MASTER_ECC32: {
      auto* p = static_cast<uint16_t*>(param);
      auto* c = static_cast<uint16_t*>(code);
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t u = f2u(x[i]);
        // top16 + (low16 >= 0x8000) as one rounding addition (a sum that wraps is a NaN's,
        // replaced)
        uint32_t pv = (u + 0x8000u) >> 16;
        pv = (u & F32_MAG) > F32_INF ? ((u >> 16) | 0x40u) : pv;
        c[i] = static_cast<uint16_t>(u);
        if (i < real) p[i] = static_cast<uint16_t>(pv);
      }
      break;
    }
    default:
      return;
  }
  if (staging) std::memcpy(staging, param, static_cast<size_t>(real) * 2);
}

void enc_master(int32_t master, const float* x, int64_t n, int64_t real, void* param, void* code,
                uint16_t* staging, const uint32_t* r) {
  if (r)
    enc_master_t<true>(master, x, n, real, param, code, staging, r);
  else
    enc_master_t<false>(master, x, n, real, param, code, staging, nullptr);
}

// Gradients of the tile as fp32 (padding 0).
void load_grad(int64_t kind, const void* grad, int64_t n, int64_t real, float* __restrict g) {
  if (kind == GRAD_FP32) {
    std::memcpy(g, grad, static_cast<size_t>(real) * 4);
  } else if (kind == GRAD_BF16) {
    const auto* p = static_cast<const uint16_t*>(grad);
    for (int64_t i = 0; i < real; ++i) g[i] = u2f(static_cast<uint32_t>(p[i]) << 16);
  } else {
    const auto* p = static_cast<const uint16_t*>(grad);
    for (int64_t i = 0; i < real; ++i) g[i] = u2f(fp16_widen(p[i]));
  }
  for (int64_t i = real; i < n; ++i) g[i] = 0.0f;
}

// ------------------------------------------------------------------------------ rules
// reference.adam after its gradient lines: p = p * decay, then the moments and the update, every
// operation individually rounded. Reads g only, so it also runs on the tensors themselves.
// ROOT: also store sqrt(v) of the new v (correctly rounded, as q8_sqrt's encoder takes it).
template <bool ROOT>
void adam_update_t(const StepConfig& c, int64_t n, float* __restrict x, const float* __restrict g,
                   float* __restrict m, float* __restrict v, float* __restrict root) {
  const float omb1 = c.s[0], b2 = c.s[1], omb2 = c.s[2], eps = c.s[3], lr_t = c.s[4],
              bc2 = c.s[5], dec = c.s[6];
  const bool decay = c.has_decay != 0;
  for (int64_t i = 0; i < n; ++i) {
    const float xi = decay ? x[i] * dec : x[i];
    const float mi = m[i] + omb1 * (g[i] - m[i]);
    const float vi = b2 * v[i] + omb2 * (g[i] * g[i]);
    const float s = std::sqrt(vi);
    const float d = s / bc2 + eps;
    x[i] = xi - lr_t * (mi / d);
    m[i] = mi;
    v[i] = vi;
    if constexpr (ROOT) root[i] = s;
  }
}

void adam_update(const StepConfig& c, int64_t n, float* x, const float* g, float* m, float* v,
                 float* root = nullptr) {
  root ? adam_update_t<true>(c, n, x, g, m, v, root)
       : adam_update_t<false>(c, n, x, g, m, v, nullptr);
}

// adam_update over an fp32 master with bf16 moments, decoded and encoded in the same loop
// (bf16 widening; bf16_round, stochastic with words r1/r2 when SR), and the bf16 staging copy of
// the new weights (nearest even) when STAGE. Decay and staging are template flags, not tests in
// the loop: GCC vectorizes neither a conditional store nor a conditional multiply for AVX2 (only
// AVX-512's masks if-convert them), and left the whole loop scalar there.
template <bool SR, bool DECAY, bool STAGE>
void adam_bf16_moments_t(const StepConfig& c, int64_t n, float* __restrict x,
                         const float* __restrict g, uint16_t* __restrict m,
                         uint16_t* __restrict v, const uint32_t* __restrict r1,
                         const uint32_t* __restrict r2, uint16_t* __restrict st) {
  const float omb1 = c.s[0], b2 = c.s[1], omb2 = c.s[2], eps = c.s[3], lr_t = c.s[4],
              bc2 = c.s[5], dec = c.s[6];
  for (int64_t i = 0; i < n; ++i) {
    const float m0 = u2f(static_cast<uint32_t>(m[i]) << 16);
    const float v0 = u2f(static_cast<uint32_t>(v[i]) << 16);
    const float xi = DECAY ? x[i] * dec : x[i];
    const float mi = m0 + omb1 * (g[i] - m0);
    const float vi = b2 * v0 + omb2 * (g[i] * g[i]);
    const float d = std::sqrt(vi) / bc2 + eps;
    const float xn = xi - lr_t * (mi / d);
    x[i] = xn;
    m[i] = static_cast<uint16_t>(bf16_round<SR>(f2u(mi), SR ? r1[i] : 0u));
    v[i] = static_cast<uint16_t>(bf16_round<SR>(f2u(vi), SR ? r2[i] : 0u));
    if constexpr (STAGE) st[i] = static_cast<uint16_t>(bf16_round<false>(f2u(xn), 0u));
  }
}

template <bool SR>
void adam_bf16_moments(const StepConfig& c, int64_t n, float* x, const float* g, uint16_t* m,
                       uint16_t* v, const uint32_t* r1, const uint32_t* r2, uint16_t* st) {
  if (c.has_decay)
    st ? adam_bf16_moments_t<SR, true, true>(c, n, x, g, m, v, r1, r2, st)
       : adam_bf16_moments_t<SR, true, false>(c, n, x, g, m, v, r1, r2, st);
  else
    st ? adam_bf16_moments_t<SR, false, true>(c, n, x, g, m, v, r1, r2, st)
       : adam_bf16_moments_t<SR, false, false>(c, n, x, g, m, v, r1, r2, st);
}

// adam_bf16_moments over an ECC-24 master (bf16 parameter p + 8-bit code, decoded and encoded as
// dec_master / enc_master do; stochastic with words r0 when SR) instead of an fp32 one:
// memopt-offload's "bf16-ecc24", 16 B per parameter where an fp32 master moves 20. The staging
// copy is the new bf16 parameter itself.
template <bool SR, bool DECAY, bool STAGE>
void adam_bf16_moments_ecc24_t(const StepConfig& c, int64_t n, uint16_t* __restrict p,
                               uint8_t* __restrict code, const float* __restrict g,
                               uint16_t* __restrict m, uint16_t* __restrict v,
                               const uint32_t* __restrict r0, const uint32_t* __restrict r1,
                               const uint32_t* __restrict r2, uint16_t* __restrict st) {
  const float omb1 = c.s[0], b2 = c.s[1], omb2 = c.s[2], eps = c.s[3], lr_t = c.s[4],
              bc2 = c.s[5], dec = c.s[6];
  for (int64_t i = 0; i < n; ++i) {
    const float x0 = u2f(ecc24_decode(p[i], code[i]));
    const float m0 = u2f(static_cast<uint32_t>(m[i]) << 16);
    const float v0 = u2f(static_cast<uint32_t>(v[i]) << 16);
    const float xi = DECAY ? x0 * dec : x0;
    const float mi = m0 + omb1 * (g[i] - m0);
    const float vi = b2 * v0 + omb2 * (g[i] * g[i]);
    const float d = std::sqrt(vi) / bc2 + eps;
    const Ecc24 e = ecc24_encode<SR>(f2u(xi - lr_t * (mi / d)), SR ? r0[i] : 0u);
    code[i] = static_cast<uint8_t>(e.top24);
    p[i] = static_cast<uint16_t>(e.param);
    m[i] = static_cast<uint16_t>(bf16_round<SR>(f2u(mi), SR ? r1[i] : 0u));
    v[i] = static_cast<uint16_t>(bf16_round<SR>(f2u(vi), SR ? r2[i] : 0u));
    if constexpr (STAGE) st[i] = static_cast<uint16_t>(e.param);
  }
}

template <bool SR>
void adam_bf16_moments_ecc24(const StepConfig& c, int64_t n, uint16_t* p, uint8_t* code,
                             const float* g, uint16_t* m, uint16_t* v, const uint32_t* r0,
                             const uint32_t* r1, const uint32_t* r2, uint16_t* st) {
  if (c.has_decay)
    st ? adam_bf16_moments_ecc24_t<SR, true, true>(c, n, p, code, g, m, v, r0, r1, r2, st)
       : adam_bf16_moments_ecc24_t<SR, true, false>(c, n, p, code, g, m, v, r0, r1, r2, st);
  else
    st ? adam_bf16_moments_ecc24_t<SR, false, true>(c, n, p, code, g, m, v, r0, r1, r2, st)
       : adam_bf16_moments_ecc24_t<SR, false, false>(c, n, p, code, g, m, v, r0, r1, r2, st);
}

// reference.adam, in its order (maximize, L2 on the gradient, then adam_update). root: see
// adam_update.
void adam_rule(const StepConfig& c, int64_t n, float* __restrict x, float* __restrict g,
               float* __restrict m, float* __restrict v, float* __restrict root) {
  const float l2 = c.s[7];
  if (c.maximize)
    for (int64_t i = 0; i < n; ++i) g[i] = -g[i];
  if (c.has_l2)
    for (int64_t i = 0; i < n; ++i) g[i] = g[i] + l2 * x[i];
  adam_update(c, n, x, g, m, v, root);
}

// reference.sgd. m holds the decoded momentum buffer (not read on the first step).
void sgd_rule(const StepConfig& c, int64_t n, float* __restrict x, float* __restrict g,
              float* __restrict m) {
  const float lr = c.s[0], mom = c.s[1], omd = c.s[2], dec = c.s[6], l2 = c.s[7];
  if (c.maximize)
    for (int64_t i = 0; i < n; ++i) g[i] = -g[i];
  if (c.has_l2)
    for (int64_t i = 0; i < n; ++i) g[i] = g[i] + l2 * x[i];
  if (c.has_decay)
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] * dec;
  if (!c.has_momentum) {
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] - lr * g[i];
    return;
  }
  if (c.first_step) {
    for (int64_t i = 0; i < n; ++i) m[i] = g[i];
  } else {
    for (int64_t i = 0; i < n; ++i) m[i] = mom * m[i] + omd * g[i];
  }
  if (c.nesterov) {
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] - lr * (g[i] + mom * m[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] - lr * m[i];
  }
}

// reference.lion (sign(0) = sign(NaN) = 0, as torch.sign on these devices). The sign is the
// difference of two comparisons converted to float (+0 for 0 and NaN): nested selects kept GCC
// from vectorizing the loop for AVX2.
void lion_rule(const StepConfig& c, int64_t n, float* __restrict x, float* __restrict g,
               float* __restrict m) {
  const float lr = c.s[0], b1 = c.s[1], omb1 = c.s[2], b2 = c.s[3], omb2 = c.s[4], dec = c.s[6];
  if (c.maximize)
    for (int64_t i = 0; i < n; ++i) g[i] = -g[i];
  if (c.has_decay)
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] * dec;
  for (int64_t i = 0; i < n; ++i) {
    const float u = b1 * m[i] + omb1 * g[i];
    const int32_t sgn = static_cast<int32_t>(u > 0.0f) - static_cast<int32_t>(u < 0.0f);
    x[i] = x[i] - lr * static_cast<float>(sgn);
    m[i] = b2 * m[i] + omb2 * g[i];
  }
}

// ------------------------------------------------------------------------------ fused step
inline bool master_rounds(int32_t master) {
  return master == MASTER_BF16 || master == MASTER_FP16 || master == MASTER_ECC24;
}
inline bool moment_rounds(int32_t fmt) { return fmt != FMT_FP32 && fmt != FMT_NONE; }
inline int64_t code_bytes(int32_t master) {
  return master == MASTER_ECC24 ? 1 : (master == MASTER_ECC32 ? 2 : 0);
}
inline int64_t moment_bytes(int32_t fmt) {
  return fmt == FMT_FP32 ? 4 : (fmt == FMT_BF16 ? 2 : 1);
}
template <class T>
inline T* at(int64_t addr, int64_t byte_offset) {
  return reinterpret_cast<T*>(addr + byte_offset);
}

// Copy the tile's bf16 weights to the staging buffer with non-temporal stores where the ISA has
// them: the buffer is read next by a host-to-device copy, not by this core.
void stream_store_u16(uint16_t* dst, const uint16_t* src, int64_t n) {
#if defined(__AVX2__)
  int64_t i = 0;
  while (i < n && (reinterpret_cast<uintptr_t>(dst + i) & 31u)) {
    dst[i] = src[i];
    ++i;
  }
  for (; i + 16 <= n; i += 16) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), w);
  }
  for (; i < n; ++i) dst[i] = src[i];
#else
  std::memcpy(dst, src, static_cast<size_t>(n) * 2);
#endif
}

void step_range(const StepConfig& c, const SlotRow& s, int64_t begin, int64_t end) {
  [[maybe_unused]] const IeeeMode ieee;
  alignas(64) float x[TILE], g[TILE], m[TILE], v[TILE], root[TILE];
  alignas(64) uint32_t w0[TILE], w1[TILE], w2[TILE];
  alignas(64) uint16_t stage[TILE];
  const bool adam = c.rule == RULE_ADAM, lion = c.rule == RULE_LION;
  const bool has_m = adam || lion || c.has_momentum;
  const bool read_m = has_m && !(c.rule == RULE_SGD && c.first_step);
  const bool sr_master = c.sr && master_rounds(c.master);
  const bool sr_m = c.sr && has_m && moment_rounds(c.fmt1);
  const bool sr_v = c.sr && adam && moment_rounds(c.fmt2);
  const int64_t pbytes = c.master == MASTER_FP32 ? 4 : 2;
  const int64_t cbytes = code_bytes(c.master);
  const int64_t mb = moment_bytes(c.fmt1), vb = moment_bytes(c.fmt2);
  const bool staging = s.staging != 0 && c.master != MASTER_FP16;  // ops.py refuses fp16 staging
  if (adam && c.master == MASTER_FP32 && c.fmt1 == FMT_FP32 && c.fmt2 == FMT_FP32 &&
      !c.maximize && !c.has_l2 && s.padded == s.numel) {
    // Plain fp32 AdamW: nothing to decode and the gradient is only read, so the update runs on
    // the tensors themselves (no tile copies), as torch's fused kernel does; a bf16/fp16
    // gradient is widened tile by tile and the staging copy is rounded from the updated tile
    // while it is in L1 (memopt-offload's fp32 case).
    const int64_t a = s.arena_offset;
    if (s.grad_kind == GRAD_FP32 && !staging) {
      adam_update(c, end - begin, at<float>(s.param, begin * 4), at<const float>(s.grad, begin * 4),
                  at<float>(c.m, (a + begin) * 4), at<float>(c.v, (a + begin) * 4));
      return;
    }
    for (int64_t t0 = begin; t0 < end; t0 += TILE) {
      const int64_t n = vmin(TILE, end - t0);
      float* xp = at<float>(s.param, t0 * 4);
      const float* gp = at<const float>(s.grad, t0 * 4);
      if (s.grad_kind != GRAD_FP32) {
        load_grad(s.grad_kind, at<void>(s.grad, t0 * 2), n, n, g);
        gp = g;
      }
      adam_update(c, n, xp, gp, at<float>(c.m, (a + t0) * 4), at<float>(c.v, (a + t0) * 4));
      if (staging) {
        for (int64_t i = 0; i < n; ++i) stage[i] = static_cast<uint16_t>(bf16_round<false>(f2u(xp[i]), 0));
        stream_store_u16(at<uint16_t>(s.staging, t0 * 2), stage, n);
      }
    }
#if defined(__AVX2__)
    if (staging) _mm_sfence();
#endif
    return;
  }
  const StepKeys keys =
      c.sr ? step_keys(c.seed, static_cast<uint32_t>(s.tensor_id), c.step) : StepKeys{};
  if (adam && c.master == MASTER_FP32 && c.fmt1 == FMT_BF16 && c.fmt2 == FMT_BF16 &&
      !c.maximize && !c.has_l2 && s.padded == s.numel) {
    // fp32 master with bf16 moments (memopt-offload's "bf16" precision): decode, update and
    // encode in one loop per tile instead of one pass per stage; the same operations as the
    // staged path below (adam_update, bf16 widening, bf16_round), so the same bits.
    const int64_t a = s.arena_offset;
    for (int64_t t0 = begin; t0 < end; t0 += TILE) {
      const int64_t n = vmin(TILE, end - t0);
      float* xp = at<float>(s.param, t0 * 4);
      const float* gp = at<const float>(s.grad, t0 * 4);
      if (s.grad_kind != GRAD_FP32) {
        load_grad(s.grad_kind, at<void>(s.grad, t0 * 2), n, n, g);
        gp = g;
      }
      auto* mp = at<uint16_t>(c.m, (a + t0) * 2);
      auto* vp = at<uint16_t>(c.v, (a + t0) * 2);
      if (c.sr)  // the moments' streams: the fp32 master does not round
        sr_words_tile(keys, s.index_base + t0, n, nullptr, w1, w2);
      c.sr ? adam_bf16_moments<true>(c, n, xp, gp, mp, vp, w1, w2, staging ? stage : nullptr)
           : adam_bf16_moments<false>(c, n, xp, gp, mp, vp, w1, w2, staging ? stage : nullptr);
      if (staging) stream_store_u16(at<uint16_t>(s.staging, t0 * 2), stage, n);
    }
#if defined(__AVX2__)
    if (staging) _mm_sfence();
#endif
    return;
  }
  if (adam && c.master == MASTER_ECC24 && c.fmt1 == FMT_BF16 && c.fmt2 == FMT_BF16 &&
      !c.maximize && !c.has_l2 && s.padded == s.numel) {
    // ECC-24 master with bf16 moments: the same one-loop form (the same operations as the staged
    // path: dec_master, adam_update, enc_master, bf16_round, so the same bits)
    const int64_t a = s.arena_offset;
    for (int64_t t0 = begin; t0 < end; t0 += TILE) {
      const int64_t n = vmin(TILE, end - t0);
      const float* gp = at<const float>(s.grad, t0 * 4);
      if (s.grad_kind != GRAD_FP32) {
        load_grad(s.grad_kind, at<void>(s.grad, t0 * 2), n, n, g);
        gp = g;
      }
      auto* pp = at<uint16_t>(s.param, t0 * 2);
      auto* cp = at<uint8_t>(c.code, a + t0);
      auto* mp = at<uint16_t>(c.m, (a + t0) * 2);
      auto* vp = at<uint16_t>(c.v, (a + t0) * 2);
      uint16_t* st = staging ? stage : nullptr;
      if (c.sr) {
        sr_words_tile(keys, s.index_base + t0, n, w0, w1, w2);
        adam_bf16_moments_ecc24<true>(c, n, pp, cp, gp, mp, vp, w0, w1, w2, st);
      } else {
        adam_bf16_moments_ecc24<false>(c, n, pp, cp, gp, mp, vp, w0, w1, w2, st);
      }
      if (staging) stream_store_u16(at<uint16_t>(s.staging, t0 * 2), stage, n);
    }
#if defined(__AVX2__)
    if (staging) _mm_sfence();
#endif
    return;
  }
  for (int64_t t0 = begin; t0 < end; t0 += TILE) {
    const int64_t n = vmin(TILE, end - t0);
    const int64_t real = vmin(vmax(s.numel - t0, int64_t{0}), n);
    const int64_t a = s.arena_offset + t0;  // arena element of the tile's first element
    void* param = at<void>(s.param, t0 * pbytes);
    void* code = cbytes ? at<void>(c.code, a * cbytes) : nullptr;
    void* grad = at<void>(s.grad, t0 * (s.grad_kind == GRAD_FP32 ? 4 : 2));
    // A tile without padding updates an fp32 master in place and reads an fp32 gradient where it
    // lies, as the fast paths above do: copying them in and out took a fifth of a q8 step. The
    // rules write the gradient only for maximize and L2, which keep the copy. A gradient that is
    // its parameter's memory (p.grad = p.detach()) is copied too: SGD's and Lion's decay pass
    // writes every weight before the update reads the gradient.
    float* xt = x;
    if (c.master == MASTER_FP32 && real == n)
      xt = static_cast<float*>(param);
    else
      dec_master(c.master, param, code, n, real, x);
    float* gt = g;
    if (s.grad_kind == GRAD_FP32 && real == n && !c.maximize && !c.has_l2 && grad != param)
      gt = static_cast<float*>(grad);
    else
      load_grad(s.grad_kind, grad, n, real, g);
    if (read_m) dec_moment(c.fmt1, at<void>(c.m, a * mb), at<uint8_t>(c.ms, a / 32), n, m);
    if (adam) dec_moment(c.fmt2, at<void>(c.v, a * vb), at<uint8_t>(c.vs, a / 32), n, v);
    if (sr_master || sr_m || sr_v)  // element t0 + i draws index index_base + t0 + i
      sr_words_tile(keys, s.index_base + t0, n, sr_master ? w0 : nullptr, sr_m ? w1 : nullptr,
                    sr_v ? w2 : nullptr);
    if (adam)
      adam_rule(c, n, xt, gt, m, v, c.fmt2 == FMT_Q8SQRT ? root : nullptr);
    else if (lion)
      lion_rule(c, n, xt, gt, m);
    else
      sgd_rule(c, n, xt, gt, m);
    enc_master(c.master, xt, n, real, param, code, staging ? stage : nullptr,
               sr_master ? w0 : nullptr);
    if (staging) stream_store_u16(at<uint16_t>(s.staging, t0 * 2), stage, real);
    if (has_m) enc_moment(c.fmt1, m, n, at<void>(c.m, a * mb), at<uint8_t>(c.ms, a / 32), sr_m ? w1 : nullptr);
    if (adam)  // q8_sqrt takes the square roots adam_rule took
      enc_moment(c.fmt2, v, n, at<void>(c.v, a * vb), at<uint8_t>(c.vs, a / 32), sr_v ? w2 : nullptr,
                 c.fmt2 == FMT_Q8SQRT ? root : nullptr);
  }
#if defined(__AVX2__)
  if (staging) _mm_sfence();  // order the streaming stores before the caller signals the copy
#endif
}

// ------------------------------------------------------------------------------ standalone
void encode_moment(int32_t fmt, const float* x, int64_t n, void* codes, uint8_t* scales,
                   const uint32_t* rand) {
  [[maybe_unused]] const IeeeMode ieee;
  const int64_t cb = moment_bytes(fmt);
  for (int64_t t = 0; t < n; t += TILE) {
    const int64_t k = vmin(TILE, n - t);
    enc_moment(fmt, x + t, k, static_cast<uint8_t*>(codes) + t * cb, scales ? scales + t / 32 : nullptr,
               rand ? rand + t : nullptr);
  }
}

void decode_moment(int32_t fmt, const void* codes, const uint8_t* scales, int64_t n, float* out) {
  [[maybe_unused]] const IeeeMode ieee;
  const int64_t cb = moment_bytes(fmt);
  for (int64_t t = 0; t < n; t += TILE) {
    const int64_t k = vmin(TILE, n - t);
    dec_moment(fmt, static_cast<const uint8_t*>(codes) + t * cb, scales ? scales + t / 32 : nullptr,
               k, out + t);
  }
}

void encode_master(int32_t master, const float* x, int64_t n, void* param, void* code,
                   const uint32_t* rand) {
  [[maybe_unused]] const IeeeMode ieee;
  const int64_t pb = master == MASTER_FP32 ? 4 : 2, cb = code_bytes(master);
  for (int64_t t = 0; t < n; t += TILE) {
    const int64_t k = vmin(TILE, n - t);
    enc_master(master, x + t, k, k, static_cast<uint8_t*>(param) + t * pb,
               cb ? static_cast<uint8_t*>(code) + t * cb : nullptr, nullptr,
               rand ? rand + t : nullptr);
  }
}

void decode_master(int32_t master, const void* param, const void* code, int64_t n, float* out) {
  [[maybe_unused]] const IeeeMode ieee;
  const int64_t pb = master == MASTER_FP32 ? 4 : 2, cb = code_bytes(master);
  for (int64_t t = 0; t < n; t += TILE) {
    const int64_t k = vmin(TILE, n - t);
    dec_master(master, static_cast<const uint8_t*>(param) + t * pb,
               cb ? static_cast<const uint8_t*>(code) + t * cb : nullptr, k, k, out + t);
  }
}

void stream_words(uint32_t seed, uint32_t tensor_id, uint32_t step, const int64_t* index,
                  int64_t n, uint32_t* out) {
  // runs of consecutive indices go through the step's generator (sr_words_tile), so tests of
  // this function cover the vector code; other indices one by one
  const StepKeys keys = step_keys(seed, tensor_id, step);
  int64_t i = 0;
  while (i < n) {
    int64_t j = i + 1;
    // (unsigned: a run may pass from -1 to 0, never overflows)
    while (j < n && static_cast<uint64_t>(index[j]) == static_cast<uint64_t>(index[j - 1]) + 1)
      ++j;
    sr_words_tile(keys, index[i], j - i, out + i, out + n + i, out + 2 * n + i);
    i = j;
  }
}

}  // namespace
}  // namespace MEMOPT_ISA_NS

#define MEMOPT_STR2(x) #x
#define MEMOPT_STR(x) MEMOPT_STR2(x)
extern const IsaKernels MEMOPT_ISA_TABLE;  // external linkage whatever kernel_api.hpp declared
const IsaKernels MEMOPT_ISA_TABLE = {
    MEMOPT_STR(MEMOPT_ISA_NS),          MEMOPT_ISA_NS::step_range,
    MEMOPT_ISA_NS::encode_moment,       MEMOPT_ISA_NS::decode_moment,
    MEMOPT_ISA_NS::encode_master,       MEMOPT_ISA_NS::decode_master,
    MEMOPT_ISA_NS::stream_words};

}  // namespace memopt_cpu
