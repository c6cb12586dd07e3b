/* aio_uring.c - the io_uring half of the NVMe I/O handle (aio.h): the worker that owns a ring and
 * moves requests taken from the handle's queue (aio.c) through it, the probe for whether this
 * process may use io_uring, and registered (fixed) buffers.
 *
 * Owns: each worker's ring and its copy of the registered ranges. Does not own: the queue, the ops
 * or the workers' threads (aio.c).
 */
#define _GNU_SOURCE
#include "aio_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if ZX_HAVE_URING
static void pause_briefly(void)
{
	struct timespec ts = { 0, 100 * 1000 }; /* 100 us */
	nanosleep(&ts, NULL);
}

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
	zx_aio_complete_tail(r);
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
			if (zx_aio_progress(r, res)) {
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

void *zx_aio_uring_main(void *arg)
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
			zx_aio_finish(aio, r);
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
			while (w->free && w->inflight + n < depth && zx_aio_claim(aio, w->free)) {
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

/* ---------------------------------------------------------------------------------------------------
 * Registered buffers (the workers take a new set in ring_take_registration) */

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
