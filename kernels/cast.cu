// cast.cu - element-wise casts between fp32, fp16 and bf16 on the caller's stream (see csrc/cuda_api.h).
// Used to copy updated fp32 master weights into low-precision parameters and back.
#include "cuda_api.h"
#include "dtype.h"

#include <cerrno>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

__device__ __forceinline__ float load(const void *p, int dtype, size_t i)
{
	switch (dtype) {
	case ZX_F16: return __half2float(static_cast<const __half *>(p)[i]);
	case ZX_BF16: return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
	default: return static_cast<const float *>(p)[i];
	}
}

__device__ __forceinline__ void store(void *p, int dtype, size_t i, float v)
{
	switch (dtype) {
	case ZX_F16: static_cast<__half *>(p)[i] = __float2half_rn(v); break;
	case ZX_BF16: static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v); break;
	default: static_cast<float *>(p)[i] = v; break;
	}
}

// Grid-stride loop: one launch covers any n, and the block count stays bounded.
__global__ void cast_kernel(const void *src, int src_dtype, void *dst, int dst_dtype, size_t n)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
		store(dst, dst_dtype, i, load(src, src_dtype, i));
}

bool is_float(int dtype) { return dtype == ZX_F32 || dtype == ZX_F16 || dtype == ZX_BF16; }

} // namespace

extern "C" int zx_cuda_cast(const void *src, int src_dtype, void *dst, int dst_dtype, size_t n, void *stream)
{
	if (!is_float(src_dtype) || !is_float(dst_dtype) || (n && (!src || !dst)))
		return -EINVAL;
	if (n == 0)
		return 0;
	const int threads = 256;
	size_t blocks = (n + threads - 1) / threads;
	if (blocks > 65535u * 8u)
		blocks = 65535u * 8u;
	cast_kernel<<<(unsigned)blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(src, src_dtype, dst,
										     dst_dtype, n);
	cudaError_t err = cudaGetLastError();
	return err == cudaSuccess ? 0 : -(ZX_CUDA_STATUS_BASE + (int)err);
}
