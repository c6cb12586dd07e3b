/* quant_internal.h - what quant.c (the kernels, one buffer per call) and quant_batch.c (many buffers per
 * call: the records of a collective) share: a job over one buffer and each ISA's runs of blocks. */
#ifndef ZX_QUANT_INTERNAL_H
#define ZX_QUANT_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>

#define QUANT_RUN 32768        /* elements a thread takes at a time (whole blocks, at least one) */
#define QUANT_INLINE (1 << 16) /* buffers smaller than this run on the caller's thread */

/* One buffer's work. Its blocks k are elements [k block, min((k + 1) block, n)); scales[k] is block k's
 * scale; the integers of element i are at dst (quantize) or src (dequantize) + i (int8) or + i / 2
 * (int4). A job may view a slice of a larger buffer: pointers moved to the slice's first block. */
struct quant_job {
	int format, dtype, level, accumulate;
	const void *src; /* quantize: the input; dequantize: the integers */
	void *dst;       /* quantize: the integers; dequantize: the output (fp32 with accumulate) */
	float *scales;
	int64_t n, block, nblocks, run; /* run: blocks a thread takes at a time (quant.c's single calls) */
	atomic_llong next;              /* the next run to take */
};

typedef void (*zx_quant_run_fn)(const struct quant_job *, int64_t k0, int64_t k1);

/* An ISA's loops over blocks [k0, k1) of a job: quantize (amax, scale, integers) or dequantize. */
struct quant_paths {
	zx_quant_run_fn quant, dequant;
};

/* The paths of isa (-1: zx_simd_level()); NULL for one this CPU lacks. */
const struct quant_paths *zx_quant_paths(int isa);

/* fp32, bf16 or fp16. */
int zx_quant_float_dtype(int dtype);

#endif /* ZX_QUANT_INTERNAL_H */
