/* comm_state.c - one parameter's fragments across ranks: the data path of the state routines
 * (zero_ext/utils/safe_state.py: safe_get / safe_set, full and local forms).
 *
 * Owns: the fragment map of one parameter (which rank holds which real elements, where), the full read
 * as an all-gather-v of the fragments (only real bytes move: no zero-filled full buffer, no sum), the
 * full write as a copy of this rank's run out of the full value, and the local forms' copies. The
 * Python layer keeps the lifecycle checks (gradients exist only between backward and step), the NVMe
 * materialisation and DeepSpeed's names; it does not touch the elements.
 *
 * Division and multiplication by the loss scale are single fp32 IEEE operations per element, as
 * torch's `x / s` and `x * s` on an fp32 tensor with a Python float: the results are the same bits.
 */
#include "comm.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

int zx_frag_map(int layout, int64_t numel, int64_t offset, int64_t part, int world, int64_t *counts,
		int64_t *param_at, int64_t *part_at)
{
	if (world < 1 || world > ZX_COMM_MAX_WORLD || numel < 0 || offset < 0 || part < 0)
		return -EINVAL;
	if (layout == ZX_FRAG_SHARDS) {
		if (part > 0 ? (numel + part - 1) / part > world : numel > 0)
			return -EINVAL; /* the shards do not cover the parameter */
		for (int r = 0; r < world; r++) {
			int64_t n = numel - (int64_t)r * part;
			counts[r] = n <= 0 ? 0 : n < part ? n : part;
			param_at[r] = counts[r] ? (int64_t)r * part : 0;
			part_at[r] = offset;
		}
		return 0;
	}
	if (layout != ZX_FRAG_FLAT || offset > INT64_MAX - numel || (numel && part == 0) ||
	    (part && offset + numel > part * (int64_t)world))
		return -EINVAL; /* outside the flat buffer */
	for (int r = 0; r < world; r++) {
		int64_t lo = (int64_t)r * part, hi = lo + part;
		int64_t a = offset > lo ? offset : lo, b = offset + numel < hi ? offset + numel : hi;
		counts[r] = b > a ? b - a : 0;
		param_at[r] = counts[r] ? a - offset : 0;
		part_at[r] = counts[r] ? a - lo : 0;
	}
	return 0;
}

int zx_frag_copy(const float *src, float *dst, int64_t count, int mode, float factor)
{
	if (count < 0 || (count && (!src || !dst)) || mode < 0 || mode > 2)
		return -EINVAL;
	if (mode == 0 || (factor == 1.0f && mode != 0)) {
		if (src != dst && count)
			memmove(dst, src, (size_t)count * sizeof(float));
	} else if (mode == 1) {
		for (int64_t i = 0; i < count; i++)
			dst[i] = src[i] / factor;
	} else {
		for (int64_t i = 0; i < count; i++)
			dst[i] = src[i] * factor;
	}
	return 0;
}

int zx_frag_gather(struct zx_comm *comm, int layout, int64_t numel, int64_t offset, int64_t part,
		   const float *partition, float *out, float divisor, char *msg, int64_t msg_len)
{
	int world = comm ? zx_comm_world(comm) : 1, rank = comm ? zx_comm_rank(comm) : 0;
	if (msg && msg_len > 0)
		msg[0] = 0;
	if (numel && !out)
		return -EINVAL;
	int64_t counts[world], param_at[world], part_at[world]; /* world <= ZX_COMM_MAX_WORLD: 24 KiB */
	int rc = zx_frag_map(layout, numel, offset, part, world, counts, param_at, part_at);
	if (rc < 0)
		return rc;
	if (counts[rank] && !partition)
		return -EINVAL;
	const float *mine = counts[rank] ? partition + part_at[rank] : NULL;
	if (!comm) { /* one rank holds it whole (a replicated state, or a world of one) */
		memset(out, 0, (size_t)numel * sizeof(float));
		rc = zx_frag_copy(mine, out + param_at[0], counts[0], 1, divisor);
		return rc;
	}
	int64_t bytes[world];
	for (int r = 0; r < world; r++)
		bytes[r] = counts[r] * (int64_t)sizeof(float);
	struct zx_comm_op *op;
	rc = zx_comm_all_gather_v(comm, mine, out, bytes, &op);
	if (rc < 0)
		return rc;
	rc = zx_comm_wait(op);
	if (rc < 0 && msg && msg_len > 0)
		snprintf(msg, (size_t)msg_len, "%s", zx_comm_op_error(op));
	zx_comm_op_free(op);
	if (rc < 0)
		return rc;
	return divisor == 1.0f ? 0 : zx_frag_copy(out, out, numel, 1, divisor);
}

int zx_frag_scatter(int layout, int64_t numel, int64_t offset, int64_t part, int world, int rank,
		    const float *full, float *partition, float factor)
{
	if (world < 1 || world > ZX_COMM_MAX_WORLD || rank < 0 || rank >= world)
		return -EINVAL;
	int64_t counts[world], param_at[world], part_at[world];
	int rc = zx_frag_map(layout, numel, offset, part, world, counts, param_at, part_at);
	if (rc < 0)
		return rc;
	if (!counts[rank])
		return 0;
	if (!full || !partition)
		return -EINVAL;
	return zx_frag_copy(full + param_at[rank], partition + part_at[rank], counts[rank], 2, factor);
}
