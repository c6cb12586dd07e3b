/* cpu_optim.c - the tiled multi-tensor driver under every CPU optimizer call, and the two passes
 * the offloaded step needs besides the update itself: the gradient norm (fused with the gradient's
 * copy into fp32) and the fp32 -> bf16/fp16 cast.
 *
 * Owns: cutting a call's tensors into tiles, handing tiles to the pool's threads, the per-tile
 * partial sums of reductions, argument checks, ISA resolution. Does not own: the threads (see
 * thread_pool.c) or any optimizer's arithmetic (cpu_adam.c, cpu_optim_adagrad.c,
 * cpu_optim_lion.c). Worker threads take the caller's MXCSR for the call (rounding mode, flush to
 * zero), so a result does not depend on which thread computed it.
 */
#include "cpu_optim.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "thread_pool.h"

/* ---------------------------------------------------------------------------------------------------
 * The driver */

struct optim_job {
	const zx_optim_tensor *t; /* (n,) */
	int64_t n;
	const int64_t *start; /* (n,) first index of each tensor in the tiled space */
	int64_t total;	      /* end of the tiled space */
	int64_t ntiles;
	atomic_llong next; /* next tile to take */
	zx_span_fn fn;
	const void *ctx;
	double *partial; /* (ntiles,) per-tile sums, or NULL */
	unsigned mxcsr;	 /* the caller's, for the workers */
};

static void optim_tile(struct optim_job *j, int64_t k)
{
	int64_t lo = k * ZX_OPTIM_TILE;
	int64_t hi = lo + ZX_OPTIM_TILE < j->total ? lo + ZX_OPTIM_TILE : j->total;
	int64_t a = 0, b = j->n - 1; /* the last tensor starting at or before lo */
	while (a < b) {
		int64_t mid = (a + b + 1) / 2;
		if (j->start[mid] <= lo)
			a = mid;
		else
			b = mid - 1;
	}
	double acc = 0.0;
	for (int64_t i = a; i < j->n && j->start[i] < hi; i++) {
		int64_t s = j->start[i];
		int64_t begin = lo > s ? lo - s : 0;
		int64_t end = hi - s < j->t[i].numel ? hi - s : j->t[i].numel;
		if (begin < end)
			j->fn(j->ctx, &j->t[i], begin, end, &acc);
	}
	if (j->partial)
		j->partial[k] = acc;
}

static void optim_worker(void *arg, int tid, int nthreads)
{
	struct optim_job *j = arg;
#if ZX_HAVE_X86
	if (tid != 0)
		_mm_setcsr(j->mxcsr);
#endif
	for (;;) {
		int64_t k = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
		if (k >= j->ntiles)
			break;
		optim_tile(j, k);
	}
}

int zx_optim_run(const zx_optim_tensor *t, int64_t n, zx_span_fn fn, const void *ctx, double *sum)
{
	if (sum)
		*sum = 0.0;
	if (n <= 0)
		return 0;
	int64_t *start = malloc((size_t)n * sizeof(int64_t));
	if (!start)
		return -ENOMEM;
	int64_t total = 0, elems = 0;
	for (int64_t i = 0; i < n; i++) {
		start[i] = total;
		int64_t padded = (t[i].numel + ZX_OPTIM_ALIGN - 1) / ZX_OPTIM_ALIGN * ZX_OPTIM_ALIGN;
		if (t[i].numel > ((int64_t)1 << 62) - total - ZX_OPTIM_ALIGN) {
			free(start);
			return -EOVERFLOW;
		}
		total += padded;
		elems += t[i].numel;
	}
	struct optim_job j = {
		.t = t,
		.n = n,
		.start = start,
		.total = total,
		.ntiles = (total + ZX_OPTIM_TILE - 1) / ZX_OPTIM_TILE,
		.fn = fn,
		.ctx = ctx,
	};
	atomic_init(&j.next, 0);
#if ZX_HAVE_X86
	j.mxcsr = _mm_getcsr();
#endif
	if (sum && j.ntiles > 0) {
		j.partial = malloc((size_t)j.ntiles * sizeof(double));
		if (!j.partial) {
			free(start);
			return -ENOMEM;
		}
	}
	int nthreads = elems < ZX_OPTIM_INLINE ? 1 : zx_pool_threads();
	if (nthreads > j.ntiles)
		nthreads = (int)j.ntiles;
	if (j.ntiles > 0)
		zx_pool_run(optim_worker, &j, nthreads);
	if (sum) {
		double s = 0.0;
		for (int64_t k = 0; k < j.ntiles; k++)
			s += j.partial[k];
		*sum = s;
	}
	free(j.partial);
	free(start);
	return 0;
}

int zx_optim_run_isa(const zx_optim_tensor *t, int64_t n, const zx_spans *spans, int isa,
		     const void *ctx, double *sum)
{
	if (isa < 0)
		isa = (int)zx_simd_level();
	else if (isa > (int)zx_simd_supported())
		return -EINVAL;
	zx_span_fn fn = isa == ZX_SIMD_AVX512 ? spans->avx512
			: isa == ZX_SIMD_AVX2 ? spans->avx2
					      : spans->scalar;
	return zx_optim_run(t, n, fn, ctx, sum);
}

static int misaligned(const void *p, uintptr_t align)
{
	return ((uintptr_t)p & (align - 1)) != 0;
}

int zx_optim_check(const zx_optim_tensor *t, int64_t n, unsigned need, int out_dtype)
{
	if (n < 0 || (n > 0 && !t))
		return -EINVAL;
	for (int64_t i = 0; i < n; i++) {
		const zx_optim_tensor *x = &t[i];
		if (x->numel < 0)
			return -EINVAL;
		if (x->numel == 0)
			continue;
		if (((need & ZX_NEED_PARAM) && (!x->param || misaligned(x->param, 4))) ||
		    ((need & ZX_NEED_GRAD) && (!x->grad || misaligned(x->grad, 4))) ||
		    ((need & ZX_NEED_EXP_AVG) && (!x->exp_avg || misaligned(x->exp_avg, 4))) ||
		    ((need & ZX_NEED_EXP_AVG_SQ) && (!x->exp_avg_sq || misaligned(x->exp_avg_sq, 4))))
			return -EINVAL;
		if (x->out && (misaligned(x->out, 2) || (out_dtype != ZX_BF16 && out_dtype != ZX_F16)))
			return -EINVAL;
	}
	return 0;
}

int zx_optim_set_threads(int n)
{
	return zx_pool_set_threads(n);
}

int zx_optim_threads(void)
{
	return zx_pool_threads();
}

uint16_t zx_f32_to_bf16(float x)
{
	return zx_bf16_scalar(x);
}

uint16_t zx_f32_to_f16(float x)
{
	return zx_f16_scalar(x);
}

/* ---------------------------------------------------------------------------------------------------
 * Gradient norm, fused with the copy into fp32. In a span, t->grad is the source (of ctx's dtype)
 * and t->param the fp32 destination or NULL. */

struct sqnorm_ctx {
	int src_dtype;
};

static void sqnorm_span_scalar(const void *ctx, const zx_optim_tensor *t, int64_t b, int64_t e,
			       double *acc)
{
	const struct sqnorm_ctx *c = ctx;
	double s = 0.0;
	for (int64_t i = b; i < e; i++) {
		float x = zx_load_f32(t->grad, i, c->src_dtype);
		if (t->param)
			t->param[i] = x;
		s += (double)x * x;
	}
	*acc += s;
}

#if ZX_HAVE_X86
ZX_TARGET_AVX2 static inline __m256d sq_acc4(__m256d acc, __m128 x)
{
	__m256d d = _mm256_cvtps_pd(x);
	return _mm256_fmadd_pd(d, d, acc);
}

ZX_TARGET_AVX2 static void sqnorm_span_avx2(const void *ctx, const zx_optim_tensor *t, int64_t b,
					    int64_t e, double *acc)
{
	const struct sqnorm_ctx *c = ctx;
	__m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
	int64_t i = b;
	for (; i + 8 <= e; i += 8) {
		__m256 x = zx_load8_f32(t->grad, i, c->src_dtype);
		if (t->param)
			_mm256_storeu_ps(t->param + i, x);
		a0 = sq_acc4(a0, _mm256_castps256_ps128(x));
		a1 = sq_acc4(a1, _mm256_extractf128_ps(x, 1));
	}
	double tmp[4];
	_mm256_storeu_pd(tmp, _mm256_add_pd(a0, a1));
	double s = (tmp[0] + tmp[1]) + (tmp[2] + tmp[3]);
	for (; i < e; i++) {
		float x = zx_load_f32(t->grad, i, c->src_dtype);
		if (t->param)
			t->param[i] = x;
		s += (double)x * x;
	}
	*acc += s;
}

ZX_TARGET_AVX512 static inline __m512d sq_acc8(__m512d acc, __m256 x)
{
	__m512d d = _mm512_cvtps_pd(x);
	return _mm512_fmadd_pd(d, d, acc);
}

ZX_TARGET_AVX512 static void sqnorm_span_avx512(const void *ctx, const zx_optim_tensor *t,
						int64_t b, int64_t e, double *acc)
{
	const struct sqnorm_ctx *c = ctx;
	__m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
	for (int64_t i = b; i < e; i += 16) {
		__mmask16 k = e - i >= 16 ? (__mmask16)0xffff : zx_tail_mask16(e - i);
		__m512 x = zx_load16_f32(t->grad, i, c->src_dtype, k);
		if (t->param)
			_mm512_mask_storeu_ps(t->param + i, k, x);
		a0 = sq_acc8(a0, _mm512_castps512_ps256(x));
		a1 = sq_acc8(a1, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
	}
	*acc += _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
}
#endif

int zx_grad_sqnorm(float *dst, const void *src, int src_dtype, int64_t n, int isa, double *sumsq)
{
	if (!sumsq || n < 0 || (n > 0 && !src) || zx_dtype_size(src_dtype) == 0)
		return -EINVAL;
	if (src_dtype != ZX_F32 && src_dtype != ZX_BF16 && src_dtype != ZX_F16)
		return -EINVAL;
	if (((uintptr_t)src & (uintptr_t)(zx_dtype_size(src_dtype) - 1)) || ((uintptr_t)dst & 3))
		return -EINVAL;
	zx_optim_tensor t = { .param = dst, .grad = src, .numel = n };
	struct sqnorm_ctx c = { .src_dtype = src_dtype };
	static const zx_spans spans = ZX_SPANS(sqnorm_span);
	return zx_optim_run_isa(&t, 1, &spans, isa, &c, sumsq);
}

/* ---------------------------------------------------------------------------------------------------
 * fp32 -> bf16/fp16 cast. In a span, t->param is the source and t->out the destination. */

struct cast_ctx {
	int dtype;
	int stream; /* a large call: non-temporal stores */
};

static void cast_span_scalar(const void *ctx, const zx_optim_tensor *t, int64_t b, int64_t e,
			     double *acc)
{
	const struct cast_ctx *c = ctx;
	for (int64_t i = b; i < e; i++)
		zx_store16_scalar(t->out, i, t->param[i], c->dtype);
}

#if ZX_HAVE_X86
ZX_TARGET_AVX2 static void cast_span_avx2(const void *ctx, const zx_optim_tensor *t, int64_t b,
					  int64_t e, double *acc)
{
	const struct cast_ctx *c = ctx;
	uint16_t *o = t->out;
	const int stream = zx_stream_span(c->stream, o, b, 16);
	int64_t i = b;
	for (; i + 8 <= e; i += 8)
		zx_store16x8(o + i, zx_to16x8(_mm256_loadu_ps(t->param + i), c->dtype), stream);
	if (i < e) {
		__m256 x = _mm256_maskload_ps(t->param + i, zx_tail_mask8(e - i));
		zx_store16_tail(o + i, zx_to16x8(x, c->dtype), e - i);
	}
	if (stream)
		_mm_sfence();
}

ZX_TARGET_AVX512 static void cast_span_avx512(const void *ctx, const zx_optim_tensor *t, int64_t b,
					      int64_t e, double *acc)
{
	const struct cast_ctx *c = ctx;
	uint16_t *o = t->out;
	const int stream = zx_stream_span(c->stream, o, b, 32);
	for (int64_t i = b; i < e; i += 16) {
		__mmask16 k = e - i >= 16 ? (__mmask16)0xffff : zx_tail_mask16(e - i);
		__m512 x = _mm512_maskz_loadu_ps(k, t->param + i);
		zx_store16x16(o + i, zx_to16x16(x, c->dtype), k, stream);
	}
	if (stream)
		_mm_sfence();
}
#endif

int zx_cast_f32(void *dst, int dst_dtype, const float *src, int64_t n, int isa)
{
	if (n < 0 || (n > 0 && (!dst || !src)) || (dst_dtype != ZX_BF16 && dst_dtype != ZX_F16) ||
	    ((uintptr_t)dst & 1) || ((uintptr_t)src & 3))
		return -EINVAL;
	/* param is only read here; the driver's tensor type has no const source field */
	zx_optim_tensor t = { .param = (float *)src, .out = dst, .numel = n };
	struct cast_ctx c = { .dtype = dst_dtype, .stream = n >= ZX_STREAM_MIN };
	static const zx_spans spans = ZX_SPANS(cast_span);
	return zx_optim_run_isa(&t, 1, &spans, isa, &c, NULL);
}
