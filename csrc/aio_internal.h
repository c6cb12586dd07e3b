/* aio_internal.h - what the two halves of the NVMe I/O handle share: its types, the queue that
 * workers take requests from (aio.c) and the io_uring worker (aio_uring.c). Not installed; aio.h
 * is the API. */
#ifndef ZX_AIO_INTERNAL_H
#define ZX_AIO_INTERNAL_H

#include "aio.h"

#if ZX_HAVE_URING /* setup.py defines it where liburing is installed; else the thread backend only */
#include <liburing.h>
#endif
#include <pthread.h>
#include <stdatomic.h>
#include <sys/types.h>
#include <sys/uio.h>

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

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The queue (aio.c), all under aio->lock but zx_aio_progress and zx_aio_complete_tail, which work on one
 * request outside it. */
int zx_aio_claim(struct zx_aio *aio, struct zx_aio_req *r);
void zx_aio_finish(struct zx_aio *aio, struct zx_aio_req *r);
int zx_aio_progress(struct zx_aio_req *r, int64_t res);
void zx_aio_complete_tail(struct zx_aio_req *r);

/* The io_uring worker's thread (aio_uring.c). */
void *zx_aio_uring_main(void *arg);

#endif /* ZX_AIO_INTERNAL_H */
