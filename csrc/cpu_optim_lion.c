/* cpu_optim_lion.c - Lion on fp32 master state: scalar reference, AVX2 and AVX-512 paths.
 *
 * Owns: Lion's per-element arithmetic. Does not own: tiling and threads (cpu_optim.c), state or
 * step counting (zero_ext/ops/lion.py). torch has no Lion; this is the published algorithm written
 * with torch's operations (the test's reference is that torch code):
 *   g = g * grad_scale;  p = p * (1 - lr*wd)                          (param.mul_)
 *   c = lerp(m, g, 1-b1);  p = fma(-lr, sign(c), p)                   (param.add_(c.sign(), -lr))
 *   m = lerp(m, g, 1-b2)                                              (exp_avg.lerp_)
 * sign is torch.sign: +0 for zeros and NaN. DeepSpeed's CPU Lion uses copysign instead, which
 * moves a parameter by lr even where m and g are both 0 (a row no batch has touched).
 */
#include <errno.h>
#include <math.h>

#include "cpu_optim.h"

/* A torch lerp(start, end, weight) with its fp32 weight split as torch splits it. */
struct lerp_coef {
	float w;     /* weight, or weight - 1 */
	int from_end; /* |weight| >= 0.5: fma(weight - 1, end - start, end) */
};

static struct lerp_coef lerp_coef(double weight)
{
	float w = (float)weight;
	struct lerp_coef k = { .w = w, .from_end = fabsf(w) >= 0.5f };
	if (k.from_end)
		k.w = w - 1.0f;
	return k;
}

struct lion_ctx {
	float grad_scale, decay, neg_lr;
	struct lerp_coef c1, c2; /* weights 1-b1 (the update), 1-b2 (the momentum) */
	int out_dtype;
	int stream; /* a large call: the copy goes out with non-temporal stores */
};

static void lion_span_scalar(const void *ctx, const zx_optim_tensor *t, int64_t b, int64_t e,
			     double *acc)
{
	const struct lion_ctx *c = ctx;
	float *P = t->param, *M = t->exp_avg;
	for (int64_t i = b; i < e; i++) {
		float p = P[i] * c->decay, g = t->grad[i] * c->grad_scale, m = M[i];
		float u = zx_fmaf(c->c1.w, g - m, c->c1.from_end ? g : m);
		float s = u > 0.0f ? 1.0f : u < 0.0f ? -1.0f : 0.0f;
		p = zx_fmaf(c->neg_lr, s, p);
		m = zx_fmaf(c->c2.w, g - m, c->c2.from_end ? g : m);
		P[i] = p;
		M[i] = m;
		if (t->out)
			zx_store16_scalar(t->out, i, p, c->out_dtype);
	}
}

#if ZX_HAVE_X86
#define ZX_INLINE static inline __attribute__((always_inline))

ZX_TARGET_AVX2 ZX_INLINE __m256 lerp8(__m256 start, __m256 end, struct lerp_coef k)
{
	__m256 base = k.from_end ? end : start;
	return _mm256_fmadd_ps(_mm256_set1_ps(k.w), _mm256_sub_ps(end, start), base);
}

ZX_TARGET_AVX2 ZX_INLINE void lion8(const struct lion_ctx *c, const zx_optim_tensor *t, int64_t i,
				    const int odt, const int stream, const int tail, __m256i mask,
				    int64_t r)
{
	float *pp = t->param + i, *mp = t->exp_avg + i;
	__m256 p, g, m;
	if (tail) {
		p = _mm256_maskload_ps(pp, mask);
		g = _mm256_maskload_ps(t->grad + i, mask);
		m = _mm256_maskload_ps(mp, mask);
	} else {
		p = _mm256_loadu_ps(pp);
		g = _mm256_loadu_ps(t->grad + i);
		m = _mm256_loadu_ps(mp);
	}
	p = _mm256_mul_ps(p, _mm256_set1_ps(c->decay));
	g = _mm256_mul_ps(g, _mm256_set1_ps(c->grad_scale));
	__m256 u = lerp8(m, g, c->c1), z = _mm256_setzero_ps();
	__m256 s = _mm256_or_ps(_mm256_and_ps(_mm256_cmp_ps(u, z, _CMP_GT_OQ), _mm256_set1_ps(1.0f)),
				_mm256_and_ps(_mm256_cmp_ps(u, z, _CMP_LT_OQ), _mm256_set1_ps(-1.0f)));
	p = _mm256_fmadd_ps(_mm256_set1_ps(c->neg_lr), s, p);
	m = lerp8(m, g, c->c2);
	if (tail) {
		_mm256_maskstore_ps(pp, mask, p);
		_mm256_maskstore_ps(mp, mask, m);
		if (odt >= 0)
			zx_store16_tail((uint16_t *)t->out + i, zx_to16x8(p, odt), r);
	} else {
		_mm256_storeu_ps(pp, p);
		_mm256_storeu_ps(mp, m);
		if (odt >= 0)
			zx_store16x8((uint16_t *)t->out + i, zx_to16x8(p, odt), stream);
	}
}

ZX_TARGET_AVX2 ZX_INLINE void lion_loop_avx2(const struct lion_ctx *c, const zx_optim_tensor *t,
					     int64_t b, int64_t e, const int odt)
{
	const __m256i all = _mm256_set1_epi32(-1);
	const int stream = odt >= 0 && zx_stream_span(c->stream, t->out, b, 16);
	int64_t i = b;
	for (; i + 32 <= e; i += 32) {
		zx_prefetch_ahead(t->param, i, t->numel, 32);
		zx_prefetch_ahead(t->grad, i, t->numel, 32);
		zx_prefetch_ahead(t->exp_avg, i, t->numel, 32);
		lion8(c, t, i, odt, stream, 0, all, 8);
		lion8(c, t, i + 8, odt, stream, 0, all, 8);
		lion8(c, t, i + 16, odt, stream, 0, all, 8);
		lion8(c, t, i + 24, odt, stream, 0, all, 8);
	}
	for (; i + 8 <= e; i += 8)
		lion8(c, t, i, odt, stream, 0, all, 8);
	if (i < e)
		lion8(c, t, i, odt, stream, 1, zx_tail_mask8(e - i), e - i);
	if (stream)
		_mm_sfence();
}

ZX_TARGET_AVX2 static void lion_span_avx2(const void *ctx, const zx_optim_tensor *t, int64_t b,
					  int64_t e, double *acc)
{
	const struct lion_ctx *c = ctx;
	int odt = t->out ? c->out_dtype : -1;
	if (odt == ZX_BF16)
		lion_loop_avx2(c, t, b, e, ZX_BF16);
	else if (odt == ZX_F16)
		lion_loop_avx2(c, t, b, e, ZX_F16);
	else
		lion_loop_avx2(c, t, b, e, -1);
}

ZX_TARGET_AVX512 ZX_INLINE __m512 lerp16(__m512 start, __m512 end, struct lerp_coef k)
{
	__m512 base = k.from_end ? end : start;
	return _mm512_fmadd_ps(_mm512_set1_ps(k.w), _mm512_sub_ps(end, start), base);
}

ZX_TARGET_AVX512 ZX_INLINE void lion16(const struct lion_ctx *c, const zx_optim_tensor *t,
				       int64_t i, const int odt, const int stream, __mmask16 mask)
{
	float *pp = t->param + i, *mp = t->exp_avg + i;
	__m512 p = _mm512_maskz_loadu_ps(mask, pp);
	__m512 g = _mm512_maskz_loadu_ps(mask, t->grad + i);
	__m512 m = _mm512_maskz_loadu_ps(mask, mp);
	p = _mm512_mul_ps(p, _mm512_set1_ps(c->decay));
	g = _mm512_mul_ps(g, _mm512_set1_ps(c->grad_scale));
	__m512 u = lerp16(m, g, c->c1), z = _mm512_setzero_ps();
	__m512 s = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(u, z, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
	s = _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(u, z, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
	p = _mm512_fmadd_ps(_mm512_set1_ps(c->neg_lr), s, p);
	m = lerp16(m, g, c->c2);
	_mm512_mask_storeu_ps(pp, mask, p);
	_mm512_mask_storeu_ps(mp, mask, m);
	if (odt >= 0)
		zx_store16x16((uint16_t *)t->out + i, zx_to16x16(p, odt), mask, stream);
}

ZX_TARGET_AVX512 ZX_INLINE void lion_loop_avx512(const struct lion_ctx *c,
						 const zx_optim_tensor *t, int64_t b, int64_t e,
						 const int odt)
{
	const int stream = odt >= 0 && zx_stream_span(c->stream, t->out, b, 32);
	int64_t i = b;
	for (; i + 64 <= e; i += 64) {
		zx_prefetch_ahead(t->param, i, t->numel, 64);
		zx_prefetch_ahead(t->grad, i, t->numel, 64);
		zx_prefetch_ahead(t->exp_avg, i, t->numel, 64);
		lion16(c, t, i, odt, stream, 0xffff);
		lion16(c, t, i + 16, odt, stream, 0xffff);
		lion16(c, t, i + 32, odt, stream, 0xffff);
		lion16(c, t, i + 48, odt, stream, 0xffff);
	}
	for (; i < e; i += 16)
		lion16(c, t, i, odt, stream, e - i >= 16 ? (__mmask16)0xffff : zx_tail_mask16(e - i));
	if (stream)
		_mm_sfence();
}

ZX_TARGET_AVX512 static void lion_span_avx512(const void *ctx, const zx_optim_tensor *t,
					      int64_t b, int64_t e, double *acc)
{
	const struct lion_ctx *c = ctx;
	int odt = t->out ? c->out_dtype : -1;
	if (odt == ZX_BF16)
		lion_loop_avx512(c, t, b, e, ZX_BF16);
	else if (odt == ZX_F16)
		lion_loop_avx512(c, t, b, e, ZX_F16);
	else
		lion_loop_avx512(c, t, b, e, -1);
}
#endif /* ZX_HAVE_X86 */

int zx_lion_step(const zx_lion_config *cfg, const zx_optim_tensor *t, int64_t ntensors,
		 int out_dtype, int isa)
{
	int level = zx_optim_isa(isa);
	if (level < 0)
		return level;
	if (!cfg)
		return -EINVAL;
	int rc = zx_optim_check(t, ntensors, ZX_NEED_PARAM | ZX_NEED_GRAD | ZX_NEED_EXP_AVG,
				out_dtype);
	if (rc)
		return rc;
	struct lion_ctx c = {
		.grad_scale = (float)cfg->grad_scale,
		.decay = (float)(1.0 - cfg->lr * cfg->weight_decay),
		.neg_lr = (float)-cfg->lr,
		.c1 = lerp_coef(1.0 - cfg->beta1),
		.c2 = lerp_coef(1.0 - cfg->beta2),
		.out_dtype = out_dtype,
		.stream = zx_optim_numel(t, ntensors) >= ZX_STREAM_MIN,
	};
	zx_span_fn fn = lion_span_scalar;
#if ZX_HAVE_X86
	if (level == ZX_SIMD_AVX512)
		fn = lion_span_avx512;
	else if (level == ZX_SIMD_AVX2)
		fn = lion_span_avx2;
#endif
	return zx_optim_run(t, ntensors, fn, &c, NULL);
}
