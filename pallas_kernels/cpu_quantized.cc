// x [M, K] @ dequantize(qw) [K, N] -> y [M, N] float32 on the CPU, for QuantizedWeights in the
// "tiles" layout (pallas_kernels/quantized.py's module docstring), as an XLA FFI handler
// (pallas_kernels/cpu_quantized.py builds, loads and calls it).
//
// Why a kernel: XLA's CPU dot takes float32 only at speed, so the XLA path writes every
// weight's float32 tile to the cache and reads it back each step (8 bytes of traffic a weight
// for ~0.6 bytes of codes). Here the threads share panels of columns; a slab of RB rows of a
// panel's codes becomes floats in registers and is multiplied into the rows' accumulators,
// each group's sums scaled once at the group's end. (Measurements: benchmarks/DECISIONS.md,
// "CPU quantized matmuls".) Portable C++ with AVX-512 / AVX2 paths where the compiler targets
// them.
//
// Every row of x is computed by the same sequence of operations whatever M is (each row's
// accumulators are its own, K is walked in the same order), so a row's result does not depend
// on the batch it is in (speculative verification, the engine's ragged batches).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t NB = 64;    // columns a block's accumulators hold in registers
constexpr int64_t PB = 8;     // column blocks a work item reads across a row (a panel), at most
constexpr int64_t RB = 16;    // rows of K dequantized at a time (divides every tile: >= 16)

struct Args {
  const float* x;  // [M, K]
  float* y;        // [M, N]
  const uint8_t* p0;  // [rows0, N]: low bits (or the 8-bit codes, int8 when signed0)
  const uint8_t* p1;  // [rows1, N]: high bits, or null
  const void* scale;         // [G, N]: scales, or sub-scales under super_scale
  const void* super_scale;   // [G', N] or null
  const void* offset;        // [G, N]: offsets, or sub-mins under super_offset; or null
  const void* super_offset;  // [G', N] or null
  int64_t scale_type, super_scale_type, offset_type, super_offset_type;  // DType
  int64_t rows0, rows1;  // byte rows of p0, p1
  int64_t m, k, n, bits0, bits1, tile, group, super_group, code_offset;
  bool signed0;
  const int8_t* xq;  // [M, K]: x rounded to int8 per RB rows of K (int8_x), or null
  const float* xd;   // [M, K / RB]: each such block's scale (x ~ xq * xd)
  const float* xs;   // [M, K / RB]: each such block's sum of xq * xd (offsets' products)
};

// Vectors of VL lanes, the target's register width: GCC keeps a wider vector type in memory
// (with 16-float vectors an AVX2 build ran 3.2x slower end to end on a Zen 1: 1155 ms a
// token against 357 on the 1.5B Q4_K_M file, and slower than the XLA tiles' 821).
#if defined(__AVX512F__)
constexpr int VL = 16;
#elif defined(__AVX__)
constexpr int VL = 8;
#else
constexpr int VL = 4;
#endif
typedef float fvec __attribute__((vector_size(4 * VL)));
typedef int32_t ivec __attribute__((vector_size(4 * VL)));

inline fvec loadv(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storev(float* p, fvec v) { std::memcpy(p, &v, sizeof v); }
// VL bytes widened to int32, zero- or sign-extended (GCC's __builtin_convertvector does it a
// byte at a time).
template <bool Signed>
inline ivec bytesv(const uint8_t* p) {
  ivec v;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i w = Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  std::memcpy(&v, &w, sizeof v);
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i w = Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  std::memcpy(&v, &w, sizeof v);
#else
  for (int i = 0; i < VL; ++i) v[i] = Signed ? int32_t(int8_t(p[i])) : int32_t(p[i]);
#endif
  return v;
}

// Where rows k .. of a slab (rows <= RB, within one tile) are: the byte rows and shifts of the
// planes, the same for the slab's every row.
struct Slab {
  int64_t row0, row1;
  int sh0, sh1, hi;
  int32_t mask0, mask1;
  Slab(const Args& a, int64_t k) {
    const int64_t t = k / a.tile, in_tile = k % a.tile;
    const int64_t r0 = 8 / a.bits0;
    row0 = a.bits0 == 8 ? k : (t / r0) * a.tile + in_tile;
    sh0 = a.bits0 == 8 ? 0 : int(a.bits0 * (t % r0));
    mask0 = a.bits0 == 8 ? 0xFF : (1 << a.bits0) - 1;
    row1 = sh1 = hi = mask1 = 0;
    if (a.bits1) {
      const int64_t r1 = 8 / a.bits1;
      row1 = (t / r1) * a.tile + in_tile;
      sh1 = int(a.bits1 * (t % r1));
      mask1 = (1 << a.bits1) - 1;
      hi = int(a.bits0);
    }
  }
};

// One plane of 8-bit codes, unsigned or signed; one of 4-bit codes; a 4-bit plane under a
// plane of 1 or 2 high bits.
enum Planes { kByte = 0, kSigned = 1, kNibble = 2, kTwo = 3 };

// A 4-bit code's float: with AVX-512 picked from a table (vpermps reads an index's low 4 bits
// only: the nibble above needs no mask, and no int-to-float conversion is left), else masked
// and converted.
struct Tables {
  fvec nibble;
  Tables() {
    for (int i = 0; i < VL; ++i) nibble[i] = float(i);
  }
};

inline fvec pick(ivec index, fvec table) {
#if defined(__AVX512F__)
  __m512i i;
  __m512 t;
  std::memcpy(&i, &index, sizeof i);
  std::memcpy(&t, &table, sizeof t);
  const __m512 f = _mm512_permutexvar_ps(i, t);
  fvec v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#else
  (void)table;
  return __builtin_convertvector(index & 15, fvec);
#endif
}

// The codes (as stored: code_offset not taken off) of columns VL q .. VL q + VL - 1 of the
// slab's row r, as floats (exact).
template <int P>
inline fvec codesv(const uint8_t* p0, const uint8_t* p1, int64_t ld, const Slab& sl,
                   const Tables& tb, int64_t r, int q) {
  const uint8_t* lo = p0 + (sl.row0 + r) * ld + VL * q;
  if (P == kSigned) return __builtin_convertvector(bytesv<true>(lo), fvec);
  if (P == kByte) return __builtin_convertvector(bytesv<false>(lo), fvec);
  if (P == kNibble) return pick(bytesv<false>(lo) >> sl.sh0, tb.nibble);
  // two planes: integer bits joined, then one conversion (two picks and an add measured
  // ~10% slower)
  const ivec c = ((bytesv<false>(lo) >> sl.sh0) & sl.mask0) |
                 (((bytesv<false>(p1 + (sl.row1 + r) * ld + VL * q) >> sl.sh1) & sl.mask1)
                  << sl.hi);
  return __builtin_convertvector(c, fvec);
}

#if defined(__AVX2__)
// 32 columns (from 32 h) of the slab's row r as bytes, the planes shifted, masked and joined
// (the float path widens them, the integer dots pair them): codes as stored (q0, q1: the planes'
// byte rows of the slab's first row, sl.row0 and sl.row1).
template <int P>
inline __m256i codes32(const uint8_t* q0, const uint8_t* q1, int64_t ld, const Slab& sl,
                       int64_t r, int h) {
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0 + r * ld + 32 * h));
  if (P == kNibble || P == kTwo) {  // 16-bit shifts: the bits they carry across are masked off
    if (sl.sh0) b = _mm256_srl_epi16(b, _mm_cvtsi32_si128(sl.sh0));
    b = _mm256_and_si256(b, _mm256_set1_epi8(char(sl.mask0)));
  }
  if (P == kTwo) {
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q1 + r * ld + 32 * h));
    c = _mm256_and_si256(_mm256_srl_epi16(c, _mm_cvtsi32_si128(sl.sh1)),
                         _mm256_set1_epi8(char(sl.mask1)));
    b = _mm256_or_si256(b, _mm256_sll_epi16(c, _mm_cvtsi32_si128(sl.hi)));
  }
  return b;
}

#endif

// Calls f(q, codesv<P>(..., r, q)) for each q < NB / VL: the slab's row r of a block. With AVX2
// 32 columns' planes are shifted, masked and joined as bytes (codes32), then widened 8 at a
// time.
template <int P, class F>
inline void row_codes(const uint8_t* p0, const uint8_t* p1, int64_t ld, const Slab& sl,
                      const Tables& tb, int64_t r, F f) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  (void)tb;
  const uint8_t* q0 = p0 + sl.row0 * ld;
  const uint8_t* q1 = p1 ? p1 + sl.row1 * ld : nullptr;
  for (int h = 0; h < NB / 32; ++h) {
    const __m256i b = codes32<P>(q0, q1, ld, sl, r, h);
    for (int l = 0; l < 2; ++l) {  // 16 columns' bytes, widened in two halves
      const __m128i c = l ? _mm256_extracti128_si256(b, 1) : _mm256_castsi256_si128(b);
      const __m128i c8 = _mm_srli_si128(c, 8);
      const __m256 f0 = _mm256_cvtepi32_ps(P == kSigned ? _mm256_cvtepi8_epi32(c)
                                                        : _mm256_cvtepu8_epi32(c));
      const __m256 f1 = _mm256_cvtepi32_ps(P == kSigned ? _mm256_cvtepi8_epi32(c8)
                                                        : _mm256_cvtepu8_epi32(c8));
      fvec v0, v1;
      std::memcpy(&v0, &f0, sizeof v0);
      std::memcpy(&v1, &f1, sizeof v1);
      f(4 * h + 2 * l, v0);
      f(4 * h + 2 * l + 1, v1);
    }
  }
#else
  for (int q = 0; q < NB / VL; ++q) f(q, codesv<P>(p0, p1, ld, sl, tb, r, q));
#endif
}

#if defined(__AVX2__)
// x rounded to int8 (int8_x): a slab's products as integer dots, as llama.cpp's CPU kernels take
// them (_mm256_maddubs_epi16: 32 unsigned codes times 32 signed x bytes, summed in pairs to
// int16) in place of a float conversion and a multiply-add a code. The planes hold a row of K per
// byte row, so two rows' codes are interleaved into byte pairs (unpacklo / unpackhi within each
// 128-bit lane) against x's pair of the same rows.
// Row pairs whose int16 sums stay exact before they are widened: maddubs saturates a pair's
// sum at 32767 and the adds wrap, so pairs * 2 * 127 * the largest code <= 32767.
inline int pairs_exact(const Args& a, int P) {
  const int cmax = (1 << (a.bits0 + (P == kTwo ? a.bits1 : 0))) - 1;
  return std::max(1, int(32767 / (2 * 127 * cmax)));
}

// Vectors a pair of rows' codes of 32 columns takes: two of byte pairs, or four of int16 pairs.
template <int P>
constexpr int pair_vectors() {
  return P == kByte || P == kSigned ? 4 : 2;
}

// Two rows' codes (r, r + 1) of 32 columns (from 32 h) into v: byte pairs by unpacklo /
// unpackhi, which work within each 128-bit lane (v[0] columns 0-7 | 16-23, v[1] 8-15 | 24-31);
// 8-bit codes go on widened to int16 pairs (v[j] columns 8 j .. 8 j + 7).
template <int P>
inline void pair_codes(const uint8_t* q0, const uint8_t* q1, int64_t ld, const Slab& sl,
                       int64_t r, int h, __m256i* v) {
  const __m256i c0 = codes32<P>(q0, q1, ld, sl, r, h), c1 = codes32<P>(q0, q1, ld, sl, r + 1, h);
  const __m256i lo = _mm256_unpacklo_epi8(c0, c1), hi = _mm256_unpackhi_epi8(c0, c1);
  if (pair_vectors<P>() == 2) {
    v[0] = lo;
    v[1] = hi;
    return;
  }
  auto wide = [](__m128i c) {
    return P == kSigned ? _mm256_cvtepi8_epi16(c) : _mm256_cvtepu8_epi16(c);
  };
  v[0] = wide(_mm256_castsi256_si128(lo));
  v[1] = wide(_mm256_castsi256_si128(hi));
  v[2] = wide(_mm256_extracti128_si256(lo, 1));
  v[3] = wide(_mm256_extracti128_si256(hi, 1));
}

// g [NB] (a block's float sums of one row of x) += xd * the slab's integer dots of the block's
// codes with xq [RB] (x's int8 over the slab's rows); the codes' pairs made here, or (buf:
// [RB / 2][2][pair_vectors]) once for every row.
//
// Sub-8-bit codes: maddubs (unsigned codes x signed x, a pair summed to int16) into int16
// sums of the whole block (s16[2 h + s]: lane l columns 32 h + 16 l + 8 s ..), widened to
// int32 every E pairs (at 4 bits once, at the end).
template <int P, int E, bool Buffered>
inline void slab_dots(const uint8_t* q0, const uint8_t* q1, int64_t ld, const Slab& sl,
                      const __m256i* buf, const int8_t* xq, float xd, float* g) {
  const __m256 d = _mm256_set1_ps(xd);
  constexpr int V = pair_vectors<P>();
  if (V == 4) {  // 8-bit codes: madd of int16 pairs to int32, 32 columns at a time
    for (int h = 0; h < 2; ++h) {
      __m256i acc[4];
      for (int j = 0; j < 4; ++j) acc[j] = _mm256_setzero_si256();
      for (int p = 0; p < RB / 2; ++p) {
        __m256i v[V];
        if (Buffered)
          for (int j = 0; j < V; ++j) v[j] = buf[(2 * p + h) * V + j];
        else
          pair_codes<P>(q0, q1, ld, sl, 2 * p, h, v);
        const __m256i xp = _mm256_set1_epi32(int32_t(uint32_t(uint16_t(int16_t(xq[2 * p]))) |
                                                     (uint32_t(uint16_t(int16_t(xq[2 * p + 1]))) << 16)));
        for (int j = 0; j < 4; ++j) acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(v[j], xp));
      }
      for (int j = 0; j < 4; ++j) {
        float* gj = g + 32 * h + 8 * j;
        _mm256_storeu_ps(gj, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[j]), d, _mm256_loadu_ps(gj)));
      }
    }
    return;
  }
  __m256i s16[4];
  for (int j = 0; j < 4; ++j) s16[j] = _mm256_setzero_si256();
  alignas(32) int32_t acc[NB];  // the int32 sums so far, where E < RB / 2
  if (E < RB / 2) std::memset(acc, 0, sizeof acc);
  auto widen = [&](int j, int l) {  // s16[j]'s lane l as int32, with acc's
    const __m256i w = _mm256_cvtepi16_epi32(l ? _mm256_extracti128_si256(s16[j], 1)
                                              : _mm256_castsi256_si128(s16[j]));
    if (E >= RB / 2) return w;
    const int c = 32 * (j / 2) + 16 * l + 8 * (j % 2);
    return _mm256_add_epi32(w, _mm256_load_si256(reinterpret_cast<const __m256i*>(acc + c)));
  };
  for (int p = 0; p < RB / 2; ++p) {
    int16_t x2;  // x's bytes 2 p, 2 p + 1 as they lie in memory: the pair to broadcast
    std::memcpy(&x2, xq + 2 * p, 2);
    const __m256i xp = _mm256_set1_epi16(x2);
    for (int h = 0; h < 2; ++h) {
      __m256i v[V];
      if (Buffered)
        for (int j = 0; j < V; ++j) v[j] = buf[(2 * p + h) * V + j];
      else
        pair_codes<P>(q0, q1, ld, sl, 2 * p, h, v);
      s16[2 * h] = _mm256_add_epi16(s16[2 * h], _mm256_maddubs_epi16(v[0], xp));
      s16[2 * h + 1] = _mm256_add_epi16(s16[2 * h + 1], _mm256_maddubs_epi16(v[1], xp));
    }
    if (E >= RB / 2 || (p + 1) % E || p + 1 == RB / 2) continue;
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 2; ++l) {
        const int c = 32 * (j / 2) + 16 * l + 8 * (j % 2);
        _mm256_store_si256(reinterpret_cast<__m256i*>(acc + c), widen(j, l));
      }
    for (int j = 0; j < 4; ++j) s16[j] = _mm256_setzero_si256();
  }
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 2; ++l) {
      float* gc = g + 32 * (j / 2) + 16 * l + 8 * (j % 2);
      _mm256_storeu_ps(gc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(j, l)), d, _mm256_loadu_ps(gc)));
    }
}

// A block's slab for every row of x (integer dots).
template <int P, int E>
inline void block_dots(const Args& a, const uint8_t* b0, const uint8_t* b1, int64_t ld,
                       const Slab& sl, int64_t k, float* gacc, int64_t width) {
  const uint8_t* q0 = b0 + sl.row0 * ld;
  const uint8_t* q1 = b1 ? b1 + sl.row1 * ld : nullptr;
  if (a.m == 1) {
    slab_dots<P, E, false>(q0, q1, ld, sl, nullptr, a.xq + k, a.xd[k / RB], gacc);
    return;
  }
  constexpr int V = pair_vectors<P>();
  alignas(32) __m256i buf[RB * V];  // [RB / 2][2][V]
  for (int p = 0; p < RB / 2; ++p)
    for (int h = 0; h < 2; ++h) pair_codes<P>(q0, q1, ld, sl, 2 * p, h, buf + (2 * p + h) * V);
  for (int64_t i = 0; i < a.m; ++i)
    slab_dots<P, E, true>(q0, q1, ld, sl, buf, a.xq + i * a.k + k, a.xd[(i * a.k + k) / RB],
                          gacc + i * width);
}
#else
// Without AVX2 the same integer dots a column at a time (the same sums: int32 is exact).
inline int pairs_exact(const Args&, int) { return 1; }

template <int P, int E>
inline void block_dots(const Args& a, const uint8_t* b0, const uint8_t* b1, int64_t ld,
                       const Slab& sl, int64_t k, float* gacc, int64_t width) {
  int32_t c[RB][NB];
  for (int64_t r = 0; r < RB; ++r)
    for (int64_t j = 0; j < NB; ++j) {
      const uint8_t lo = b0[(sl.row0 + r) * ld + j];
      if (P == kSigned) c[r][j] = int8_t(lo);
      else if (P == kByte) c[r][j] = lo;
      else c[r][j] = (lo >> sl.sh0) & sl.mask0;
      if (P == kTwo) c[r][j] |= ((b1[(sl.row1 + r) * ld + j] >> sl.sh1) & sl.mask1) << sl.hi;
    }
  for (int64_t i = 0; i < a.m; ++i) {
    const int8_t* xq = a.xq + i * a.k + k;
    const float xd = a.xd[(i * a.k + k) / RB];
    float* g = gacc + i * width;
    for (int64_t j = 0; j < NB; ++j) {
      int32_t sum = 0;
      for (int64_t r = 0; r < RB; ++r) sum += c[r][j] * xq[r];
      g[j] = std::fma(float(sum), xd, g[j]);
    }
  }
}
#endif

// Element types of the scale arrays (DType in cpu_quantized.py).
enum DType : int64_t { kF32 = 0, kF16 = 1, kBF16 = 2, kI8 = 3, kU8 = 4 };

inline int64_t dtype_bytes(int64_t t) { return t == kF32 ? 4 : t <= kBF16 ? 2 : 1; }

// IEEE half -> float, exactly (subnormals, infinities and NaNs included).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (man << 13);
  } else if (exp) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else {  // zero or subnormal: man * 2^-24
    const float f = float(man) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float to_float(const void* p, int64_t i, int64_t t) {
  switch (t) {
    case kF32: return static_cast<const float*>(p)[i];
    case kF16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    case kBF16: {
      const uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case kI8: return float(static_cast<const int8_t*>(p)[i]);
    default: return float(static_cast<const uint8_t*>(p)[i]);
  }
}

// VL elements from p + i as floats.
inline fvec load_as_float(const void* p, int64_t i, int64_t t) {
  switch (t) {
    case kF32: return loadv(static_cast<const float*>(p) + i);
    case kF16: {
      fvec v;
#if defined(__AVX512F__)
      const __m512 f = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)));
      std::memcpy(&v, &f, sizeof v);
#elif defined(__AVX__) && defined(__F16C__)
      const __m256 f = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
      std::memcpy(&v, &f, sizeof v);
#else
      for (int j = 0; j < VL; ++j) v[j] = to_float(p, i + j, t);
#endif
      return v;
    }
    case kBF16: {
      fvec v;
      for (int j = 0; j < VL; ++j) v[j] = to_float(p, i + j, t);
      return v;
    }
    case kI8: return __builtin_convertvector(bytesv<true>(static_cast<const uint8_t*>(p) + i),
                                             fvec);
    default: return __builtin_convertvector(bytesv<false>(static_cast<const uint8_t*>(p) + i),
                                            fvec);
  }
}

// The group's scale and offset of columns n0 .. n0 + nb - 1, in float32 as group_scales forms
// them (s = scale or super_scale * sub-scale; o = offset or -(super_offset * sub-min)); o then
// takes s * code_offset off, so that s * c + o applies to the codes as stored. width: nb
// rounded up to VL (the last block's tail is read one element at a time).
inline void group_scales(const Args& a, int64_t g, int64_t n0, int64_t nb, int64_t width,
                         float* s, float* o) {
  const int64_t at = g * a.n + n0;
  const int64_t sat = (a.super_group ? (g * a.group) / a.super_group : 0) * a.n + n0;
  const fvec off = fvec{} + float(a.code_offset);
  if (nb < width) {
    for (int64_t j = 0; j < nb; ++j) {
      s[j] = to_float(a.scale, at + j, a.scale_type);
      if (a.super_scale) s[j] = to_float(a.super_scale, sat + j, a.super_scale_type) * s[j];
      o[j] = a.offset ? to_float(a.offset, at + j, a.offset_type) : 0.0f;
      if (a.super_offset) o[j] = -(to_float(a.super_offset, sat + j, a.super_offset_type) * o[j]);
      o[j] -= s[j] * float(a.code_offset);
    }
    return;
  }
  for (int64_t j = 0; j < width; j += VL) {
    fvec sv = load_as_float(a.scale, at + j, a.scale_type);
    if (a.super_scale) sv = load_as_float(a.super_scale, sat + j, a.super_scale_type) * sv;
    fvec ov = fvec{};
    if (a.offset) ov = load_as_float(a.offset, at + j, a.offset_type);
    if (a.super_offset) ov = -(load_as_float(a.super_offset, sat + j, a.super_offset_type) * ov);
    storev(s + j, sv);
    storev(o + j, ov - sv * off);
  }
}

constexpr int64_t PF = 2;  // slabs ahead whose rows are prefetched (strided rows defeat the
                           // hardware prefetcher: each row of a slab is another page)

// Each cache line of width bytes from p.
inline void prefetch_span(const void* p, int64_t width) {
  for (int64_t i = 0; i < width; i += 64) __builtin_prefetch(static_cast<const char*>(p) + i);
}

// Prefetch the byte rows (width bytes from the panel's first column) of the slab at k, and
// its group's scale and offset rows when it starts a group.
inline void prefetch_rows(const Args& a, const uint8_t* p0, const uint8_t* p1, int64_t ld,
                          int64_t n0, int64_t width, int64_t k) {
  if (k >= a.k) return;
  const Slab sl(a, k);
  const int64_t rows = std::min(RB, a.k - k);
  for (int64_t r = 0; r < rows; ++r) prefetch_span(p0 + (sl.row0 + r) * ld, width);
  if (p1)
    for (int64_t r = 0; r < rows; ++r) prefetch_span(p1 + (sl.row1 + r) * ld, width);
  if (k % a.group == 0) {
    const int64_t at = (k / a.group) * a.n + n0;
    const int64_t sb = dtype_bytes(a.scale_type), ob = dtype_bytes(a.offset_type);
    prefetch_span(static_cast<const char*>(a.scale) + at * sb, width * sb);
    if (a.offset) prefetch_span(static_cast<const char*>(a.offset) + at * ob, width * ob);
  }
}

// Rows of x whose accumulators stay in registers at once: with 16 registers of 8 floats one
// row's 8 and a slab row's 8 codes (a Zen 1, Q4_K 1536 x 8960 at 5 rows: 4.98 ms at 1 row,
// 5.92 at 2, 7.55 at 4).
constexpr int MR = VL == 16 ? 4 : 1;

// acc [R][NB] (stride lda) += x [R] rows (stride ldx) . w [rows][NB]: R x NB / VL accumulators
// in registers.
template <int R>
inline void multiply_rows(const float* x, int64_t ldx, const float* w, int64_t rows,
                          float* acc, int64_t lda) {
  fvec v[R][NB / VL];
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < NB / VL; ++q) v[i][q] = loadv(acc + i * lda + VL * q);
  for (int64_t r = 0; r < rows; ++r) {
    fvec wr[NB / VL];
    for (int q = 0; q < NB / VL; ++q) wr[q] = loadv(w + r * NB + VL * q);
    for (int i = 0; i < R; ++i) {
      const fvec xv = fvec{} + x[i * ldx + r];
      for (int q = 0; q < NB / VL; ++q) v[i][q] += xv * wr[q];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < NB / VL; ++q) storev(acc + i * lda + VL * q, v[i][q]);
}

// Columns n0 .. n0 + blocks * NB - 1 of every row of y (a panel of column blocks, read a slab
// of rows at a time across the panel: a row's bytes are then blocks * NB contiguous ones, not
// NB bytes from every page), those below N stored. Per group of K and row of x: the codes'
// products summed (gacc), then y += s * gacc + o * (the group's sum of x): one multiply-add a
// code, the scales once a group.
template <int P>
void panel(const Args& a, int64_t n0, int64_t blocks, float* gacc /* [M][blocks * NB] */,
           float* yacc /* [M][blocks * NB] */, float* so /* [2][blocks * NB] */,
           std::vector<uint8_t>& tail) {
  alignas(64) float w[RB * NB];
  const int64_t width = blocks * NB;
  const int64_t nb = std::min(width, a.n - n0);  // columns to store (< width: the last block)
  const uint8_t* p0 = a.p0 + n0;
  const uint8_t* p1 = a.p1 ? a.p1 + n0 : nullptr;
  int64_t ld = a.n;
  if (nb < width) {  // the matrix's last, narrower block (alone): copied to rows of NB bytes
    tail.assign((a.rows0 + a.rows1) * NB, 0);
    for (int64_t r = 0; r < a.rows0; ++r) std::memcpy(&tail[r * NB], p0 + r * a.n, nb);
    for (int64_t r = 0; r < a.rows1; ++r)
      std::memcpy(&tail[(a.rows0 + r) * NB], p1 + r * a.n, nb);
    p0 = tail.data();
    p1 = a.p1 ? tail.data() + a.rows0 * NB : nullptr;
    ld = NB;
  }
  float* s = so;
  float* o = so + width;
  const Tables tb;
  const int every = pairs_exact(a, P);
  std::fill(yacc, yacc + a.m * width, 0.0f);
  std::fill(gacc, gacc + a.m * width, 0.0f);
  std::fill(so, so + 2 * width, 0.0f);
  for (int64_t k = 0; k < a.k; k += RB) {
    if (k % a.group == 0) group_scales(a, k / a.group, n0, nb, width, s, o);
    const int64_t rows = std::min(RB, a.k - k);
    prefetch_rows(a, p0, p1, ld, n0, std::min(width, ld), k + PF * RB);
    const Slab sl(a, k);
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* b0 = p0 + b * NB;
      const uint8_t* b1 = p1 ? p1 + b * NB : nullptr;
      if (a.xq) {  // integer dots (rows == RB: K % RB == 0)
        float* g = gacc + b * NB;
        switch (every) {  // pairs_exact: 8 at 4 bits, 4 at 5, 2 at 6 (8-bit codes: unused)
          case 8: block_dots<P, 8>(a, b0, b1, ld, sl, k, g, width); break;
          case 4: block_dots<P, 4>(a, b0, b1, ld, sl, k, g, width); break;
          case 2: block_dots<P, 2>(a, b0, b1, ld, sl, k, g, width); break;
          default: block_dots<P, 1>(a, b0, b1, ld, sl, k, g, width);
        }
        continue;
      }
      if (a.m == 1) {  // the block's sums in registers over the slab
        fvec g[NB / VL];
        for (int q = 0; q < NB / VL; ++q) g[q] = loadv(gacc + b * NB + VL * q);
        for (int64_t r = 0; r < rows; ++r) {
          const fvec xv = fvec{} + a.x[k + r];
          row_codes<P>(b0, b1, ld, sl, tb, r, [&](int q, fvec c) { g[q] += xv * c; });
        }
        for (int q = 0; q < NB / VL; ++q) storev(gacc + b * NB + VL * q, g[q]);
        continue;
      }
      for (int64_t r = 0; r < rows; ++r)
        row_codes<P>(b0, b1, ld, sl, tb, r,
                     [&](int q, fvec c) { storev(w + r * NB + VL * q, c); });
      for (int64_t i0 = 0; i0 < a.m; i0 += MR) {  // MR rows at a time, each its own sums
        float* gi = gacc + i0 * width + b * NB;
        const float* x = a.x + i0 * a.k + k;
        switch (std::min<int64_t>(MR, a.m - i0)) {
          case 1: multiply_rows<1>(x, a.k, w, rows, gi, width); break;
          case 2: multiply_rows<2>(x, a.k, w, rows, gi, width); break;
          case 3: multiply_rows<3>(x, a.k, w, rows, gi, width); break;
          default: multiply_rows<4>(x, a.k, w, rows, gi, width);
        }
      }
    }
    const int64_t end = k + rows;
    if (end % a.group && end < a.k) continue;
    const int64_t g0 = (k / a.group) * a.group;  // the group ends: its scales applied
    for (int64_t i = 0; i < a.m; ++i) {
      const float* x = a.x + i * a.k;
      float xs = 0.0f;  // the group's sum of x as its products took it
      if (a.xq)
        for (int64_t j = g0; j < end; j += RB) xs += a.xs[(i * a.k + j) / RB];
      else
        for (int64_t j = g0; j < end; ++j) xs += x[j];
      const fvec xsv = fvec{} + xs;
      float* gi = gacc + i * width;
      float* yi = yacc + i * width;
      for (int64_t q = 0; q < width; q += VL) {
        storev(yi + q, loadv(yi + q) + loadv(gi + q) * loadv(s + q) + xsv * loadv(o + q));
        storev(gi + q, fvec{});
      }
    }
  }
  for (int64_t i = 0; i < a.m; ++i)
    std::memcpy(a.y + i * a.n + n0, yacc + i * width, nb * sizeof(float));
}

// Work items (column blocks) shared by the calling thread and the pool's: each takes the next
// block until none is left; the caller then waits for the blocks others are still on.
struct Shared {
  Args a;           // all rows (units = 1), or one row's expert slices (units = M: stacked)
  int64_t units;    // the rows taken one at a time with their expert (stacked), else 1
  const int32_t* ids;      // [M] each row's expert (stacked), else null
  int64_t stride[6];       // bytes an expert of p0, p1, scale, super_scale, offset, super_offset
  int64_t blocks;   // work items: panels of PB column blocks, the last block alone if narrower
  int64_t full;     // column blocks of NB whole columns
  int64_t pb;       // column blocks a panel
  std::vector<int8_t> xq;  // a.xq's and a.xd's storage
  std::vector<float> xd, xs;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
};

// The Args of work unit u: all rows, or (stacked experts) row u with its expert's slices.
Args unit_args(const Shared& sh, int64_t u) {
  Args a = sh.a;
  if (!sh.ids) return a;
  const int64_t e = sh.ids[u];
  auto at = [&](const void* p, int i) -> const void* {
    return p ? static_cast<const char*>(p) + e * sh.stride[i] : nullptr;
  };
  a.x += u * a.k;
  a.y += u * a.n;
  if (a.xq) {
    a.xq += u * a.k;
    a.xd += u * (a.k / RB);
    a.xs += u * (a.k / RB);
  }
  a.m = 1;
  a.p0 = static_cast<const uint8_t*>(at(a.p0, 0));
  a.p1 = static_cast<const uint8_t*>(at(a.p1, 1));
  a.scale = at(a.scale, 2);
  a.super_scale = at(a.super_scale, 3);
  a.offset = at(a.offset, 4);
  a.super_offset = at(a.super_offset, 5);
  return a;
}

void work(Shared& sh) {
  const int64_t pb = sh.pb;
  const int64_t m = sh.ids ? 1 : sh.a.m;
  std::vector<float> buf(2 * (m + 1) * pb * NB);
  std::vector<uint8_t> tail;
  const Args& a0 = sh.a;
  auto run = a0.p1 ? panel<kTwo> : a0.signed0 ? panel<kSigned>
             : a0.bits0 == 4 ? panel<kNibble> : panel<kByte>;
  float* gacc = buf.data();
  float* yacc = gacc + m * pb * NB;
  float* so = yacc + m * pb * NB;
  const int64_t panels = (sh.full + pb - 1) / pb;
  const int64_t per_unit = sh.blocks / sh.units;
  int64_t mine = 0;
  for (int64_t i; (i = sh.next.fetch_add(1)) < sh.blocks; ++mine) {
    const Args a = unit_args(sh, i / per_unit);
    const int64_t j = i % per_unit;
    if (j < panels)
      run(a, j * pb * NB, std::min(pb, sh.full - j * pb), gacc, yacc, so, tail);
    else  // the narrower last block
      run(a, sh.full * NB, 1, gacc, yacc, so, tail);
  }
  if (mine && sh.done.fetch_add(mine) + mine == sh.blocks) {
    std::lock_guard<std::mutex> lock(sh.mu);
    sh.cv.notify_all();
  }
}

// The DType of a scale array, or -1.
int64_t dtype_of(ffi::AnyBuffer b) {
  switch (b.element_type()) {
    case ffi::DataType::F32: return kF32;
    case ffi::DataType::F16: return kF16;
    case ffi::DataType::BF16: return kBF16;
    case ffi::DataType::S8: return kI8;
    case ffi::DataType::U8: return kU8;
    default: return -1;
  }
}

// Absent arrays (has_* = 0) are passed as any one-element array. Stacked experts (every
// array [E, ...]): row m of x takes expert ids[m]'s weight; else ids is any one-element array.
ffi::Error QuantizedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer p0,
                           ffi::AnyBuffer p1, ffi::AnyBuffer scale, ffi::AnyBuffer super_scale,
                           ffi::AnyBuffer offset, ffi::AnyBuffer super_offset,
                           ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> y,
                           int64_t stacked, int64_t bits0, int64_t bits1,
                           int64_t tile, int64_t group, int64_t super_group,
                           int64_t code_offset, int64_t has_super_scale, int64_t has_offset,
                           int64_t has_super_offset, int64_t int8_x, int64_t threads) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("x must be [M, K] and y [M, N]");
  if (tile % RB || (group % RB && group < xd[1]))
    return ffi::Error::InvalidArgument("tile and group must be multiples of 16 rows");
  auto sh = std::make_shared<Shared>();
  Args& a = sh->a;
  a.x = x.typed_data();
  a.y = y->typed_data();
  a.m = xd[0];
  a.k = xd[1];
  a.n = yd[1];
  a.p0 = static_cast<const uint8_t*>(p0.untyped_data());
  a.p1 = bits1 ? static_cast<const uint8_t*>(p1.untyped_data()) : nullptr;
  a.rows0 = p0.dimensions()[stacked ? 1 : 0];
  a.rows1 = bits1 ? p1.dimensions()[stacked ? 1 : 0] : 0;
  a.signed0 = p0.element_type() == ffi::DataType::S8;
  a.scale = scale.untyped_data();
  a.super_scale = has_super_scale ? super_scale.untyped_data() : nullptr;
  a.offset = has_offset ? offset.untyped_data() : nullptr;
  a.super_offset = has_super_offset ? super_offset.untyped_data() : nullptr;
  a.scale_type = dtype_of(scale);
  a.super_scale_type = dtype_of(super_scale);
  a.offset_type = dtype_of(offset);
  a.super_offset_type = dtype_of(super_offset);
  if (a.scale_type < 0 || (a.super_scale && a.super_scale_type < 0) ||
      (a.offset && a.offset_type < 0) || (a.super_offset && a.super_offset_type < 0))
    return ffi::Error::InvalidArgument("scales must be float32, float16, bfloat16, int8 or uint8");
  a.bits0 = bits0;
  a.bits1 = bits1;
  a.tile = tile;
  a.group = group >= a.k ? INT64_MAX / 2 : group;  // one group (per-column scales): g = 0
  a.super_group = super_group;
  a.code_offset = code_offset;
  a.xq = nullptr;
  a.xd = a.xs = nullptr;
  if (int8_x && a.k % RB == 0) {
    // x rounded to int8 per RB rows of K, as llama.cpp's Q8 blocks
    sh->xq.resize(a.m * a.k);
    sh->xd.resize(a.m * a.k / RB);
    sh->xs.resize(a.m * a.k / RB);
    for (int64_t j = 0; j < a.m * a.k; j += RB) {
      float amax = 0.0f;
      for (int64_t r = 0; r < RB; ++r) amax = std::max(amax, std::fabs(a.x[j + r]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int64_t r = 0; r < RB; ++r) {
        sh->xq[j + r] = int8_t(std::nearbyint(a.x[j + r] * inv));
        sum += sh->xq[j + r];
      }
      sh->xd[j / RB] = amax / 127.0f;
      sh->xs[j / RB] = float(sum) * sh->xd[j / RB];
    }
    a.xq = sh->xq.data();
    a.xd = sh->xd.data();
    a.xs = sh->xs.data();
  }
  if (threads <= 0) threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t units = stacked ? a.m : 1;  // stacked: a unit per row, with its expert
  sh->full = a.n / NB;  // panels: at most PB blocks, at least 4 work items a thread if N allows
  sh->pb = std::clamp<int64_t>(sh->full * units / (4 * threads), 1,
                               std::max<int64_t>(std::min(PB, sh->full), 1));
  sh->blocks = (sh->full + sh->pb - 1) / sh->pb + (a.n % NB ? 1 : 0);
  sh->units = 1;
  sh->ids = nullptr;
  if (stacked) {
    const int64_t experts = p0.dimensions()[0];
    if (ids.element_count() != size_t(a.m))
      return ffi::Error::InvalidArgument("stacked experts need one expert id a row of x");
    for (int64_t i = 0; i < a.m; ++i)
      if (ids.typed_data()[i] < 0 || ids.typed_data()[i] >= experts)
        return ffi::Error::InvalidArgument("an expert id is out of range");
    const ffi::AnyBuffer arrays[6] = {p0, p1, scale, super_scale, offset, super_offset};
    for (int i = 0; i < 6; ++i) sh->stride[i] = arrays[i].size_bytes() / experts;
    sh->units = units;
    sh->ids = ids.typed_data();
    sh->blocks *= units;
  }
  const int64_t helpers = std::min<int64_t>(threads - 1, sh->blocks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh] { work(*sh); });
  work(*sh);
  std::unique_lock<std::mutex> lock(sh->mu);
  sh->cv.wait(lock, [&] { return sh->done.load() == sh->blocks; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQuantizedMatmul, QuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("stacked")
                                  .Attr<int64_t>("bits0")
                                  .Attr<int64_t>("bits1")
                                  .Attr<int64_t>("tile")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("super_group")
                                  .Attr<int64_t>("code_offset")
                                  .Attr<int64_t>("has_super_scale")
                                  .Attr<int64_t>("has_offset")
                                  .Attr<int64_t>("has_super_offset")
                                  .Attr<int64_t>("int8_x")
                                  .Attr<int64_t>("threads"));
