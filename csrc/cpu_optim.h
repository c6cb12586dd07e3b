/* cpu_optim.h - internals shared by the CPU optimizer files (cpu_optim.c, cpu_adam.c,
 * cpu_optim_adagrad.c, cpu_optim_lion.c, membw.c); not part of the API (that is cpu_adam.h).
 *
 * defines: the tiled multi-tensor driver zx_optim_run (which also picks a kernel's ISA path),
 * argument checks, the streaming stores of bf16/fp16 copies, and the AVX2 / AVX-512 loops the
 * optimizer steps share (the conversions themselves are convert.h's).
 */
#ifndef ZX_CPU_OPTIM_H
#define ZX_CPU_OPTIM_H

#include <stdint.h>
#include <string.h>

#include "cpu_adam.h"
#include "convert.h"
#include "cpu_features.h"
#include "dtype.h"

#if ZX_HAVE_X86
#include <immintrin.h>
#endif

/* The tensors of a call are laid end to end in one index space, each starting at a multiple of
 * ZX_OPTIM_ALIGN elements (so a tile boundary inside a tensor keeps its base's vector alignment),
 * and that space is cut into tiles of ZX_OPTIM_TILE elements that threads take from an atomic
 * counter: one tile may cover many small tensors, one large tensor spans many tiles. */
#define ZX_OPTIM_TILE 32768   /* elements: 128 KiB of each fp32 array */
#define ZX_OPTIM_ALIGN 64     /* elements */
#define ZX_OPTIM_INLINE 65536 /* calls with fewer elements than this run on the caller's thread */

/* Calls with at least this many elements write their bf16/fp16 copies with non-temporal stores:
 * the copy is for the device, and storing it through the caches would first read every one of its
 * lines from memory (2 of the ~32 bytes an Adam step moves per element) and evict the state. Below
 * this the whole step fits in the caches, where plain stores are faster. */
#define ZX_STREAM_MIN (1 << 22)

/* Works on elements [begin, end) of one tensor; adds to *acc where the call is a reduction. */
typedef void (*zx_span_fn)(const void *ctx, const zx_optim_tensor *t, int64_t begin, int64_t end,
			   double *acc);

/* A kernel's span function for each SIMD level. ZX_SPANS(name) is { name_scalar, name_avx2,
 * name_avx512 }; a build without the x86 paths has only the scalar one (and never asks for more). */
typedef struct zx_spans {
	zx_span_fn scalar, avx2, avx512;
} zx_spans;
#if ZX_HAVE_X86
#define ZX_SPANS(name) { name##_scalar, name##_avx2, name##_avx512 }
#else
#define ZX_SPANS(name) { name##_scalar, NULL, NULL }
#endif

/* Runs fn over every element of t (n,) on the pool's threads. sum: NULL, or where the total of
 * the per-tile accumulators goes, added in tile order (so it does not depend on the threads).
 * Returns 0, -EOVERFLOW for more than 2^62 elements, or -ENOMEM. */
int zx_optim_run(const zx_optim_tensor *t, int64_t n, zx_span_fn fn, const void *ctx, double *sum);

/* zx_optim_run with the span function of `spans` for isa (as the API takes it: -1 for
 * zx_simd_level(), or a zx_simd): the one place a kernel's ISA is chosen. -EINVAL for an isa this
 * CPU lacks. */
int zx_optim_run_isa(const zx_optim_tensor *t, int64_t n, const zx_spans *spans, int isa,
		     const void *ctx, double *sum);

/* Elements in t (n,) in all (numels already checked to be >= 0). */
static inline int64_t zx_optim_numel(const zx_optim_tensor *t, int64_t n)
{
	int64_t total = 0;
	for (int64_t i = 0; i < n; i++)
		total += t[i].numel;
	return total;
}

/* Which fields zx_optim_check requires to be set when numel > 0. */
enum {
	ZX_NEED_PARAM = 1,
	ZX_NEED_GRAD = 2,
	ZX_NEED_EXP_AVG = 4,
	ZX_NEED_EXP_AVG_SQ = 8,
	ZX_NEED_ALL = 15, /* Adam's arrays */
};

/* 0 if every tensor has numel >= 0, the fields in `need` set and naturally aligned, and, where
 * any out is set, out_dtype is ZX_BF16 or ZX_F16; else -EINVAL. */
int zx_optim_check(const zx_optim_tensor *t, int64_t n, unsigned need, int out_dtype);

/* fma(a, b, c) for the portable path: the hardware instruction where the compiler may use it,
 * otherwise in double, where a*b is exact (24 + 24 bits < 53) and only the sum rounds before the
 * final rounding to fp32. That double rounding can differ from a fused result only when the sum
 * lands within 2^-53 of a point halfway between two floats (about one operation in 2^29), so the
 * portable path gives the vector paths' bits in practice, at the speed of plain C. */
static inline float zx_fmaf(float a, float b, float c)
{
#ifdef FP_FAST_FMAF
	return __builtin_fmaf(a, b, c);
#else
	return (float)((double)a * (double)b + (double)c);
#endif
}

#if ZX_HAVE_X86
/* Whether a span may stream its copy: a large call (ZX_STREAM_MIN), and the span's first vector
 * of `bytes` aligned, as non-temporal stores need (vectors then stay aligned along the span). */
static inline int zx_stream_span(int stream, const void *out, int64_t begin, uintptr_t bytes)
{
	return stream && out && ((uintptr_t)((const uint16_t *)out + begin) & (bytes - 1)) == 0;
}

/* Stores 8 16-bit values at out16, bypassing the caches where stream is set (see ZX_STREAM_MIN;
 * the span ends with _mm_sfence then). */
ZX_TARGET_AVX2 static inline void zx_store16x8(uint16_t *out16, __m128i v, int stream)
{
	if (stream)
		_mm_stream_si128((__m128i *)out16, v);
	else
		_mm_storeu_si128((__m128i *)out16, v);
}

/* Stores the first r (1..8) 16-bit values of v at out16. */
static inline void zx_store16_tail(uint16_t *out16, __m128i v, int64_t r)
{
	uint16_t tmp[8];
	memcpy(tmp, &v, sizeof(tmp));
	memcpy(out16, tmp, (size_t)r * sizeof(uint16_t));
}

/* Stores the lanes in mask of 16 16-bit values at out16; full vectors bypass the caches where
 * stream is set (see zx_store16x8). */
ZX_TARGET_AVX512 static inline void zx_store16x16(uint16_t *out16, __m256i v, __mmask16 mask,
						 int stream)
{
	if (stream && mask == 0xffff)
		_mm256_stream_si256((__m256i *)out16, v);
	else
		_mm256_mask_storeu_epi16(out16, mask, v);
}
#define ZX_INLINE static inline __attribute__((always_inline))

/* Prefetches n floats of array a from ZX_PREFETCH_BYTES past index i, where they are still inside
 * its numel elements. Loops over arrays larger than the caches call it once per block and array:
 * a core is bound by the cache misses it keeps in flight, and the hardware prefetcher alone keeps
 * too few (see cpu_adam.c). */
#define ZX_PREFETCH_BYTES 2048
ZX_INLINE void zx_prefetch_ahead(const float *a, int64_t i, int64_t numel, int n)
{
	const int64_t at = i + ZX_PREFETCH_BYTES / 4;
	if (at + n > numel)
		return;
	for (int o = 0; o < n; o += 16)
		_mm_prefetch((const char *)(a + at + o), _MM_HINT_T0);
}

/* zx_prefetch_ahead of the arrays in `arrays` (ZX_NEED_*, a constant) that t has. */
ZX_INLINE void zx_prefetch(const zx_optim_tensor *t, int64_t i, int n, const unsigned arrays)
{
	zx_prefetch_ahead(t->grad, i, t->numel, n);
	if (arrays & ZX_NEED_EXP_AVG)
		zx_prefetch_ahead(t->exp_avg, i, t->numel, n);
	if (arrays & ZX_NEED_EXP_AVG_SQ)
		zx_prefetch_ahead(t->exp_avg_sq, i, t->numel, n);
	zx_prefetch_ahead(t->param, i, t->numel, n);
}

/* ---------------------------------------------------------------------------------------------------
 * The loops of the optimizer steps (Adam, Adagrad, Lion). A step is its arithmetic on one vector of
 * each of its arrays (a zx_math8_fn / zx_math16_fn); the loads, stores, prefetch, tail, bf16/fp16
 * copy and specialisation around it are the same for every step and live here, as Adam's
 * measurements chose them (cpu_adam.c): AVX-512 does one vector (a cache line of each array) per
 * iteration; AVX2 does blocks of ZX_BLOCK8 vectors with all loads first, as the compiler, not
 * knowing that the arrays do not alias, would not move a later vector's loads above an earlier
 * one's stores itself. Everything here is always inlined, the math included (GCC inlines a call
 * through a pointer that is a constant after inlining), so each step compiles into its own loops,
 * one per value of `spec` (up to two flags of the step's own, such as Adam's L2 mode) and of the
 * copy's dtype, with no test of either per vector. */

/* One vector of each array: param, grad, exp_avg, exp_avg_sq. The loops load only the arrays in
 * the step's `arrays` (ZX_NEED_*; param and grad always) and store them back, grad excepted. */
typedef struct zx_vec8 {
	__m256 p, g, m, v;
} zx_vec8;
typedef struct zx_vec16 {
	__m512 p, g, m, v;
} zx_vec16;

/* A step's arithmetic on x, in place. ctx: the step's own context (a local copy, so that no store
 * through the arrays can alias it and its broadcasts leave the loop); spec: a constant. */
typedef void (*zx_math8_fn)(const void *ctx, zx_vec8 *x, int spec);
typedef void (*zx_math16_fn)(const void *ctx, zx_vec16 *x, int spec);

/* Calls loop(args..., spec, odt) with spec (0..3) and odt (ZX_BF16, ZX_F16 or -1) as constants. */
#define ZX_WITH_ODT(loop, S, odt, ...)                                                              \
	((odt) == ZX_BF16  ? loop(__VA_ARGS__, S, ZX_BF16)                                          \
	 : (odt) == ZX_F16 ? loop(__VA_ARGS__, S, ZX_F16)                                           \
			   : loop(__VA_ARGS__, S, -1))
#define ZX_SPECIALISE(loop, spec, odt, ...)                                                         \
	((spec) == 3   ? ZX_WITH_ODT(loop, 3, odt, __VA_ARGS__)                                     \
	 : (spec) == 2 ? ZX_WITH_ODT(loop, 2, odt, __VA_ARGS__)                                     \
	 : (spec) == 1 ? ZX_WITH_ODT(loop, 1, odt, __VA_ARGS__)                                     \
		       : ZX_WITH_ODT(loop, 0, odt, __VA_ARGS__))

/* AVX2: 8 lanes. A full vector, or (tail) the lanes in mask. */
ZX_TARGET_AVX2 ZX_INLINE __m256 zx_load8(const float *a, const int tail, __m256i mask)
{
	return tail ? _mm256_maskload_ps(a, mask) : _mm256_loadu_ps(a);
}

ZX_TARGET_AVX2 ZX_INLINE void zx_save8(float *a, __m256 x, const int tail, __m256i mask)
{
	if (tail)
		_mm256_maskstore_ps(a, mask, x);
	else
		_mm256_storeu_ps(a, x);
}

#define ZX_BLOCK8 8 /* vectors of each array per block of the AVX2 loop */

/* A block of ZX_BLOCK8 vectors of 8 at offset i: every load, then the arithmetic, then the stores.
 * The array pointers are taken once per block: with each address computed from t, GCC scheduled
 * the loads differently and spilled them (Adam 10 % slower in cache). */
ZX_TARGET_AVX2 ZX_INLINE void zx_block8(const zx_optim_tensor *t, int64_t i, zx_math8_fn math,
					const void *ctx, const unsigned arrays, const int stream,
					const int spec, const int odt)
{
	const int use_m = arrays & ZX_NEED_EXP_AVG, use_v = arrays & ZX_NEED_EXP_AVG_SQ;
	float *pp = t->param + i, *mp = t->exp_avg + i, *vp = t->exp_avg_sq + i;
	const float *gp = t->grad + i;
	zx_vec8 x[ZX_BLOCK8];
	zx_prefetch(t, i, 8 * ZX_BLOCK8, arrays);
	for (int u = 0; u < ZX_BLOCK8; u++)
		x[u].g = _mm256_loadu_ps(gp + 8 * u);
	for (int u = 0; u < ZX_BLOCK8 && use_m; u++)
		x[u].m = _mm256_loadu_ps(mp + 8 * u);
	for (int u = 0; u < ZX_BLOCK8 && use_v; u++)
		x[u].v = _mm256_loadu_ps(vp + 8 * u);
	for (int u = 0; u < ZX_BLOCK8; u++)
		x[u].p = _mm256_loadu_ps(pp + 8 * u);
	for (int u = 0; u < ZX_BLOCK8; u++)
		math(ctx, &x[u], spec);
	for (int u = 0; u < ZX_BLOCK8; u++)
		_mm256_storeu_ps(pp + 8 * u, x[u].p);
	for (int u = 0; u < ZX_BLOCK8 && use_m; u++)
		_mm256_storeu_ps(mp + 8 * u, x[u].m);
	for (int u = 0; u < ZX_BLOCK8 && use_v; u++)
		_mm256_storeu_ps(vp + 8 * u, x[u].v);
	for (int u = 0; u < ZX_BLOCK8 && odt >= 0; u++)
		zx_store16x8((uint16_t *)t->out + i + 8 * u, zx_to16x8(x[u].p, odt), stream);
}

/* One vector of 8 at offset i; tail != 0: only the lanes in mask (the last r < 8 elements). */
ZX_TARGET_AVX2 ZX_INLINE void zx_vector8(const zx_optim_tensor *t, int64_t i, zx_math8_fn math,
					 const void *ctx, const unsigned arrays, const int stream,
					 const int spec, const int odt, const int tail, __m256i mask,
					 int64_t r)
{
	zx_vec8 x;
	x.p = zx_load8(t->param + i, tail, mask);
	x.g = zx_load8(t->grad + i, tail, mask);
	if (arrays & ZX_NEED_EXP_AVG)
		x.m = zx_load8(t->exp_avg + i, tail, mask);
	if (arrays & ZX_NEED_EXP_AVG_SQ)
		x.v = zx_load8(t->exp_avg_sq + i, tail, mask);
	math(ctx, &x, spec);
	zx_save8(t->param + i, x.p, tail, mask);
	if (arrays & ZX_NEED_EXP_AVG)
		zx_save8(t->exp_avg + i, x.m, tail, mask);
	if (arrays & ZX_NEED_EXP_AVG_SQ)
		zx_save8(t->exp_avg_sq + i, x.v, tail, mask);
	if (odt >= 0 && tail)
		zx_store16_tail((uint16_t *)t->out + i, zx_to16x8(x.p, odt), r);
	else if (odt >= 0)
		zx_store16x8((uint16_t *)t->out + i, zx_to16x8(x.p, odt), stream);
}

ZX_TARGET_AVX2 ZX_INLINE void zx_loop8(const zx_optim_tensor *t, int64_t b, int64_t e,
				       zx_math8_fn math, const void *ctx, const unsigned arrays,
				       const int stream, const int spec, const int odt)
{
	const __m256i all = _mm256_set1_epi32(-1);
	int64_t i = b;
	for (; i + 8 * ZX_BLOCK8 <= e; i += 8 * ZX_BLOCK8)
		zx_block8(t, i, math, ctx, arrays, stream, spec, odt);
	for (; i + 8 <= e; i += 8)
		zx_vector8(t, i, math, ctx, arrays, stream, spec, odt, 0, all, 8);
	if (i < e)
		zx_vector8(t, i, math, ctx, arrays, stream, spec, odt, 1, zx_tail_mask8(e - i), e - i);
	if (stream)
		_mm_sfence(); /* the copy is complete before the caller (or DMA) reads it */
}

/* A step's AVX2 span [b, e) of t: math over the arrays in `arrays`, the copy (of out_dtype) where
 * t->out is set, streamed where stream (the call's ZX_STREAM_MIN) and the span's alignment allow. */
ZX_TARGET_AVX2 ZX_INLINE void zx_span8(const zx_optim_tensor *t, int64_t b, int64_t e,
				       zx_math8_fn math, const void *ctx, const unsigned arrays,
				       int spec, int out_dtype, int stream)
{
	const int odt = t->out ? out_dtype : -1;
	stream = odt >= 0 && zx_stream_span(stream, t->out, b, 16);
	ZX_SPECIALISE(zx_loop8, spec, odt, t, b, e, math, ctx, arrays, stream);
}

/* AVX-512: 16 lanes, the tail through a mask. One vector of 16 at offset i, the lanes in mask. */
ZX_TARGET_AVX512 ZX_INLINE void zx_vector16(const zx_optim_tensor *t, int64_t i, zx_math16_fn math,
					    const void *ctx, const unsigned arrays, const int stream,
					    const int spec, const int odt, __mmask16 mask)
{
	zx_vec16 x;
	x.p = _mm512_maskz_loadu_ps(mask, t->param + i);
	x.g = _mm512_maskz_loadu_ps(mask, t->grad + i);
	if (arrays & ZX_NEED_EXP_AVG)
		x.m = _mm512_maskz_loadu_ps(mask, t->exp_avg + i);
	if (arrays & ZX_NEED_EXP_AVG_SQ)
		x.v = _mm512_maskz_loadu_ps(mask, t->exp_avg_sq + i);
	math(ctx, &x, spec);
	_mm512_mask_storeu_ps(t->param + i, mask, x.p);
	if (arrays & ZX_NEED_EXP_AVG)
		_mm512_mask_storeu_ps(t->exp_avg + i, mask, x.m);
	if (arrays & ZX_NEED_EXP_AVG_SQ)
		_mm512_mask_storeu_ps(t->exp_avg_sq + i, mask, x.v);
	if (odt >= 0)
		zx_store16x16((uint16_t *)t->out + i, zx_to16x16(x.p, odt), mask, stream);
}

ZX_TARGET_AVX512 ZX_INLINE void zx_loop16(const zx_optim_tensor *t, int64_t b, int64_t e,
					  zx_math16_fn math, const void *ctx, const unsigned arrays,
					  const int stream, const int spec, const int odt)
{
	int64_t i = b;
	for (; i + 16 <= e; i += 16) { /* a vector is a cache line of each array */
		zx_prefetch(t, i, 16, arrays);
		zx_vector16(t, i, math, ctx, arrays, stream, spec, odt, 0xffff);
	}
	if (i < e)
		zx_vector16(t, i, math, ctx, arrays, stream, spec, odt, zx_tail_mask16(e - i));
	if (stream)
		_mm_sfence(); /* the copy is complete before the caller (or DMA) reads it */
}

/* zx_span8 for AVX-512. */
ZX_TARGET_AVX512 ZX_INLINE void zx_span16(const zx_optim_tensor *t, int64_t b, int64_t e,
					  zx_math16_fn math, const void *ctx, const unsigned arrays,
					  int spec, int out_dtype, int stream)
{
	const int odt = t->out ? out_dtype : -1;
	stream = odt >= 0 && zx_stream_span(stream, t->out, b, 32);
	ZX_SPECIALISE(zx_loop16, spec, odt, t, b, e, math, ctx, arrays, stream);
}
#endif /* ZX_HAVE_X86 */

#endif /* ZX_CPU_OPTIM_H */
