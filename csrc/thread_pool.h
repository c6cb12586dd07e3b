/* thread_pool.h - a small pthread pool for the CPU kernels (CPU optimizers, memory-bandwidth floor).
 *
 * Not OpenMP: torch's wheel bundles its own OpenMP runtime, and two runtimes in one process fight
 * over cores. The pool is created lazily on the first run, sized by zx_pool_set_threads (Python
 * passes torch.get_num_threads()), and shared by the whole process. Runs are serialized: a second
 * caller waits for the first to finish. After fork() the child starts with no workers and creates
 * them again on its first run.
 */
#ifndef ZX_THREAD_POOL_H
#define ZX_THREAD_POOL_H

#define ZX_POOL_MAX_THREADS 256

/* Work run on every thread of a run: tid is 0 (the caller) .. nthreads-1. The function is
 * expected to split its work itself, e.g. by taking tiles from an atomic counter in arg. */
typedef void (*zx_pool_fn)(void *arg, int tid, int nthreads);

/* Sets the number of threads later runs use (the caller counts as one), 1..ZX_POOL_MAX_THREADS.
 * Workers of a different earlier size are stopped and joined first. Returns 0 or -EINVAL. */
int zx_pool_set_threads(int nthreads);

/* The number of threads a run uses: the size set, or by default the CPUs this process may run on
 * (its affinity mask). */
int zx_pool_threads(void);

/* Runs fn(arg, tid, n) on n = min(nthreads, zx_pool_threads()) threads and returns when all have
 * returned. The caller runs tid 0 itself, so nthreads == 1 starts no thread at all. If a worker
 * cannot be started the run goes on with those that could (never fewer than the caller). Call it
 * without the GIL. Returns 0, or -EINVAL for nthreads < 1 or fn == NULL. */
int zx_pool_run(zx_pool_fn fn, void *arg, int nthreads);

#endif /* ZX_THREAD_POOL_H */
