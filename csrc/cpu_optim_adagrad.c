/* cpu_optim_adagrad.c - Adagrad on fp32 master state: scalar reference, AVX2 and AVX-512 paths.
 *
 * Owns: Adagrad's per-element arithmetic. Does not own: the vector loops and the bf16/fp16 copy
 * (cpu_optim.h), tiling, threads and the ISA choice (cpu_optim.c), state or step counting
 * (zero_ext/ops/adagrad.py). It is torch.optim.Adagrad with lr_decay = 0 and
 * initial_accumulator_value = 0 (DeepSpeed's CPU Adagrad computes the same), one rounding per torch
 * operation and FMA where torch's vectorised kernels use it:
 *   g = g * grad_scale;  g = fma(wd, p, g) if wd;  s = fma(g, g, s)      (addcmul_ with value 1)
 *   p = p + (-lr * g) / (sqrt(s) + eps)                                  (addcdiv_, value -lr)
 */
#include <errno.h>
#include <math.h>

#include "cpu_optim.h"

/* The sum of squares is kept in exp_avg_sq. */
#define ADAGRAD_ARRAYS (ZX_NEED_PARAM | ZX_NEED_GRAD | ZX_NEED_EXP_AVG_SQ)

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
/* AVX2 and AVX-512: the arithmetic on one vector, in cpu_optim.h's loops (spec: ADAGRAD_L2). */

enum { ADAGRAD_L2 = 1 };

ZX_TARGET_AVX2 ZX_INLINE void adagrad_math8(const void *ctx, zx_vec8 *x, const int spec)
{
	const struct adagrad_ctx *c = ctx;
	__m256 p = x->p, g = _mm256_mul_ps(x->g, _mm256_set1_ps(c->grad_scale));
	if (spec & ADAGRAD_L2)
		g = _mm256_fmadd_ps(_mm256_set1_ps(c->wd), p, g);
	__m256 s = _mm256_fmadd_ps(g, g, x->v);
	__m256 d = _mm256_add_ps(_mm256_sqrt_ps(s), _mm256_set1_ps(c->eps));
	x->p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c->neg_lr), g), d));
	x->v = s;
}

ZX_TARGET_AVX2 static void adagrad_span_avx2(const void *ctx, const zx_optim_tensor *t, int64_t b,
					     int64_t e, double *acc)
{
	const struct adagrad_ctx c = *(const struct adagrad_ctx *)ctx; /* a copy no store can alias */
	zx_span8(t, b, e, adagrad_math8, &c, ADAGRAD_ARRAYS, c.l2 ? ADAGRAD_L2 : 0, c.out_dtype,
		 c.stream);
}

ZX_TARGET_AVX512 ZX_INLINE void adagrad_math16(const void *ctx, zx_vec16 *x, const int spec)
{
	const struct adagrad_ctx *c = ctx;
	__m512 p = x->p, g = _mm512_mul_ps(x->g, _mm512_set1_ps(c->grad_scale));
	if (spec & ADAGRAD_L2)
		g = _mm512_fmadd_ps(_mm512_set1_ps(c->wd), p, g);
	__m512 s = _mm512_fmadd_ps(g, g, x->v);
	__m512 d = _mm512_add_ps(_mm512_sqrt_ps(s), _mm512_set1_ps(c->eps));
	x->p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c->neg_lr), g), d));
	x->v = s;
}

ZX_TARGET_AVX512 static void adagrad_span_avx512(const void *ctx, const zx_optim_tensor *t,
						 int64_t b, int64_t e, double *acc)
{
	const struct adagrad_ctx c = *(const struct adagrad_ctx *)ctx; /* a copy no store can alias */
	zx_span16(t, b, e, adagrad_math16, &c, ADAGRAD_ARRAYS, c.l2 ? ADAGRAD_L2 : 0, c.out_dtype,
		  c.stream);
}
#endif /* ZX_HAVE_X86 */

int zx_adagrad_step(const zx_adagrad_config *cfg, const zx_optim_tensor *t, int64_t ntensors,
		    int out_dtype, int isa)
{
	if (!cfg)
		return -EINVAL;
	int rc = zx_optim_check(t, ntensors, ADAGRAD_ARRAYS, out_dtype);
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
	static const zx_spans spans = ZX_SPANS(adagrad_span);
	return zx_optim_run_isa(t, ntensors, &spans, isa, &c, NULL);
}
