/* planner.c - the layouts of planner.h: flat stage 1/2 partitions, stage 3 shards, buckets. */
#include "planner.h"

#include <errno.h>
#include <stddef.h>

/* Sums and products here are on element counts; anything past 2^62 is a caller's bug, not a model. */
#define ZX_MAX_ELEMS ((int64_t)1 << 62)

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Appends a piece if there is room; the count goes on either way (snprintf's contract). */
static void put_piece(zx_piece *out, int64_t cap, int64_t k, zx_piece piece)
{
	if (out && k < cap)
		out[k] = piece;
}

static int check_list(const int64_t *numel, int64_t n)
{
	if (n < 0 || (n > 0 && !numel))
		return -EINVAL;
	return 0;
}

/* ---- stage 1/2 ------------------------------------------------------------------------------------ */

int64_t zx_flat_layout(const int64_t *numel, int64_t n, int64_t world, int64_t align, int64_t *offset)
{
	if (check_list(numel, n) || world < 1 || align < 1)
		return -EINVAL;
	if (world > ZX_MAX_ELEMS / align)
		return -EOVERFLOW;
	int64_t total = 0;
	for (int64_t i = 0; i < n; i++) {
		if (numel[i] < 0)
			return -EINVAL;
		if (numel[i] > ZX_MAX_ELEMS - total)
			return -EOVERFLOW;
		if (offset)
			offset[i] = total;
		total += numel[i];
	}
	int64_t unit = align * world;
	return ceil_div(total, unit) * unit;
}

/* The pieces of parameters [first, last) of a flat layout (starting at `start` elements) that fall in
 * [lo, hi) of the flat buffer, written from index k on. Returns the new count. */
static int64_t flat_pieces_in(const int64_t *numel, int64_t n, int64_t part, int64_t lo, int64_t hi,
			      zx_piece *out, int64_t cap, int64_t k)
{
	int64_t start = 0;
	for (int64_t i = 0; i < n && start < hi; start += numel[i], i++) {
		int64_t a = max64(start, lo), b = min64(start + numel[i], hi);
		if (a >= b)
			continue;
		zx_piece p = { .param = i, .rank = a / part, .param_offset = a - start,
			       .part_offset = a % part, .bucket_offset = -1, .length = b - a };
		put_piece(out, cap, k++, p);
	}
	return k;
}

int64_t zx_flat_fragments(const int64_t *numel, int64_t n, int64_t world, int64_t align, int64_t rank,
			  zx_piece *out, int64_t cap)
{
	int64_t padded = zx_flat_layout(numel, n, world, align, NULL);
	if (padded < 0)
		return padded;
	if (rank < 0 || rank >= world || cap < 0)
		return -EINVAL;
	int64_t part = padded / world;
	if (part == 0)
		return 0;
	return flat_pieces_in(numel, n, part, rank * part, (rank + 1) * part, out, cap, 0);
}

int64_t zx_flat_bucket_pieces(const int64_t *numel, int64_t n, int64_t world, int64_t align,
			      const int64_t *order, int64_t count, zx_piece *out, int64_t cap)
{
	int64_t padded = zx_flat_layout(numel, n, world, align, NULL);
	if (padded < 0)
		return padded;
	if (count < 0 || (count > 0 && !order) || cap < 0)
		return -EINVAL;
	int64_t part = padded / world, k = 0, bucket_pos = 0;
	for (int64_t j = 0; j < count; j++) {
		int64_t i = order[j];
		if (i < 0 || i >= n)
			return -EINVAL;
		int64_t start = 0; /* flat offset of parameter i: a prefix sum, O(n) per bucket entry is */
		for (int64_t q = 0; q < i; q++) /* fine at plan time, and keeps the function allocation-free */
			start += numel[q];
		for (int64_t a = start; a < start + numel[i];) {
			int64_t owner = a / part;
			int64_t b = min64(start + numel[i], (owner + 1) * part);
			zx_piece p = { .param = i, .rank = owner, .param_offset = a - start,
				       .part_offset = a - owner * part,
				       .bucket_offset = bucket_pos + (a - start), .length = b - a };
			put_piece(out, cap, k++, p);
			a = b;
		}
		bucket_pos += numel[i];
	}
	return k;
}

int64_t zx_allgather_chunk(int64_t partition, int64_t world, int64_t align, int64_t bucket)
{
	if (partition < 0 || world < 1 || align < 1 || bucket < 0)
		return -EINVAL;
	int64_t chunk = bucket / world / align * align;
	return max64(chunk, align);
}

/* ---- stage 3 -------------------------------------------------------------------------------------- */

int64_t zx_shard_numel(int64_t numel, int64_t world)
{
	if (numel < 0 || world < 1)
		return -EINVAL;
	return ceil_div(numel, world);
}

int64_t zx_shard_valid(int64_t numel, int64_t world, int64_t rank)
{
	int64_t shard = zx_shard_numel(numel, world);
	if (shard < 0 || rank < 0 || rank >= world)
		return -EINVAL;
	return max64(0, min64(shard, numel - rank * shard));
}

int64_t zx_sub_groups(const int64_t *numel, int64_t n, int64_t world, int64_t sub_group_size,
		      int64_t *group_of)
{
	if (check_list(numel, n) || world < 1 || sub_group_size < 0 || (n > 0 && !group_of))
		return -EINVAL;
	int64_t group = 0, held = 0;
	for (int64_t i = 0; i < n; i++) {
		int64_t shard = zx_shard_numel(numel[i], world);
		if (shard < 0)
			return shard;
		group_of[i] = group;
		held += shard;
		if (held >= sub_group_size && i + 1 < n) {
			group++;
			held = 0;
		}
	}
	return n > 0 ? group + 1 : 0;
}

int64_t zx_shard_bucket_pieces(const int64_t *numel, int64_t n, int64_t world, const int64_t *order,
			       int64_t count, int64_t *block, zx_piece *out, int64_t cap)
{
	if (check_list(numel, n) || world < 1 || count < 0 || (count > 0 && !order) || cap < 0)
		return -EINVAL;
	int64_t len = 0;
	for (int64_t j = 0; j < count; j++) {
		if (order[j] < 0 || order[j] >= n || numel[order[j]] < 0)
			return -EINVAL;
		int64_t shard = zx_shard_numel(numel[order[j]], world);
		if (shard > ZX_MAX_ELEMS / world - len)
			return -EOVERFLOW;
		len += shard;
	}
	if (block)
		*block = len;
	int64_t k = 0;
	for (int64_t r = 0; r < world; r++) {
		int64_t pos = r * len;
		for (int64_t j = 0; j < count; j++) {
			int64_t i = order[j], shard = zx_shard_numel(numel[i], world);
			int64_t valid = zx_shard_valid(numel[i], world, r);
			if (valid > 0) {
				zx_piece p = { .param = i, .rank = r, .param_offset = r * shard,
					       .part_offset = 0, .bucket_offset = pos, .length = valid };
				put_piece(out, cap, k++, p);
			}
			pos += shard;
		}
	}
	return k;
}

/* ---- buckets -------------------------------------------------------------------------------------- */

int64_t zx_buckets(const int64_t *size, int64_t n, const int64_t *order, int64_t bucket_size,
		   int64_t *bucket_of)
{
	if (check_list(size, n) || bucket_size < 0 || (n > 0 && !bucket_of))
		return -EINVAL;
	int64_t bucket = -1, held = 0;
	for (int64_t k = 0; k < n; k++) {
		int64_t i = order ? order[k] : k;
		if (i < 0 || i >= n || size[i] < 0)
			return -EINVAL;
		/* open a new bucket when this item would overflow a non-empty one */
		if (bucket < 0 || (held > 0 && size[i] > bucket_size - held)) {
			bucket++;
			held = 0;
		}
		bucket_of[k] = bucket;
		held += size[i];
	}
	return bucket + 1;
}
