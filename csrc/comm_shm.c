/* comm_shm.c - the shared-memory transport of comm.h: ranks on one host, CPU memory.
 *
 * The segment (a /dev/shm file, 0600): a header, one seat per rank, then two sets of `world` slots of
 * slot_bytes. An op moves its streams (comm_internal.h) in rounds over windows of slot_bytes: each
 * rank copies its window into its slot of set (round & 1), arrives, waits for every rank to arrive,
 * then copies or reduces out of the slots (its own bytes it copies from its input before arriving:
 * they wait for no one). A rank writes set (round & 1) again only in round + 2, after everyone
 * arrived at round + 1, i.e. after everyone finished reading round: one barrier per round is enough.
 *
 * An all-reduce of at least one slot runs split (reduce-scatter + all-gather inside each round, two
 * barriers): every rank copies into its slot the shares of the window the others reduce, arrives,
 * reduces its own share (its own input read in place, the others' from their slots, in rank order:
 * the same bits as the whole reduction) into its output and its slot in one pass, arrives again, and
 * copies the others' shares out. Each rank reduces 1/N of the window instead of all of it, and writes
 * (N-1)/N of it. A reduce-scatter runs split too, with one barrier: round k moves window k of every
 * rank's chunk, each rank copying into its slot its part of the chunks the others keep and then
 * reducing its own chunk's window straight into its output; every rank reduces in every round (a
 * round of the whole streams would leave all but the chunk's owner idle). The set rule above holds
 * per data round: a set is written again only after everyone passed the next data round's
 * barriers, which follow their reads.
 *
 * Arrival is a per-seat counter; waiting spins briefly, then sleeps on a futex in the segment, and
 * every few milliseconds looks at the missing ranks: a seat marked left (destroyed, exited, or failed
 * with its own error) or a rank whose lock is gone (its process died: each rank holds an
 * open-file-description lock on its seat's byte of the file, which the kernel drops with the process)
 * ends the wait at once; otherwise the communicator's timeout does, naming the ranks that did not
 * arrive.
 *
 * The rounds themselves are comm_shm_rounds.c's.
 *
 * Names: rank 0 creates the file, the others attach by name, and rank 0 removes the name once all
 * have attached (zx_shm_unlink), so a run killed later leaves nothing behind. A run killed between
 * creation and that point leaves a file no one holds a lock on: zx_shm_unique_id reaps those.
 */
#define _GNU_SOURCE
#include "comm_shm.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "thread_pool.h"

/* ---------------------------------------------------------------------------------------------------
 * Small helpers */

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The lock on byte r of the file: held by rank r for as long as its process lives. */
static int lock_seat(int fd, int r, int cmd, short type)
{
	struct flock fl = { .l_type = type, .l_whence = SEEK_SET, .l_start = r, .l_len = 1 };
	if (fcntl(fd, cmd, &fl) < 0)
		return -errno;
	return cmd == F_OFD_GETLK ? fl.l_type != F_UNLCK : 0;
}

/* 1 when rank r attached and its process is gone. */
static int seat_dead(const struct zx_shm *s, int r)
{
	const struct shm_seat *st = shm_seat_of(s, r);
	if (atomic_load(&st->state) != SEAT_IN)
		return 0;
	if (lock_seat(s->fd, r, F_OFD_GETLK, F_WRLCK) == 0)
		return 1;
	/* a forked child sharing the description keeps the lock; the pid then tells */
	return kill(st->pid, 0) < 0 && errno == ESRCH;
}

/* ---------------------------------------------------------------------------------------------------
 * Names, creation, attachment */

/* Removes /dev/shm/zx-comm-* files no rank holds a lock on and older than SHM_STALE_S. */
static void reap_stale(void)
{
	DIR *dir = opendir("/dev/shm");
	if (!dir)
		return;
	struct dirent *e;
	time_t now = time(NULL);
	while ((e = readdir(dir))) {
		if (strncmp(e->d_name, SHM_PREFIX, strlen(SHM_PREFIX)))
			continue;
		char name[NAME_MAX + 2];
		snprintf(name, sizeof(name), "/%s", e->d_name);
		int fd = shm_open(name, O_RDWR, 0);
		if (fd < 0)
			continue; /* another user's, or gone */
		struct stat st;
		struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0,
				    .l_len = ZX_COMM_MAX_WORLD };
		if (fstat(fd, &st) == 0 && now - st.st_mtime > SHM_STALE_S && fcntl(fd, F_OFD_GETLK, &fl) == 0 &&
		    fl.l_type == F_UNLCK)
			shm_unlink(name);
		close(fd);
	}
	closedir(dir);
}

int zx_shm_unique_id(char id[ZX_COMM_ID_BYTES])
{
	uint64_t r;
	if (getrandom(&r, sizeof(r), 0) != sizeof(r))
		return -EIO;
	reap_stale();
	snprintf(id, ZX_COMM_ID_BYTES, "/" SHM_PREFIX "%u-%d-%016llx", (unsigned)getuid(), (int)getpid(),
		 (unsigned long long)r);
	return 0;
}

static int64_t pick_slot(int64_t asked, int world)
{
	int64_t s = asked ? asked : world == 1 ? SHM_SOLO_SLOT : SHM_DEFAULT_SLOT;
	if (!asked && s * 2 * world > (64 << 20))
		s = (64 << 20) / (2 * world);
	s = (s + 4095) & ~(int64_t)4095;
	return s < 4096 ? 4096 : s;
}

static int create_segment(struct zx_shm *s, int world, int64_t slot_bytes, char *msg, size_t len)
{
	int64_t data_offset = ((int64_t)(sizeof(struct shm_header) + world * sizeof(struct shm_seat)) + 4095) &
			      ~(int64_t)4095;
	int64_t total = data_offset + 2 * world * slot_bytes;
	s->fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL, 0600);
	if (s->fd < 0) {
		int rc = -errno;
		snprintf(msg, len, "cannot create /dev/shm%s: %s", s->name, strerror(errno));
		return rc;
	}
	int rc = lock_seat(s->fd, 0, F_OFD_SETLK, F_WRLCK);
	if (!rc && fchmod(s->fd, 0600) < 0) /* exactly 0600, whatever the umask */
		rc = -errno;
	if (!rc && ftruncate(s->fd, total) < 0)
		rc = -errno;
	if (!rc)
		rc = -posix_fallocate(s->fd, 0, total); /* ENOSPC now, not SIGBUS at the first write */
	if (rc < 0) {
		snprintf(msg, len, "cannot make a %lld-byte segment in /dev/shm (%s): %s", (long long)total,
			 s->name, strerror(-rc));
		return rc;
	}
	void *map = mmap(NULL, (size_t)total, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
	if (map == MAP_FAILED) {
		rc = -errno;
		snprintf(msg, len, "cannot map /dev/shm%s: %s", s->name, strerror(errno));
		return rc;
	}
	s->h = map;
	s->h->world = world;
	s->h->version = 2; /* 2: seats carry op stamps */
	s->h->slot_bytes = slot_bytes;
	s->h->data_offset = data_offset;
	s->h->total_bytes = total;
	atomic_store(&s->h->magic, SHM_MAGIC);
	return 0;
}

static int attach_segment(struct zx_shm *s, int rank, int world, double timeout_s, char *msg, size_t len)
{
	s->fd = shm_open(s->name, O_RDWR, 0);
	if (s->fd < 0) {
		int rc = -errno;
		snprintf(msg, len, "cannot open /dev/shm%s: %s", s->name, strerror(errno));
		return rc;
	}
	/* the creator fills the file after creating it: wait for its size and magic */
	struct stat st;
	double deadline = now_s() + timeout_s;
	while (fstat(s->fd, &st) == 0 && st.st_size < (off_t)sizeof(struct shm_header) && now_s() < deadline)
		usleep(1000);
	if (st.st_size < (off_t)sizeof(struct shm_header)) {
		snprintf(msg, len, "/dev/shm%s was never filled by rank 0", s->name);
		return -ETIMEDOUT;
	}
	void *map = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
	if (map == MAP_FAILED) {
		int rc = -errno;
		snprintf(msg, len, "cannot map /dev/shm%s: %s", s->name, strerror(errno));
		return rc;
	}
	s->h = map;
	while (atomic_load(&s->h->magic) != SHM_MAGIC && now_s() < deadline)
		usleep(1000);
	if (atomic_load(&s->h->magic) != SHM_MAGIC || s->h->total_bytes != st.st_size) {
		snprintf(msg, len, "/dev/shm%s is not a zero_ext communicator", s->name);
		munmap(map, (size_t)st.st_size);
		s->h = NULL;
		return -EPROTO;
	}
	if (s->h->world != world) {
		snprintf(msg, len, "/dev/shm%s was made for %d ranks, not %d", s->name, s->h->world, world);
		munmap(map, (size_t)st.st_size);
		s->h = NULL;
		return -EINVAL;
	}
	int rc = lock_seat(s->fd, rank, F_OFD_SETLK, F_WRLCK);
	if (rc < 0) {
		snprintf(msg, len, "rank %d of /dev/shm%s is taken by another process", rank, s->name);
		munmap(map, (size_t)st.st_size);
		s->h = NULL;
		return rc == -EAGAIN || rc == -EACCES ? -EADDRINUSE : rc;
	}
	return 0;
}

int zx_shm_open(struct zx_comm *comm, const char *id, int64_t slot_bytes, char *msg, size_t len)
{
	struct zx_shm *s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	s->fd = -1;
	if (snprintf(s->name, sizeof(s->name), "%s", id) >= (int)sizeof(s->name) || id[0] != '/' ||
	    strchr(id + 1, '/')) {
		free(s);
		snprintf(msg, len, "bad communicator id");
		return -EINVAL;
	}
	int rc = comm->rank == 0 ? create_segment(s, comm->world, pick_slot(slot_bytes, comm->world), msg, len)
				 : attach_segment(s, comm->rank, comm->world, comm->timeout_s, msg, len);
	if (rc < 0) {
		if (s->fd >= 0)
			close(s->fd);
		if (comm->rank == 0 && rc != -EEXIST)
			shm_unlink(s->name);
		free(s);
		return rc;
	}
	s->slot = s->h->slot_bytes;
	s->data = (char *)s->h + s->h->data_offset;
	s->threads = zx_pool_threads() / comm->world; /* the ranks share this host's CPUs */
	if (s->threads < 1)
		s->threads = 1;
	struct shm_seat *me = shm_seat_of(s, comm->rank);
	me->pid = (int32_t)getpid();
	atomic_store(&me->state, SEAT_IN);
	comm->shm = s;
	return 0;
}

int zx_shm_unlink(struct zx_comm *comm)
{
	if (comm->rank != 0)
		return -EINVAL;
	if (shm_unlink(comm->shm->name) < 0 && errno != ENOENT)
		return -errno;
	return 0;
}

static void wake_all(struct shm_header *h)
{
	atomic_fetch_add(&h->wake, 1);
	if (atomic_load(&h->sleepers))
		syscall(SYS_futex, &h->wake, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

void zx_shm_leave(struct zx_comm *comm, int failed, const char *reason)
{
	struct shm_seat *me = shm_seat_of(comm->shm, comm->rank);
	if (atomic_load(&me->state) != SEAT_IN)
		return;
	snprintf(me->reason, sizeof(me->reason), "%s", reason);
	atomic_store(&me->state, failed ? SEAT_FAILED : SEAT_LEFT);
	wake_all(comm->shm->h);
}

void zx_shm_close(struct zx_comm *comm, int owner)
{
	struct zx_shm *s = comm->shm;
	if (owner && comm->rank == 0)
		shm_unlink(s->name); /* normally gone already (zx_shm_unlink) */
	munmap(s->h, (size_t)s->h->total_bytes);
	close(s->fd); /* drops this rank's seat lock */
	free(s->jobs);
	free(s);
	comm->shm = NULL;
}

int64_t zx_shm_bytes(const struct zx_comm *comm)
{
	return comm->shm->h->total_bytes;
}

/* ---------------------------------------------------------------------------------------------------
 * The barrier */

/* The first rank (from `from`) that has not arrived at round, or -1. */
static int missing(const struct zx_shm *s, uint64_t round, int from)
{
	for (int r = from; r < s->h->world; r++)
		if (atomic_load_explicit(&shm_seat_of(s, r)->arrived, memory_order_acquire) < round)
			return r;
	return -1;
}

static void cpu_relax(void)
{
#if defined(__x86_64__)
	__builtin_ia32_pause();
#endif
}

/* Ends a wait that cannot succeed: a missing rank that left or died, or the timeout. */
static int check_missing(struct zx_comm *comm, struct zx_comm_op *op, uint64_t round, double start)
{
	struct zx_shm *s = comm->shm;
	int first = missing(s, round, 0);
	for (int r = first; r >= 0; r = missing(s, round, r + 1)) {
		const struct shm_seat *st = shm_seat_of(s, r);
		uint32_t state = atomic_load(&st->state);
		if (state == SEAT_LEFT || state == SEAT_FAILED) {
			snprintf(op->error, sizeof(op->error), "%s #%lld: rank %d left before arriving (%s)",
				 op->verb, (long long)op->seq, r, st->reason);
			return -ECONNRESET;
		}
		if (seat_dead(s, r)) {
			snprintf(op->error, sizeof(op->error),
				 "%s #%lld: rank %d (pid %d) died before arriving (its process ended: killed, or "
				 "crashed)", op->verb, (long long)op->seq, r, st->pid);
			return -EPIPE;
		}
	}
	double waited = now_s() - start, timeout = op->timeout_s > 0 ? op->timeout_s : comm->timeout_s;
	if (waited < timeout)
		return 0;
	int n = snprintf(op->error, sizeof(op->error), "%s #%lld: rank", op->verb, (long long)op->seq);
	int count = 0;
	for (int r = first; r >= 0 && n < (int)sizeof(op->error) - 64; r = missing(s, round, r + 1), count++)
		n += snprintf(op->error + n, sizeof(op->error) - n, "%s %d", count ? "," : "", r);
	snprintf(op->error + n, sizeof(op->error) - n,
		 " did not arrive within %.0f s (alive: stuck elsewhere, or on a branch the others did not "
		 "take)", timeout);
	return -ETIMEDOUT;
}

int zx_shm_arrive(struct zx_comm *comm, struct zx_comm_op *op, uint64_t round)
{
	struct zx_shm *s = comm->shm;
	struct shm_header *h = s->h;
	atomic_store(&shm_seat_of(s, comm->rank)->arrived, round);
	wake_all(h);
	/* spin a little (the others are usually close), yield a little (they may share our core) */
	for (int i = 0; i < 256; i++) {
		if (missing(s, round, 0) < 0)
			return 0;
		if (i < 128)
			cpu_relax();
		else
			sched_yield();
	}
	double start = now_s();
	struct timespec pause = { 0, SHM_CHECK_NS };
	for (;;) {
		atomic_fetch_add(&h->sleepers, 1);
		uint32_t w = atomic_load(&h->wake);
		if (missing(s, round, 0) >= 0)
			syscall(SYS_futex, &h->wake, FUTEX_WAIT, w, &pause, NULL, 0);
		atomic_fetch_sub(&h->sleepers, 1);
		if (missing(s, round, 0) < 0)
			return 0;
		int rc = check_missing(comm, op, round, start);
		if (rc < 0)
			return rc;
	}
}
