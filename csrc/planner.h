/* planner.h - where every element of a ZeRO model lives: flat layouts, shards, sub-groups, buckets.
 *
 * Pure arithmetic on element counts; no tensors, no allocation. Every later part of zero_ext (the stage
 * 1/2/3 optimizers, NVMe swapping, checkpoints) reads its layout from here, so the layouts are decided
 * once and match DeepSpeed's (see docs/design.md, "Layouts"):
 *
 *   stage 1/2  per param group, parameters are laid end to end in one flat buffer, padded at the end to
 *              a multiple of align * world (DeepSpeed: nccl_start_alignment_factor = 2), then cut into
 *              `world` equal contiguous partitions; a parameter may straddle partitions.
 *   stage 3    every parameter is cut on its own into `world` shards of ceil(numel / world) elements; the
 *              last shards hold the padding (zeroed by the caller).
 *
 * Conventions (liburing's): functions return a count or 0 on success and -errno on bad input (-EINVAL)
 * or overflow (-EOVERFLOW); they never print, never exit. Functions that produce a list take an output
 * array and its capacity, write at most `cap` entries and return how many there are in all, so a caller
 * may ask with cap = 0 first (snprintf's contract).
 */
#ifndef ZX_PLANNER_H
#define ZX_PLANNER_H

#include <stdint.h>

/* One contiguous run of a parameter's elements that one rank owns. */
typedef struct {
	int64_t param;         /* index of the parameter in the list given, e.g. 3 */
	int64_t rank;          /* owning rank, 0 <= rank < world */
	int64_t param_offset;  /* first element of the run within the (flattened) parameter */
	int64_t part_offset;   /* first element of the run within the owner's partition / shard */
	int64_t bucket_offset; /* first element within the bucket buffer; -1 outside bucket plans */
	int64_t length;        /* elements in the run, > 0 */
} zx_piece;

/* ---- stage 1/2: one flat buffer per param group ------------------------------------------------- */

/* Lays `n` parameters of numel[i] elements end to end; offset[i] receives the start of parameter i
 * (offset may be NULL). Returns the padded length of the flat buffer: the smallest multiple of
 * align * world that holds them all (0 for an empty or all-empty group), or -errno.
 * The partition of each rank is padded_length / world elements long. */
int64_t zx_flat_layout(const int64_t *numel, int64_t n, int64_t world, int64_t align, int64_t *offset);

/* The pieces of every parameter that fall into the partition of `rank`, in flat order, with
 * bucket_offset = -1. Zero-size parameters own no piece. Returns the number of pieces, or -errno. */
int64_t zx_flat_fragments(const int64_t *numel, int64_t n, int64_t world, int64_t align, int64_t rank,
			  zx_piece *out, int64_t cap);

/* A bucket of whole parameters order[0..count) copied back to back into one buffer (in that order):
 * which rank owns which run of it. Pieces come in bucket order; part_offset is within the owner's
 * partition of the flat layout above. Returns the number of pieces, or -errno. */
int64_t zx_flat_bucket_pieces(const int64_t *numel, int64_t n, int64_t world, int64_t align,
			      const int64_t *order, int64_t count, zx_piece *out, int64_t cap);

/* The all-gather of updated partitions, `bucket` elements at a time (allgather_bucket_size): each call
 * gathers `chunk` elements of every rank's partition, chunk = max(align, bucket / world) rounded down
 * to a multiple of align. Returns that chunk length, or -errno; chunks = ceil(partition / chunk). */
int64_t zx_allgather_chunk(int64_t partition, int64_t world, int64_t align, int64_t bucket);

/* ---- stage 3: each parameter sharded on its own -------------------------------------------------- */

/* Elements of one shard: ceil(numel / world) (0 for an empty parameter). */
int64_t zx_shard_numel(int64_t numel, int64_t world);

/* Real (unpadded) elements in the shard of `rank`: numel - rank * shard, clamped to [0, shard]. */
int64_t zx_shard_valid(int64_t numel, int64_t world, int64_t rank);

/* Cuts parameters, in order, into optimizer sub-groups of whole parameters; group_of[i] receives the
 * sub-group of parameter i. As DeepSpeed does, a sub-group is closed as soon as it holds at least
 * `sub_group_size` shard elements, so it may exceed that size by its last parameter; this keeps the
 * sub-group boundaries (and so the checkpoint's fp32 groups) identical to DeepSpeed's.
 * Returns the number of sub-groups, or -errno. */
int64_t zx_sub_groups(const int64_t *numel, int64_t n, int64_t world, int64_t sub_group_size,
		      int64_t *group_of);

/* A reduce-scatter / all-gather bucket of parameters order[0..count) in the rank-major layout that
 * torch's reduce_scatter_tensor / all_gather_into_tensor use: rank r's block holds, back to back, the
 * shard of every parameter (padded to shard_numel), so every block has the same length. One piece per
 * (parameter, rank) with real elements; bucket_offset is its place in the whole bucket buffer.
 * *block (may be NULL) receives the block length. Returns the number of pieces, or -errno. */
int64_t zx_shard_bucket_pieces(const int64_t *numel, int64_t n, int64_t world, const int64_t *order,
			       int64_t count, int64_t *block, zx_piece *out, int64_t cap);

/* ---- buckets -------------------------------------------------------------------------------------- */

/* Groups items of size[order[k]] elements, in the order given, into consecutive buckets of at most
 * `bucket_size` elements; an item larger than the bucket gets one of its own (it is never split, as in
 * DeepSpeed). bucket_of[k] receives the bucket of order[k]; order may be NULL for 0..n-1. Zero-size
 * items join the current bucket. Returns the number of buckets, or -errno. */
int64_t zx_buckets(const int64_t *size, int64_t n, const int64_t *order, int64_t bucket_size,
		   int64_t *bucket_of);

#endif /* ZX_PLANNER_H */
