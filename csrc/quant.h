/* quant.h - block quantization of fp32 / bf16 / fp16 buffers, the wire formats of ZeRO++: int8 for
 * the weights all-gathered by qwZ, int4 for the gradients reduced by qgZ.
 *
 * Format: the buffer is cut into blocks of `block` elements (the last may be shorter). Each block
 * has one fp32 scale s = amax / L, where amax is the largest |x| of the block and L the format's
 * level (127 for int8, 7 for int4), and each element one signed integer q = rint(x * (L / amax))
 * in [-L, L] (round to nearest even; L / amax is computed once per block). Dequantization is
 * q * s. int8 takes one byte per element; int4 two per byte, element 2k in the low nibble (two's
 * complement), and `block` must then be even so that every block starts on a byte.
 *
 * Error bound, per element: |q * s - x| <= s/2 + 2^-21 (s + |x|), where s/2 is the rounding to an
 * integer and 2^-21 (s + |x|) covers the fp32 roundings of L / amax, x * (L / amax), amax / L and
 * q * s; plus the rounding to the output's dtype for bf16 / fp16.
 * A block of zeros has s = 0 and dequantizes to zeros. A block holding a NaN or an infinity has
 * s = NaN and q = 0: it dequantizes to NaN throughout, so an overflow stays visible after a
 * quantized collective.
 *
 * Every ISA path (scalar reference, AVX2, AVX-512; isa as zx_optim_run takes it: -1 for
 * zx_simd_level()) gives the reference's bits; large buffers are split over the thread pool by
 * blocks, which does not change the result. Functions return 0 or -EINVAL.
 */
#ifndef ZX_QUANT_H
#define ZX_QUANT_H

#include <stdint.h>

typedef enum {
	ZX_QUANT_INT8 = 0,
	ZX_QUANT_INT4 = 1,
} zx_quant_format;

/* L of a format (127 or 7), 0 for an unknown one. */
int zx_quant_level(int format);

/* Bytes of quantized data for n elements: n for int8, ceil(n / 2) for int4; -EINVAL for a bad
 * format or n < 0. */
int64_t zx_quant_data_bytes(int format, int64_t n);

/* Blocks (= scales) for n elements: ceil(n / block); -EINVAL for n < 0, block < 1, or an odd block
 * with int4. */
int64_t zx_quant_blocks(int format, int64_t n, int64_t block);

/* Quantizes src (n elements of dtype ZX_F32, ZX_BF16 or ZX_F16) into q (zx_quant_data_bytes) and
 * scales (zx_quant_blocks fp32 values). */
int zx_quantize(int format, int dtype, const void *src, int64_t n, int64_t block, void *q,
		float *scales, int isa);

/* Dequantizes q and scales (as zx_quantize wrote them for n elements and block) into dst of dtype
 * ZX_F32, ZX_BF16 or ZX_F16. With accumulate (dst fp32 only) adds q * s to dst instead of storing
 * it: one rounding per element, so a reduction of quantized pieces accumulates in fp32. */
int zx_dequantize(int format, const void *q, const float *scales, int64_t n, int64_t block,
		  int dtype, void *dst, int accumulate, int isa);

/* --- batches: the pieces of a collective's record in one call ---------------------------------------
 *
 * An item is one buffer of n elements: format ZX_QUANT_INT8 / INT4 (src, dst and scales as
 * zx_quantize / zx_dequantize take them), or ZX_QUANT_RAW: elements of `dtype` carried unquantized
 * (copied by quantize; by dequantize copied, or added to an fp32 dst with accumulate). dtype is the
 * floating side's: quantize's src, dequantize's dst (a raw item's src; with accumulate the dst is fp32).
 * `group` consecutive items form a group (nitems a multiple of it); with accumulate the items of a
 * group share dst and n and are added in item order, one rounding each, so a sum over ranks comes out
 * the same whatever the threads. Work is cut into runs of whole blocks spread over the thread pool;
 * the result is each item's zx_quantize / zx_dequantize. 0 or -EINVAL (nothing done). */
#define ZX_QUANT_RAW 2

struct zx_quant_item {
	const void *src;
	void *dst;
	float *scales; /* NULL for a raw item */
	int64_t n;
	int32_t format, dtype;
};

int zx_quantize_batch(const struct zx_quant_item *items, int64_t nitems, int64_t block, int isa);
int zx_dequantize_batch(const struct zx_quant_item *items, int64_t nitems, int64_t group, int64_t block,
			int accumulate, int isa);

/* Sums quantized again (ZeRO++ qgZ's second level): the fp32 sum of each group of `group` items, in item
 * order from 0 (read as zx_dequantize_batch with accumulate reads them; their dst is not used), goes into
 * outs[g] (nitems / group of them; the group's n): quantized in outs[g].format, or, raw, stored as fp32
 * (outs' dtype is ZX_F32, their src is not used). The bits are those of dequantizing the group into a
 * zeroed fp32 buffer and quantizing it with zx_quantize_batch, without the buffer: a tile's sum stays in
 * cache between the two. 0, -EINVAL (nothing done) or -ENOMEM. */
int zx_requantize_batch(const struct zx_quant_item *items, int64_t nitems, int64_t group,
			const struct zx_quant_item *outs, int64_t block, int isa);

#endif /* ZX_QUANT_H */
