/* thread_pool.c - the process-wide pthread pool behind zx_pool_run (see thread_pool.h).
 *
 * Owns: the worker threads, their start/finish handshake (one mutex, two condition variables and a
 * generation counter), lazy (re)creation at a new size, and the fork handler. Does not own: how work
 * is split (the caller's fn does that) or any per-run memory. Between runs workers poll the
 * generation counter for up to POOL_SPIN_NS, then sleep on a condition variable; a run costs about a
 * microsecond when it finds them polling, tens of microseconds when it must wake them, so callers
 * run small jobs inline instead (see cpu_optim.c).
 */
#define _GNU_SOURCE
#include "thread_pool.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

struct zx_pool {
	pthread_mutex_t run_lock; /* held for a whole run or resize: runs are serialized */
	pthread_mutex_t mu;	  /* guards the fields below */
	pthread_cond_t start_cv;  /* workers wait here for gen to change */
	pthread_cond_t done_cv;	  /* the caller waits here for pending to reach 0 */
	pthread_t thread[ZX_POOL_MAX_THREADS];
	int nworkers;	/* workers running, tids 1..nworkers */
	int want;	/* threads wanted in all (caller included); 0 = not set, use the default */
	uint64_t gen;	/* bumped once per run */
	uint64_t start_gen; /* gen when the current workers were started: they wait for the next */
	int quit;	/* set to stop every worker */
	int pending;	/* workers of the current run not finished yet */
	zx_pool_fn fn;	/* the current run */
	void *arg;
	int njob;	/* threads taking part in the current run, caller included */
};

static struct zx_pool pool = {
	.run_lock = PTHREAD_MUTEX_INITIALIZER,
	.mu = PTHREAD_MUTEX_INITIALIZER,
	.start_cv = PTHREAD_COND_INITIALIZER,
	.done_cv = PTHREAD_COND_INITIALIZER,
};

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/* In the child of fork() only the forking thread exists: forget the workers (they were not copied)
 * and start from fresh locks, which may have been held by another thread at the fork. */
static void pool_atfork_child(void)
{
	pthread_mutex_init(&pool.run_lock, NULL);
	pthread_mutex_init(&pool.mu, NULL);
	pthread_cond_init(&pool.start_cv, NULL);
	pthread_cond_init(&pool.done_cv, NULL);
	pool.nworkers = 0;
	pool.quit = 0;
	pool.pending = 0;
}

static void pool_register_atfork(void)
{
	pthread_atfork(NULL, NULL, pool_atfork_child);
}

/* How long a thread spins (polls) for the event it waits for before it sleeps on a condition
 * variable. Sleeping lets an idle virtual CPU halt, and waking a halted one costs the host a
 * reschedule: measured here, a run after 200 us of other work took 88 us to start its worker
 * against 7 us back to back, a quarter of an Adam step of 1e6 elements. OpenMP runtimes spin
 * after a parallel region for the same reason (libgomp: up to GOMP_SPINCOUNT). */
#define POOL_SPIN_NS 200000

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Polls ready(arg) until it holds, for at most POOL_SPIN_NS. Called without pool.mu; the caller
 * re-checks under it. */
static void spin_until(int (*ready)(uint64_t), uint64_t arg)
{
	uint64_t start = now_ns();
	for (unsigned k = 0; !ready(arg); k++) {
		if ((k & 63) == 63 && now_ns() - start > POOL_SPIN_NS)
			return;
#if defined(__x86_64__) || defined(__i386__)
		__builtin_ia32_pause();
#endif
	}
}

/* A worker's wait: a run after generation `seen` has begun, or the pool is stopping. */
static int new_run(uint64_t seen)
{
	return __atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE) != seen ||
	       __atomic_load_n(&pool.quit, __ATOMIC_RELAXED);
}

/* The caller's wait: every worker of the current run has finished. */
static int run_finished(uint64_t unused)
{
	return __atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE) == 0;
}

static void *pool_worker(void *p)
{
	int tid = (int)(intptr_t)p;
	pthread_mutex_lock(&pool.mu);
	/* Not pool.gen: a run may have begun before this thread got here, and it must take part. */
	uint64_t seen = pool.start_gen;
	for (;;) {
		if (pool.gen == seen && !pool.quit) {
			pthread_mutex_unlock(&pool.mu);
			spin_until(new_run, seen);
			pthread_mutex_lock(&pool.mu);
		}
		while (pool.gen == seen && !pool.quit)
			pthread_cond_wait(&pool.start_cv, &pool.mu);
		if (pool.quit)
			break;
		seen = pool.gen;
		if (tid >= pool.njob)
			continue; /* not needed in this run */
		zx_pool_fn fn = pool.fn;
		void *arg = pool.arg;
		int njob = pool.njob;
		pthread_mutex_unlock(&pool.mu);
		fn(arg, tid, njob);
		pthread_mutex_lock(&pool.mu);
		__atomic_store_n(&pool.pending, pool.pending - 1, __ATOMIC_RELEASE);
		if (pool.pending == 0)
			pthread_cond_signal(&pool.done_cv);
	}
	pthread_mutex_unlock(&pool.mu);
	return NULL;
}

/* Under run_lock: stops and joins every worker. */
static void pool_stop(void)
{
	pthread_mutex_lock(&pool.mu);
	__atomic_store_n(&pool.quit, 1, __ATOMIC_RELAXED); /* (spinners poll it) */
	pthread_cond_broadcast(&pool.start_cv);
	pthread_mutex_unlock(&pool.mu);
	for (int i = 0; i < pool.nworkers; i++)
		pthread_join(pool.thread[i], NULL);
	pool.nworkers = 0;
	pool.quit = 0;
}

/* Under run_lock: starts workers 1..n-1. Workers get every signal blocked, so that signals (SIGINT
 * for Python) keep going to the threads that expect them. Stops at the first failure. */
static void pool_start(int n)
{
	sigset_t all, old;
	pool.start_gen = pool.gen; /* stable while these workers live: gen moves only under run_lock */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	while (pool.nworkers < n - 1) {
		intptr_t tid = pool.nworkers + 1;
		if (pthread_create(&pool.thread[pool.nworkers], NULL, pool_worker, (void *)tid))
			break;
		pool.nworkers++;
	}
	pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static int default_threads(void)
{
	cpu_set_t set;
	if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0)
		return CPU_COUNT(&set);
	long n = sysconf(_SC_NPROCESSORS_ONLN);
	return n > 0 ? (int)n : 1;
}

int zx_pool_set_threads(int nthreads)
{
	if (nthreads < 1 || nthreads > ZX_POOL_MAX_THREADS)
		return -EINVAL;
	pthread_mutex_lock(&pool.run_lock);
	pool.want = nthreads;
	if (pool.nworkers && pool.nworkers != nthreads - 1)
		pool_stop(); /* the next run starts the new size */
	pthread_mutex_unlock(&pool.run_lock);
	return 0;
}

int zx_pool_threads(void)
{
	int n = __atomic_load_n(&pool.want, __ATOMIC_RELAXED);
	if (n <= 0)
		n = default_threads();
	return n < ZX_POOL_MAX_THREADS ? n : ZX_POOL_MAX_THREADS;
}

int zx_pool_run(zx_pool_fn fn, void *arg, int nthreads)
{
	if (!fn || nthreads < 1)
		return -EINVAL;
	int size = zx_pool_threads();
	if (nthreads > size)
		nthreads = size;
	if (nthreads == 1) {
		fn(arg, 0, 1);
		return 0;
	}
	pthread_once(&atfork_once, pool_register_atfork);
	pthread_mutex_lock(&pool.run_lock);
	if (pool.nworkers != size - 1) {
		if (pool.nworkers)
			pool_stop();
		pool_start(size);
	}
	if (nthreads > pool.nworkers + 1)
		nthreads = pool.nworkers + 1;

	pthread_mutex_lock(&pool.mu);
	pool.fn = fn;
	pool.arg = arg;
	pool.njob = nthreads;
	pool.pending = nthreads - 1;
	__atomic_store_n(&pool.gen, pool.gen + 1, __ATOMIC_RELEASE); /* (workers poll it, see spin_until) */
	if (nthreads > 1)
		pthread_cond_broadcast(&pool.start_cv);
	pthread_mutex_unlock(&pool.mu);

	fn(arg, 0, nthreads);

	spin_until(run_finished, 0);
	pthread_mutex_lock(&pool.mu);
	while (pool.pending > 0)
		pthread_cond_wait(&pool.done_cv, &pool.mu);
	pthread_mutex_unlock(&pool.mu);
	pthread_mutex_unlock(&pool.run_lock);
	return 0;
}
