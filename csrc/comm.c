/* comm.c - the communicator of comm.h: verbs described as ops (comm_internal.h), their queue, the
 * progress thread that runs them in call order, and the handles callers wait on.
 *
 * Owns: the op descriptions (one allocation each, arrays inline), the queue (under comm->lock), the
 * progress thread. A handle's wait is a futex on the op itself, so waiting touches nothing the
 * communicator frees. Does NOT move bytes (the transport does: comm_shm.c) or name peers' faults
 * (the transport's messages do).
 */
#define _GNU_SOURCE
#include "comm_internal.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "dtype.h"

/* ---------------------------------------------------------------------------------------------------
 * Handles */

static void op_unref(struct zx_comm_op *op)
{
	if (atomic_fetch_sub(&op->refs, 1) == 1)
		free(op);
}

static void run_queued(struct zx_comm *comm, struct zx_comm_op *upto);

int zx_comm_wait(struct zx_comm_op *op)
{
	if (!atomic_load_explicit(&op->done, memory_order_acquire) && op->comm->pid == getpid())
		run_queued(op->comm, op);
	while (!atomic_load_explicit(&op->done, memory_order_acquire))
		syscall(SYS_futex, &op->done, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
	return op->status;
}

int zx_comm_test(const struct zx_comm_op *op)
{
	return (int)atomic_load_explicit(&op->done, memory_order_acquire);
}

const char *zx_comm_op_error(const struct zx_comm_op *op)
{
	return zx_comm_test(op) ? op->error : "";
}

void zx_comm_op_free(struct zx_comm_op *op)
{
	if (op)
		op_unref(op);
}

static void finish(struct zx_comm_op *op, int status)
{
	op->status = status;
	atomic_store_explicit(&op->done, 1, memory_order_release);
	syscall(SYS_futex, &op->done, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
	op_unref(op);
}

/* ---------------------------------------------------------------------------------------------------
 * The progress thread: ops in call order; after a failure every later op fails with its message */

static void run_one(struct zx_comm *comm, struct zx_comm_op *op)
{
	if (comm->failed) {
		snprintf(op->error, sizeof(op->error), "%s #%lld not run: %.180s", op->verb, (long long)op->seq,
			 comm->error);
		finish(op, comm->failed);
		return;
	}
	int rc = zx_shm_run(comm, op);
	if (rc < 0) {
		comm->failed = rc;
		snprintf(comm->error, sizeof(comm->error), "%s", op->error);
		zx_shm_leave(comm, 1, op->error); /* so the others fail now, not at their timeout */
	}
	finish(op, rc);
}

/* Takes the queue's head to run (comm->lock held, nothing running): the caller runs it unlocked. */
static struct zx_comm_op *take(struct zx_comm *comm)
{
	struct zx_comm_op *op = comm->head;
	comm->head = op->next;
	if (!comm->head)
		comm->tail = NULL;
	comm->running = 1;
	return op;
}

static void *progress(void *arg)
{
	struct zx_comm *comm = arg;
	pthread_mutex_lock(&comm->lock);
	for (;;) {
		if (comm->running || !comm->head) {
			if (comm->stopping && !comm->running && !comm->head)
				break;
			pthread_cond_wait(&comm->wake, &comm->lock);
			continue;
		}
		struct zx_comm_op *op = take(comm);
		pthread_mutex_unlock(&comm->lock);
		atomic_fetch_add_explicit(&comm->handed_off, 1, memory_order_relaxed);
		run_one(comm, op);
		pthread_mutex_lock(&comm->lock);
		comm->running = 0;
	}
	pthread_mutex_unlock(&comm->lock);
	return NULL;
}

/* A thread about to wait for `upto` runs the queued ops up to it itself while the progress thread is
 * idle, in call order as the progress thread would: a blocking collective then costs no hand-over to
 * the progress thread and back (two thread wake-ups; on a virtual machine each can cost more than the
 * op's copies). An op the progress thread already runs is waited for as before. */
static void run_queued(struct zx_comm *comm, struct zx_comm_op *upto)
{
	pthread_mutex_lock(&comm->lock);
	while (!comm->running && comm->head && !atomic_load_explicit(&upto->done, memory_order_acquire)) {
		struct zx_comm_op *op = take(comm);
		pthread_mutex_unlock(&comm->lock);
		run_one(comm, op); /* may free op: `upto` is still held by its handle */
		pthread_mutex_lock(&comm->lock);
		comm->running = 0;
		if (op == upto)
			break;
	}
	if (comm->head || comm->stopping)
		pthread_cond_signal(&comm->wake); /* the progress thread takes what is left, or stops */
	pthread_mutex_unlock(&comm->lock);
}

void zx_comm_defer_next(struct zx_comm *comm, int on)
{
	atomic_store_explicit(&comm->defer_next, on ? 1 : 0, memory_order_relaxed);
}

/* ---------------------------------------------------------------------------------------------------
 * Lifecycle */

int zx_comm_unique_id(int transport, char id[ZX_COMM_ID_BYTES])
{
	if (transport != ZX_COMM_SHM)
		return -EINVAL;
	return zx_shm_unique_id(id);
}

int zx_comm_create(struct zx_comm **out, int transport, const char *id, int rank, int world,
		   double timeout_s, int64_t slot_bytes)
{
	*out = NULL;
	if (transport != ZX_COMM_SHM || !id || world < 1 || world > ZX_COMM_MAX_WORLD || rank < 0 ||
	    rank >= world || !(timeout_s > 0) || slot_bytes < 0)
		return -EINVAL;
	struct zx_comm *comm = calloc(1, sizeof(*comm));
	if (!comm)
		return -ENOMEM;
	comm->transport = transport;
	comm->rank = rank;
	comm->world = world;
	comm->pid = getpid();
	comm->timeout_s = timeout_s;
	char msg[ZX_COMM_ERROR_BYTES];
	int rc = zx_shm_open(comm, id, slot_bytes, msg, sizeof(msg));
	if (rc < 0) {
		free(comm);
		return rc;
	}
	pthread_mutex_init(&comm->lock, NULL);
	pthread_cond_init(&comm->wake, NULL);
	rc = -pthread_create(&comm->thread, NULL, progress, comm);
	if (rc < 0) {
		zx_shm_leave(comm, 1, "could not start its progress thread");
		zx_shm_close(comm, 1);
		free(comm);
		return rc;
	}
	*out = comm;
	return 0;
}

int zx_comm_unlink(struct zx_comm *comm)
{
	return zx_shm_unlink(comm);
}

void zx_comm_destroy(struct zx_comm *comm)
{
	if (!comm)
		return;
	int owner = comm->pid == getpid();
	if (owner) { /* a forked child only frees its copy: the thread and the seat are the parent's */
		pthread_mutex_lock(&comm->lock);
		comm->stopping = 1;
		pthread_cond_signal(&comm->wake);
		pthread_mutex_unlock(&comm->lock);
		pthread_join(comm->thread, NULL);
		if (!comm->failed)
			zx_shm_leave(comm, 0, "destroyed its communicator");
		pthread_mutex_destroy(&comm->lock);
		pthread_cond_destroy(&comm->wake);
	}
	zx_shm_close(comm, owner);
	free(comm);
}

int zx_comm_rank(const struct zx_comm *comm) { return comm->rank; }
int zx_comm_world(const struct zx_comm *comm) { return comm->world; }
int64_t zx_comm_segment_bytes(const struct zx_comm *comm) { return zx_shm_bytes(comm); }
int64_t zx_comm_ops(const struct zx_comm *comm) { return atomic_load(&comm->nops); }
int64_t zx_comm_handed_off(const struct zx_comm *comm) { return atomic_load(&comm->handed_off); }

/* ---------------------------------------------------------------------------------------------------
 * Ops: one allocation holding the arrays */

static struct zx_comm_op *op_new(const char *verb, int nsegs, int nreads, int nreds)
{
	size_t size = sizeof(struct zx_comm_op) + (size_t)nsegs * sizeof(struct zx_comm_seg) +
		      (size_t)nreads * sizeof(struct zx_comm_read) + (size_t)nreds * sizeof(struct zx_comm_red);
	struct zx_comm_op *op = calloc(1, size);
	if (!op)
		return NULL;
	op->verb = verb;
	op->segs = (struct zx_comm_seg *)(op + 1);
	op->reads = (struct zx_comm_read *)(op->segs + nsegs);
	op->reds = (struct zx_comm_red *)(op->reads + nreads);
	op->scale = 1.0;
	op->dtype = op->redop = -1; /* a movement (reductions set theirs): what the op's stamp shows */
	atomic_init(&op->refs, 2);
	return op;
}

static int enqueue(struct zx_comm *comm, struct zx_comm_op *op, struct zx_comm_op **out)
{
	if (comm->pid != getpid()) {
		free(op);
		return -EOWNERDEAD;
	}
	pthread_mutex_lock(&comm->lock);
	op->seq = atomic_fetch_add(&comm->nops, 1) + 1;
	op->comm = comm;
	if (comm->tail)
		comm->tail->next = op;
	else
		comm->head = op;
	comm->tail = op;
	/* A deferred op is run by its waiter, or by the progress thread when it finishes the op it runs
	 * (it looks at the queue before it sleeps): waking it would only race the waiter for the op. */
	if (!atomic_exchange_explicit(&comm->defer_next, 0, memory_order_relaxed))
		pthread_cond_signal(&comm->wake);
	pthread_mutex_unlock(&comm->lock);
	*out = op;
	return 0;
}

static void add_seg(struct zx_comm_op *op, const void *ptr, int64_t len)
{
	if (len > 0)
		op->segs[op->nsegs++] = (struct zx_comm_seg){ ptr, len };
}

static void add_read(struct zx_comm_op *op, int src, int64_t off, void *dst, int64_t len)
{
	if (len > 0)
		op->reads[op->nreads++] = (struct zx_comm_read){ src, off, dst, len };
}

static int bytes_ok(int64_t bytes, int64_t times)
{
	return bytes >= 0 && bytes <= INT64_MAX / (times > 0 ? times : 1);
}

/* ---------------------------------------------------------------------------------------------------
 * Verbs */

int zx_comm_all_gather(struct zx_comm *comm, const void *in, void *out, int64_t bytes,
		       struct zx_comm_op **opp)
{
	return zx_comm_all_gather_group(comm, 1, &in, &out, &bytes, opp);
}

int zx_comm_all_gather_group(struct zx_comm *comm, int n, const void *const *ins, void *const *outs,
			     const int64_t *bytes, struct zx_comm_op **opp)
{
	int world = comm->world;
	if (n < 0 || n > INT_MAX / world)
		return -EINVAL;
	int64_t span = 0;
	for (int j = 0; j < n; j++) {
		if (!bytes_ok(bytes[j], world) || span > INT64_MAX - bytes[j] || (bytes[j] && (!ins[j] || !outs[j])))
			return -EINVAL;
		span += bytes[j];
	}
	struct zx_comm_op *op = op_new("all_gather", n, n * world, 0);
	if (!op)
		return -ENOMEM;
	op->span = span;
	for (int j = 0; j < n; j++)
		add_seg(op, ins[j], bytes[j]);
	for (int src = 0; src < world; src++)
		for (int64_t j = 0, at = 0; j < n; at += bytes[j], j++)
			add_read(op, src, at, (char *)outs[j] + src * bytes[j], bytes[j]);
	return enqueue(comm, op, opp);
}

int zx_comm_all_gather_v(struct zx_comm *comm, const void *in, void *out, const int64_t *counts,
			 struct zx_comm_op **opp)
{
	int world = comm->world;
	struct zx_comm_op *op = op_new("all_gather_v", 1, world, 0);
	if (!op)
		return -ENOMEM;
	int64_t at = 0;
	for (int src = 0; src < world; src++) {
		if (!bytes_ok(counts[src], 1) || at > INT64_MAX - counts[src] || (counts[src] && !out)) {
			free(op);
			return -EINVAL;
		}
		if (counts[src] > op->span)
			op->span = counts[src];
		add_read(op, src, 0, (char *)out + at, counts[src]);
		at += counts[src];
	}
	if (counts[comm->rank] && !in) {
		free(op);
		return -EINVAL;
	}
	add_seg(op, in, counts[comm->rank]);
	return enqueue(comm, op, opp);
}

/* The reductions: every rank sends `elems` elements; `reds` say what this rank keeps. */
static int reduction(struct zx_comm *comm, const char *verb, const void *in, int64_t elems, int dtype,
		     int redop, double scale, int64_t off, void *out, int64_t count, int split,
		     struct zx_comm_op **opp)
{
	int size = zx_dtype_size(dtype);
	if (!size || !bytes_ok(elems, size) || count < 0 || (elems && !in))
		return -EINVAL;
	/* the kernel's own checks, before anything is enqueued */
	const void *probe = in ? in : (const void *)&size;
	if (zx_comm_reduce_kernel(dtype, redop, scale, &probe, 1, NULL, 0, 0) < 0)
		return -EINVAL;
	struct zx_comm_op *op = op_new(verb, 1, 0, 1);
	if (!op)
		return -ENOMEM;
	op->span = elems * size;
	op->dtype = dtype;
	op->redop = redop;
	op->scale = scale;
	op->split = split; /* the transport decides whether splitting pays (comm_shm.c) */
	add_seg(op, in, elems * size);
	if (out && count)
		op->reds[op->nreds++] = (struct zx_comm_red){ off * size, out, count };
	return enqueue(comm, op, opp);
}

int zx_comm_reduce_scatter(struct zx_comm *comm, const void *in, void *out, int64_t count, int dtype,
			   int redop, double scale, struct zx_comm_op **opp)
{
	if (count < 0 || count > INT64_MAX / comm->world)
		return -EINVAL;
	return reduction(comm, "reduce_scatter", in, count * comm->world, dtype, redop, scale,
			 count * comm->rank, out, count, ZX_SPLIT_SCATTER, opp);
}

int zx_comm_all_reduce(struct zx_comm *comm, const void *in, void *out, int64_t count, int dtype,
		       int redop, double scale, struct zx_comm_op **opp)
{
	if (count && !out)
		return -EINVAL;
	return reduction(comm, "all_reduce", in, count, dtype, redop, scale, 0, out, count, ZX_SPLIT_ALL_REDUCE,
			 opp);
}

int zx_comm_reduce(struct zx_comm *comm, const void *in, void *out, int64_t count, int dtype, int redop,
		   double scale, int root, struct zx_comm_op **opp)
{
	if (root < 0 || root >= comm->world || (comm->rank == root && count && !out))
		return -EINVAL;
	return reduction(comm, "reduce", in, count, dtype, redop, scale, 0, comm->rank == root ? out : NULL,
			 count, ZX_SPLIT_NONE, opp);
}

int zx_comm_broadcast(struct zx_comm *comm, void *buf, int64_t bytes, int root, struct zx_comm_op **opp)
{
	if (root < 0 || root >= comm->world || !bytes_ok(bytes, 1) || (bytes && !buf))
		return -EINVAL;
	struct zx_comm_op *op = op_new("broadcast", 1, 1, 0);
	if (!op)
		return -ENOMEM;
	op->span = bytes;
	if (comm->rank == root)
		add_seg(op, buf, bytes);
	else
		add_read(op, root, 0, buf, bytes);
	return enqueue(comm, op, opp);
}

int zx_comm_scatter(struct zx_comm *comm, const void *in, void *out, int64_t bytes, int root,
		    struct zx_comm_op **opp)
{
	int world = comm->world;
	if (root < 0 || root >= world || !bytes_ok(bytes, world) || (bytes && !out) ||
	    (comm->rank == root && bytes && !in))
		return -EINVAL;
	struct zx_comm_op *op = op_new("scatter", 1, 1, 0);
	if (!op)
		return -ENOMEM;
	op->span = bytes * world;
	if (comm->rank == root)
		add_seg(op, in, bytes * world);
	add_read(op, root, bytes * comm->rank, out, bytes);
	return enqueue(comm, op, opp);
}

int zx_comm_barrier(struct zx_comm *comm, struct zx_comm_op **opp)
{
	struct zx_comm_op *op = op_new("barrier", 0, 0, 0);
	if (!op)
		return -ENOMEM;
	return enqueue(comm, op, opp);
}

/* ---------------------------------------------------------------------------------------------------
 * All-to-all: rank s's stream is its `in`, its chunks in destination order; rank d reads, from each
 * stream, the chunk addressed to it. With counts NULL every chunk is `bytes`. */

static int64_t a2a_count(const int64_t *counts, int64_t bytes, int world, int s, int d)
{
	return counts ? counts[(int64_t)s * world + d] : bytes;
}

static int all_to_all(struct zx_comm *comm, const void *in, void *out, const int64_t *counts, int64_t bytes,
		      struct zx_comm_op **opp)
{
	int world = comm->world, me = comm->rank;
	int64_t span = 0, sent = 0, got = 0;
	for (int s = 0; s < world; s++) { /* every row's sum is a stream: each must fit an int64 */
		int64_t row = 0;
		for (int d = 0; d < world; d++) {
			int64_t c = a2a_count(counts, bytes, world, s, d);
			if (!bytes_ok(c, 1) || row > INT64_MAX - c)
				return -EINVAL;
			row += c;
			if (d == me && got > INT64_MAX - c)
				return -EINVAL;
			got += d == me ? c : 0;
		}
		span = row > span ? row : span;
		sent = s == me ? row : sent;
	}
	if ((sent && !in) || (got && !out))
		return -EINVAL;
	/* this rank's own chunk is copied from `in` while the others still read it from the slots */
	if (sent && got && (const char *)in < (char *)out + got && (char *)out < (const char *)in + sent)
		return -EINVAL;
	struct zx_comm_op *op = op_new(counts ? "all_to_all_v" : "all_to_all", 1, world, 0);
	if (!op)
		return -ENOMEM;
	op->span = span;
	add_seg(op, in, sent);
	int64_t at = 0;
	for (int s = 0; s < world; s++) {
		int64_t off = 0;
		for (int d = 0; d < me; d++)
			off += a2a_count(counts, bytes, world, s, d);
		int64_t len = a2a_count(counts, bytes, world, s, me);
		add_read(op, s, off, (char *)out + at, len);
		at += len;
	}
	return enqueue(comm, op, opp);
}

int zx_comm_all_to_all(struct zx_comm *comm, const void *in, void *out, int64_t bytes, struct zx_comm_op **opp)
{
	if (!bytes_ok(bytes, comm->world))
		return -EINVAL;
	return all_to_all(comm, in, out, NULL, bytes, opp);
}

int zx_comm_all_to_all_v(struct zx_comm *comm, const void *in, void *out, const int64_t *counts,
			 struct zx_comm_op **opp)
{
	if (!counts)
		return -EINVAL;
	return all_to_all(comm, in, out, counts, 0, opp);
}

int zx_comm_agree(struct zx_comm *comm, const char *label, double timeout_s, struct zx_comm_op **opp)
{
	struct zx_comm_op *op = op_new("agree", 0, 0, 0);
	if (!op)
		return -ENOMEM;
	snprintf(op->label, sizeof(op->label), "%s", label);
	op->verb = op->label;
	op->timeout_s = timeout_s;
	return enqueue(comm, op, opp);
}
