/* membw.c - the memory-bandwidth floor kernel (see membw.h). Owns nothing else: it reuses the
 * optimizers' driver (cpu_optim.c) so that tiles, threads and stores (non-temporal for the 2-byte
 * copy of large calls, as theirs) match the kernels measured against it, and does one add per
 * array so that the loop stays bound by memory, not arithmetic. It prefetches as the Adam kernels
 * do (1-7 % faster than without: a floor must be the fastest trivial loop; blocks of loads as in
 * the AVX2 Adam loop made it slower).
 */
#include <errno.h>

#include "cpu_optim.h"
#include "membw.h"

static void membw_span_scalar(const void *ctx, const zx_optim_tensor *t, int64_t b, int64_t e,
			      double *acc)
{
	for (int64_t i = b; i < e; i++) {
		float g = t->grad[i], p = t->param[i] + g;
		t->param[i] = p;
		t->exp_avg[i] += g;
		t->exp_avg_sq[i] += g;
		if (t->out)
			((uint16_t *)t->out)[i] = (uint16_t)(zx_f32_bits(p) >> 16);
	}
}

#if ZX_HAVE_X86
ZX_TARGET_AVX2 static inline void membw8(const zx_optim_tensor *t, int64_t i, uint16_t *o, int stream)
{
	__m256 g = _mm256_loadu_ps(t->grad + i);
	__m256 p = _mm256_add_ps(_mm256_loadu_ps(t->param + i), g);
	_mm256_storeu_ps(t->param + i, p);
	_mm256_storeu_ps(t->exp_avg + i, _mm256_add_ps(_mm256_loadu_ps(t->exp_avg + i), g));
	_mm256_storeu_ps(t->exp_avg_sq + i, _mm256_add_ps(_mm256_loadu_ps(t->exp_avg_sq + i), g));
	if (o) {
		__m256i h = _mm256_srli_epi32(_mm256_castps_si256(p), 16);
		h = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xd8);
		zx_store16x8(o + i, _mm256_castsi256_si128(h), stream);
	}
}

ZX_TARGET_AVX2 static void membw_span_avx2(const void *ctx, const zx_optim_tensor *t, int64_t b,
					   int64_t e, double *acc)
{
	uint16_t *o = t->out;
	const int stream = zx_stream_span(*(const int *)ctx, o, b, 16);
	int64_t i = b;
	for (; i + 16 <= e; i += 16) { /* a line of each array per iteration */
		zx_prefetch(t, i, 16, ZX_NEED_ALL);
		membw8(t, i, o, stream);
		membw8(t, i + 8, o, stream);
	}
	for (; i + 8 <= e; i += 8)
		membw8(t, i, o, stream);
	if (stream)
		_mm_sfence();
	membw_span_scalar(ctx, t, i, e, acc);
}

ZX_TARGET_AVX512 static void membw_span_avx512(const void *ctx, const zx_optim_tensor *t,
					       int64_t b, int64_t e, double *acc)
{
	uint16_t *o = t->out;
	const int stream = zx_stream_span(*(const int *)ctx, o, b, 32);
	for (int64_t i = b; i < e; i += 16) {
		__mmask16 k = e - i >= 16 ? (__mmask16)0xffff : zx_tail_mask16(e - i);
		zx_prefetch(t, i, 16, ZX_NEED_ALL);
		__m512 g = _mm512_maskz_loadu_ps(k, t->grad + i);
		__m512 p = _mm512_add_ps(_mm512_maskz_loadu_ps(k, t->param + i), g);
		__m512 m = _mm512_add_ps(_mm512_maskz_loadu_ps(k, t->exp_avg + i), g);
		__m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(k, t->exp_avg_sq + i), g);
		_mm512_mask_storeu_ps(t->param + i, k, p);
		_mm512_mask_storeu_ps(t->exp_avg + i, k, m);
		_mm512_mask_storeu_ps(t->exp_avg_sq + i, k, v);
		if (o) {
			__m512i top = _mm512_srli_epi32(_mm512_castps_si512(p), 16);
			zx_store16x16(o + i, _mm512_cvtepi32_epi16(top), k, stream);
		}
	}
	if (stream)
		_mm_sfence();
}
#endif

int zx_membw_adam(const zx_optim_tensor *t, int64_t ntensors, int out_dtype, int isa)
{
	int rc = zx_optim_check(t, ntensors,
				ZX_NEED_PARAM | ZX_NEED_GRAD | ZX_NEED_EXP_AVG | ZX_NEED_EXP_AVG_SQ,
				out_dtype);
	if (rc)
		return rc;
	static const zx_spans spans = ZX_SPANS(membw_span);
	int stream = zx_optim_numel(t, ntensors) >= ZX_STREAM_MIN; /* the span's ctx */
	return zx_optim_run_isa(t, ntensors, &spans, isa, &stream, NULL);
}
