/* cpu_adam.c - Adam and AdamW on fp32 master state: the portable scalar reference, and the AVX2
 * and AVX-512 paths beside it, chosen at run time (see cpu_features.h).
 *
 * Owns: Adam's per-element arithmetic and the flags its loops are specialised on (L2 or decoupled
 * decay, division by bc2). Does not own: the vector loops, the bf16/fp16 copy-out and the
 * specialisation machinery (cpu_optim.h), tiling, threads and the ISA choice (cpu_optim.c), state
 * allocation or step counting (zero_ext/ops/adam.py).
 *
 * The arithmetic is torch.optim.Adam's single-tensor code, one rounding per torch operation, with
 * FMA exactly where torch's vectorised CPU kernels use it (lerp, addcmul, add with alpha):
 *   g  = g * grad_scale                      (the offloaded step's unscale and clip, on load)
 *   g  = fma(wd, p, g)                       (Adam with weight decay: grad.add(param, alpha=wd))
 *   p  = p * (1 - lr*wd)                     (AdamW: param.mul_)
 *   m  = fma(1-b1, g - m, m)                 (exp_avg.lerp_(grad, 1-b1); for 1-b1 >= 0.5 torch
 *                                             uses fma((1-b1) - 1, g - m, g), and so do we)
 *   v  = fma((1-b2)*g, g, v*b2)              (exp_avg_sq.mul_(b2).addcmul_(g, g, value=1-b2))
 *   d  = sqrt(v) / sqrt(1-b2^t) + eps        (IEEE sqrt; the division exact, see below)
 *   p  = p + (-lr/(1-b1^t) * m) / d          (param.addcdiv_(exp_avg, denom, value=-step_size))
 * so the vector paths give torch's bits (torch's own vectorised sqrt is not correctly rounded; ours
 * is, so we differ from torch where its sqrt is 1 ulp off).
 *
 * The divider (sqrt and division share it) bounds the speed, so the division by the per-call
 * constant b = sqrt(1-b2^t) is done without it: s * (1/b) in double, rounded to fp32, equals the
 * fp32 division s / b bit for bit. Proof: s = S 2^x and b = B 2^y with 24-bit integers S, B; a
 * point halfway between two floats is M 2^z with M odd of 25 bits. If s/b is not such a point, its
 * relative distance to it, |S 2^x - M B 2^(y+z)| / (M B 2^(y+z)), is at least 1 / (M B) > 2^-49
 * (the numerator is a nonzero multiple of 2^(y+z), as x >= y+z+23 for s/b near M 2^z). And s/b is
 * never such a point (M B would need 25 significant bits from S's 24). The double product is
 * within 2^-52 of s/b (two roundings of 2^-53), so it rounds to the same float. s = sqrt(v) is 0,
 * normal, Inf or NaN, never subnormal, and b is in (0, 1], so neither overflows nor underflows.
 * Past the caches the kernel is bound by how many cache misses one core keeps in flight, so every
 * line is prefetched 2 KiB ahead (from ~0.90 to ~0.97 of the bandwidth floor at 1e8 elements,
 * benchmarks/bench_cpu_adam.py). An AVX2 iteration works on a block of eight vectors of every array:
 * all 32 loads first, then the arithmetic, then the stores (the arrays may alias as far as the
 * compiler knows, so it would not hoist a later vector's loads above an earlier one's stores
 * itself). An AVX-512 vector is one cache line of each array, and one vector per iteration did best
 * there: blocks of eight ran 0-2 % slower at 1e8 elements and 11 % at 1e7 (in this machine's L3).
 * The divider bounds the arithmetic, and it does as many elements per cycle at either width: in
 * cache the two paths run at the same speed (2.4e9 elements/s on one core here).
 */
#include <errno.h>
#include <math.h>

#include "cpu_optim.h"

/* Hyperparameters, rounded to fp32 from the double values torch computes in Python. */
struct adam_ctx {
	float grad_scale;
	float wd;	/* L2 coefficient (Adam mode with weight decay) */
	float decay;	/* 1 - lr*wd in AdamW mode, else 1 */
	float w1;	/* the lerp coefficient for m: 1-b1, or (1-b1) - 1 when 1-b1 >= 0.5 */
	int m_from_g;	/* 1-b1 >= 0.5: m = fma(w1, g - m, g) */
	float b2, w2;	/* b2, 1-b2 */
	float bc2;	/* sqrt(1 - b2^t), 1 without bias correction */
	double inv_bc2; /* 1 / bc2, for the division by bc2 in double (see the top of the file) */
	int div_bc2;	/* bc2 != 1 (it rounds to 1 after ~17k steps with b2 = 0.999) */
	float eps;
	float neg_step; /* -lr / (1 - b1^t) */
	int l2;
	int out_dtype;
	int stream; /* a large call: the copy goes out with non-temporal stores */
};

static void adam_ctx_init(struct adam_ctx *c, const zx_adam_config *cfg, int out_dtype)
{
	double bc1 = 1.0, bc2 = 1.0;
	if (cfg->bias_correction) {
		bc1 = 1.0 - pow(cfg->beta1, (double)cfg->step);
		bc2 = 1.0 - pow(cfg->beta2, (double)cfg->step);
	}
	double w1 = 1.0 - cfg->beta1;
	c->grad_scale = (float)cfg->grad_scale;
	c->l2 = !cfg->adamw_mode && cfg->weight_decay != 0.0;
	c->wd = c->l2 ? (float)cfg->weight_decay : 0.0f;
	c->decay = cfg->adamw_mode ? (float)(1.0 - cfg->lr * cfg->weight_decay) : 1.0f;
	/* torch's lerp rounds the weight to fp32 and picks its formula from that */
	c->m_from_g = fabsf((float)w1) >= 0.5f;
	c->w1 = c->m_from_g ? (float)w1 - 1.0f : (float)w1;
	c->b2 = (float)cfg->beta2;
	c->w2 = (float)(1.0 - cfg->beta2);
	c->bc2 = (float)sqrt(bc2);
	c->inv_bc2 = 1.0 / (double)c->bc2;
	c->div_bc2 = c->bc2 != 1.0f;
	c->eps = (float)cfg->eps;
	c->neg_step = (float)(-(cfg->lr / bc1));
	c->out_dtype = out_dtype;
	c->stream = 0;
}

/* ---------------------------------------------------------------------------------------------------
 * Scalar reference */

static void adam_span_scalar(const void *ctx, const zx_optim_tensor *t, int64_t b, int64_t e,
			     double *acc)
{
	const struct adam_ctx c = *(const struct adam_ctx *)ctx; /* a copy no store can alias */
	float *P = t->param, *M = t->exp_avg, *V = t->exp_avg_sq;
	const float *G = t->grad;
	void *out = t->out;
	for (int64_t i = b; i < e; i++) {
		float p = P[i], g = G[i] * c.grad_scale, m = M[i], v = V[i];
		if (c.l2)
			g = zx_fmaf(c.wd, p, g);
		else
			p = p * c.decay;
		m = zx_fmaf(c.w1, g - m, c.m_from_g ? g : m);
		v = zx_fmaf(c.w2 * g, g, v * c.b2);
		float d = sqrtf(v);
		if (c.div_bc2) /* == d / c.bc2 */
			d = (float)((double)d * c.inv_bc2);
		d = d + c.eps;
		p = p + (c.neg_step * m) / d;
		P[i] = p;
		M[i] = m;
		V[i] = v;
		if (out)
			zx_store16_scalar(out, i, p, c.out_dtype);
	}
}

#if ZX_HAVE_X86
/* ---------------------------------------------------------------------------------------------------
 * AVX2 and AVX-512: the arithmetic on one vector; the loops around it are cpu_optim.h's, with
 * Adam's flags as their `spec`. */

enum { ADAM_L2 = 1, ADAM_DIV_BC2 = 2 };

static int adam_spec(const struct adam_ctx *c)
{
	return (c->l2 ? ADAM_L2 : 0) | (c->div_bc2 ? ADAM_DIV_BC2 : 0);
}

ZX_TARGET_AVX2 ZX_INLINE void adam_math8(const void *ctx, zx_vec8 *x, const int spec)
{
	const struct adam_ctx *c = ctx;
	__m256 p = x->p, g = x->g, m = x->m, v = x->v;
	g = _mm256_mul_ps(g, _mm256_set1_ps(c->grad_scale));
	if (spec & ADAM_L2)
		g = _mm256_fmadd_ps(_mm256_set1_ps(c->wd), p, g);
	else
		p = _mm256_mul_ps(p, _mm256_set1_ps(c->decay));
	__m256 m_from_g = _mm256_castsi256_ps(_mm256_set1_epi32(c->m_from_g ? -1 : 0));
	m = _mm256_fmadd_ps(_mm256_set1_ps(c->w1), _mm256_sub_ps(g, m), _mm256_blendv_ps(m, g, m_from_g));
	v = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(c->w2), g), g,
			    _mm256_mul_ps(v, _mm256_set1_ps(c->b2)));
	__m256 d = _mm256_sqrt_ps(v);
	if (spec & ADAM_DIV_BC2) { /* d / bc2, in double: exact, and off the divider */
		const __m256d inv_bc2 = _mm256_set1_pd(c->inv_bc2);
		__m128 lo = _mm256_castps256_ps128(d), hi = _mm256_extractf128_ps(d, 1);
		lo = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(lo), inv_bc2));
		hi = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(hi), inv_bc2));
		d = _mm256_set_m128(hi, lo);
	}
	d = _mm256_add_ps(d, _mm256_set1_ps(c->eps));
	x->p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c->neg_step), m), d));
	x->m = m;
	x->v = v;
}

ZX_TARGET_AVX2 static void adam_span_avx2(const void *ctx, const zx_optim_tensor *t, int64_t b,
					  int64_t e, double *acc)
{
	const struct adam_ctx c = *(const struct adam_ctx *)ctx; /* a copy no store can alias */
	zx_span8(t, b, e, adam_math8, &c, ZX_NEED_ALL, adam_spec(&c), c.out_dtype, c.stream);
}

ZX_TARGET_AVX512 ZX_INLINE void adam_math16(const void *ctx, zx_vec16 *x, const int spec)
{
	const struct adam_ctx *c = ctx;
	__m512 p = x->p, g = x->g, m = x->m, v = x->v;
	g = _mm512_mul_ps(g, _mm512_set1_ps(c->grad_scale));
	if (spec & ADAM_L2)
		g = _mm512_fmadd_ps(_mm512_set1_ps(c->wd), p, g);
	else
		p = _mm512_mul_ps(p, _mm512_set1_ps(c->decay));
	__mmask16 m_from_g = c->m_from_g ? (__mmask16)0xffff : 0;
	m = _mm512_fmadd_ps(_mm512_set1_ps(c->w1), _mm512_sub_ps(g, m),
			    _mm512_mask_blend_ps(m_from_g, m, g));
	v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(c->w2), g), g,
			    _mm512_mul_ps(v, _mm512_set1_ps(c->b2)));
	__m512 d = _mm512_sqrt_ps(v);
	if (spec & ADAM_DIV_BC2) { /* d / bc2, in double: exact, and off the divider */
		const __m512d inv_bc2 = _mm512_set1_pd(c->inv_bc2);
		__m256 lo = _mm512_castps512_ps256(d);
		__m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(d), 1));
		lo = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(lo), inv_bc2));
		hi = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(hi), inv_bc2));
		d = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)),
							_mm256_castps_pd(hi), 1));
	}
	d = _mm512_add_ps(d, _mm512_set1_ps(c->eps));
	x->p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c->neg_step), m), d));
	x->m = m;
	x->v = v;
}

ZX_TARGET_AVX512 static void adam_span_avx512(const void *ctx, const zx_optim_tensor *t,
					      int64_t b, int64_t e, double *acc)
{
	const struct adam_ctx c = *(const struct adam_ctx *)ctx; /* a copy no store can alias */
	zx_span16(t, b, e, adam_math16, &c, ZX_NEED_ALL, adam_spec(&c), c.out_dtype, c.stream);
}
#endif /* ZX_HAVE_X86 */

/* ---------------------------------------------------------------------------------------------------
 * Entry */

int zx_adam_step(const zx_adam_config *cfg, const zx_optim_tensor *t, int64_t ntensors,
		 int out_dtype, int isa)
{
	if (!cfg || cfg->step < 1)
		return -EINVAL;
	int rc = zx_optim_check(t, ntensors, ZX_NEED_ALL, out_dtype);
	if (rc)
		return rc;
	struct adam_ctx c;
	adam_ctx_init(&c, cfg, out_dtype);
	c.stream = zx_optim_numel(t, ntensors) >= ZX_STREAM_MIN;
	static const zx_spans spans = ZX_SPANS(adam_span);
	return zx_optim_run_isa(t, ntensors, &spans, isa, &c, NULL);
}
