/* cpu_optim_adagrad.c - Adagrad on fp32 master state: scalar reference, AVX2 and AVX-512 paths.
 *
 * Owns: Adagrad's per-element arithmetic. Does not own: tiling and threads (cpu_optim.c), state or
 * step counting (zero_ext/ops/adagrad.py). It is torch.optim.Adagrad with lr_decay = 0 and
 * initial_accumulator_value = 0 (DeepSpeed's CPU Adagrad computes the same), one rounding per torch
 * operation and FMA where torch's vectorised kernels use it:
 *   g = g * grad_scale;  g = fma(wd, p, g) if wd;  s = fma(g, g, s)      (addcmul_ with value 1)
 *   p = p + (-lr * g) / (sqrt(s) + eps)                                  (addcdiv_, value -lr)
 */
#include <errno.h>
#include <math.h>

#include "cpu_optim.h"

struct adagrad_ctx {
	float grad_scale, wd, eps, neg_lr;
	int l2, out_dtype;
	int stream; /* a large call: the copy goes out with non-temporal stores */
};

static void adagrad_span_scalar(const void *ctx, const zx_optim_tensor *t, int64_t b, int64_t e,
				double *acc)
{
	const struct adagrad_ctx *c = ctx;
	float *P = t->param, *S = t->exp_avg_sq;
	for (int64_t i = b; i < e; i++) {
		float p = P[i], g = t->grad[i] * c->grad_scale, s = S[i];
		if (c->l2)
			g = zx_fmaf(c->wd, p, g);
		s = zx_fmaf(g, g, s);
		p = p + (c->neg_lr * g) / (sqrtf(s) + c->eps);
		P[i] = p;
		S[i] = s;
		if (t->out)
			zx_store16_scalar(t->out, i, p, c->out_dtype);
	}
}

#if ZX_HAVE_X86
#define ZX_INLINE static inline __attribute__((always_inline))

ZX_TARGET_AVX2 ZX_INLINE void adagrad8(const struct adagrad_ctx *c, const zx_optim_tensor *t,
				       int64_t i, const int odt, const int stream, const int tail, __m256i mask,
				       int64_t r)
{
	float *pp = t->param + i, *sp = t->exp_avg_sq + i;
	__m256 p, g, s;
	if (tail) {
		p = _mm256_maskload_ps(pp, mask);
		g = _mm256_maskload_ps(t->grad + i, mask);
		s = _mm256_maskload_ps(sp, mask);
	} else {
		p = _mm256_loadu_ps(pp);
		g = _mm256_loadu_ps(t->grad + i);
		s = _mm256_loadu_ps(sp);
	}
	g = _mm256_mul_ps(g, _mm256_set1_ps(c->grad_scale));
	if (c->l2)
		g = _mm256_fmadd_ps(_mm256_set1_ps(c->wd), p, g);
	s = _mm256_fmadd_ps(g, g, s);
	__m256 d = _mm256_add_ps(_mm256_sqrt_ps(s), _mm256_set1_ps(c->eps));
	p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c->neg_lr), g), d));
	if (tail) {
		_mm256_maskstore_ps(pp, mask, p);
		_mm256_maskstore_ps(sp, mask, s);
		if (odt >= 0)
			zx_store16_tail((uint16_t *)t->out + i, zx_to16x8(p, odt), r);
	} else {
		_mm256_storeu_ps(pp, p);
		_mm256_storeu_ps(sp, s);
		if (odt >= 0)
			zx_store16x8((uint16_t *)t->out + i, zx_to16x8(p, odt), stream);
	}
}

ZX_TARGET_AVX2 ZX_INLINE void adagrad_loop_avx2(const struct adagrad_ctx *c,
						const zx_optim_tensor *t, int64_t b, int64_t e,
						const int odt)
{
	const __m256i all = _mm256_set1_epi32(-1);
	const int stream = odt >= 0 && zx_stream_span(c->stream, t->out, b, 16);
	int64_t i = b;
	for (; i + 32 <= e; i += 32) {
		zx_prefetch_ahead(t->param, i, t->numel, 32);
		zx_prefetch_ahead(t->grad, i, t->numel, 32);
		zx_prefetch_ahead(t->exp_avg_sq, i, t->numel, 32);
		adagrad8(c, t, i, odt, stream, 0, all, 8);
		adagrad8(c, t, i + 8, odt, stream, 0, all, 8);
		adagrad8(c, t, i + 16, odt, stream, 0, all, 8);
		adagrad8(c, t, i + 24, odt, stream, 0, all, 8);
	}
	for (; i + 8 <= e; i += 8)
		adagrad8(c, t, i, odt, stream, 0, all, 8);
	if (i < e)
		adagrad8(c, t, i, odt, stream, 1, zx_tail_mask8(e - i), e - i);
	if (stream)
		_mm_sfence();
}

ZX_TARGET_AVX2 static void adagrad_span_avx2(const void *ctx, const zx_optim_tensor *t, int64_t b,
					     int64_t e, double *acc)
{
	const struct adagrad_ctx *c = ctx;
	int odt = t->out ? c->out_dtype : -1;
	if (odt == ZX_BF16)
		adagrad_loop_avx2(c, t, b, e, ZX_BF16);
	else if (odt == ZX_F16)
		adagrad_loop_avx2(c, t, b, e, ZX_F16);
	else
		adagrad_loop_avx2(c, t, b, e, -1);
}

ZX_TARGET_AVX512 ZX_INLINE void adagrad16(const struct adagrad_ctx *c, const zx_optim_tensor *t,
					  int64_t i, const int odt, const int stream, __mmask16 mask)
{
	float *pp = t->param + i, *sp = t->exp_avg_sq + i;
	__m512 p = _mm512_maskz_loadu_ps(mask, pp);
	__m512 g = _mm512_maskz_loadu_ps(mask, t->grad + i);
	__m512 s = _mm512_maskz_loadu_ps(mask, sp);
	g = _mm512_mul_ps(g, _mm512_set1_ps(c->grad_scale));
	if (c->l2)
		g = _mm512_fmadd_ps(_mm512_set1_ps(c->wd), p, g);
	s = _mm512_fmadd_ps(g, g, s);
	__m512 d = _mm512_add_ps(_mm512_sqrt_ps(s), _mm512_set1_ps(c->eps));
	p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c->neg_lr), g), d));
	_mm512_mask_storeu_ps(pp, mask, p);
	_mm512_mask_storeu_ps(sp, mask, s);
	if (odt >= 0)
		zx_store16x16((uint16_t *)t->out + i, zx_to16x16(p, odt), mask, stream);
}

ZX_TARGET_AVX512 ZX_INLINE void adagrad_loop_avx512(const struct adagrad_ctx *c,
						    const zx_optim_tensor *t, int64_t b, int64_t e,
						    const int odt)
{
	const int stream = odt >= 0 && zx_stream_span(c->stream, t->out, b, 32);
	int64_t i = b;
	for (; i + 64 <= e; i += 64) {
		zx_prefetch_ahead(t->param, i, t->numel, 64);
		zx_prefetch_ahead(t->grad, i, t->numel, 64);
		zx_prefetch_ahead(t->exp_avg_sq, i, t->numel, 64);
		adagrad16(c, t, i, odt, stream, 0xffff);
		adagrad16(c, t, i + 16, odt, stream, 0xffff);
		adagrad16(c, t, i + 32, odt, stream, 0xffff);
		adagrad16(c, t, i + 48, odt, stream, 0xffff);
	}
	for (; i < e; i += 16)
		adagrad16(c, t, i, odt, stream, e - i >= 16 ? (__mmask16)0xffff : zx_tail_mask16(e - i));
	if (stream)
		_mm_sfence();
}

ZX_TARGET_AVX512 static void adagrad_span_avx512(const void *ctx, const zx_optim_tensor *t,
						 int64_t b, int64_t e, double *acc)
{
	const struct adagrad_ctx *c = ctx;
	int odt = t->out ? c->out_dtype : -1;
	if (odt == ZX_BF16)
		adagrad_loop_avx512(c, t, b, e, ZX_BF16);
	else if (odt == ZX_F16)
		adagrad_loop_avx512(c, t, b, e, ZX_F16);
	else
		adagrad_loop_avx512(c, t, b, e, -1);
}
#endif /* ZX_HAVE_X86 */

int zx_adagrad_step(const zx_adagrad_config *cfg, const zx_optim_tensor *t, int64_t ntensors,
		    int out_dtype, int isa)
{
	int level = zx_optim_isa(isa);
	if (level < 0)
		return level;
	if (!cfg)
		return -EINVAL;
	int rc = zx_optim_check(t, ntensors, ZX_NEED_PARAM | ZX_NEED_GRAD | ZX_NEED_EXP_AVG_SQ,
				out_dtype);
	if (rc)
		return rc;
	struct adagrad_ctx c = {
		.grad_scale = (float)cfg->grad_scale,
		.l2 = cfg->weight_decay != 0.0,
		.wd = (float)cfg->weight_decay,
		.eps = (float)cfg->eps,
		.neg_lr = (float)-cfg->lr,
		.out_dtype = out_dtype,
		.stream = zx_optim_numel(t, ntensors) >= ZX_STREAM_MIN,
	};
	zx_span_fn fn = adagrad_span_scalar;
#if ZX_HAVE_X86
	if (level == ZX_SIMD_AVX512)
		fn = adagrad_span_avx512;
	else if (level == ZX_SIMD_AVX2)
		fn = adagrad_span_avx2;
#endif
	return zx_optim_run(t, ntensors, fn, &c, NULL);
}
