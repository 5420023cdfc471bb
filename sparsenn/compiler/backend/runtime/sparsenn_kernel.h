/* What every generated sparsenn kernel needs: its value, storage and index types, SIMD
   vectors with unaligned loads and stores, horizontal sums, prefetch and a balanced
   split of a compressed level. Standard library only, and not <cmath> or <algorithm>
   (no PyTorch headers either): parsing them cost a kernel's build more than its code.
   libm's functions are called through the compiler's builtins, as <cmath> does.

   The including translation unit defines first:
     SN_VALUE         the value type V every computation uses (float or double)
     SN_STORAGE       optional: the type S of the value arrays (operands' values, dense
                      operands, outputs), sn_bf16 or sn_f16 with V float; S is V without it
     SN_INDEX         the index type I (int32_t or int64_t)
     SN_VECTOR_BYTES  the SIMD vector width in bytes (a power of two, 8 to 64) */
#ifndef SPARSENN_KERNEL_H
#define SPARSENN_KERNEL_H

#if !defined(SN_VALUE) || !defined(SN_INDEX) || !defined(SN_VECTOR_BYTES)
#error "define SN_VALUE, SN_INDEX and SN_VECTOR_BYTES before including sparsenn_kernel.h"
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <utility>

typedef SN_VALUE V;
typedef SN_INDEX I;

/* SIMD vectors of V for register-blocked loops (GCC/Clang vector extensions). */
typedef V VV __attribute__((vector_size(SN_VECTOR_BYTES)));
constexpr int SN_W = (int)(sizeof(VV) / sizeof(V));
static_assert(SN_W * sizeof(V) == SN_VECTOR_BYTES && (SN_W & (SN_W - 1)) == 0,
              "SN_VECTOR_BYTES must be a power-of-two multiple of sizeof(V)");
static inline VV sn_load(const V* p) { VV v; std::memcpy(&v, p, sizeof v); return v; }
static inline void sn_store(V* p, VV v) { std::memcpy(p, &v, sizeof v); }

/* The calling thread's buffer number Id of at least n values (zeros when it grows), kept
   across calls (a register tile's packed panels: no allocation per panel); freed when the
   thread ends. It starts on a cache line (SN_CACHE_LINE bytes): a pack's rows are whole
   vectors, so no vector load from it straddles two lines (calloc's 16-byte alignment
   split every other 32-byte load of a pack across lines, each costing two loads). */
#define SN_CACHE_LINE 64
struct sn_buffer {
  V* data = nullptr;
  int64_t size = 0;
  ~sn_buffer() { std::free(data); }
};
template <int Id> static inline V* sn_scratch(int64_t n) {
  static thread_local sn_buffer buffer;
  if (buffer.size < n) {
    std::free(buffer.data);
    const size_t bytes = ((size_t)n * sizeof(V) + SN_CACHE_LINE - 1) / SN_CACHE_LINE * SN_CACHE_LINE;
    buffer.data = (V*)std::aligned_alloc(SN_CACHE_LINE, bytes);
    if (buffer.data != nullptr) std::memset(buffer.data, 0, bytes);
    buffer.size = buffer.data == nullptr ? 0 : n;
    if (buffer.data == nullptr) throw std::bad_alloc();
  }
  return buffer.data;
}

/* A fused kernel's stage printed as its own function (called once per team coordinate
   from sn_run, maybe in another translation unit): neither inlined into sn_run's team
   and single-thread loops nor cloned by GCC's constant propagation, each of which would
   compile the stage again. */
#if defined(__clang__)
#define SN_STAGE __attribute__((visibility("hidden"), noinline))
#else
#define SN_STAGE __attribute__((visibility("hidden"), noinline, noclone))
#endif

/* The smallest and largest of integer bounds (index arithmetic: sn_min and sn_max are
   the value functions), and the first of the sorted coordinates [first, last) not below
   value: std::min, std::max and std::lower_bound without <algorithm>, whose parsing cost
   most of a small kernel's build. */
static inline int64_t sn_imin(int64_t a) { return a; }
template <class... T> static inline int64_t sn_imin(int64_t a, int64_t b, T... rest) {
  return sn_imin(b < a ? b : a, (int64_t)rest...);
}
static inline int64_t sn_imax(int64_t a) { return a; }
template <class... T> static inline int64_t sn_imax(int64_t a, int64_t b, T... rest) {
  return sn_imax(a < b ? b : a, (int64_t)rest...);
}
template <class J> static inline const J* sn_lower_bound(const J* first, const J* last, J value) {
  for (int64_t count = last - first; count > 0;) {
    const int64_t half = count / 2;
    if (first[half] < value) {
      first += half + 1;
      count -= half + 1;
    } else {
      count = half;
    }
  }
  return first;
}
static inline int64_t sn_clamp(int64_t n, int64_t lo, int64_t hi) { return n < lo ? lo : n > hi ? hi : n; }

#ifdef SN_STORAGE
/* 16-bit storage, float arithmetic. A stored value is widened to float exactly when it
   is read (sn_widen) and rounded to nearest, ties to even, when it is written
   (sn_narrow), bit for bit as torch converts: bfloat16 is float's top half, rounded at
   bit 16 (NaN becomes 0x7fc0); float16 rebases the exponent (subnormals through a
   float multiply or add that rounds once), overflows to inf and keeps NaN quiet.
   Branch-free integer arithmetic on the bits, written once for a uint32_t and for a
   vector of them (VU), so loops over stored values vectorise and sn_load / sn_store
   convert SN_W lanes at a time. */
struct sn_bf16 { uint16_t bits; };
struct sn_f16 { uint16_t bits; };
typedef SN_STORAGE S;
static_assert(sizeof(V) == 4, "16-bit storage computes in float");
typedef uint32_t VU __attribute__((vector_size(SN_VECTOR_BYTES)));
typedef int32_t VM __attribute__((vector_size(SN_VECTOR_BYTES)));  // a vector comparison's lanes

static inline uint32_t sn_mask(bool c) { return 0u - (uint32_t)c; }
static inline VU sn_mask(VM c) { return (VU)c; }
template <class U> static inline U sn_select(U mask, U a, U b) { return (a & mask) | (b & ~mask); }

template <class U> static inline U sn_bf16_widened(U h) { return h << 16; }
template <class U> static inline U sn_bf16_rounded(U u, U nan) {
  return sn_select(nan, U{} + 0x7fc0u, (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
template <class U, class F> static inline U sn_f16_widened(U h) {
  const U magnitude = h & 0x7fffu;
  const U finite = __builtin_bit_cast(U, __builtin_bit_cast(F, magnitude << 13) * 0x1p112f);
  return finite | (sn_mask(magnitude >= 0x7c00u) & 0x7f800000u) | ((h & 0x8000u) << 16);
}
template <class U, class F> static inline U sn_f16_rounded(U u) {
  const U a = u & 0x7fffffffu;
  const U subnormal = __builtin_bit_cast(U, __builtin_bit_cast(F, a) + 0.5f) - 0x3f000000u;
  const U normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
  const U large = sn_select(sn_mask(a > 0x7f800000u), U{} + 0x7e00u, U{} + 0x7c00u);  // NaN, or inf
  const U magnitude = sn_select(sn_mask(a >= 0x47800000u), large,
                                sn_select(sn_mask(a < 0x38800000u), subnormal, normal));
  return magnitude | ((u >> 16) & 0x8000u);
}

constexpr bool sn_is_bf16 = std::is_same<S, sn_bf16>::value;
static inline V sn_widen(S x) {
  const uint32_t h = x.bits;
  return __builtin_bit_cast(V, sn_is_bf16 ? sn_bf16_widened(h) : sn_f16_widened<uint32_t, V>(h));
}
static inline S sn_narrow(V x) {
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  return S{(uint16_t)(sn_is_bf16 ? sn_bf16_rounded(u, sn_mask(x != x)) : sn_f16_rounded<uint32_t, V>(u))};
}
/* float16 vectors convert in one instruction where the CPU has one (x86's F16C, 8 or 16
   lanes; same results, rounding to nearest even). */
#if defined(__F16C__) && (SN_VECTOR_BYTES == 32 || (SN_VECTOR_BYTES == 64 && defined(__AVX512F__)))
#define SN_F16_VECTORS 1
#include <immintrin.h>
#else
#define SN_F16_VECTORS 0
#endif
static inline VV sn_load(const S* p) {
#if SN_F16_VECTORS
  if constexpr (!sn_is_bf16) {
#if SN_VECTOR_BYTES == 32
    return (VV)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
    return (VV)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#endif
  }
#endif
  VU h;
  for (int l = 0; l < SN_W; ++l) h[l] = p[l].bits;
  return __builtin_bit_cast(VV, sn_is_bf16 ? sn_bf16_widened(h) : sn_f16_widened<VU, VV>(h));
}
static inline void sn_store(S* p, VV v) {
#if SN_F16_VECTORS
  if constexpr (!sn_is_bf16) {
#if SN_VECTOR_BYTES == 32
    _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    return;
  }
#endif
  const VU u = __builtin_bit_cast(VU, v);
  const VU bits = sn_is_bf16 ? sn_bf16_rounded(u, sn_mask(v != v)) : sn_f16_rounded<VU, VV>(u);
  for (int l = 0; l < SN_W; ++l) p[l].bits = (uint16_t)bits[l];
}
#else
typedef V S;
static inline V sn_narrow(V x) { return x; }
#endif

/* Lanes of a and b picked by constant indices (b's lanes numbered from SN_W). */
typedef std::conditional<sizeof(V) == 8, int64_t, int32_t>::type sn_lane_index;
typedef sn_lane_index VI __attribute__((vector_size(SN_VECTOR_BYTES)));
#if defined(__clang__)
#define SN_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SN_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (VI){__VA_ARGS__})
#endif
typedef std::make_integer_sequence<int, SN_W> sn_lanes;

/* A mask of a vector's first lanes, sn_first_lanes(n) (lanes [0, n), n clamped to [0,
   SN_W]), and loads and stores of only those lanes, the others loaded as zero: nothing
   past them is read or written (a row narrower than a vector, or a row's last, partial
   vector). A mask register and one masked instruction where the CPU has them (AVX-512;
   AVX2 for 32-byte vectors, AVX for 16-byte ones), else a loop over the lanes. Defined for kernels that use
   them (SN_LANE_MASKS). */
#ifdef SN_LANE_MASKS
#if (defined(__AVX512F__) && SN_VECTOR_BYTES == 64) || \
    (defined(__AVX512VL__) && (SN_VECTOR_BYTES == 32 || SN_VECTOR_BYTES == 16))
#define SN_MASK_REGISTERS 1
typedef unsigned sn_lane_mask;
static inline sn_lane_mask sn_first_lanes(int64_t n) {
  return n <= 0 ? 0u : n >= SN_W ? (1u << SN_W) - 1 : (1u << n) - 1;
}
static inline bool sn_lane_on(sn_lane_mask m, int l) { return (m >> l) & 1u; }
#elif (defined(__AVX2__) && SN_VECTOR_BYTES == 32) || (defined(__AVX__) && SN_VECTOR_BYTES == 16)
#define SN_MASK_VECTORS 1
typedef VI sn_lane_mask;
static inline sn_lane_mask sn_first_lanes(int64_t n) {
  VI lane;
  for (int l = 0; l < SN_W; ++l) lane[l] = l;
  return lane < (sn_lane_index)sn_clamp(n, 0, SN_W);
}
static inline bool sn_lane_on(sn_lane_mask m, int l) { return m[l] != 0; }
#else
typedef int sn_lane_mask;
static inline sn_lane_mask sn_first_lanes(int64_t n) { return (int)sn_clamp(n, 0, SN_W); }
static inline bool sn_lane_on(sn_lane_mask m, int l) { return l < m; }
#endif
#if SN_MASK_REGISTERS || SN_MASK_VECTORS
#if defined(__GNUC__) && !defined(__clang__)
/* GCC's builtins behind the masked load and store intrinsics, on vector types of their
   own: <immintrin.h> takes longer to parse than a small kernel takes to compile. */
typedef float sn_f32x16 __attribute__((vector_size(64)));
typedef double sn_f64x8 __attribute__((vector_size(64)));
typedef float sn_f32x8 __attribute__((vector_size(32)));
typedef double sn_f64x4 __attribute__((vector_size(32)));
typedef int sn_i32x8 __attribute__((vector_size(32)));
typedef long long sn_i64x4 __attribute__((vector_size(32)));
typedef float sn_f32x4 __attribute__((vector_size(16)));
typedef double sn_f64x2 __attribute__((vector_size(16)));
typedef int sn_i32x4 __attribute__((vector_size(16)));
typedef long long sn_i64x2 __attribute__((vector_size(16)));
#define SN_MASKZ_LOADU_PS512(m, p) __builtin_ia32_loadups512_mask((const float*)(p), sn_f32x16{}, (unsigned short)(m))
#define SN_MASKZ_LOADU_PD512(m, p) __builtin_ia32_loadupd512_mask((const double*)(p), sn_f64x8{}, (unsigned char)(m))
#define SN_MASKZ_LOADU_PS256(m, p) __builtin_ia32_loadups256_mask((const float*)(p), sn_f32x8{}, (unsigned char)(m))
#define SN_MASKZ_LOADU_PD256(m, p) __builtin_ia32_loadupd256_mask((const double*)(p), sn_f64x4{}, (unsigned char)(m))
#define SN_MASK_STOREU_PS512(p, m, v) __builtin_ia32_storeups512_mask((float*)(p), (sn_f32x16)(v), (unsigned short)(m))
#define SN_MASK_STOREU_PD512(p, m, v) __builtin_ia32_storeupd512_mask((double*)(p), (sn_f64x8)(v), (unsigned char)(m))
#define SN_MASK_STOREU_PS256(p, m, v) __builtin_ia32_storeups256_mask((float*)(p), (sn_f32x8)(v), (unsigned char)(m))
#define SN_MASK_STOREU_PD256(p, m, v) __builtin_ia32_storeupd256_mask((double*)(p), (sn_f64x4)(v), (unsigned char)(m))
#define SN_MASKLOAD_PS256(p, m) __builtin_ia32_maskloadps256((const sn_f32x8*)(p), (sn_i32x8)(m))
#define SN_MASKLOAD_PD256(p, m) __builtin_ia32_maskloadpd256((const sn_f64x4*)(p), (sn_i64x4)(m))
#define SN_MASKSTORE_PS256(p, m, v) __builtin_ia32_maskstoreps256((sn_f32x8*)(p), (sn_i32x8)(m), (sn_f32x8)(v))
#define SN_MASKSTORE_PD256(p, m, v) __builtin_ia32_maskstorepd256((sn_f64x4*)(p), (sn_i64x4)(m), (sn_f64x4)(v))
#define SN_MASKZ_LOADU_PS128(m, p) __builtin_ia32_loadups128_mask((const float*)(p), sn_f32x4{}, (unsigned char)(m))
#define SN_MASKZ_LOADU_PD128(m, p) __builtin_ia32_loadupd128_mask((const double*)(p), sn_f64x2{}, (unsigned char)(m))
#define SN_MASK_STOREU_PS128(p, m, v) __builtin_ia32_storeups128_mask((float*)(p), (sn_f32x4)(v), (unsigned char)(m))
#define SN_MASK_STOREU_PD128(p, m, v) __builtin_ia32_storeupd128_mask((double*)(p), (sn_f64x2)(v), (unsigned char)(m))
#define SN_MASKLOAD_PS128(p, m) __builtin_ia32_maskloadps((const sn_f32x4*)(p), (sn_i32x4)(m))
#define SN_MASKLOAD_PD128(p, m) __builtin_ia32_maskloadpd((const sn_f64x2*)(p), (sn_i64x2)(m))
#define SN_MASKSTORE_PS128(p, m, v) __builtin_ia32_maskstoreps((sn_f32x4*)(p), (sn_i32x4)(m), (sn_f32x4)(v))
#define SN_MASKSTORE_PD128(p, m, v) __builtin_ia32_maskstorepd((sn_f64x2*)(p), (sn_i64x2)(m), (sn_f64x2)(v))
#define SN_MOVEMASK_PS256(m) __builtin_ia32_movmskps256((sn_f32x8)(m))
#define SN_MOVEMASK_PD256(m) __builtin_ia32_movmskpd256((sn_f64x4)(m))
#define SN_MOVEMASK_PS128(m) __builtin_ia32_movmskps((sn_f32x4)(m))
#define SN_MOVEMASK_PD128(m) __builtin_ia32_movmskpd((sn_f64x2)(m))
#else
#include <immintrin.h>
#define SN_MASKZ_LOADU_PS512(m, p) _mm512_maskz_loadu_ps((__mmask16)(m), (p))
#define SN_MASKZ_LOADU_PD512(m, p) _mm512_maskz_loadu_pd((__mmask8)(m), (p))
#define SN_MASKZ_LOADU_PS256(m, p) _mm256_maskz_loadu_ps((__mmask8)(m), (p))
#define SN_MASKZ_LOADU_PD256(m, p) _mm256_maskz_loadu_pd((__mmask8)(m), (p))
#define SN_MASK_STOREU_PS512(p, m, v) _mm512_mask_storeu_ps((p), (__mmask16)(m), (__m512)(v))
#define SN_MASK_STOREU_PD512(p, m, v) _mm512_mask_storeu_pd((p), (__mmask8)(m), (__m512d)(v))
#define SN_MASK_STOREU_PS256(p, m, v) _mm256_mask_storeu_ps((p), (__mmask8)(m), (__m256)(v))
#define SN_MASK_STOREU_PD256(p, m, v) _mm256_mask_storeu_pd((p), (__mmask8)(m), (__m256d)(v))
#define SN_MASKLOAD_PS256(p, m) _mm256_maskload_ps((const float*)(p), (__m256i)(m))
#define SN_MASKLOAD_PD256(p, m) _mm256_maskload_pd((const double*)(p), (__m256i)(m))
#define SN_MASKSTORE_PS256(p, m, v) _mm256_maskstore_ps((float*)(p), (__m256i)(m), (__m256)(v))
#define SN_MASKSTORE_PD256(p, m, v) _mm256_maskstore_pd((double*)(p), (__m256i)(m), (__m256d)(v))
#define SN_MASKZ_LOADU_PS128(m, p) _mm_maskz_loadu_ps((__mmask8)(m), (p))
#define SN_MASKZ_LOADU_PD128(m, p) _mm_maskz_loadu_pd((__mmask8)(m), (p))
#define SN_MASK_STOREU_PS128(p, m, v) _mm_mask_storeu_ps((p), (__mmask8)(m), (__m128)(v))
#define SN_MASK_STOREU_PD128(p, m, v) _mm_mask_storeu_pd((p), (__mmask8)(m), (__m128d)(v))
#define SN_MASKLOAD_PS128(p, m) _mm_maskload_ps((const float*)(p), (__m128i)(m))
#define SN_MASKLOAD_PD128(p, m) _mm_maskload_pd((const double*)(p), (__m128i)(m))
#define SN_MASKSTORE_PS128(p, m, v) _mm_maskstore_ps((float*)(p), (__m128i)(m), (__m128)(v))
#define SN_MASKSTORE_PD128(p, m, v) _mm_maskstore_pd((double*)(p), (__m128i)(m), (__m128d)(v))
#define SN_MOVEMASK_PS256(m) _mm256_movemask_ps((__m256)(m))
#define SN_MOVEMASK_PD256(m) _mm256_movemask_pd((__m256d)(m))
#define SN_MOVEMASK_PS128(m) _mm_movemask_ps((__m128)(m))
#define SN_MOVEMASK_PD128(m) _mm_movemask_pd((__m128d)(m))
#endif
#endif
static inline VV sn_load_first(const V* p, sn_lane_mask m) {
#if SN_MASK_REGISTERS && SN_VECTOR_BYTES == 64
  if constexpr (sizeof(V) == 4) return (VV)SN_MASKZ_LOADU_PS512(m, p);
  else return (VV)SN_MASKZ_LOADU_PD512(m, p);
#elif SN_MASK_REGISTERS && SN_VECTOR_BYTES == 16
  if constexpr (sizeof(V) == 4) return (VV)SN_MASKZ_LOADU_PS128(m, p);
  else return (VV)SN_MASKZ_LOADU_PD128(m, p);
#elif SN_MASK_REGISTERS
  if constexpr (sizeof(V) == 4) return (VV)SN_MASKZ_LOADU_PS256(m, p);
  else return (VV)SN_MASKZ_LOADU_PD256(m, p);
#elif SN_MASK_VECTORS && SN_VECTOR_BYTES == 16
  if constexpr (sizeof(V) == 4) return (VV)SN_MASKLOAD_PS128(p, m);
  else return (VV)SN_MASKLOAD_PD128(p, m);
#elif SN_MASK_VECTORS
  if constexpr (sizeof(V) == 4) return (VV)SN_MASKLOAD_PS256(p, m);
  else return (VV)SN_MASKLOAD_PD256(p, m);
#else
  VV v{};
  for (int l = 0; l < SN_W; ++l) if (sn_lane_on(m, l)) v[l] = p[l];
  return v;
#endif
}
#if SN_MASK_VECTORS
/* Lanes From .. From + sizeof...(I) - 1 of the vector v, as a vector of that many lanes. */
template <int From, class T, int... I>
static inline auto sn_lanes_of(T v, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(v, v, (From + I)...);
}
/* The first n lanes (n < W) of v, a vector of W lanes, stored at p: a half of v when
   n has that bit, then the first lanes of the half after it. */
template <int W, class T>
static inline void sn_store_head(V* p, T v, int n) {
  if constexpr (W > 1) {
    constexpr int H = W / 2;
    const auto low = sn_lanes_of<0>(v, std::make_integer_sequence<int, H>{});
    const auto high = sn_lanes_of<H>(v, std::make_integer_sequence<int, H>{});
    if (n & H) {
      std::memcpy(p, &low, sizeof low);
      sn_store_head<H>(p + H, high, n);
    } else {
      sn_store_head<H>(p, low, n);
    }
  }
}
#endif
static inline void sn_store_first(V* p, VV v, sn_lane_mask m) {
#if SN_MASK_REGISTERS && SN_VECTOR_BYTES == 64
  if constexpr (sizeof(V) == 4) SN_MASK_STOREU_PS512(p, m, v);
  else SN_MASK_STOREU_PD512(p, m, v);
#elif SN_MASK_REGISTERS && SN_VECTOR_BYTES == 16
  if constexpr (sizeof(V) == 4) SN_MASK_STOREU_PS128(p, m, v);
  else SN_MASK_STOREU_PD128(p, m, v);
#elif SN_MASK_REGISTERS
  if constexpr (sizeof(V) == 4) SN_MASK_STOREU_PS256(p, m, v);
  else SN_MASK_STOREU_PD256(p, m, v);
#elif SN_MASK_VECTORS
  /* AVX's masked store is microcoded on AMD CPUs (about 25 cycles on Zen 3): the mask
     of the first n lanes stores as whole halves, quarters, ... of the vector instead. */
#if SN_VECTOR_BYTES == 16
  const int on = sizeof(V) == 4 ? SN_MOVEMASK_PS128(m) : SN_MOVEMASK_PD128(m);
#else
  const int on = sizeof(V) == 4 ? SN_MOVEMASK_PS256(m) : SN_MOVEMASK_PD256(m);
#endif
  const int n = __builtin_popcount((unsigned)on);
  if (n == SN_W) return sn_store(p, v);
  sn_store_head<SN_W>(p, v, n);
#else
  for (int l = 0; l < SN_W; ++l) if (sn_lane_on(m, l)) p[l] = v[l];
#endif
}
#ifdef SN_STORAGE
static inline VV sn_load_first(const S* p, sn_lane_mask m) {
  VU h{};
  for (int l = 0; l < SN_W; ++l) if (sn_lane_on(m, l)) h[l] = p[l].bits;
  return __builtin_bit_cast(VV, sn_is_bf16 ? sn_bf16_widened(h) : sn_f16_widened<VU, VV>(h));
}
static inline void sn_store_first(S* p, VV v, sn_lane_mask m) {
  const VU u = __builtin_bit_cast(VU, v);
  const VU bits = sn_is_bf16 ? sn_bf16_rounded(u, sn_mask(v != v)) : sn_f16_rounded<VU, VV>(u);
  for (int l = 0; l < SN_W; ++l) if (sn_lane_on(m, l)) p[l].bits = (uint16_t)bits[l];
}
#endif
#endif  // SN_LANE_MASKS

/* The vector of p[crd[l] * stride] over lanes l: values at a vector of stored
   coordinates (a loop the compiler turns into a gather instruction where there is one). */
template <class J> static inline VV sn_gather(const V* p, const J* crd, int64_t stride) {
  VV v;
  for (int l = 0; l < SN_W; ++l) v[l] = p[(int64_t)crd[l] * stride];
  return v;
}
#ifdef SN_STORAGE
template <class J> static inline VV sn_gather(const S* p, const J* crd, int64_t stride) {
  VU h;
  for (int l = 0; l < SN_W; ++l) h[l] = p[(int64_t)crd[l] * stride].bits;
  return __builtin_bit_cast(VV, sn_is_bf16 ? sn_bf16_widened(h) : sn_f16_widened<VU, VV>(h));
}
#endif

/* Horizontal sums as trees of shuffles and adds (log2(SN_W) dependent adds, no round
   trip through memory), unrolled by parameter packs (L over lanes, P over vectors) so
   that every lane index is a constant. sn_fold<h> adds lanes [h, 2h) onto lanes
   [0, h); sn_pair<s> takes vectors a, b whose lanes hold s rows each (lane l holds row
   l mod s) and adds lanes l and l + s of each block of 2s lanes, giving one vector
   whose lanes hold the 2s rows. */
constexpr int sn_fold_lane(int h, int l) { return l < h ? l + h : l; }
constexpr int sn_pair_lane(int s, int l) {
  return l / (2 * s) * 2 * s + (l % (2 * s) < s ? l % (2 * s) : SN_W + l % (2 * s) - s);
}

template <int H, int... L>
static inline VV sn_fold(VV v, std::integer_sequence<int, L...>) {
  return v + SN_SHUFFLE(v, v, sn_fold_lane(H, L)...);
}

template <int S, int... L>
static inline VV sn_pair(VV a, VV b, std::integer_sequence<int, L...>) {
  return SN_SHUFFLE(a, b, sn_pair_lane(S, L)...) + SN_SHUFFLE(a, b, (sn_pair_lane(S, L) + S)...);
}

/* v's first Live lanes halved by folds until Keep remain. */
template <int Live, int Keep>
static inline VV sn_fold_to(VV v) {
  if constexpr (Live > Keep) {
    return sn_fold_to<Live / 2, Keep>(sn_fold<Live / 2>(v, sn_lanes{}));
  } else {
    return v;
  }
}

/* N vectors whose lanes hold S rows each, paired level by level into one. */
template <int S, int N, int... P>
static inline VV sn_transpose_add(const VV (&v)[N], std::integer_sequence<int, P...>) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    const VV next[N / 2] = {sn_pair<S>(v[2 * P], v[2 * P + 1], sn_lanes{})...};
    return sn_transpose_add<2 * S>(next, std::make_integer_sequence<int, N / 4>{});
  }
}

/* The sum of v's lanes. */
static inline V sn_hsum(VV v) { return sn_fold_to<SN_W, 1>(v)[0]; }

/* The SN_W x SN_W block at src (rows src_stride values apart) transposed into dst (rows
   dst_stride apart): a panel packed from across its factor's layout. log2(SN_W) rounds
   each interleave row i with row i + SN_W / 2 (lanes of the first half, then of the
   second): a round rotates the bits of (row, lane) by one, so the last swaps them. */
constexpr int sn_interleave_lane(int from, int l) { return (l % 2 ? SN_W : 0) + from + l / 2; }
template <int From, int... L>
static inline VV sn_interleave(VV a, VV b, std::integer_sequence<int, L...>) {
  return SN_SHUFFLE(a, b, sn_interleave_lane(From, L)...);
}
template <class T> static inline void sn_transpose_block(const T* src, int64_t src_stride, V* dst, int64_t dst_stride) {
  VV row[SN_W], next[SN_W];
  for (int i = 0; i < SN_W; ++i) row[i] = sn_load(src + i * src_stride);
  for (int round = 1; round < SN_W; round *= 2) {
    for (int i = 0; i < SN_W / 2; ++i) {
      next[2 * i] = sn_interleave<0>(row[i], row[i + SN_W / 2], sn_lanes{});
      next[2 * i + 1] = sn_interleave<SN_W / 2>(row[i], row[i + SN_W / 2], sn_lanes{});
    }
    for (int i = 0; i < SN_W; ++i) row[i] = next[i];
  }
  for (int i = 0; i < SN_W; ++i) sn_store(dst + i * dst_stride, row[i]);
}

/* Lane-wise max and min that keep a NaN (as sn_max, sn_min), a vector of one value, and
   the max or min of v's lanes by a tree of shuffles. */
static inline VV sn_vmax(VV a, VV b) { return ((a > b) | (a != a)) ? a : b; }
static inline VV sn_vmin(VV a, VV b) { return ((a < b) | (a != a)) ? a : b; }
static inline VV sn_splat(V x) { return VV{} + x; }
template <int H, int... L>
static inline VV sn_upper_half(VV v, std::integer_sequence<int, L...>) {
  return SN_SHUFFLE(v, v, sn_fold_lane(H, L)...);
}
template <int Live, typename Combine>
static inline VV sn_fold_lanes(VV v, Combine combine) {
  if constexpr (Live > 1) {
    return sn_fold_lanes<Live / 2>(combine(v, sn_upper_half<Live / 2>(v, sn_lanes{})), combine);
  } else {
    return v;
  }
}
static inline V sn_hmax(VV v) { return sn_fold_lanes<SN_W>(v, sn_vmax)[0]; }
static inline V sn_hmin(VV v) { return sn_fold_lanes<SN_W>(v, sn_vmin)[0]; }

/* acc[0] + ... + acc[A - 1]. */
template <int A, int... P>
static inline VV sn_sum(const VV (&acc)[A], std::integer_sequence<int, P...>) {
  return (acc[0] + ... + acc[P + 1]);
}

/* Rows [First, First + G) of s: transposed and added, then folded to G lanes. */
template <int G, int First, int R, int... P>
static inline void sn_hsums_group(const VV (&s)[R], V* out, std::integer_sequence<int, P...>) {
  const VV group[G] = {s[First + P]...};
  const VV total = sn_fold_to<SN_W, G>(sn_transpose_add<1>(group, std::make_integer_sequence<int, G / 2>{}));
  std::memcpy(out + First, &total, G * sizeof(V));
}

template <int G, int R, int... P>
static inline void sn_hsums_groups(const VV (&s)[R], V* out, std::integer_sequence<int, P...>) {
  (sn_hsums_group<G, P * G>(s, out, std::make_integer_sequence<int, G>{}), ...);
}

template <int R, int A, int... P>
static inline void sn_hsums_rows(const VV (&acc)[R][A], V* out, std::integer_sequence<int, P...>) {
  const VV s[R] = {sn_sum(acc[P], std::make_integer_sequence<int, A - 1>{})...};
  constexpr int G = R < SN_W ? R : SN_W;
  sn_hsums_groups<G>(s, out, std::make_integer_sequence<int, R / G>{});
}

/* out[r] = the sum of the lanes of acc[r][0] + ... + acc[r][A - 1], for r < R (a power
   of two): rows transposed and added in groups of min(R, SN_W), then halves folded
   until the group's rows remain. */
template <int R, int A>
static inline void sn_hsums(const VV (&acc)[R][A], V* out) {
  sn_hsums_rows(acc, out, std::make_integer_sequence<int, R>{});
}

/* Prefetch n bytes from p, a cache line (64 bytes) at a time, into L2 (prefetcht1):
   the L1's few miss buffers would cap the lines in flight. */
static inline void sn_prefetch(const void* p, int64_t n) {
  for (int64_t b = 0; b < n; b += 64) __builtin_prefetch((const char*)p + b, 0, 2);
}

/* First coordinate r in [0, n] with pos[r] + r >= target (pos is non-decreasing). */
template <class J>
static inline int64_t sn_balanced_bound(const J* pos, int64_t n, int64_t target) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if ((int64_t)pos[mid] + mid < target) lo = mid + 1; else hi = mid;
  }
  return lo;
}

/* The scalar functions of index notation (sparsenn/compiler/frontend/functions.py), each as
   torch computes it: NaN propagates through relu, max and min. */
static inline V sn_neg(V x) { return -x; }
static inline V sn_abs(V x) { if constexpr (sizeof(V) == 4) return __builtin_fabsf(x); else return __builtin_fabs(x); }
static inline V sn_relu(V x) { return x < V(0) ? V(0) : x; }
/* exp(x) = 2^n e^r, n = round(x / ln 2) (adding and subtracting 1.5 * 2^mantissa bits:
   floor does not vectorise), r = x - n ln 2 (ln 2 in two parts), e^r by Cephes'
   polynomial (float) or Pade form (double), 2^n as two normal powers of two so that
   subnormal results round once more at most: branch-free arithmetic the compiler
   vectorises (libm's exp is a call per value). Within 2 ulps of the exact value for
   normal results; inf above the overflow bound, 0 below the underflow one, NaN kept. */
template <class T> static inline T sn_pow2(int64_t n) {
  typedef typename std::conditional<sizeof(T) == 8, int64_t, int32_t>::type Bits;
  const Bits bits = (Bits)(n + (sizeof(T) == 8 ? 1023 : 127)) << (sizeof(T) == 8 ? 52 : 23);
  return __builtin_bit_cast(T, bits);
}
static inline float sn_exp_of(float x) {
  const float high = 88.72283935546875f, low = -103.97208404541016f;
  const float clamped = x > high ? high : (x < low ? low : x);
  const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // rounded by 1.5 * 2^23
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const float r2 = r * r;  // the polynomial in Estrin's form: a shorter chain of dependent operations
  const float p = (5.0000001201e-1f + 1.6666665459e-1f * r) + r2 * ((4.1665795894e-2f + 8.3334519073e-3f * r)
                  + r2 * (1.3981999507e-3f + 1.9875691500e-4f * r));
  const int32_t k = (int32_t)n, half = k >> 1;
  const float y = (p * r2 + r + 1.0f) * sn_pow2<float>(half) * sn_pow2<float>(k - half);
  return x > high ? std::numeric_limits<float>::infinity() : (x < low ? 0.0f : y);
}
static inline double sn_exp_of(double x) {
  const double high = 709.782712893384, low = -745.1332191019412;
  const double clamped = x > high ? high : (x < low ? low : x);
  const double n = (clamped * 1.4426950408889634073599 + 6755399441055744.0) - 6755399441055744.0;  // 1.5 * 2^52
  double r = clamped - n * 6.93145751953125e-1;
  r = r - n * 1.42860682030941723212e-6;
  const double rr = r * r;
  const double p = r * ((1.26177193074810590878e-4 * rr + 3.02994407707441961300e-2) * rr + 9.99999999999999999910e-1);
  const double q = ((3.00198505138664455042e-6 * rr + 2.52448340349684104192e-3) * rr + 2.27265548208155028766e-1) * rr
                   + 2.00000000000000000009e0;
  const int64_t k = (int64_t)n, half = k >> 1;
  const double y = (1.0 + 2.0 * p / (q - p)) * sn_pow2<double>(half) * sn_pow2<double>(k - half);
  return x > high ? std::numeric_limits<double>::infinity() : (x < low ? 0.0 : y);
}
static inline V sn_exp(V x) { return sn_exp_of(x); }
static inline V sn_sigmoid(V x) { return V(1) / (V(1) + sn_exp(-x)); }
static inline V sn_silu(V x) { return x / (V(1) + sn_exp(-x)); }
static inline V sn_tanh(V x) { if constexpr (sizeof(V) == 4) return __builtin_tanhf(x); else return __builtin_tanh(x); }
static inline V sn_log(V x) { if constexpr (sizeof(V) == 4) return __builtin_logf(x); else return __builtin_log(x); }
static inline V sn_sqrt(V x) { if constexpr (sizeof(V) == 4) return __builtin_sqrtf(x); else return __builtin_sqrt(x); }
static inline V sn_detach(V x) { return x; }  // the value; its derivative is 0 (functions.py)
/* Phi(x) = erfc(-x / sqrt 2) / 2. In float, erfc(z) for z >= 0 is Numerical Recipes'
   Chebyshev fit t exp(-z^2 + P(t)), t = 1 / (1 + z / 2), within 1.2e-7 of erfc (relative)
   for every z, and 2 - erfc(-z) below 0: branch-free arithmetic the compiler vectorises,
   within a few units of float's rounding in both tails (torch's float gelu, through
   1 + erf, loses all digits below x = -5). Double calls libm's erf. */
static inline float sn_normal_cdf_of(float x) {
  const float z = x * -0.70710678118654752440f, a = z < 0.0f ? -z : z;
  const float t = 1.0f / (1.0f + 0.5f * a);
  const float t2 = t * t, t4 = t2 * t2, t8 = t4 * t4;  // P(t) in Estrin's form, as sn_exp_of
  const float p = ((-1.26551223f + 1.00002368f * t) + t2 * (0.37409196f + 0.09678418f * t))
                  + t4 * ((-0.18628806f + 0.27886807f * t) + t2 * (-1.13520398f + 1.48851587f * t))
                  + t8 * (-0.82215223f + 0.17087277f * t);
  // exp(p - a^2) with the argument's rounding errors (up to 1e-6 at a = 5) carried to
  // first order: a^2 = sq + sq_low exactly (fma), and p - sq = s + s_low exactly where
  // |p| <= sq (Fast2Sum; below, the rounding of s is too small to matter).
  const float sq = a * a, sq_low = __builtin_fmaf(a, a, -sq);
  const float s = p - sq, s_low = p - (s + sq);
  const float tail = t * sn_exp_of(s) * (1.0f + (s_low - sq_low));
  return 0.5f * (z < 0.0f ? 2.0f - tail : tail);
}
static inline double sn_normal_cdf_of(double x) { return 0.5 * (1.0 + __builtin_erf(x * 0.70710678118654752440)); }
static inline V sn_normal_cdf(V x) { return sn_normal_cdf_of(x); }
static inline V sn_normal_pdf(V x) { return sn_exp(V(-0.5) * x * x) * V(0.39894228040143267794); }
static inline V sn_gelu(V x) { return x * sn_normal_cdf(x); }
static inline V sn_max(V a, V b) { return (a > b || a != a) ? a : b; }
static inline V sn_min(V a, V b) { return (a < b || a != a) ? a : b; }
// omp simd reductions combining lanes as sn_max / sn_min do (a NaN lane wins)
#pragma omp declare reduction(sn_max_reduction : V : omp_out = sn_max(omp_out, omp_in)) \
    initializer(omp_priv = -std::numeric_limits<V>::infinity())
#pragma omp declare reduction(sn_min_reduction : V : omp_out = sn_min(omp_out, omp_in)) \
    initializer(omp_priv = std::numeric_limits<V>::infinity())
static inline V sn_step(V x) { return x > V(0) ? V(1) : V(0); }
static inline V sn_sign(V x) { return x > V(0) ? V(1) : x < V(0) ? V(-1) : V(0); }
static inline V sn_pick(V a, V b) { return a > b ? V(1) : a == b ? V(0.5) : V(0); }
static inline V sn_equal(V a, V b) { return a == b ? V(1) : V(0); }
/* Vector forms (lane-wise, as the scalar ones above, NaN kept) of the functions an
   epilogue applies to a register block before its store (lower/epilogue.py,
   VECTOR_FUNCTIONS); a scalar argument is the same value in every lane. */
static inline VV sn_neg(VV x) { return -x; }
static inline VV sn_relu(VV x) { return (x < VV{}) ? VV{} : x; }
static inline VV sn_max(VV a, VV b) { return sn_vmax(a, b); }
static inline VV sn_max(VV a, V b) { return sn_vmax(a, sn_splat(b)); }
static inline VV sn_max(V a, VV b) { return sn_vmax(sn_splat(a), b); }
static inline VV sn_min(VV a, VV b) { return sn_vmin(a, b); }
static inline VV sn_min(VV a, V b) { return sn_vmin(a, sn_splat(b)); }
static inline VV sn_min(V a, VV b) { return sn_vmin(sn_splat(a), b); }

#endif
