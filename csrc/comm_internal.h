/* comm_internal.h - what comm.c (ops, queue, progress thread) and comm_shm.c (the transport) share.
 *
 * An op is described transport-neutrally as data movement over per-rank *streams*: each rank sends a
 * stream made of its segments laid end to end; a read copies a range of one rank's stream into local
 * memory; a reduction combines the same range of every rank's stream into local memory. Every verb of
 * comm.h is such a description (comm.c builds them), and the transport moves it.
 */
#ifndef ZX_COMM_INTERNAL_H
#define ZX_COMM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <sys/types.h>

#include "comm.h"

struct zx_comm_seg { /* part of this rank's stream, in order */
	const char *ptr;
	int64_t len;
};

struct zx_comm_read { /* stream of rank src, bytes [off, off + len) -> dst */
	int src;
	int64_t off;
	char *dst;
	int64_t len;
};

struct zx_comm_red { /* every stream's elements at [off, off + count * size) reduced -> dst */
	int64_t off;
	char *dst;
	int64_t count;
};

/* A reduction's shape, for transports that run it split (comm_shm.c): ZX_SPLIT_ALL_REDUCE, every rank
 * keeps the whole result (reduce-scatter + all-gather within each round); ZX_SPLIT_SCATTER, every rank
 * keeps its own equal chunk of the streams, rank r chunk r (a reduce-scatter). */
enum { ZX_SPLIT_NONE = 0, ZX_SPLIT_ALL_REDUCE = 1, ZX_SPLIT_SCATTER = 2 };

struct zx_comm_op {
	const char *verb;
	int64_t seq;  /* this communicator's op number, from 1, for messages */
	int64_t span; /* the longest stream of any rank: the op moves bytes [0, span) of each */
	int nsegs, nreads, nreds;
	struct zx_comm_seg *segs;
	struct zx_comm_read *reads;
	struct zx_comm_red *reds;
	int dtype, redop;
	double scale;
	int split; /* how the transport may run a reduction: ZX_SPLIT_* (comm_shm.c) */
	double timeout_s; /* > 0: this op's own bound on its waits (zx_comm_agree), else the communicator's */
	char label[ZX_COMM_LABEL_BYTES]; /* zx_comm_agree's name (verb points here) */

	struct zx_comm *comm;	 /* set when queued: a waiter may run it (zx_comm_wait) */
	struct zx_comm_op *next; /* the queue */
	_Atomic uint32_t done;	 /* a futex word: 0 until the op ran */
	_Atomic int refs;	 /* the handle's and the queue's */
	int status;
	char error[ZX_COMM_ERROR_BYTES];
};

struct zx_shm; /* comm_shm.c */

struct zx_comm {
	int transport, rank, world;
	pid_t pid; /* the creating process: a child of fork() may not use it */
	double timeout_s;
	struct zx_shm *shm;

	pthread_t thread;
	pthread_mutex_t lock; /* the queue and `stopping` */
	pthread_cond_t wake;
	struct zx_comm_op *head, *tail;
	int running; /* an op is being run: by the progress thread, or by a waiter (zx_comm_wait) */
	int stopping;
	_Atomic int64_t nops;
	_Atomic int defer_next; /* zx_comm_defer_next: the next op enqueued wakes no thread */
	_Atomic int64_t handed_off; /* ops the progress thread ran (the rest ran on their waiter's thread) */

	/* the first failure (the progress thread's only) */
	int failed;
	char error[ZX_COMM_ERROR_BYTES];
};

/* The SHM transport. create: 0 or -errno (*msg says why, for the caller's message). run: moves one
 * op, 0 or -errno with op->error set. leave: tells the others this rank left (reason: why). */
int zx_shm_open(struct zx_comm *comm, const char *id, int64_t slot_bytes, char *msg, size_t msg_len);
int zx_shm_run(struct zx_comm *comm, struct zx_comm_op *op);
void zx_shm_leave(struct zx_comm *comm, int failed, const char *reason);
void zx_shm_close(struct zx_comm *comm, int owner);
int zx_shm_unlink(struct zx_comm *comm);
int64_t zx_shm_bytes(const struct zx_comm *comm);
int zx_shm_unique_id(char id[ZX_COMM_ID_BYTES]);

#endif /* ZX_COMM_INTERNAL_H */
