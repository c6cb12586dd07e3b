/* aio.c - the handle of aio.h: ops cut into requests, the io_uring worker and the pread/pwrite worker.
 *
 * Owns: the op table, the queue of requests not yet started, worker threads and their rings, the
 * bounce page of a padded tail. One mutex guards the table and the queue; I/O runs outside it.
 * Requests are taken from the queue in submission order by whichever worker has room, so one op
 * spreads over every worker (DeepSpeed cuts an op into intra_op_parallelism equal ranges instead;
 * taking blocks from one queue balances the same and needs no divisibility rule).
 *
 * Does NOT open or name files (the caller passes descriptors; python/bind_aio.c and zero_ext/aio.py turn a
 * failed op into an error naming the file), allocate the caller's buffers, or print.
 */
#define _GNU_SOURCE
#include "aio.h"

#include <errno.h>
#include <fcntl.h>
#if ZX_HAVE_URING /* setup.py defines it where liburing is installed; else the thread backend only */
#include <liburing.h>
#endif
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------------------
 * Types */

/* One submitted read or write. Its bytes [0, main) move straight from/to buf in block_size pieces;
 * a tail of nbytes - main < ZX_AIO_ALIGN bytes moves through `bounce` as one more piece. */
struct zx_aio_op {
	int64_t id;
	int fd;		      /* our duplicate of the caller's fd, closed when the op is freed */
	int write;
	char *buf;	      /* caller's memory, (nbytes,) */
	int64_t nbytes;	      /* bytes asked for */
	int64_t offset;	      /* file offset, a multiple of ZX_AIO_ALIGN */
	int64_t main;	      /* nbytes rounded down to ZX_AIO_ALIGN */
	char *bounce;	      /* ZX_AIO_ALIGN bytes for the tail, or NULL */
	int64_t npieces;      /* requests in all */
	int64_t next_piece;   /* first request not yet taken by a worker */
	int64_t unfinished;   /* requests not yet completed (taken or not) */
	int done;	      /* unfinished reached 0: the op touches no memory any more */
	int waiter;	      /* a thread is in zx_aio_wait for it */
	struct zx_aio_result res;
	struct zx_aio_op *next;	 /* the handle's list of ops not yet waited */
	struct zx_aio_op *qnext; /* the queue of ops with requests not yet taken */
};

/* One request (piece of an op) being moved by a worker. */
struct zx_aio_req {
	struct zx_aio_op *op;
	char *buf;	/* where the piece starts in memory */
	int64_t offset; /* where it starts in the file */
	int64_t length; /* bytes to move */
	int64_t need;	/* bytes that must move: length, or a read's real tail bytes */
	int64_t done;	/* bytes moved so far */
	int retries;	/* -EINTR / -EAGAIN answers so far */
	int error;	/* 0 or -errno once finished */
	int short_io;
	struct zx_aio_req *next; /* free list, or the worker's list of finished requests */
};

struct zx_aio_worker {
	struct zx_aio *aio;
	pthread_t thread;
	int started;
#if ZX_HAVE_URING
	struct io_uring ring; /* io_uring backend only, made by the worker itself (SINGLE_ISSUER) */
#endif
	int has_ring;
	int setup;	       /* 1 once the worker has tried to make its ring, then ring_rc says how */
	int ring_rc;
	int dead;	       /* -errno after a submission the kernel refused for good */
	int inflight;	       /* requests in the ring */
	struct zx_aio_req *reqs; /* queue_depth of them (io_uring), or 1 (threads) */
	struct zx_aio_req **batch; /* (queue_depth,) requests taken in one round (io_uring) */
	struct zx_aio_req *free, *finished;
	uint64_t reg_seen;   /* the registration generation this worker's ring has */
	int reg_rc;	     /* how registering it went: 0 or -errno */
	struct iovec *fixed; /* the ranges registered with this ring (its own copy), or NULL */
	int nfixed;
};

struct zx_aio {
	struct zx_aio_params p;
	int backend;
	pid_t pid; /* of the process that made it: in a forked child its workers do not exist */
	pthread_mutex_t lock;
	pthread_cond_t work; /* pieces queued, or stopping */
	pthread_cond_t done; /* an op finished */
	int stopping;
	int64_t next_id;
	int64_t pending;	     /* ops not yet waited */
	struct zx_aio_op *ops;	     /* every op not yet waited, newest first */
	struct zx_aio_op *qhead, *qtail; /* ops with pieces not yet taken, in submission order */
	int nworkers;
	struct zx_aio_worker *workers;
	struct iovec *reg; /* the ranges of zx_aio_register_buffers, for workers to take */
	int nreg;
	uint64_t reg_gen; /* bumped by each zx_aio_register_buffers */
	atomic_llong fixed_requests; /* requests that went through a registered range */
};

#define ZX_AIO_MAX_RETRIES 10000 /* -EINTR/-EAGAIN answers to one request before it fails */

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

#if ZX_HAVE_URING
static void pause_briefly(void)
{
	struct timespec ts = { 0, 100 * 1000 }; /* 100 us */
	nanosleep(&ts, NULL);
}
#endif

/* ---------------------------------------------------------------------------------------------------
 * The queue (all under aio->lock) */

/* Takes the next piece of the oldest queued op into r. Returns 1, or 0 when nothing is queued. */
static int claim(struct zx_aio *aio, struct zx_aio_req *r)
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
static void finish(struct zx_aio *aio, struct zx_aio_req *r)
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
static int progress(struct zx_aio_req *r, int64_t res)
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
static void complete_tail(struct zx_aio_req *r)
{
	struct zx_aio_op *op = r->op;
	if (!r->error && !op->write && r->buf == op->bounce)
		memcpy(op->buf + op->main, op->bounce, (size_t)(op->nbytes - op->main));
}

#if ZX_HAVE_URING
/* ---------------------------------------------------------------------------------------------------
 * The io_uring worker */

/* The index of the registered range holding [buf, buf + len), or -1. */
static int fixed_index(const struct zx_aio_worker *w, const char *buf, unsigned len)
{
	for (int i = 0; i < w->nfixed; i++) {
		const char *b = w->fixed[i].iov_base;
		if (buf >= b && (size_t)(buf - b) + len <= w->fixed[i].iov_len)
			return i;
	}
	return -1;
}

/* Puts the remainder of r into the ring (not yet submitted). */
static void ring_prep(struct zx_aio_worker *w, struct zx_aio_req *r)
{
	struct io_uring_sqe *sqe = io_uring_get_sqe(&w->ring); /* never NULL: ring >= depth */
	unsigned len = (unsigned)(r->length - r->done);
	char *buf = r->buf + r->done;
	uint64_t off = (uint64_t)(r->offset + r->done);
	int fixed = fixed_index(w, buf, len);
	if (fixed >= 0)
		atomic_fetch_add_explicit(&w->aio->fixed_requests, 1, memory_order_relaxed);
	if (fixed >= 0 && r->op->write)
		io_uring_prep_write_fixed(sqe, r->op->fd, buf, len, off, fixed);
	else if (fixed >= 0)
		io_uring_prep_read_fixed(sqe, r->op->fd, buf, len, off, fixed);
	else if (r->op->write)
		io_uring_prep_write(sqe, r->op->fd, buf, len, off);
	else
		io_uring_prep_read(sqe, r->op->fd, buf, len, off);
	io_uring_sqe_set_data(sqe, r);
}

/* Called with aio->lock held and nothing in flight: gives the ring the handle's current set of
 * registered ranges (see zx_aio_register_buffers), with the lock released meanwhile. */
static void ring_take_registration(struct zx_aio_worker *w)
{
	struct zx_aio *aio = w->aio;
	uint64_t gen = aio->reg_gen;
	int n = aio->nreg, rc = 0;
	struct iovec *mine = NULL;
	if (n > 0) {
		mine = malloc((size_t)n * sizeof(*mine));
		if (mine)
			memcpy(mine, aio->reg, (size_t)n * sizeof(*mine));
		else
			rc = -ENOMEM;
	}
	pthread_mutex_unlock(&aio->lock);
	if (w->nfixed > 0)
		io_uring_unregister_buffers(&w->ring);
	free(w->fixed);
	w->fixed = NULL;
	w->nfixed = 0;
	if (mine && !rc) {
		rc = io_uring_register_buffers(&w->ring, mine, (unsigned)n);
		if (rc == 0) {
			w->fixed = mine;
			w->nfixed = n;
		}
	}
	if (!w->fixed)
		free(mine);
	pthread_mutex_lock(&aio->lock);
	w->reg_rc = rc;
	w->reg_seen = gen;
	pthread_cond_broadcast(&aio->done);
}

/* Submits every queued entry, retrying what the kernel answers as transient, and in the same call
 * waits for wait_nr completions (0: none). Returns 0, or the -errno of a refusal after which the
 * entries left in the ring must never be submitted. */
static int ring_flush(struct zx_aio_worker *w, unsigned wait_nr)
{
	while (io_uring_sq_ready(&w->ring) > 0) {
		int rc = wait_nr ? io_uring_submit_and_wait(&w->ring, wait_nr) : io_uring_submit(&w->ring);
		if (rc == -EINTR || rc == -EAGAIN || rc == -EBUSY) {
			pause_briefly();
			continue;
		}
		if (rc < 0)
			return rc;
	}
	return 0;
}

static void retire(struct zx_aio_worker *w, struct zx_aio_req *r)
{
	complete_tail(r);
	r->next = w->finished;
	w->finished = r;
}

/* A refused submission: of the n requests in batch, the first `prepped` went into the ring and the
 * last of those still queued there never reached the kernel; they and the ones not prepped fail,
 * and this worker submits nothing more (see ring_flush). */
static void ring_dead(struct zx_aio_worker *w, int rc, struct zx_aio_req **batch, int prepped, int n)
{
	int first = prepped - (int)io_uring_sq_ready(&w->ring);
	w->dead = rc;
	for (int i = first > 0 ? first : 0; i < n; i++) {
		batch[i]->error = rc;
		w->inflight--;
		retire(w, batch[i]);
	}
}

/* Handles completions: waits for one, then takes every one ready; with all = 1, goes on until
 * nothing is in flight. Requests with a remainder go back into the ring. */
static void ring_reap(struct zx_aio_worker *w, int all)
{
	do {
		struct io_uring_cqe *cqe;
		int rc = io_uring_wait_cqe(&w->ring, &cqe);
		if (rc < 0) { /* -EINTR, or a ring in trouble: try again */
			if (rc != -EINTR && rc != -EAGAIN)
				pause_briefly();
			continue;
		}
		do {
			struct zx_aio_req *r = io_uring_cqe_get_data(cqe);
			int res = cqe->res;
			io_uring_cqe_seen(&w->ring, cqe);
			if (progress(r, res)) {
				ring_prep(w, r);
				int frc = ring_flush(w, 0);
				if (frc)
					ring_dead(w, frc, &r, 1, 1);
			} else {
				w->inflight--;
				retire(w, r);
			}
		} while (w->inflight > 0 && io_uring_peek_cqe(&w->ring, &cqe) == 0);
	} while (all && w->inflight > 0);
}

/* The ring of a worker, made on its own thread so that the kernel may take the cheaper paths for a
 * ring with one submitter: completions run as deferred task work when the worker asks for them
 * (DEFER_TASKRUN, Linux 6.1), else without interrupting it (COOP_TASKRUN, 5.19), else plain. */
static int ring_setup(struct zx_aio_worker *w, unsigned depth)
{
	static const unsigned flags[] = { IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
					  IORING_SETUP_COOP_TASKRUN, 0 };
	int rc = -EINVAL;
	for (size_t i = 0; i < sizeof(flags) / sizeof(flags[0]) && rc == -EINVAL; i++) {
		struct io_uring_params prm;
		memset(&prm, 0, sizeof(prm));
		prm.flags = flags[i];
		rc = io_uring_queue_init_params(depth, &w->ring, &prm);
	}
	return rc;
}

static void *uring_main(void *arg)
{
	struct zx_aio_worker *w = arg;
	struct zx_aio *aio = w->aio;
	const int depth = aio->p.queue_depth;
	struct zx_aio_req **batch = w->batch;
	int rc = ring_setup(w, (unsigned)depth);

	pthread_mutex_lock(&aio->lock);
	w->has_ring = rc == 0;
	w->ring_rc = rc;
	w->setup = 1;
	pthread_cond_broadcast(&aio->done); /* zx_aio_init waits for every worker's ring */
	if (rc) {
		pthread_mutex_unlock(&aio->lock);
		return NULL;
	}
	for (;;) {
		while (w->finished) {
			struct zx_aio_req *r = w->finished;
			w->finished = r->next;
			finish(aio, r);
			r->next = w->free;
			w->free = r;
		}
		int n = 0;
		const int switching = w->reg_seen != aio->reg_gen; /* takes no new work meanwhile */
		if (switching && w->inflight == 0) {
			ring_take_registration(w);
			continue;
		}
		/* lock-step (overlap_events off): a new batch only once the last one is complete */
		if (!switching && (aio->p.overlap_events || w->inflight == 0)) {
			while (w->free && w->inflight + n < depth && claim(aio, w->free)) {
				batch[n++] = w->free;
				w->free = w->free->next;
			}
		}
		if (n == 0 && w->inflight == 0) {
			if (aio->stopping)
				break;
			pthread_cond_wait(&aio->work, &aio->lock);
			continue;
		}
		pthread_mutex_unlock(&aio->lock);

		w->inflight += n;
		if (w->dead) {
			for (int i = 0; i < n; i++) {
				batch[i]->error = w->dead;
				w->inflight--;
				retire(w, batch[i]);
			}
		} else if (n > 0) {
			int frc = 0, prepped = 0;
			while (prepped < n && !frc) {
				ring_prep(w, batch[prepped++]);
				if (aio->p.single_submit)
					frc = ring_flush(w, 0);
			}
			/* one system call submits and waits for what ring_reap takes next */
			if (!frc)
				frc = ring_flush(w, aio->p.overlap_events ? 1 : (unsigned)w->inflight);
			if (frc)
				ring_dead(w, frc, batch, prepped, n);
		}
		if (w->inflight > 0)
			ring_reap(w, !aio->p.overlap_events);

		pthread_mutex_lock(&aio->lock);
	}
	pthread_mutex_unlock(&aio->lock);
	return NULL;
}

#endif /* ZX_HAVE_URING */

/* ---------------------------------------------------------------------------------------------------
 * The pread/pwrite worker: one request at a time, blocking */

static void *threads_main(void *arg)
{
	struct zx_aio_worker *w = arg;
	struct zx_aio *aio = w->aio;
	struct zx_aio_req *r = w->reqs;

	pthread_mutex_lock(&aio->lock);
	for (;;) {
		if (!claim(aio, r)) {
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
		} while (progress(r, res));
		complete_tail(r);
		pthread_mutex_lock(&aio->lock);
		finish(aio, r);
	}
	pthread_mutex_unlock(&aio->lock);
	return NULL;
}

/* ---------------------------------------------------------------------------------------------------
 * Set-up and tear-down */

int zx_aio_uring_probe(void)
{
#if !ZX_HAVE_URING
	return -ENOSYS;
#else
	struct io_uring ring;
	struct io_uring_cqe *cqe;
	int rc = io_uring_queue_init(1, &ring, 0);
	if (rc < 0)
		return rc;
	struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
	io_uring_prep_nop(sqe);
	rc = io_uring_submit(&ring);
	if (rc == 1) {
		rc = io_uring_wait_cqe(&ring, &cqe);
		if (!rc) {
			rc = cqe->res;
			io_uring_cqe_seen(&ring, cqe);
		}
	} else if (rc >= 0) {
		rc = -EIO;
	}
	io_uring_queue_exit(&ring);
	return rc < 0 ? rc : 0;
#endif
}

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
	void *(*fn)(void *) = aio->backend == ZX_AIO_URING ? uring_main : threads_main;
#else
	void *(*fn)(void *) = threads_main;
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

int64_t zx_aio_fixed_requests(struct zx_aio *aio)
{
	return atomic_load_explicit(&aio->fixed_requests, memory_order_relaxed);
}

/* Publishes reg (n ranges, owned by the handle from here) and waits until every worker's ring has
 * taken it. Returns 0 or the first worker's -errno. Called with aio->lock held. */
static int publish_registration(struct zx_aio *aio, struct iovec *reg, int n)
{
	free(aio->reg);
	aio->reg = reg;
	aio->nreg = n;
	uint64_t gen = ++aio->reg_gen;
	pthread_cond_broadcast(&aio->work);
	int rc = 0;
	for (int i = 0; i < aio->nworkers; i++) {
		struct zx_aio_worker *w = &aio->workers[i];
		while (w->reg_seen < gen) /* not !=: a later call's set may overtake this one */
			pthread_cond_wait(&aio->done, &aio->lock);
		if (w->reg_rc && !rc)
			rc = w->reg_rc;
	}
	return rc;
}

int zx_aio_register_buffers(struct zx_aio *aio, void *const *bufs, const int64_t *lens, int n)
{
	if (!aio)
		return -EINVAL;
	if (aio->pid != getpid())
		return -EOWNERDEAD;
	if (aio->backend != ZX_AIO_URING)
		return -EOPNOTSUPP;
	const int64_t most = (int64_t)1 << 30; /* the kernel's limit on one registered range */
	int64_t count = 0;
	int rc = n < 0 || (n > 0 && (!bufs || !lens)) ? -EINVAL : 0;
	for (int i = 0; i < n && !rc; i++) {
		if (!bufs[i] || lens[i] <= 0)
			rc = -EINVAL;
		else if ((count += (lens[i] + most - 1) / most) > ZX_AIO_MAX_REGISTERED)
			rc = -EINVAL;
	}
	struct iovec *reg = NULL;
	if (!rc && count > 0 && !(reg = malloc((size_t)count * sizeof(*reg))))
		rc = -ENOMEM;
	int k = 0;
	for (int i = 0; i < n && !rc; i++)
		for (int64_t o = 0; o < lens[i]; o += most, k++) {
			reg[k].iov_base = (char *)bufs[i] + o;
			reg[k].iov_len = (size_t)min64(most, lens[i] - o);
		}
	pthread_mutex_lock(&aio->lock);
	if (aio->stopping) {
		pthread_mutex_unlock(&aio->lock);
		free(reg);
		return -ESHUTDOWN;
	}
	if (!rc)
		rc = publish_registration(aio, reg, k);
	if (rc && !aio->stopping)
		publish_registration(aio, NULL, 0); /* all or nothing: no worker keeps any set */
	pthread_mutex_unlock(&aio->lock);
	return rc;
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
