/* comm_reduce.c - the reduction kernels of the collectives (see comm.h for the order they follow).
 *
 * Element by element, so the AVX-512 and AVX2 paths give the scalar reference's bits: the same
 * additions in the same order, one multiply by the scale, one rounding (the conversions of
 * convert.h, which the optimizers already prove equal to torch's). Vector tails go through the
 * scalar code, which computes the same thing.
 */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "comm.h"
#include "convert.h"

static inline float combine_f(float acc, float x, int redop)
{
	switch (redop) {
	case ZX_REDOP_MAX:
		return x != x ? x : (x > acc ? x : acc);
	case ZX_REDOP_MIN:
		return x != x ? x : (x < acc ? x : acc);
	default:
		return acc + x;
	}
}

/* The reference for fp32 / fp16 / bf16, and the vector paths' tail. */
static void reduce_float_scalar(int dtype, int redop, float scale, const void *const *srcs, int n,
				void *dst, void *dst2, int64_t b, int64_t e)
{
	for (int64_t i = b; i < e; i++) {
		float acc = zx_load_f32(srcs[0], i, dtype);
		for (int k = 1; k < n; k++)
			acc = combine_f(acc, zx_load_f32(srcs[k], i, dtype), redop);
		if (scale != 1.0f)
			acc *= scale;
		if (dtype == ZX_F32) {
			((float *)dst)[i] = acc;
			if (dst2)
				((float *)dst2)[i] = acc;
		} else {
			zx_store16_scalar(dst, i, acc, dtype);
			if (dst2)
				zx_store16_scalar(dst2, i, acc, dtype);
		}
	}
}

#if ZX_HAVE_X86
ZX_TARGET_AVX2 static inline __m256 combine8(__m256 acc, __m256 x, int redop)
{
	if (redop == ZX_REDOP_SUM || redop == ZX_REDOP_AVG)
		return _mm256_add_ps(acc, x);
	/* MAXPS / MINPS return their second operand when either is NaN: acc stays NaN, x's NaN is
	 * put back by the blend (the scalar combine_f, lane by lane) */
	__m256 m = redop == ZX_REDOP_MAX ? _mm256_max_ps(x, acc) : _mm256_min_ps(x, acc);
	return _mm256_blendv_ps(m, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

ZX_TARGET_AVX2 static void reduce_float_avx2(int dtype, int redop, float scale, const void *const *srcs,
					      int n, void *dst, void *dst2, int64_t b, int64_t e)
{
	const __m256 s = _mm256_set1_ps(scale);
	int64_t i = b;
	for (; i + 8 <= e; i += 8) {
		__m256 acc = zx_load8_f32(srcs[0], i, dtype);
		for (int k = 1; k < n; k++)
			acc = combine8(acc, zx_load8_f32(srcs[k], i, dtype), redop);
		if (scale != 1.0f)
			acc = _mm256_mul_ps(acc, s);
		if (dtype == ZX_F32) {
			_mm256_storeu_ps((float *)dst + i, acc);
			if (dst2)
				_mm256_storeu_ps((float *)dst2 + i, acc);
		} else {
			__m128i h = zx_to16x8(acc, dtype);
			_mm_storeu_si128((__m128i *)((uint16_t *)dst + i), h);
			if (dst2)
				_mm_storeu_si128((__m128i *)((uint16_t *)dst2 + i), h);
		}
	}
	reduce_float_scalar(dtype, redop, scale, srcs, n, dst, dst2, i, e);
}

ZX_TARGET_AVX512 static inline __m512 combine16(__m512 acc, __m512 x, int redop)
{
	if (redop == ZX_REDOP_SUM || redop == ZX_REDOP_AVG)
		return _mm512_add_ps(acc, x);
	__m512 m = redop == ZX_REDOP_MAX ? _mm512_max_ps(x, acc) : _mm512_min_ps(x, acc);
	return _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

ZX_TARGET_AVX512 static void reduce_float_avx512(int dtype, int redop, float scale,
						  const void *const *srcs, int n, void *dst, void *dst2,
						  int64_t b, int64_t e)
{
	const __m512 s = _mm512_set1_ps(scale);
	int64_t i = b;
	for (; i + 16 <= e; i += 16) {
		__m512 acc = zx_load16_f32(srcs[0], i, dtype, 0xffff);
		for (int k = 1; k < n; k++)
			acc = combine16(acc, zx_load16_f32(srcs[k], i, dtype, 0xffff), redop);
		if (scale != 1.0f)
			acc = _mm512_mul_ps(acc, s);
		if (dtype == ZX_F32) {
			_mm512_storeu_ps((float *)dst + i, acc);
			if (dst2)
				_mm512_storeu_ps((float *)dst2 + i, acc);
		} else {
			__m256i h = zx_to16x16(acc, dtype);
			_mm256_storeu_si256((__m256i *)((uint16_t *)dst + i), h);
			if (dst2)
				_mm256_storeu_si256((__m256i *)((uint16_t *)dst2 + i), h);
		}
	}
	reduce_float_scalar(dtype, redop, scale, srcs, n, dst, dst2, i, e);
}
#endif

/* fp64 and the integer types: rare (counters, flags), scalar only. */
#define REDUCE_PLAIN(T, name, NANCHECK)                                                             \
	static void name(int redop, double scale, const void *const *srcs, int n, void *dst,        \
			 void *dst2, int64_t count)                                                 \
	{                                                                                           \
		for (int64_t i = 0; i < count; i++) {                                               \
			T acc = ((const T *)srcs[0])[i];                                            \
			for (int k = 1; k < n; k++) {                                               \
				T x = ((const T *)srcs[k])[i];                                      \
				if (redop == ZX_REDOP_MAX)                                          \
					acc = NANCHECK(x) ? x : (x > acc ? x : acc);                \
				else if (redop == ZX_REDOP_MIN)                                     \
					acc = NANCHECK(x) ? x : (x < acc ? x : acc);                \
				else                                                                \
					acc = (T)(acc + x);                                         \
			}                                                                           \
			if (scale != 1.0)                                                           \
				acc = (T)(acc * scale);                                             \
			((T *)dst)[i] = acc;                                                        \
			if (dst2)                                                                   \
				((T *)dst2)[i] = acc;                                               \
		}                                                                                   \
	}
#define IS_NAN(x) ((x) != (x))
#define NEVER(x) 0
REDUCE_PLAIN(double, reduce_f64, IS_NAN)
REDUCE_PLAIN(int32_t, reduce_i32, NEVER)
REDUCE_PLAIN(int64_t, reduce_i64, NEVER)
REDUCE_PLAIN(uint8_t, reduce_u8, NEVER)

int zx_comm_reduce_kernel(int dtype, int redop, double scale, const void *const *srcs, int n, void *dst,
			  int64_t count, int isa)
{
	return zx_comm_reduce_kernel2(dtype, redop, scale, srcs, n, dst, NULL, count, isa);
}

int zx_comm_reduce_kernel2(int dtype, int redop, double scale, const void *const *srcs, int n, void *dst,
			   void *dst2, int64_t count, int isa)
{
	if (n < 1 || count < 0 || redop < ZX_REDOP_SUM || redop > ZX_REDOP_MIN || !isfinite(scale))
		return -EINVAL;
	int floating = dtype == ZX_F32 || dtype == ZX_F16 || dtype == ZX_BF16 || dtype == ZX_F64;
	if (!floating && (redop == ZX_REDOP_AVG || scale != 1.0))
		return -EINVAL;
	if (redop == ZX_REDOP_AVG)
		scale /= n;
	switch (dtype) {
	case ZX_F64:
		reduce_f64(redop, scale, srcs, n, dst, dst2, count);
		return 0;
	case ZX_I32:
		reduce_i32(redop, scale, srcs, n, dst, dst2, count);
		return 0;
	case ZX_I64:
		reduce_i64(redop, scale, srcs, n, dst, dst2, count);
		return 0;
	case ZX_U8:
		reduce_u8(redop, scale, srcs, n, dst, dst2, count);
		return 0;
	case ZX_F32:
	case ZX_F16:
	case ZX_BF16:
		break;
	default:
		return -EINVAL;
	}
	int level = isa < 0 ? (int)zx_simd_level() : isa;
	if (level > (int)zx_simd_supported())
		return -EINVAL;
	float s = (float)scale;
#if ZX_HAVE_X86
	if (level == ZX_SIMD_AVX512) {
		reduce_float_avx512(dtype, redop, s, srcs, n, dst, dst2, 0, count);
		return 0;
	}
	if (level == ZX_SIMD_AVX2) {
		reduce_float_avx2(dtype, redop, s, srcs, n, dst, dst2, 0, count);
		return 0;
	}
#endif
	reduce_float_scalar(dtype, redop, s, srcs, n, dst, dst2, 0, count);
	return 0;
}
