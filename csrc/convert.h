/* convert.h - fp32 <-> bf16 / fp16 for every kernel of the C core (optimizers, collectives'
 * reductions, quantization), scalar, AVX2 and AVX-512. Each direction has one definition here, so
 * that all paths give torch's bits: 16 -> 32 is exact; 32 -> 16 rounds to nearest even, keeps
 * subnormals, and writes NaN as torch does.
 */
#ifndef ZX_CONVERT_H
#define ZX_CONVERT_H

#include <stdint.h>
#include <string.h>

#include "cpu_features.h"
#include "dtype.h"

#if ZX_HAVE_X86
#include <immintrin.h>
#endif

/* ---------------------------------------------------------------------------------------------------
 * bf16 / fp16 -> fp32, scalar: exact. */

static inline float zx_f32_from_bits(uint32_t u)
{
	float f;
	memcpy(&f, &u, sizeof(f));
	return f;
}

static inline float zx_f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
	if (e == 0x1f) /* inf, NaN (payload kept, as F16C's VCVTPH2PS) */
		return zx_f32_from_bits(sign | 0x7f800000u | (m << 13));
	if (e)
		return zx_f32_from_bits(sign | ((e + 112) << 23) | (m << 13));
	if (!m)
		return zx_f32_from_bits(sign);
	int sh = 0; /* subnormal: normalise */
	while (!(m & 0x400u)) {
		m <<= 1;
		sh++;
	}
	return zx_f32_from_bits(sign | ((uint32_t)(113 - sh) << 23) | ((m & 0x3ffu) << 13));
}

/* Element i of a buffer of dtype ZX_F32, ZX_BF16 or ZX_F16, as fp32. */
static inline float zx_load_f32(const void *src, int64_t i, int dtype)
{
	if (dtype == ZX_F32)
		return ((const float *)src)[i];
	uint16_t h = ((const uint16_t *)src)[i];
	return dtype == ZX_BF16 ? zx_f32_from_bits((uint32_t)h << 16) : zx_f16_to_f32(h);
}

/* ---------------------------------------------------------------------------------------------------
 * fp32 -> bf16 / fp16, scalar. Round to nearest even in integer arithmetic: subnormals stay,
 * overflow goes to infinity. */

static inline uint32_t zx_f32_bits(float x)
{
	uint32_t u;
	memcpy(&u, &x, sizeof(u));
	return u;
}

static inline uint16_t zx_bf16_scalar(float x)
{
	uint32_t u = zx_f32_bits(x);
	if ((u & 0x7fffffffu) > 0x7f800000u)
		return 0xffff; /* NaN, as torch's vectorised cast writes it */
	return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline uint16_t zx_f16_scalar(float x)
{
	uint32_t u = zx_f32_bits(x);
	uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
	uint32_t a = u & 0x7fffffffu;
	if (a > 0x7f800000u) /* NaN: quiet, sign and top payload bits kept (F16C) */
		return sign | 0x7e00u | (uint16_t)((a >> 13) & 0x3ffu);
	if (a >= 0x477ff000u) /* >= 65520 rounds to infinity; infinity stays */
		return sign | 0x7c00u;
	if (a >= 0x38800000u) { /* normal in fp16: rebias the exponent by 127 - 15, round 13 bits */
		uint32_t r = a - 0x38000000u;
		r += 0xfffu + ((r >> 13) & 1u);
		return sign | (uint16_t)(r >> 13);
	}
	uint32_t e = a >> 23;
	if (e < 102) /* below 2^-25: rounds to zero */
		return sign;
	/* subnormal in fp16: units of 2^-24, i.e. the 24-bit significand shifted right by 126 - e */
	uint32_t mant = (a & 0x7fffffu) | 0x800000u;
	uint32_t shift = 126 - e; /* 14..24 */
	uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
	if (rem > half || (rem == half && (q & 1u)))
		q++;
	return sign | (uint16_t)q;
}

static inline void zx_store16_scalar(void *out, int64_t i, float x, int dtype)
{
	((uint16_t *)out)[i] = dtype == ZX_BF16 ? zx_bf16_scalar(x) : zx_f16_scalar(x);
}

#if ZX_HAVE_X86
/* ---------------------------------------------------------------------------------------------------
 * AVX2: 8 lanes. Same integer rounding; fp16 through F16C, whose results the scalar code copies. */

ZX_TARGET_AVX2 static inline __m128i zx_bf16x8(__m256 x)
{
	__m256i u = _mm256_castps_si256(x);
	__m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
	__m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
	r = _mm256_srli_epi32(r, 16);
	__m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
	r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xffff), _mm256_castps_si256(nan));
	/* 32 -> 16 bits: packus works per 128-bit lane, so gather the two halves after it */
	r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
	return _mm256_castsi256_si128(r);
}

ZX_TARGET_AVX2 static inline __m128i zx_to16x8(__m256 x, int dtype)
{
	return dtype == ZX_BF16 ? zx_bf16x8(x) : _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
}

/* Lanes [0, r) set, for maskload/maskstore of a tail of r < 8 elements. */
ZX_TARGET_AVX2 static inline __m256i zx_tail_mask8(int64_t r)
{
	return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)r), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Elements i..i+7 of a buffer of dtype ZX_F32, ZX_BF16 or ZX_F16, as fp32. */
ZX_TARGET_AVX2 static inline __m256 zx_load8_f32(const void *src, int64_t i, int dtype)
{
	if (dtype == ZX_F32)
		return _mm256_loadu_ps((const float *)src + i);
	__m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)src + i));
	if (dtype == ZX_F16)
		return _mm256_cvtph_ps(h);
	return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* ---------------------------------------------------------------------------------------------------
 * AVX-512: 16 lanes, tails through masks. Not VCVTNEPS2BF16 (AVX512-BF16): it flushes subnormal
 * inputs to zero and writes NaN differently from torch. */

ZX_TARGET_AVX512 static inline __m256i zx_bf16x16(__m512 x)
{
	__m512i u = _mm512_castps_si512(x);
	__m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
	__m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
	r = _mm512_srli_epi32(r, 16);
	__mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
	r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xffff));
	return _mm512_cvtepi32_epi16(r);
}

ZX_TARGET_AVX512 static inline __m256i zx_to16x16(__m512 x, int dtype)
{
	return dtype == ZX_BF16 ? zx_bf16x16(x)
				: _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

ZX_TARGET_AVX512 static inline __mmask16 zx_tail_mask16(int64_t r)
{
	return (__mmask16)((1u << r) - 1u);
}

/* The lanes of mask k of elements i..i+15 of a buffer of dtype ZX_F32, ZX_BF16 or ZX_F16, as fp32
 * (the others 0). */
ZX_TARGET_AVX512 static inline __m512 zx_load16_f32(const void *src, int64_t i, int dtype, __mmask16 k)
{
	if (dtype == ZX_F32)
		return _mm512_maskz_loadu_ps(k, (const float *)src + i);
	__m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)src + i);
	if (dtype == ZX_F16)
		return _mm512_cvtph_ps(h);
	return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif /* ZX_HAVE_X86 */

#endif /* ZX_CONVERT_H */
