/* comm_shm_rounds.c - the shared-memory transport's rounds: an op's streams (comm_internal.h) moved
 * through the slots of the segment (comm_shm.c), window by window, the copies and reductions of a
 * large round split over the C thread pool (the host's CPUs shared among its ranks).
 */
#include "comm_shm.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "thread_pool.h"

struct run_ctx {
	struct zx_comm *comm;
	struct zx_comm_op *op;
	uint64_t round, set;
	_Atomic int next;
	_Atomic int status;
};

static int add_job2(struct zx_shm *s, char *dst, char *dst2, const char *src, int64_t slot_off, int64_t bytes,
		    int reduce)
{
	for (int64_t at = 0; at < bytes; at += SHM_PIECE) { /* pieces for the pool (element multiples) */
		if (s->njobs == s->cap) {
			int cap = s->cap ? 2 * s->cap : 64;
			struct shm_job *jobs = realloc(s->jobs, (size_t)cap * sizeof(*jobs));
			if (!jobs)
				return -ENOMEM;
			s->jobs = jobs;
			s->cap = cap;
		}
		int64_t n = bytes - at < SHM_PIECE ? bytes - at : SHM_PIECE;
		s->jobs[s->njobs++] = (struct shm_job){ dst + at, dst2 ? dst2 + at : NULL, src ? src + at : NULL,
							slot_off + at, n, reduce };
	}
	return 0;
}

static int add_job(struct zx_shm *s, char *dst, const char *src, int64_t slot_off, int64_t bytes, int reduce)
{
	return add_job2(s, dst, NULL, src, slot_off, bytes, reduce);
}

static int do_job(const struct run_ctx *ctx, const struct shm_job *j)
{
	if (!j->reduce) {
		memcpy(j->dst, j->src, (size_t)j->bytes);
		return 0;
	}
	const struct zx_shm *s = ctx->comm->shm;
	const struct zx_comm_op *op = ctx->op;
	const void *srcs[ZX_COMM_MAX_WORLD];
	for (int r = 0; r < s->h->world; r++)
		srcs[r] = shm_slot(s, ctx->set, r) + j->slot_off;
	if (j->src)
		srcs[ctx->comm->rank] = j->src;
	return zx_comm_reduce_kernel2(op->dtype, op->redop, op->scale, srcs, s->h->world, j->dst, j->dst2,
				      j->bytes / zx_dtype_size(op->dtype), -1);
}

static void pool_fn(void *arg, int tid, int nthreads)
{
	struct run_ctx *ctx = arg;
	const struct zx_shm *s = ctx->comm->shm;
	for (int i; (i = atomic_fetch_add(&ctx->next, 1)) < s->njobs;) {
		int rc = do_job(ctx, &s->jobs[i]);
		if (rc < 0)
			atomic_store(&ctx->status, rc);
	}
}

static int run_jobs(struct run_ctx *ctx, int64_t bytes)
{
	struct zx_shm *s = ctx->comm->shm;
	atomic_store(&ctx->next, 0);
	atomic_store(&ctx->status, 0);
	if (bytes >= SHM_POOL_MIN && s->threads > 1 && s->njobs > 1)
		zx_pool_run(pool_fn, ctx, s->threads);
	else
		pool_fn(ctx, 0, 1);
	s->njobs = 0;
	return atomic_load(&ctx->status);
}

/* The op's stamp (comm_shm.h) into this rank's seat, for the first round of the op, at slot set `set`. */
static void stamp_op(struct zx_shm *s, int me, const struct zx_comm_op *op, uint64_t set)
{
	struct shm_stamp *st = &shm_seat_of(s, me)->stamp[set & 1];
	st->seq = op->seq;
	st->span = op->span;
	st->dtype = op->dtype; /* (a reduce's too on the ranks that receive nothing) */
	st->redop = op->redop;
	snprintf(st->verb, sizeof(st->verb), "%s", op->verb);
}

static int describe(char *buf, size_t len, const struct shm_stamp *st)
{
	static const char *redops[] = { "sum", "avg", "max", "min" };
	if (st->dtype < 0)
		return snprintf(buf, len, "%.31s #%lld (%lld bytes)", st->verb, (long long)st->seq, (long long)st->span);
	return snprintf(buf, len, "%.31s #%lld (%lld bytes, dtype %d, %s)", st->verb, (long long)st->seq,
			(long long)st->span, st->dtype, st->redop >= 0 && st->redop < 4 ? redops[st->redop] : "?");
}

/* After the first barrier of an op: every rank's stamp equals this rank's, else -EPROTO naming both. */
static int check_stamps(struct zx_comm *comm, struct zx_comm_op *op, uint64_t set)
{
	const struct zx_shm *s = comm->shm;
	const struct shm_stamp *mine = &shm_seat_of(s, comm->rank)->stamp[set & 1];
	for (int r = 0; r < s->h->world; r++) {
		const struct shm_stamp *st = &shm_seat_of(s, r)->stamp[set & 1];
		if (st->seq == mine->seq && st->span == mine->span && st->dtype == mine->dtype &&
		    st->redop == mine->redop && !strncmp(st->verb, mine->verb, sizeof(st->verb)))
			continue;
		char a[96], b[96];
		describe(a, sizeof(a), mine);
		describe(b, sizeof(b), st);
		snprintf(op->error, sizeof(op->error), "ranks in different collectives: rank %d in %.80s, rank %d in %.80s",
			 comm->rank, a, r, b);
		return -EPROTO;
	}
	return 0;
}

/* [lo, hi) = [a, a + n) ∩ [w0, w1); 0 when empty. */
static int overlap(int64_t a, int64_t n, int64_t w0, int64_t w1, int64_t *lo, int64_t *hi)
{
	*lo = a > w0 ? a : w0;
	*hi = a + n < w1 ? a + n : w1;
	return *lo < *hi;
}

static int fail_jobs(struct zx_comm_op *op, int rc)
{
	snprintf(op->error, sizeof(op->error), "%s #%lld: %s", op->verb, (long long)op->seq,
		 rc == -ENOMEM ? "out of memory" : "unsupported dtype or reduction");
	return rc;
}

/* A round's first half: the jobs queued so far (rc: how queueing them went) run, then this rank
 * arrives; at an op's first round its stamp is posted before the barrier and compared after it. */
static int write_and_meet(struct run_ctx *ctx, int rc, int64_t moved, int first)
{
	struct zx_comm *comm = ctx->comm;
	if (!rc)
		rc = run_jobs(ctx, moved);
	if (rc < 0)
		return fail_jobs(ctx->op, rc);
	if (first)
		stamp_op(comm->shm, comm->rank, ctx->op, ctx->set);
	rc = zx_shm_arrive(comm, ctx->op, ctx->round);
	if (rc == 0 && first)
		rc = check_stamps(comm, ctx->op, ctx->set);
	return rc;
}

/* The reads of window [w0, w1): own == 1, those this rank serves from its own input (its own bytes
 * inside one input segment: they need no other rank, so they run before the barrier, beside the
 * writes); own == 0, the rest, out of the slots. Returns 0 or -ENOMEM; *moved counts the bytes. */
static int add_reads(struct zx_shm *s, int me, const struct zx_comm_op *op, uint64_t set, int64_t w0,
		     int64_t w1, int own, int64_t *moved)
{
	int k = 0; /* own reads come in stream order: one cursor over the segments, not a scan per read */
	int64_t seg_at = 0, lo, hi;
	for (int i = 0; i < op->nreads; i++) {
		const struct zx_comm_read *r = &op->reads[i];
		if (!overlap(r->off, r->len, w0, w1, &lo, &hi))
			continue;
		const char *src = shm_slot(s, set, r->src) + (lo - w0);
		char *dst = r->dst + (lo - r->off);
		int from_input = 0;
		if (r->src == me) { /* own bytes: from the input itself, unless already there */
			while (k < op->nsegs && seg_at + op->segs[k].len <= lo)
				seg_at += op->segs[k++].len;
			if (k < op->nsegs && lo >= seg_at && hi <= seg_at + op->segs[k].len) {
				src = op->segs[k].ptr + (lo - seg_at);
				from_input = 1;
			}
		}
		if (from_input != own || src == dst)
			continue;
		if (add_job(s, dst, src, 0, hi - lo, 0) < 0)
			return -ENOMEM;
		*moved += hi - lo;
	}
	return 0;
}

static int one_round(struct zx_comm *comm, struct zx_comm_op *op, int64_t w0, int64_t w1)
{
	struct zx_shm *s = comm->shm;
	struct run_ctx ctx = { .comm = comm, .op = op, .round = ++s->round, .set = ++s->sets };
	char *mine = shm_slot(s, ctx.set, comm->rank);
	int64_t lo, hi, at = 0, moved = 0;
	int rc = 0;
	for (int i = 0; i < op->nsegs && !rc; at += op->segs[i].len, i++)
		if (overlap(at, op->segs[i].len, w0, w1, &lo, &hi)) {
			rc = add_job(s, mine + (lo - w0), op->segs[i].ptr + (lo - at), 0, hi - lo, 0);
			moved += hi - lo;
		}
	if (!rc)
		rc = add_reads(s, comm->rank, op, ctx.set, w0, w1, 1, &moved);
	rc = write_and_meet(&ctx, rc, moved, w0 == 0);
	if (rc < 0)
		return rc;
	moved = 0;
	rc = add_reads(s, comm->rank, op, ctx.set, w0, w1, 0, &moved);
	int size = op->nreds ? zx_dtype_size(op->dtype) : 1;
	for (int i = 0; i < op->nreds && !rc; i++) {
		const struct zx_comm_red *r = &op->reds[i];
		if (overlap(r->off, r->count * size, w0, w1, &lo, &hi)) {
			rc = add_job(s, r->dst + (lo - r->off), NULL, lo - w0, hi - lo, 1);
			moved += (hi - lo) * s->h->world;
		}
	}
	if (!rc)
		rc = run_jobs(&ctx, moved);
	return rc < 0 ? fail_jobs(op, rc) : 0;
}

/* Rank q's share of a window of n elements of `size` bytes: [*lo, *hi) in elements. */
static void share_of(int64_t n, int size, int world, int q, int64_t *lo, int64_t *hi)
{
	int64_t align = SHM_SHARE_ALIGN / size > 1 ? SHM_SHARE_ALIGN / size : 1;
	int64_t share = ((n + world - 1) / world + align - 1) / align * align;
	*lo = (int64_t)q * share < n ? (int64_t)q * share : n;
	*hi = *lo + share < n ? *lo + share : n;
}

/* One round of a split all-reduce over bytes [w0, w1) of the input (op->segs[0]) into the output
 * (op->reds[0].dst): the others' shares into this rank's slot; arrive; this rank's share reduced
 * into its output and, in the same pass, into its slot; arrive; the others' shares out of their slots. */
static int split_round(struct zx_comm *comm, struct zx_comm_op *op, int64_t w0, int64_t w1)
{
	struct zx_shm *s = comm->shm;
	struct run_ctx ctx = { .comm = comm, .op = op, .round = ++s->round, .set = ++s->sets };
	int world = s->h->world, me = comm->rank, size = zx_dtype_size(op->dtype);
	const char *in = op->segs[0].ptr + w0;
	char *out = op->reds[0].dst + w0, *mine = shm_slot(s, ctx.set, me);
	int64_t n = (w1 - w0) / size, lo, hi, lo_me, hi_me;
	share_of(n, size, world, me, &lo_me, &hi_me);
	int rc = add_job(s, mine, in, 0, lo_me * size, 0);
	if (!rc)
		rc = add_job(s, mine + hi_me * size, in + hi_me * size, 0, (n - hi_me) * size, 0);
	rc = write_and_meet(&ctx, rc, (n - (hi_me - lo_me)) * size, w0 == 0);
	if (rc < 0)
		return rc;
	rc = add_job2(s, out + lo_me * size, mine + lo_me * size, in + lo_me * size, lo_me * size,
		      (hi_me - lo_me) * size, 1);
	if (!rc)
		rc = run_jobs(&ctx, (hi_me - lo_me) * size * world);
	if (rc < 0)
		return fail_jobs(op, rc);
	rc = zx_shm_arrive(comm, op, ctx.round = ++s->round);
	if (rc < 0)
		return rc;
	for (int q = 0; q < world && !rc; q++) {
		if (q == me)
			continue; /* already in the output */
		share_of(n, size, world, q, &lo, &hi);
		rc = add_job(s, out + lo * size, shm_slot(s, ctx.set, q) + lo * size, 0, (hi - lo) * size, 0);
	}
	if (!rc)
		rc = run_jobs(&ctx, (n - (hi_me - lo_me)) * size);
	return rc < 0 ? fail_jobs(op, rc) : 0;
}

/* Bytes of each rank's chunk a scatter round moves: `world` of them fill a slot (aligned, whole elements). */
static int64_t scatter_window(int64_t slot, int world, int size)
{
	int64_t align = SHM_SHARE_ALIGN % size ? size : SHM_SHARE_ALIGN;
	int64_t w = slot / world / align * align;
	return w > 0 ? w : size;
}

/* One round of a split reduce-scatter: bytes [c0, c1) of every rank's chunk (rank q's chunk is bytes
 * [q * chunk, (q + 1) * chunk) of every stream). This rank copies into its slot, at q * window, its part
 * of the chunks the others keep (its own stays in its input); arrives; then reduces its own chunk's
 * window straight into its output, its own operand read in place, the others' from their slots, in
 * rank order (the bits of the unsplit reduction). One barrier; no rank idles while another reduces. */
static int scatter_round(struct zx_comm *comm, struct zx_comm_op *op, int64_t chunk, int64_t window,
			 int64_t c0, int64_t c1)
{
	struct zx_shm *s = comm->shm;
	struct run_ctx ctx = { .comm = comm, .op = op, .round = ++s->round, .set = ++s->sets };
	int world = s->h->world, me = comm->rank;
	const char *in = op->segs[0].ptr;
	char *mine = shm_slot(s, ctx.set, me);
	int64_t len = c1 - c0;
	int rc = 0;
	for (int q = 0; q < world && !rc; q++)
		if (q != me && len > 0)
			rc = add_job(s, mine + q * window, in + q * chunk + c0, 0, len, 0);
	rc = write_and_meet(&ctx, rc, (world - 1) * len, c0 == 0);
	if (rc < 0 || len == 0 || !op->nreds)
		return rc;
	rc = add_job(s, op->reds[0].dst + c0, in + me * chunk + c0, me * window, len, 1);
	if (!rc)
		rc = run_jobs(&ctx, len * world);
	return rc < 0 ? fail_jobs(op, rc) : 0;
}

static int run_scatter(struct zx_comm *comm, struct zx_comm_op *op)
{
	int world = comm->world;
	int64_t chunk = op->span / world;
	int64_t window = scatter_window(comm->shm->slot, world, zx_dtype_size(op->dtype));
	int64_t c0 = 0;
	do { /* at least one round: an empty op still meets */
		int64_t c1 = chunk - c0 < window ? chunk : c0 + window;
		int rc = scatter_round(comm, op, chunk, window, c0, c1);
		if (rc < 0)
			return rc;
		c0 = c1;
	} while (c0 < chunk);
	return 0;
}

int zx_shm_run(struct zx_comm *comm, struct zx_comm_op *op)
{
	int64_t slot = comm->shm->slot;
	int64_t w0 = 0;
	int whole = comm->world > 1 && op->nsegs == 1 && op->nreds <= 1;
	if (whole && op->split == ZX_SPLIT_SCATTER && op->span % comm->world == 0 &&
	    (!op->nreds || (op->reds[0].off == comm->rank * (op->span / comm->world) &&
			    op->reds[0].count * zx_dtype_size(op->dtype) == op->span / comm->world)))
		return run_scatter(comm, op);
	int split = whole && op->split == ZX_SPLIT_ALL_REDUCE && op->nreds == 1 &&
		    op->span >= (slot < SHM_SPLIT_MIN ? slot : SHM_SPLIT_MIN);
	do { /* at least one round: a barrier, or an op every rank sends nothing to, still meets */
		int64_t w1 = op->span - w0 < slot ? op->span : w0 + slot;
		int rc = split ? split_round(comm, op, w0, w1) : one_round(comm, op, w0, w1);
		if (rc < 0)
			return rc;
		w0 = w1;
	} while (w0 < op->span);
	return 0;
}
