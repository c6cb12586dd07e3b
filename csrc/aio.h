/* aio.h - asynchronous file I/O for NVMe swapping: io_uring, or a pread/pwrite thread pool.
 *
 * A handle (struct zx_aio) owns worker threads. A read or write of `nbytes` at a file offset is one
 * *op*: it is cut into block_size requests that the workers keep in flight, up to queue_depth each,
 * and the op is done when every request has completed. Submitting never blocks on I/O; waiting
 * returns the op's result. Two backends do the same work behind one API:
 *
 *   ZX_AIO_URING    each of `threads` workers owns an io_uring of queue_depth entries
 *                   (DeepSpeed's intra_op_parallelism: one libaio context per thread there);
 *   ZX_AIO_THREADS  threads * queue_depth workers (at most ZX_AIO_MAX_WORKERS) each doing blocking
 *                   pread/pwrite, for kernels or sandboxes (seccomp) that refuse io_uring.
 *
 * Alignment (so that O_DIRECT works and files look the same with or without it): file offsets are
 * multiples of ZX_AIO_ALIGN; buffers too when the file descriptor has O_DIRECT. A length that is not
 * a multiple of ZX_AIO_ALIGN is padded: its last partial page goes through a page-sized bounce buffer
 * of the op, so a write of n bytes writes round_up(n, ZX_AIO_ALIGN) bytes (the tail zero-filled) and a
 * read of n bytes never touches the caller's memory past n. The file must hold offset + n bytes for
 * a read; a short read or write is an error, never partial data.
 *
 * Conventions (liburing's): functions return 0, a count or an op id, or -errno; they never print,
 * never exit, never touch errno. Everything may be called without the GIL and from any thread; a
 * given op is waited for once. The workers do not survive fork(): in a child, calls on a handle
 * made by the parent return -EOWNERDEAD, and zx_aio_exit only frees the child's copy.
 */
#ifndef ZX_AIO_H
#define ZX_AIO_H

#include <stdint.h>

#define ZX_AIO_ALIGN 4096	   /* bytes: file offsets, block sizes, O_DIRECT buffers */
#define ZX_AIO_MAX_WORKERS 64	   /* threads of one handle, either backend */
#define ZX_AIO_MAX_DEPTH 4096	   /* requests in flight per io_uring worker */
#define ZX_AIO_MAX_BLOCK (1 << 30) /* bytes per request (io_uring lengths are 32-bit) */
#define ZX_AIO_MAX_REGISTERED 1024 /* ranges of zx_aio_register_buffers, after the 1 GiB split */

struct zx_aio; /* opaque: its workers, rings and ops */

enum zx_aio_backend {
	ZX_AIO_AUTO = 0,    /* io_uring where the kernel allows it, else threads */
	ZX_AIO_URING = 1,   /* io_uring or fail */
	ZX_AIO_THREADS = 2, /* the pread/pwrite thread pool */
};

/* The `aio` config section (DeepSpeed's keys and defaults in brackets). */
struct zx_aio_params {
	int64_t block_size; /* bytes per request, a multiple of ZX_AIO_ALIGN [1 MiB] */
	int queue_depth;    /* requests in flight per worker, 1..ZX_AIO_MAX_DEPTH [8] */
	int threads;	    /* intra_op_parallelism: io_uring workers, 1..ZX_AIO_MAX_WORKERS [1] */
	int single_submit;  /* nonzero: one submission call per request, not one per batch [0] */
	int overlap_events; /* nonzero: refill each completion at once; zero: lock-step batches of
			     * queue_depth requests [1] */
	int backend;	    /* enum zx_aio_backend */
};

/* What a waited op reports. On failure it describes the first request that failed. */
struct zx_aio_result {
	int error;	/* 0, or -errno: -ECANCELED when the handle was closed before it ran */
	int short_io;	/* 1 when the request moved fewer bytes than asked without an errno: a
			 * read past the end of the file, or a write the file system cut short
			 * (error is then -ENODATA for a read, -EIO for a write) */
	int64_t offset; /* file offset of that request, bytes */
	int64_t length; /* bytes it had to move */
	int64_t done;	/* bytes it moved */
};

/* Starts a handle with p's settings and stores it in *out. ZX_AIO_AUTO takes io_uring unless the
 * kernel refuses it (see zx_aio_uring_probe), then the thread pool; zx_aio_backend says which.
 * Returns 0, -EINVAL for a setting out of range, the kernel's -errno when ZX_AIO_URING was asked
 * for and refused, -ENOMEM, or -EAGAIN when threads cannot be started. */
int zx_aio_init(struct zx_aio **out, const struct zx_aio_params *p);

/* The backend a handle runs: ZX_AIO_URING or ZX_AIO_THREADS. */
int zx_aio_backend(const struct zx_aio *aio);

/* Whether this process may use io_uring: sets up a one-entry ring and completes a no-op on it.
 * Returns 0, or the kernel's -errno (-ENOSYS on old kernels, -EPERM under seccomp or with
 * kernel.io_uring_disabled). */
int zx_aio_uring_probe(void);

/* Queues a read of nbytes from fd at offset into buf (nbytes >= 0) and returns at once with the op
 * id (> 0), or -errno: -EINVAL for a misaligned offset (or buffer, on an O_DIRECT fd), -EBADF for an
 * fd not open for reading, -ENOMEM, -ESHUTDOWN once zx_aio_exit has begun. The op works on its own
 * duplicate of fd, so the caller may close fd at once; buf must stay valid until the op is waited. */
int64_t zx_aio_submit_read(struct zx_aio *aio, int fd, void *buf, int64_t nbytes, int64_t offset);

/* As zx_aio_submit_read, for a write of nbytes from buf to fd at offset (-EBADF: fd not open for
 * writing). Writes round_up(nbytes, ZX_AIO_ALIGN) bytes: see the alignment rules above. */
int64_t zx_aio_submit_write(struct zx_aio *aio, int fd, const void *buf, int64_t nbytes,
			    int64_t offset);

/* Blocks until op has finished (every request completed or cancelled), fills *res (may be NULL)
 * and forgets the op. Returns 0 or res->error; -ENOENT for an id that is not pending (never
 * submitted, or already waited), -EBUSY while another thread waits for the same op. */
int zx_aio_wait(struct zx_aio *aio, int64_t op, struct zx_aio_result *res);

/* Without blocking: 1 when op has finished (wait will not block), 0 when it runs, -ENOENT. */
int zx_aio_done(struct zx_aio *aio, int64_t op);

/* Registers memory with the io_uring workers: a request that lies inside one of the n ranges
 * (bufs[i], lens[i] bytes) then goes through io_uring's fixed-buffer read or write, for which the
 * kernel pinned the pages once, here, instead of on every request (on this project's machine a
 * quarter of the CPU time per byte read, half per byte written). The call replaces the handle's
 * whole set: n = 0 unregisters everything. Ranges longer than 1 GiB (the kernel's limit) are split.
 * Workers switch sets between requests, so ops may be in flight meanwhile; the call returns once
 * every worker has switched. The memory must stay mapped until it is unregistered or the handle
 * closed: the kernel holds the pages, and a range freed and mapped again would read and write the
 * old ones. Returns 0; -EOPNOTSUPP for the thread backend; -ESHUTDOWN once zx_aio_exit has begun;
 * -EINVAL for a NULL or empty range or too many; or the kernel's -errno (-ENOMEM past
 * RLIMIT_MEMLOCK without CAP_IPC_LOCK, -EFAULT for memory it cannot pin). After -EINVAL or a
 * kernel error no range stays registered, and requests run as before. */
int zx_aio_register_buffers(struct zx_aio *aio, void *const *bufs, const int64_t *lens, int n);

/* Requests (attempts, retries included) that went through a registered range so far. */
int64_t zx_aio_fixed_requests(struct zx_aio *aio);

/* Ops submitted and not yet waited. */
int64_t zx_aio_pending(struct zx_aio *aio);

/* Cancels requests that have not started, waits for those in flight, stops the workers and frees
 * the handle with every op still in it. After it returns no I/O touches any buffer given to it.
 * aio may be NULL. */
void zx_aio_exit(struct zx_aio *aio);

#endif /* ZX_AIO_H */
