/* cpu_features.c - run-time choice of SIMD path (see cpu_features.h). */
#include "cpu_features.h"

#include <stdlib.h>
#include <string.h>

zx_simd zx_simd_supported(void)
{
#if ZX_HAVE_X86
	__builtin_cpu_init();
	if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
	    __builtin_cpu_supports("avx512vl"))
		return ZX_SIMD_AVX512;
	if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
		return ZX_SIMD_AVX2;
#endif
	return ZX_SIMD_SCALAR;
}

zx_simd zx_simd_level(void)
{
	zx_simd best = zx_simd_supported();
	const char *cap = getenv("ZERO_EXT_ISA");
	if (!cap || !*cap)
		return best;
	zx_simd want = best;
	if (!strcmp(cap, "scalar"))
		want = ZX_SIMD_SCALAR;
	else if (!strcmp(cap, "avx2"))
		want = ZX_SIMD_AVX2;
	else if (!strcmp(cap, "avx512"))
		want = ZX_SIMD_AVX512;
	return want < best ? want : best;
}

const char *zx_simd_name(zx_simd level)
{
	switch (level) {
	case ZX_SIMD_AVX512:
		return "avx512";
	case ZX_SIMD_AVX2:
		return "avx2";
	default:
		return "scalar";
	}
}
