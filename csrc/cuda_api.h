/* cuda_api.h - the CUDA library of zero_ext (libzx_cuda.so): NCCL collectives and CUDA kernels.
 *
 * Built only where nvcc and NCCL are found, and loaded by Python (zero_ext/_native/cuda.py, ctypes) only when
 * CUDA tensors are used, so that `import zero_ext` works without CUDA. Plain C ABI, no Python: the
 * same library serves any Python or torch version on the GPU machine.
 *
 * Every function returns 0 on success or a negative status: -(ncclResult_t) for NCCL calls,
 * -(1000 + cudaError_t) for CUDA calls, -EINVAL for bad arguments. zx_cuda_error_string() names it.
 * Streams are the caller's (cudaStream_t passed as void *): nothing here synchronizes the host.
 */
#ifndef ZX_CUDA_API_H
#define ZX_CUDA_API_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ZX_EXPORT __attribute__((visibility("default")))
#define ZX_CUDA_STATUS_BASE 1000
#define ZX_NCCL_ID_BYTES 128

/* Text for a status returned by this library. */
ZX_EXPORT const char *zx_cuda_error_string(int status);

/* ---- NCCL (csrc/comm_nccl.c) ---- */

/* Reduction ops, as zx_nccl_* take them. */
enum { ZX_SUM = 0, ZX_AVG = 1, ZX_MAX = 2, ZX_MIN = 3 };

/* A fresh unique id (rank 0 makes it and shares it, e.g. through torch.distributed's store). */
ZX_EXPORT int zx_nccl_unique_id(unsigned char id[ZX_NCCL_ID_BYTES]);
/* Joins the communicator named by id as `rank` of `world`; *comm receives it. Collective. */
ZX_EXPORT int zx_nccl_comm_init(void **comm, int world, int rank, const unsigned char id[ZX_NCCL_ID_BYTES]);
ZX_EXPORT int zx_nccl_comm_destroy(void *comm);
/* Aborts a communicator whose peer died, so that no rank waits forever. */
ZX_EXPORT int zx_nccl_comm_abort(void *comm);
/* recv holds world * count elements, rank-major. */
ZX_EXPORT int zx_nccl_all_gather(void *comm, const void *send, void *recv, size_t count, int dtype,
				 void *stream);
/* send holds world * count elements, rank-major; recv receives this rank's reduced count. */
ZX_EXPORT int zx_nccl_reduce_scatter(void *comm, const void *send, void *recv, size_t count, int dtype,
				     int op, void *stream);
ZX_EXPORT int zx_nccl_all_reduce(void *comm, const void *send, void *recv, size_t count, int dtype, int op,
				 void *stream);
ZX_EXPORT int zx_nccl_broadcast(void *comm, const void *send, void *recv, size_t count, int dtype, int root,
				void *stream);
/* Brackets the collectives of one bucket so that NCCL launches them as one. */
ZX_EXPORT int zx_nccl_group_start(void);
ZX_EXPORT int zx_nccl_group_end(void);

/* ---- kernels (kernels/cast.cu) ---- */

/* dst[i] = (dst type) src[i] for i < n, between ZX_F32, ZX_F16 and ZX_BF16 (round to nearest even). */
ZX_EXPORT int zx_cuda_cast(const void *src, int src_dtype, void *dst, int dst_dtype, size_t n, void *stream);

/* ---- kernels (kernels/quant.cu): csrc/quant.h's format (0 int8, 1 int4), the same integers and scales ---- */

/* src (n elements of ZX_F32 / ZX_F16 / ZX_BF16) into q and scales (one per block of `block`). */
ZX_EXPORT int zx_cuda_quantize(int format, int dtype, const void *src, long long n, long long block, void *q,
			       float *scales, void *stream);
/* q * s into dst of dtype (added to an fp32 dst with accumulate). */
ZX_EXPORT int zx_cuda_dequantize(int format, const void *q, const float *scales, long long n, long long block,
				 int dtype, void *dst, int accumulate, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* ZX_CUDA_API_H */
