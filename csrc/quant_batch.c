/* quant_batch.c - the batches of quant.h: the pieces of a collective's records quantized, dequantized,
 * or summed and quantized again, each in one call.
 *
 * Every call cuts its items' blocks into tiles (runs of whole blocks, the same for every item of a
 * group) and threads take tiles from one counter; a tile is one ISA run per item (quant.c), so the
 * result is each item's zx_quantize / zx_dequantize, whatever the threads.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "dtype.h"
#include "quant.h"
#include "quant_internal.h"
#include "thread_pool.h"

/* Elements of a requantizing tile: its fp32 sum stays in the core's L1 / L2 between the additions
 * and the quantization. */
#define REQUANT_TILE 8192

struct batch {
	const struct zx_quant_item *items, *outs; /* outs: requantize's, one per group */
	int64_t ngroups, group, block, run;
	int64_t *first_tile; /* ngroups + 1 prefix sums */
	float *sums;         /* requantize: a tile's sum per thread */
	int accumulate, quantize, requantize;
	const struct quant_paths *p;
	atomic_llong next;
};

static int64_t item_blocks(const struct zx_quant_item *it, int64_t block)
{
	return it->n / block + (it->n % block != 0);
}

/* Item it's blocks [k0, k1) as a job of their own: pointers moved to block k0 (it quantized). */
static struct quant_job slice_job(const struct zx_quant_item *it, int64_t block, int64_t k0, int64_t k1, int quantize)
{
	int64_t b = k0 * block, e = k1 * block < it->n ? k1 * block : it->n;
	int64_t qoff = it->format == ZX_QUANT_INT8 ? b : b / 2; /* b is even for int4: blocks are */
	struct quant_job j = { .format = it->format, .dtype = it->dtype, .level = zx_quant_level(it->format),
			       .scales = it->scales + k0, .n = e - b, .block = block };
	if (quantize) {
		j.src = (const char *)it->src + b * zx_dtype_size(it->dtype);
		j.dst = (char *)it->dst + qoff;
	} else {
		j.src = (const char *)it->src + qoff;
		j.dst = (char *)it->dst + b * zx_dtype_size(it->dtype);
	}
	return j;
}

static void raw_span(const struct zx_quant_item *it, int64_t b, int64_t e, int quantize, int accumulate)
{
	int size = zx_dtype_size(it->dtype);
	if (quantize || !accumulate) {
		memcpy((char *)it->dst + b * size, (const char *)it->src + b * size, (size_t)((e - b) * size));
		return;
	}
	float *dst = it->dst;
	for (int64_t i = b; i < e; i++)
		dst[i] += zx_load_f32(it->src, i, it->dtype);
}

/* Blocks [k0, k1) of every item of group g (quantize_batch, dequantize_batch). */
static void batch_tile(const struct batch *bt, int64_t g, int64_t k0, int64_t k1)
{
	for (int64_t m = 0; m < bt->group; m++) {
		const struct zx_quant_item *it = &bt->items[g * bt->group + m];
		int64_t last = item_blocks(it, bt->block);
		if (k0 >= last)
			continue;
		int64_t end = k1 < last ? k1 : last;
		if (it->format == ZX_QUANT_RAW) {
			int64_t e = end * bt->block < it->n ? end * bt->block : it->n;
			raw_span(it, k0 * bt->block, e, bt->quantize, bt->accumulate);
			continue;
		}
		struct quant_job j = slice_job(it, bt->block, k0, end, bt->quantize);
		if (bt->accumulate) {
			j.accumulate = 1;
			j.dtype = ZX_F32;
		}
		(bt->quantize ? bt->p->quant : bt->p->dequant)(&j, 0, end - k0);
	}
}

/* Blocks [k0, k1) of requantize group g: the items' sum in order into sum (fp32, from 0), then it
 * quantized (or copied, raw) into the group's output. */
static void requant_tile(const struct batch *bt, int64_t g, int64_t k0, int64_t k1, float *sum)
{
	const struct zx_quant_item *out = &bt->outs[g];
	int64_t last = item_blocks(out, bt->block), end = k1 < last ? k1 : last;
	int64_t b = k0 * bt->block, e = end * bt->block < out->n ? end * bt->block : out->n;
	memset(sum, 0, (size_t)(e - b) * sizeof(float));
	for (int64_t m = 0; m < bt->group; m++) {
		const struct zx_quant_item *it = &bt->items[g * bt->group + m];
		if (it->format == ZX_QUANT_RAW) {
			for (int64_t i = b; i < e; i++)
				sum[i - b] += zx_load_f32(it->src, i, it->dtype);
			continue;
		}
		struct quant_job j = slice_job(it, bt->block, k0, end, 0);
		j.dst = sum;
		j.accumulate = 1;
		j.dtype = ZX_F32;
		bt->p->dequant(&j, 0, end - k0);
	}
	if (out->format == ZX_QUANT_RAW) {
		memcpy((float *)out->dst + b, sum, (size_t)(e - b) * sizeof(float));
		return;
	}
	struct quant_job j = slice_job(out, bt->block, k0, end, 1);
	j.src = sum;
	bt->p->quant(&j, 0, end - k0);
}

static void batch_worker(void *arg, int tid, int nthreads)
{
	struct batch *bt = arg;
	float *sum = bt->sums ? bt->sums + tid * bt->run * bt->block : NULL; /* requantize: this thread's */
	for (;;) {
		int64_t t = (int64_t)atomic_fetch_add(&bt->next, 1);
		if (t >= bt->first_tile[bt->ngroups])
			break;
		int64_t lo = 0, hi = bt->ngroups; /* the group holding tile t: first_tile[g] <= t < first_tile[g + 1] */
		while (hi - lo > 1) {
			int64_t mid = (lo + hi) / 2;
			if (bt->first_tile[mid] <= t)
				lo = mid;
			else
				hi = mid;
		}
		int64_t k0 = (t - bt->first_tile[lo]) * bt->run;
		if (bt->requantize)
			requant_tile(bt, lo, k0, k0 + bt->run, sum);
		else
			batch_tile(bt, lo, k0, k0 + bt->run);
	}
}

/* A quantized item of block-aligned blocks, or a raw one (quantized: int8 / int4 with scales). */
static int item_ok(const struct zx_quant_item *it, int64_t block, int need_src, int need_dst)
{
	if (it->n < 0 || (it->n > 0 && ((need_src && !it->src) || (need_dst && !it->dst))))
		return 0;
	if (it->format == ZX_QUANT_RAW)
		return zx_quant_float_dtype(it->dtype);
	return zx_quant_blocks(it->format, it->n, block) >= 0 && (it->n == 0 || it->scales);
}

/* Each group's tiles: enough for its longest item. */
static int64_t *tiles_of(const struct zx_quant_item *items, int64_t ngroups, int64_t group, int64_t block,
			 int64_t run)
{
	int64_t *first = malloc((size_t)(ngroups + 1) * sizeof(int64_t));
	if (!first)
		return NULL;
	first[0] = 0;
	for (int64_t g = 0; g < ngroups; g++) {
		int64_t blocks = 0;
		for (int64_t m = 0; m < group; m++) {
			int64_t b = item_blocks(&items[g * group + m], block);
			blocks = b > blocks ? b : blocks;
		}
		first[g + 1] = first[g] + (blocks + run - 1) / run;
	}
	return first;
}

static int run_tiles(struct batch *bt, int64_t total)
{
	bt->first_tile = tiles_of(bt->items, bt->ngroups, bt->group, bt->block, bt->run);
	if (!bt->first_tile)
		return -ENOMEM;
	int threads = total < QUANT_INLINE || bt->first_tile[bt->ngroups] < 2 ? 1 : zx_pool_threads();
	int rc = 0;
	if (bt->requantize && !(bt->sums = malloc((size_t)(threads * bt->run * bt->block) * sizeof(float))))
		rc = -ENOMEM;
	atomic_init(&bt->next, 0);
	if (!rc)
		rc = zx_pool_run(batch_worker, bt, threads);
	free(bt->sums);
	free(bt->first_tile);
	return rc;
}

static int run_batch(const struct zx_quant_item *items, int64_t nitems, int64_t group, int64_t block,
		     int accumulate, int quantize, int isa)
{
	const struct quant_paths *p = zx_quant_paths(isa);
	if (!p || nitems < 0 || group < 1 || nitems % group || block < 1 || (nitems && !items))
		return -EINVAL;
	int64_t total = 0;
	for (int64_t i = 0; i < nitems; i++) {
		const struct zx_quant_item *it = &items[i], *lead = &items[i - i % group];
		int wide = it->format == ZX_QUANT_RAW || quantize || !accumulate || it->dtype == ZX_F32;
		if (!item_ok(it, block, 1, 1) || !zx_quant_float_dtype(it->dtype) || !wide ||
		    (accumulate && (it->dst != lead->dst || it->n != lead->n)))
			return -EINVAL;
		total += it->n;
	}
	struct batch bt = { .items = items, .ngroups = nitems / group, .group = group, .block = block,
			    .run = block >= QUANT_RUN ? 1 : QUANT_RUN / block, .accumulate = accumulate,
			    .quantize = quantize, .p = p };
	return run_tiles(&bt, total);
}

int zx_quantize_batch(const struct zx_quant_item *items, int64_t nitems, int64_t block, int isa)
{
	return run_batch(items, nitems, 1, block, 0, 1, isa);
}

int zx_dequantize_batch(const struct zx_quant_item *items, int64_t nitems, int64_t group, int64_t block,
			int accumulate, int isa)
{
	return run_batch(items, nitems, group, block, accumulate, 0, isa);
}

int zx_requantize_batch(const struct zx_quant_item *items, int64_t nitems, int64_t group,
			const struct zx_quant_item *outs, int64_t block, int isa)
{
	const struct quant_paths *p = zx_quant_paths(isa);
	if (!p || nitems < 0 || group < 1 || nitems % group || block < 1 || (nitems && (!items || !outs)))
		return -EINVAL;
	int64_t total = 0;
	for (int64_t i = 0; i < nitems; i++) {
		const struct zx_quant_item *it = &items[i], *out = &outs[i / group];
		if (!item_ok(it, block, 1, 0) || (it->format != ZX_QUANT_RAW && it->dtype != ZX_F32) ||
		    it->n != out->n || !item_ok(out, block, 0, 1) || out->dtype != ZX_F32)
			return -EINVAL;
		total += it->n;
	}
	int64_t run = block >= REQUANT_TILE ? 1 : REQUANT_TILE / block;
	struct batch bt = { .items = items, .outs = outs, .ngroups = nitems / group, .group = group,
			    .block = block, .run = run, .requantize = 1, .p = p };
	return run_tiles(&bt, total);
}
