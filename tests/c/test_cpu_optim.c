/* test_cpu_optim.c - the CPU optimizer internals Python cannot see: the tile driver touches every
 * element of every tensor exactly once for any mix of sizes and threads (including pool resizes),
 * and the scalar fp16/bf16 conversions equal the F16C / AVX-512 ones on every input class.
 *
 *   cc -std=c11 -O2 -Icsrc tests/c/test_cpu_optim.c csrc/cpu_optim.c csrc/thread_pool.c \
 *      csrc/cpu_features.c -lpthread -lm -o /tmp/test_cpu_optim && /tmp/test_cpu_optim
 *
 * Exit status: 0 pass, 1 fail (what failed on stderr), 77 skip.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_optim.h"
#include "thread_pool.h"

#define T_EXIT_PASS 0
#define T_EXIT_FAIL 1
#define T_EXIT_SKIP 77

/* ---------------------------------------------------------------------------------------------------
 * The driver: count how often each element is visited. t->exp_avg holds the counters. */

static atomic_int spans_seen;

static void count_span(const void *ctx, const zx_optim_tensor *t, int64_t b, int64_t e, double *acc)
{
	for (int64_t i = b; i < e; i++)
		t->exp_avg[i] += 1.0f;
	*acc += (double)(e - b);
	atomic_fetch_add(&spans_seen, 1);
}

static int t_driver(unsigned seed)
{
	enum { MAXT = 40 };
	zx_optim_tensor t[MAXT];
	srand(seed);
	for (int round = 0; round < 60; round++) {
		int n = 1 + rand() % MAXT, threads = 1 + rand() % 5;
		if (zx_pool_set_threads(threads)) {
			fprintf(stderr, "set_threads(%d) failed\n", threads);
			return 1;
		}
		int64_t want = 0;
		for (int i = 0; i < n; i++) {
			/* mostly small, sometimes across several tiles, sometimes empty */
			int64_t numel = rand() % 4 == 0 ? rand() % 100000 : rand() % 3000;
			if (rand() % 10 == 0)
				numel = 0;
			memset(&t[i], 0, sizeof(t[i]));
			t[i].numel = numel;
			t[i].exp_avg = calloc((size_t)(numel ? numel : 1), sizeof(float));
			if (!t[i].exp_avg)
				return 1;
			want += numel;
		}
		double sum = -1.0;
		int rc = zx_optim_run(t, n, count_span, NULL, &sum);
		int bad = rc != 0 || sum != (double)want;
		for (int i = 0; i < n && !bad; i++)
			for (int64_t k = 0; k < t[i].numel; k++)
				if (t[i].exp_avg[k] != 1.0f) {
					fprintf(stderr, "round %d: tensor %d element %lld visited %g times\n", round,
						i, (long long)k, t[i].exp_avg[k]);
					bad = 1;
					break;
				}
		for (int i = 0; i < n; i++)
			free(t[i].exp_avg);
		if (bad) {
			fprintf(stderr, "round %d (%d tensors, %d threads): rc %d, sum %g of %lld\n", round, n,
				threads, rc, sum, (long long)want);
			return 1;
		}
	}
	return 0;
}

/* ---------------------------------------------------------------------------------------------------
 * Conversions: every upper 19 bits (sign, exponent, top of the mantissa) with low 13 bits at,
 * around and away from every rounding point, scalar against the vector instructions. */

static const uint32_t lows[] = { 0, 1, 2, 0x7ff, 0x800, 0x801, 0xfff, 0x1000, 0x1001, 0x1555, 0x1fff };

static int t_conversions(void)
{
#if ZX_HAVE_X86
	if (zx_simd_supported() < ZX_SIMD_AVX2)
		return T_EXIT_SKIP;
	enum { N = 1 << 19 };
	const int nl = (int)(sizeof(lows) / sizeof(lows[0]));
	float *x = malloc((size_t)N * nl * sizeof(float));
	uint16_t *vec = malloc((size_t)N * nl * sizeof(uint16_t));
	if (!x || !vec)
		return 1;
	for (uint32_t hi = 0; hi < N; hi++)
		for (int l = 0; l < nl; l++) {
			uint32_t u = (hi << 13) | lows[l];
			memcpy(&x[(size_t)hi * nl + l], &u, sizeof(u));
		}
	int64_t n = (int64_t)N * nl, fails = 0;
	for (int level = ZX_SIMD_AVX2; level <= (int)zx_simd_supported(); level++)
		for (int dtype = ZX_F16; dtype <= ZX_BF16; dtype++) {
			if (zx_cast_f32(vec, dtype, x, n, level)) {
				fprintf(stderr, "zx_cast_f32 failed\n");
				return 1;
			}
			for (int64_t i = 0; i < n && fails < 5; i++) {
				uint16_t s = dtype == ZX_F16 ? zx_f32_to_f16(x[i]) : zx_f32_to_bf16(x[i]);
				if (s != vec[i]) {
					uint32_t u;
					memcpy(&u, &x[i], sizeof(u));
					fprintf(stderr, "%s of 0x%08x: scalar 0x%04x, %s 0x%04x\n",
						dtype == ZX_F16 ? "fp16" : "bf16", u, s, zx_simd_name(level),
						vec[i]);
					fails++;
				}
			}
		}
	free(x);
	free(vec);
	return fails ? 1 : 0;
#else
	return T_EXIT_SKIP;
#endif
}

int main(void)
{
	int rc = t_driver(1);
	if (rc) {
		fprintf(stderr, "driver: FAIL\n");
		return T_EXIT_FAIL;
	}
	if (atomic_load(&spans_seen) == 0)
		return T_EXIT_FAIL;
	rc = t_conversions();
	if (rc == T_EXIT_SKIP) {
		fprintf(stderr, "conversions: skipped (no AVX2 to compare with)\n");
		return T_EXIT_SKIP;
	}
	if (rc) {
		fprintf(stderr, "conversions: FAIL\n");
		return T_EXIT_FAIL;
	}
	return T_EXIT_PASS;
}
