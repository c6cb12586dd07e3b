/* cpu_optim_lion.c - Lion on fp32 master state: scalar reference, AVX2 and AVX-512 paths.
 *
 * Owns: Lion's per-element arithmetic. Does not own: the vector loops and the bf16/fp16 copy
 * (cpu_optim.h), tiling, threads and the ISA choice (cpu_optim.c), state or step counting
 * (zero_ext/ops/lion.py). torch has no Lion; this is the published algorithm written
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

#define LION_ARRAYS (ZX_NEED_PARAM | ZX_NEED_GRAD | ZX_NEED_EXP_AVG)

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
/* AVX2 and AVX-512: the arithmetic on one vector, in cpu_optim.h's loops. spec: which of the two
 * lerps take torch's from-the-end formula. */

enum { LION_C1_FROM_END = 1, LION_C2_FROM_END = 2 };

static int lion_spec(const struct lion_ctx *c)
{
	return (c->c1.from_end ? LION_C1_FROM_END : 0) | (c->c2.from_end ? LION_C2_FROM_END : 0);
}

ZX_TARGET_AVX2 ZX_INLINE __m256 lerp8(__m256 start, __m256 end, float w, const int from_end)
{
	return _mm256_fmadd_ps(_mm256_set1_ps(w), _mm256_sub_ps(end, start), from_end ? end : start);
}

ZX_TARGET_AVX2 ZX_INLINE void lion_math8(const void *ctx, zx_vec8 *x, const int spec)
{
	const struct lion_ctx *c = ctx;
	__m256 p = _mm256_mul_ps(x->p, _mm256_set1_ps(c->decay));
	__m256 g = _mm256_mul_ps(x->g, _mm256_set1_ps(c->grad_scale)), m = x->m;
	__m256 u = lerp8(m, g, c->c1.w, spec & LION_C1_FROM_END), z = _mm256_setzero_ps();
	__m256 s = _mm256_or_ps(_mm256_and_ps(_mm256_cmp_ps(u, z, _CMP_GT_OQ), _mm256_set1_ps(1.0f)),
				_mm256_and_ps(_mm256_cmp_ps(u, z, _CMP_LT_OQ), _mm256_set1_ps(-1.0f)));
	x->p = _mm256_fmadd_ps(_mm256_set1_ps(c->neg_lr), s, p);
	x->m = lerp8(m, g, c->c2.w, spec & LION_C2_FROM_END);
}

ZX_TARGET_AVX2 static void lion_span_avx2(const void *ctx, const zx_optim_tensor *t, int64_t b,
					  int64_t e, double *acc)
{
	const struct lion_ctx c = *(const struct lion_ctx *)ctx; /* a copy no store can alias */
	zx_span8(t, b, e, lion_math8, &c, LION_ARRAYS, lion_spec(&c), c.out_dtype, c.stream);
}

ZX_TARGET_AVX512 ZX_INLINE __m512 lerp16(__m512 start, __m512 end, float w, const int from_end)
{
	return _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_sub_ps(end, start), from_end ? end : start);
}

ZX_TARGET_AVX512 ZX_INLINE void lion_math16(const void *ctx, zx_vec16 *x, const int spec)
{
	const struct lion_ctx *c = ctx;
	__m512 p = _mm512_mul_ps(x->p, _mm512_set1_ps(c->decay));
	__m512 g = _mm512_mul_ps(x->g, _mm512_set1_ps(c->grad_scale)), m = x->m;
	__m512 u = lerp16(m, g, c->c1.w, spec & LION_C1_FROM_END), z = _mm512_setzero_ps();
	__m512 s = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(u, z, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
	s = _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(u, z, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
	x->p = _mm512_fmadd_ps(_mm512_set1_ps(c->neg_lr), s, p);
	x->m = lerp16(m, g, c->c2.w, spec & LION_C2_FROM_END);
}

ZX_TARGET_AVX512 static void lion_span_avx512(const void *ctx, const zx_optim_tensor *t,
					      int64_t b, int64_t e, double *acc)
{
	const struct lion_ctx c = *(const struct lion_ctx *)ctx; /* a copy no store can alias */
	zx_span16(t, b, e, lion_math16, &c, LION_ARRAYS, lion_spec(&c), c.out_dtype, c.stream);
}
#endif /* ZX_HAVE_X86 */

int zx_lion_step(const zx_lion_config *cfg, const zx_optim_tensor *t, int64_t ntensors,
		 int out_dtype, int isa)
{
	if (!cfg)
		return -EINVAL;
	int rc = zx_optim_check(t, ntensors, LION_ARRAYS, out_dtype);
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
	static const zx_spans spans = ZX_SPANS(lion_span);
	return zx_optim_run_isa(t, ntensors, &spans, isa, &c, NULL);
}
