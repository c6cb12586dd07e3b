/* comm_shm.h - what the shared-memory transport's two files share: comm_shm.c (the segment: names,
 * creation, attachment, seats, the barrier) and comm_shm_rounds.c (ops moved in rounds over the slots).
 * Internal to the transport; comm_internal.h is the communicator's side.
 */
#ifndef ZX_COMM_SHM_H
#define ZX_COMM_SHM_H

#include "comm_internal.h"

#define SHM_MAGIC 0x31306d6d6f63787aull /* "zxcomm01" */
#define SHM_PREFIX "zx-comm-"
#define SHM_REASON_BYTES 200
#define SHM_STALE_S 60		   /* an unlocked segment this old is a dead run's */
#define SHM_CHECK_NS 5000000	   /* the missing ranks are looked at every 5 ms of waiting */
#define SHM_PIECE (1 << 20)	   /* bytes of work one pool thread takes at a time */
#define SHM_POOL_MIN (4 << 20)	   /* a round moving less than this stays on one thread */
#define SHM_DEFAULT_SLOT (4 << 20) /* bytes, capped so both sets stay within 64 MiB */
#define SHM_SOLO_SLOT (64 << 10)   /* one rank only copies: small slots suffice */
#define SHM_SPLIT_MIN (256 << 10)  /* all-reduces from this size (or one slot) run split */
#define SHM_SHARE_ALIGN 64	   /* bytes: shares of a window start on their own cache line */

enum { SEAT_EMPTY = 0, SEAT_IN = 1, SEAT_LEFT = 2, SEAT_FAILED = 3 };

/* What a rank runs, written into its seat before the first barrier of an op (per slot set, whose reuse
 * rule keeps it until every rank has read it) and compared by every rank after that barrier, before any
 * byte is read out of the slots: ranks in different collectives fail at once, each naming both. */
struct shm_stamp {
	int64_t seq, span;  /* the op's number on this communicator, its bytes (op->span) */
	int32_t dtype, redop; /* -1 for movements */
	char verb[ZX_COMM_LABEL_BYTES];
};

struct shm_seat {
	_Atomic uint64_t arrived; /* the last round this rank arrived at */
	_Atomic uint32_t state;
	int32_t pid;
	char reason[SHM_REASON_BYTES]; /* why it left, written before state */
	struct shm_stamp stamp[2];     /* by slot set */
} __attribute__((aligned(256)));

struct shm_header {
	_Atomic uint64_t magic; /* set last by the creator */
	int32_t world, version;
	int64_t slot_bytes, data_offset, total_bytes;
	_Atomic uint32_t wake;	   /* the futex word: bumped by every arrival */
	_Atomic uint32_t sleepers; /* ranks inside a futex wait */
	struct shm_seat seats[] __attribute__((aligned(256)));
};

struct shm_job { /* copy bytes src -> dst, or (reduce) reduce every slot at slot_off -> dst (and dst2
		  * when set), this rank's own operand read from src instead of its slot when src is set */
	char *dst, *dst2;
	const char *src;
	int64_t slot_off, bytes;
	int reduce;
};

struct zx_shm {
	int fd;
	char name[ZX_COMM_ID_BYTES];
	struct shm_header *h;
	char *data;
	int64_t slot;
	uint64_t round; /* barriers passed */
	uint64_t sets;	/* data rounds run: the slot set of round d is d & 1 */
	int threads;	/* pool threads this rank uses: the host's CPUs shared among its ranks */
	struct shm_job *jobs; /* the progress thread's, reused from round to round */
	int njobs, cap;
};

static inline struct shm_seat *shm_seat_of(const struct zx_shm *s, int r)
{
	return &s->h->seats[r];
}

/* Rank r's slot of set `set` (a data round's number; its parity picks the set). */
static inline char *shm_slot(const struct zx_shm *s, uint64_t set, int r)
{
	return s->data + ((int64_t)(set & 1) * s->h->world + r) * s->slot;
}

/* Arrives at barrier `round` and waits for every rank: 0, or -errno with op->error naming the rank
 * that left, died or did not arrive within the timeout. */
int zx_shm_arrive(struct zx_comm *comm, struct zx_comm_op *op, uint64_t round);

#endif /* ZX_COMM_SHM_H */
