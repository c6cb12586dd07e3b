/* aio.c - the handle of aio.h: ops cut into requests, their queue, and the pread/pwrite worker (the
 * io_uring worker and registered buffers are in aio_uring.c).
 *
 * Owns: the op table, the queue of requests not yet started, the worker threads (a ring is made in
 * aio_uring.c by its worker and freed here with the handle), the bounce page of a padded tail. One
 * mutex guards the table and the queue; I/O runs outside it.
 * Requests are taken from the queue in submission order by whichever worker has room, so one op
 * spreads over every worker (DeepSpeed cuts an op into intra_op_parallelism equal ranges instead;
 * taking blocks from one queue balances the same and needs no divisibility rule).
 *
 * Does NOT open or name files (the caller passes descriptors; python/bind_aio.c and zero_ext/nvme/aio.py turn a
 * failed op into an error naming the file), allocate the caller's buffers, or print.
 */
#define _GNU_SOURCE
#include "aio_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------------------
 * The queue (all under aio->lock) */

/* Takes the next piece of the oldest queued op into r. Returns 1, or 0 when nothing is queued. */
int zx_aio_claim(struct zx_aio *aio, struct zx_aio_req *r)
{
	struct zx_aio_op *op = aio->qhead;
	if (!op)
		return 0;
	int64_t i = op->next_piece++;
	if (op->next_piece == op->npieces) {
		aio->qhead = op->qnext;
		if (!aio->qhead)
			aio->qtail = NULL;
	}
	int64_t bs = aio->p.block_size, first = i * bs;
	r->op = op;
	if (first < op->main) {
		r->buf = op->buf + first;
		r->offset = op->offset + first;
		r->length = r->need = min64(bs, op->main - first);
	} else {
		r->buf = op->bounce;
		r->offset = op->offset + op->main;
		r->length = ZX_AIO_ALIGN;
		r->need = op->write ? ZX_AIO_ALIGN : op->nbytes - op->main;
	}
	r->done = 0;
	r->retries = 0;
	r->error = 0;
	r->short_io = 0;
	return 1;
}

static void unqueue(struct zx_aio *aio, struct zx_aio_op *op)
{
	struct zx_aio_op **pp = &aio->qhead, *prev = NULL;
	while (*pp && *pp != op) {
		prev = *pp;
		pp = &(*pp)->qnext;
	}
	if (!*pp)
		return;
	*pp = op->qnext;
	if (aio->qtail == op)
		aio->qtail = prev;
}

/* Drops the pieces of op no worker has taken; the op fails with `error` unless it failed already. */
static void cancel_rest(struct zx_aio *aio, struct zx_aio_op *op, int error)
{
	int64_t left = op->npieces - op->next_piece;
	if (left <= 0)
		return;
	if (!op->res.error) {
		int64_t first = op->next_piece * aio->p.block_size;
		op->res.error = error;
		op->res.offset = op->offset + first;
		op->res.length = op->nbytes - min64(first, op->nbytes);
		op->res.done = 0;
	}
	unqueue(aio, op);
	op->next_piece = op->npieces;
	op->unfinished -= left;
}

static void op_finished_check(struct zx_aio *aio, struct zx_aio_op *op)
{
	if (op->unfinished == 0 && !op->done) {
		op->done = 1;
		pthread_cond_broadcast(&aio->done);
	}
}

/* Books a finished request on its op. A failure cancels the op's pieces not yet taken. */
void zx_aio_finish(struct zx_aio *aio, struct zx_aio_req *r)
{
	struct zx_aio_op *op = r->op;
	if (r->error && !op->res.error) {
		op->res.error = r->error;
		op->res.short_io = r->short_io;
		op->res.offset = r->offset;
		op->res.length = r->need;
		op->res.done = r->done;
	}
	if (r->error)
		cancel_rest(aio, op, r->error);
	op->unfinished--;
	op_finished_check(aio, op);
}

/* ---------------------------------------------------------------------------------------------------
 * One request's progress (both backends, outside the lock) */

/* Books the answer of one attempt at r: `res` bytes moved, or -errno. Returns 1 when the remainder
 * needs another attempt, 0 when r is finished (r->error tells how). A partial transfer is retried
 * while it stays page-aligned (O_DIRECT needs that); a full file system answers the retry with
 * -ENOSPC. No progress at all is a short read (end of file) or a short write. */
int zx_aio_progress(struct zx_aio_req *r, int64_t res)
{
	if (res == -EINTR || res == -EAGAIN) {
		if (++r->retries < ZX_AIO_MAX_RETRIES)
			return 1;
	}
	if (res < 0) {
		r->error = (int)res;
		return 0;
	}
	r->done += res;
	if (r->done >= r->need)
		return 0;
	if (res == 0 || r->done % ZX_AIO_ALIGN) {
		r->short_io = 1;
		r->error = r->op->write ? -EIO : -ENODATA;
		return 0;
	}
	return 1;
}

/* After a read's tail went into the bounce page, copies the bytes asked for to the caller. */
void zx_aio_complete_tail(struct zx_aio_req *r)
{
	struct zx_aio_op *op = r->op;
	if (!r->error && !op->write && r->buf == op->bounce)
		memcpy(op->buf + op->main, op->bounce, (size_t)(op->nbytes - op->main));
}

/* ---------------------------------------------------------------------------------------------------
 * The pread/pwrite worker: one request at a time, blocking */

static void *aio_threads_main(void *arg)
{
	struct zx_aio_worker *w = arg;
	struct zx_aio *aio = w->aio;
	struct zx_aio_req *r = w->reqs;

	pthread_mutex_lock(&aio->lock);
	for (;;) {
		if (!zx_aio_claim(aio, r)) {
			if (aio->stopping)
				break;
			pthread_cond_wait(&aio->work, &aio->lock);
			continue;
		}
		pthread_mutex_unlock(&aio->lock);
		int64_t res;
		do {
			size_t len = (size_t)(r->length - r->done);
			off_t off = (off_t)(r->offset + r->done);
			ssize_t got = r->op->write ? pwrite(r->op->fd, r->buf + r->done, len, off)
						   : pread(r->op->fd, r->buf + r->done, len, off);
			res = got < 0 ? -errno : got;
		} while (zx_aio_progress(r, res));
		zx_aio_complete_tail(r);
		pthread_mutex_lock(&aio->lock);
		zx_aio_finish(aio, r);
	}
	pthread_mutex_unlock(&aio->lock);
	return NULL;
}
/* ---------------------------------------------------------------------------------------------------
 * Set-up and tear-down */


static int check_params(const struct zx_aio_params *p)
{
	if (!p || p->block_size <= 0 || p->block_size % ZX_AIO_ALIGN || p->block_size > ZX_AIO_MAX_BLOCK)
		return -EINVAL;
	if (p->queue_depth < 1 || p->queue_depth > ZX_AIO_MAX_DEPTH)
		return -EINVAL;
	if (p->threads < 1 || p->threads > ZX_AIO_MAX_WORKERS)
		return -EINVAL;
	if (p->backend != ZX_AIO_AUTO && p->backend != ZX_AIO_URING && p->backend != ZX_AIO_THREADS)
		return -EINVAL;
	return 0;
}

/* Waits until every started io_uring worker has made its ring; 0, or the first -errno. */
static int rings_made(struct zx_aio *aio)
{
	int rc = 0;
	pthread_mutex_lock(&aio->lock);
	for (int i = 0; i < aio->nworkers; i++) {
		struct zx_aio_worker *w = &aio->workers[i];
		while (w->started && !w->setup)
			pthread_cond_wait(&aio->done, &aio->lock);
		if (w->started && w->ring_rc && !rc)
			rc = w->ring_rc;
	}
	pthread_mutex_unlock(&aio->lock);
	return rc;
}

/* Workers with every signal blocked, so that signals (Ctrl-C) go to the thread that runs Python. */
static int start_workers(struct zx_aio *aio)
{
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	int rc = 0;
#if ZX_HAVE_URING
	void *(*fn)(void *) = aio->backend == ZX_AIO_URING ? zx_aio_uring_main : aio_threads_main;
#else
	void *(*fn)(void *) = aio_threads_main;
#endif
	for (int i = 0; i < aio->nworkers && !rc; i++) {
		struct zx_aio_worker *w = &aio->workers[i];
		rc = -pthread_create(&w->thread, NULL, fn, w);
		w->started = !rc;
	}
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	return rc;
}

static void free_op(struct zx_aio_op *op)
{
	if (op->fd >= 0)
		close(op->fd);
	free(op->bounce);
	free(op);
}

/* Frees the workers' rings and buffers and every op; join: wait for the worker threads first (not in a
 * forked child, where a parent's handle has no threads and its locks may have been held at fork). */
static void free_handle_memory(struct zx_aio *aio, int join)
{
	for (int i = 0; i < aio->nworkers; i++) {
		struct zx_aio_worker *w = &aio->workers[i];
		if (join && w->started)
			pthread_join(w->thread, NULL);
#if ZX_HAVE_URING
		if (w->has_ring)
			io_uring_queue_exit(&w->ring);
#endif
		free(w->reqs);
		free(w->batch);
		free(w->fixed);
	}
	free(aio->reg);
	while (aio->ops) {
		struct zx_aio_op *op = aio->ops;
		aio->ops = op->next;
		free_op(op);
	}
	free(aio->workers);
}

void zx_aio_exit(struct zx_aio *aio)
{
	if (!aio)
		return;
	if (aio->pid != getpid()) { /* a forked child's copy: only its memory and descriptors */
		free_handle_memory(aio, 0);
		free(aio);
		return;
	}
	pthread_mutex_lock(&aio->lock);
	aio->stopping = 1;
	while (aio->qhead) {
		struct zx_aio_op *op = aio->qhead;
		cancel_rest(aio, op, -ECANCELED);
		op_finished_check(aio, op);
	}
	pthread_cond_broadcast(&aio->work);
	pthread_mutex_unlock(&aio->lock);
	free_handle_memory(aio, 1);
	pthread_cond_destroy(&aio->done);
	pthread_cond_destroy(&aio->work);
	pthread_mutex_destroy(&aio->lock);
	free(aio);
}

int zx_aio_init(struct zx_aio **out, const struct zx_aio_params *p)
{
	int rc = check_params(p);
	if (rc || !out)
		return -EINVAL;
	*out = NULL;
#if !ZX_HAVE_URING
	if (p->backend == ZX_AIO_URING)
		return -ENOSYS; /* built without liburing */
#endif
	struct zx_aio *aio = calloc(1, sizeof(*aio));
	if (!aio)
		return -ENOMEM;
	aio->p = *p;
	aio->pid = getpid();
	pthread_mutex_init(&aio->lock, NULL);
	pthread_cond_init(&aio->work, NULL);
	pthread_cond_init(&aio->done, NULL);

	aio->backend = p->backend == ZX_AIO_THREADS ? ZX_AIO_THREADS : ZX_AIO_URING;
	if (p->backend == ZX_AIO_AUTO && zx_aio_uring_probe() < 0)
		aio->backend = ZX_AIO_THREADS;
	int depth = aio->backend == ZX_AIO_URING ? p->queue_depth : 1;
	int64_t want = aio->backend == ZX_AIO_URING ? p->threads : (int64_t)p->threads * p->queue_depth;
	aio->nworkers = (int)min64(want, ZX_AIO_MAX_WORKERS);
	aio->workers = calloc((size_t)aio->nworkers, sizeof(*aio->workers));
	if (!aio->workers) {
		rc = -ENOMEM;
		goto err;
	}
	for (int i = 0; i < aio->nworkers; i++) {
		struct zx_aio_worker *w = &aio->workers[i];
		w->aio = aio;
		w->reqs = calloc((size_t)depth, sizeof(*w->reqs));
		w->batch = calloc((size_t)depth, sizeof(*w->batch));
		if (!w->reqs || !w->batch) {
			rc = -ENOMEM;
			goto err;
		}
		for (int k = 0; k < depth; k++) {
			w->reqs[k].next = w->free;
			w->free = &w->reqs[k];
		}
	}
	rc = start_workers(aio);
	if (rc)
		goto err;
	if (aio->backend == ZX_AIO_URING) {
		rc = rings_made(aio);
		if (rc && p->backend == ZX_AIO_URING)
			goto err;
		if (rc) { /* AUTO: the probe passed but a full-size ring did not (e.g. memlock) */
			zx_aio_exit(aio);
			struct zx_aio_params q = *p;
			q.backend = ZX_AIO_THREADS;
			return zx_aio_init(out, &q);
		}
	}
	*out = aio;
	return 0;
err:
	zx_aio_exit(aio);
	return rc;
}

int zx_aio_backend(const struct zx_aio *aio)
{
	return aio->backend;
}

/* ---------------------------------------------------------------------------------------------------
 * Ops */

static int64_t submit(struct zx_aio *aio, int write, int fd, char *buf, int64_t nbytes, int64_t offset)
{
	if (!aio || nbytes < 0 || offset < 0 || offset % ZX_AIO_ALIGN || (nbytes > 0 && !buf))
		return -EINVAL;
	if (aio->pid != getpid())
		return -EOWNERDEAD;
	if (nbytes > INT64_MAX - offset - ZX_AIO_ALIGN)
		return -EINVAL;
	int fl = fcntl(fd, F_GETFL);
	if (fl < 0)
		return -errno;
	int mode = fl & O_ACCMODE;
	if (write ? mode == O_RDONLY : mode == O_WRONLY)
		return -EBADF;
	if ((fl & O_DIRECT) && (uintptr_t)buf % ZX_AIO_ALIGN)
		return -EINVAL;

	struct zx_aio_op *op = calloc(1, sizeof(*op));
	if (!op)
		return -ENOMEM;
	op->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (op->fd < 0) {
		int err = -errno;
		free(op);
		return err;
	}
	op->write = write;
	op->buf = buf;
	op->nbytes = nbytes;
	op->offset = offset;
	op->main = nbytes & ~(int64_t)(ZX_AIO_ALIGN - 1);
	int64_t tail = nbytes - op->main;
	if (tail) {
		void *page = NULL;
		if (posix_memalign(&page, ZX_AIO_ALIGN, ZX_AIO_ALIGN)) {
			free_op(op);
			return -ENOMEM;
		}
		op->bounce = page;
		memset(op->bounce, 0, ZX_AIO_ALIGN);
		if (write)
			memcpy(op->bounce, buf + op->main, (size_t)tail);
	}
	int64_t bs = aio->p.block_size;
	op->npieces = (op->main + bs - 1) / bs + (tail ? 1 : 0);
	op->unfinished = op->npieces;
	op->done = op->npieces == 0;

	pthread_mutex_lock(&aio->lock);
	if (aio->stopping) {
		pthread_mutex_unlock(&aio->lock);
		free_op(op);
		return -ESHUTDOWN;
	}
	op->id = ++aio->next_id;
	op->next = aio->ops;
	aio->ops = op;
	aio->pending++;
	if (op->npieces) {
		if (aio->qtail)
			aio->qtail->qnext = op;
		else
			aio->qhead = op;
		aio->qtail = op;
		if (op->npieces > 1)
			pthread_cond_broadcast(&aio->work);
		else
			pthread_cond_signal(&aio->work);
	}
	int64_t id = op->id;
	pthread_mutex_unlock(&aio->lock);
	return id;
}

int64_t zx_aio_submit_read(struct zx_aio *aio, int fd, void *buf, int64_t nbytes, int64_t offset)
{
	return submit(aio, 0, fd, buf, nbytes, offset);
}

int64_t zx_aio_submit_write(struct zx_aio *aio, int fd, const void *buf, int64_t nbytes,
			    int64_t offset)
{
	return submit(aio, 1, fd, (char *)buf, nbytes, offset);
}

static struct zx_aio_op **find(struct zx_aio *aio, int64_t id)
{
	struct zx_aio_op **pp = &aio->ops;
	while (*pp && (*pp)->id != id)
		pp = &(*pp)->next;
	return pp;
}

int zx_aio_wait(struct zx_aio *aio, int64_t id, struct zx_aio_result *res)
{
	if (aio->pid != getpid())
		return -EOWNERDEAD;
	pthread_mutex_lock(&aio->lock);
	struct zx_aio_op *op = *find(aio, id);
	if (!op || op->waiter) {
		pthread_mutex_unlock(&aio->lock);
		return op ? -EBUSY : -ENOENT;
	}
	op->waiter = 1;
	while (!op->done)
		pthread_cond_wait(&aio->done, &aio->lock);
	struct zx_aio_op **pp = find(aio, id); /* the list may have changed while waiting */
	*pp = op->next;
	aio->pending--;
	pthread_mutex_unlock(&aio->lock);
	if (res)
		*res = op->res;
	int rc = op->res.error;
	free_op(op);
	return rc;
}

int zx_aio_done(struct zx_aio *aio, int64_t id)
{
	if (aio->pid != getpid())
		return -EOWNERDEAD;
	pthread_mutex_lock(&aio->lock);
	struct zx_aio_op *op = *find(aio, id);
	int rc = op ? op->done : -ENOENT;
	pthread_mutex_unlock(&aio->lock);
	return rc;
}

int64_t zx_aio_pending(struct zx_aio *aio)
{
	if (aio->pid != getpid())
		return -EOWNERDEAD;
	pthread_mutex_lock(&aio->lock);
	int64_t n = aio->pending;
	pthread_mutex_unlock(&aio->lock);
	return n;
}
