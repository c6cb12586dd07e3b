/* comm.h - collectives between the ranks of a process group, on raw buffers (no Python, no torch).
 *
 * A communicator (struct zx_comm) joins `world` ranks through one transport:
 *
 *   ZX_COMM_SHM   ranks on one host, CPU memory: a shared segment of two sets of per-rank slots in
 *                 /dev/shm (comm_shm.c). Every verb is a sequence of rounds over a window of
 *                 slot_bytes: each rank copies its part of the window into its slot, all arrive at
 *                 a barrier, each copies or reduces what it needs out of the slots. Two slot sets
 *                 alternate, so one barrier per round is enough.
 *
 * Creation: one rank calls zx_comm_unique_id() and hands the id to the others out of band (zero_ext
 * does it through torch.distributed's store: dist stays the rendezvous and the process-group owner);
 * then rank 0 creates the communicator from it before the others attach.
 *
 * Verbs are asynchronous: each enqueues one op and returns its handle; the communicator's progress
 * thread runs ops in call order (which must be the same on every rank), and zx_comm_wait() returns
 * the op's status (a waiter runs the queued ops up to its own itself, in that order, while the progress
 * thread is idle: no hand-over for a blocking call). Buffers must stay valid and untouched until then.
 *
 * Reduction order, the same on every rank and for every ISA path (so results can be compared bit for
 * bit): out[i] = ((x_0[i] + x_1[i]) + x_2[i]) + ... + x_{N-1}[i] in rank order, where fp16 / bf16
 * inputs are widened to fp32 and summed in fp32; then multiplied by the scale when it is not 1 (AVG:
 * 1/N); then rounded once to the element type (round to nearest even). MAX / MIN take NaN from any
 * rank. Integer types sum in their own width (wrapping).
 *
 * Errors: functions return 0 or -errno and never print or exit. A failed op leaves a message
 * (zx_comm_op_error) naming the collective and the rank at fault; -ETIMEDOUT: a rank did not arrive
 * within the timeout; -EPIPE: a rank died (its process ended without leaving); -ECONNRESET: a rank
 * left (destroyed its communicator, or gave up after its own error); -EPROTO: the ranks called different
 * collectives (each op's first round carries its name, number, size and reduction, compared by every
 * rank before any byte moves: the message names this rank's op and the other's). After an error every later op
 * fails at once with the first error's message: ranks cannot resynchronise within one communicator.
 * A child process after fork() gets -EOWNERDEAD.
 */
#ifndef ZX_COMM_H
#define ZX_COMM_H

#include <stdint.h>

#define ZX_COMM_ID_BYTES 64	    /* a unique id, NUL-terminated */
#define ZX_COMM_MAX_WORLD 1024	    /* ranks of one communicator */
#define ZX_COMM_ERROR_BYTES 256	    /* an op's message, NUL-terminated */
#define ZX_COMM_LABEL_BYTES 32	    /* an op's name as the ranks compare it (zx_comm_agree's label) */

enum zx_comm_transport { ZX_COMM_SHM = 1 };

/* Reductions (the order is in the header comment). */
enum zx_comm_redop { ZX_REDOP_SUM = 0, ZX_REDOP_AVG = 1, ZX_REDOP_MAX = 2, ZX_REDOP_MIN = 3 };

struct zx_comm;	   /* opaque */
struct zx_comm_op; /* an op's handle: waited for, or released with zx_comm_op_free */

/* A fresh id for a communicator of `transport` (for SHM, the segment's name). Also removes the
 * segments earlier runs left behind when they were killed before every rank attached. */
int zx_comm_unique_id(int transport, char id[ZX_COMM_ID_BYTES]);

/* Joins communicator `id` as `rank` of `world`. Rank 0 must return from it before the others call
 * it (it creates the segment). timeout_s bounds every wait of every op. slot_bytes: bytes of each
 * rank's slot (rounded to 4 KiB; 0 picks a size from world). -ENOENT: no such communicator yet. */
int zx_comm_create(struct zx_comm **out, int transport, const char *id, int rank, int world,
		   double timeout_s, int64_t slot_bytes);

/* Called by rank 0 once every rank has returned from zx_comm_create: removes the segment's name, so
 * nothing is left in /dev/shm whatever happens later (the memory lives while a rank maps it). */
int zx_comm_unlink(struct zx_comm *comm);

/* Waits for the ops in flight, tells the other ranks this one left, and frees the communicator. */
void zx_comm_destroy(struct zx_comm *comm);

int zx_comm_rank(const struct zx_comm *comm);
int zx_comm_world(const struct zx_comm *comm);
int64_t zx_comm_segment_bytes(const struct zx_comm *comm); /* shared memory this rank maps */
int64_t zx_comm_ops(const struct zx_comm *comm);	    /* ops enqueued so far */
int64_t zx_comm_handed_off(const struct zx_comm *comm);    /* ... of which the progress thread ran */

/* --- verbs: each returns 0 with *op set, or -errno (nothing enqueued) --------------------------- */

/* Every rank's `bytes` at `in` into `out` (world * bytes), rank-major. `in` may lie inside `out`. */
int zx_comm_all_gather(struct zx_comm *comm, const void *in, void *out, int64_t bytes,
		       struct zx_comm_op **op);

/* A bucket of n tensors in one op, without a flatten copy: rank r's ins[j] (bytes[j] bytes) lands
 * at outs[j] + r * bytes[j] on every rank. */
int zx_comm_all_gather_group(struct zx_comm *comm, int n, const void *const *ins, void *const *outs,
			     const int64_t *bytes, struct zx_comm_op **op);

/* Rank r's counts[r] bytes at `in` land at out + (counts[0] + ... + counts[r-1]). */
int zx_comm_all_gather_v(struct zx_comm *comm, const void *in, void *out, const int64_t *counts,
			 struct zx_comm_op **op);

/* `in` holds world * count elements; out (count) = the reduction over ranks of chunk `rank`, times
 * scale. */
int zx_comm_reduce_scatter(struct zx_comm *comm, const void *in, void *out, int64_t count, int dtype,
			   int redop, double scale, struct zx_comm_op **op);

/* out (count) = the reduction over ranks of in (count), times scale. in == out is allowed. */
int zx_comm_all_reduce(struct zx_comm *comm, const void *in, void *out, int64_t count, int dtype,
		       int redop, double scale, struct zx_comm_op **op);

/* As all_reduce, but only `root` writes out (others may pass NULL). */
int zx_comm_reduce(struct zx_comm *comm, const void *in, void *out, int64_t count, int dtype, int redop,
		   double scale, int root, struct zx_comm_op **op);

/* `bytes` at buf of `root` into buf of every rank. */
int zx_comm_broadcast(struct zx_comm *comm, void *buf, int64_t bytes, int root, struct zx_comm_op **op);

/* root's `in` (world * bytes) cut in rank order: chunk r into `out` of rank r. */
int zx_comm_scatter(struct zx_comm *comm, const void *in, void *out, int64_t bytes, int root,
		    struct zx_comm_op **op);

int zx_comm_barrier(struct zx_comm *comm, struct zx_comm_op **op);

/* Personalised exchange: `in` holds world chunks of `bytes`, chunk d for rank d; `out` (world * bytes)
 * receives chunk s from rank s, rank-major. `in` and `out` must not overlap. */
int zx_comm_all_to_all(struct zx_comm *comm, const void *in, void *out, int64_t bytes,
		       struct zx_comm_op **op);

/* The same with chunks of any size (0 included): counts (world * world, the same on every rank) holds
 * counts[s * world + d] = the bytes rank s sends to rank d. Rank s's chunks lie end to end in its
 * `in` in destination order; chunk s of `out` holds what rank s sent, end to end in source order. */
int zx_comm_all_to_all_v(struct zx_comm *comm, const void *in, void *out, const int64_t *counts,
			 struct zx_comm_op **op);

/* A barrier named `label` (up to ZX_COMM_LABEL_BYTES - 1 characters are compared): the ranks agree that
 * they all reached the same point, e.g. "save_checkpoint". timeout_s > 0 bounds its wait instead of the
 * communicator's timeout. */
int zx_comm_agree(struct zx_comm *comm, const char *label, double timeout_s, struct zx_comm_op **op);

/* --- handles ------------------------------------------------------------------------------------ */

/* The next op this communicator enqueues (any thread) will be waited for at once by its caller, who
 * then runs it itself (zx_comm_wait): its enqueue wakes no progress thread. on=0 withdraws the promise
 * (a caller whose op failed before it was queued). Never for an op the caller may not wait for: it
 * would run only at the next wait, or after the op before it when one is running. */
void zx_comm_defer_next(struct zx_comm *comm, int on);
/* Blocks until the op ran; returns its status. May be called again (same status). */
int zx_comm_wait(struct zx_comm_op *op);
/* 1 once the op ran, else 0. */
int zx_comm_test(const struct zx_comm_op *op);
/* The op's message after a failed wait ("" when it succeeded). */
const char *zx_comm_op_error(const struct zx_comm_op *op);
/* Releases the handle; an op still in flight runs to its end first. */
void zx_comm_op_free(struct zx_comm_op *op);

/* --- the reduction kernels (comm_reduce.c), also used by tests against their reference ---------- */

/* dst[i] = reduce(srcs[0][i], ..., srcs[n-1][i]) * scale, in the documented order; isa: -1 for
 * zx_simd_level(), else a zx_simd (0 = the scalar reference). dst may be one of the srcs.
 * -EINVAL: a dtype / redop pair not supported (AVG and a scale are for floating types only). */
int zx_comm_reduce_kernel(int dtype, int redop, double scale, const void *const *srcs, int n, void *dst,
			  int64_t count, int isa);
/* The same, writing the result to dst and, when dst2 is set, also to dst2 (same bits): a split
 * all-reduce's share goes to the output and to the slot the others copy it from in one pass. */
int zx_comm_reduce_kernel2(int dtype, int redop, double scale, const void *const *srcs, int n, void *dst,
			   void *dst2, int64_t count, int isa);

/* --- one parameter's fragments: the data path of the state routines (safe_get / safe_set) --------
 *
 * A parameter of `numel` elements is cut into per-rank fragments that tile it in rank order:
 *   ZX_FRAG_FLAT    (stages 0-2) it starts at element `offset` of its group's flat buffer, which is cut
 *                   into `world` partitions of `part` elements; rank r holds its overlap with
 *                   [r * part, (r + 1) * part) (possibly empty, possibly straddling);
 *   ZX_FRAG_SHARDS  (stage 3) shards of `part` = ceil(numel / world) elements; rank r's real elements
 *                   are numel - r * part clamped to [0, part], at `offset` of its own partition (the
 *                   rest of its shard is padding).
 * Values are fp32 (master weights, the fp32 gradient partition, optimizer state). */
enum zx_frag_layout { ZX_FRAG_FLAT = 0, ZX_FRAG_SHARDS = 1 };

/* Each rank's fragment: counts[r] real elements, starting at param_at[r] within the parameter and at
 * part_at[r] within rank r's partition (arrays of `world`). 0 or -EINVAL. */
int zx_frag_map(int layout, int64_t numel, int64_t offset, int64_t part, int world, int64_t *counts,
		int64_t *param_at, int64_t *part_at);

/* The full parameter from every rank's fragment: out (numel fp32) = the fragments in rank order (an
 * all-gather-v moving only real bytes), each element then divided by `divisor` when it is not 1 (IEEE
 * division, as torch's `x / s`). `partition` is this rank's partition; its fragment lies at
 * part_at[rank]. Collective (every rank, same parameter, same order as the other ops) and blocking.
 * comm NULL: a map of one rank (state every rank holds whole), nothing is communicated.
 * Returns 0 or -errno; a failed collective leaves its message in msg. */
int zx_frag_gather(struct zx_comm *comm, int layout, int64_t numel, int64_t offset, int64_t part,
		   const float *partition, float *out, float divisor, char *msg, int64_t msg_len);

/* A full value into this rank's fragment: partition[part_at[rank] + i] = full[param_at[rank] + i] *
 * factor (factor 1: copied), for the setters (every rank passes the same full value: no
 * communication). 0 or -EINVAL. */
int zx_frag_scatter(int layout, int64_t numel, int64_t offset, int64_t part, int world, int rank,
		    const float *full, float *partition, float factor);

/* The local forms: dst[i] = src[i] (mode 0), src[i] / factor (1) or src[i] * factor (2). */
int zx_frag_copy(const float *src, float *dst, int64_t count, int mode, float factor);

#endif /* ZX_COMM_H */
