/* cpu_features.h - which SIMD paths this CPU runs, read once at run time (cpuid), so that one build of
 * zero_ext runs on any x86-64 CPU. Fast paths are compiled with per-function target attributes
 * (ZX_TARGET_AVX512, ZX_TARGET_AVX2) and chosen through zx_simd_level(). */
#ifndef ZX_CPU_FEATURES_H
#define ZX_CPU_FEATURES_H

typedef enum {
	ZX_SIMD_SCALAR = 0, /* portable C */
	ZX_SIMD_AVX2 = 1,   /* AVX2 + FMA + F16C */
	ZX_SIMD_AVX512 = 2, /* AVX-512 F + BW + VL */
} zx_simd;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ZX_HAVE_X86 1
#define ZX_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZX_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#else
#define ZX_HAVE_X86 0
#endif

/* The best level this CPU supports, capped by the environment variable ZERO_EXT_ISA
 * ("scalar", "avx2", "avx512"), which tests and benchmarks use to run every path on one machine. */
zx_simd zx_simd_level(void);

/* The best level this CPU supports, ignoring ZERO_EXT_ISA. */
zx_simd zx_simd_supported(void);

/* "scalar", "avx2" or "avx512". */
const char *zx_simd_name(zx_simd level);

#endif /* ZX_CPU_FEATURES_H */
