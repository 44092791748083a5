// CUDA kernels of the residency ops (schemas in ../ops.cpp), on the current stream.
//
// Bounds: a first kernel records the lowest out-of-range index in a device flag; the kernel
// that writes reads the flag first and does nothing when it is set; the host then reads the
// flag (one stream sync) and raises. So a bad batch raises and writes nothing, as on the CPU.
// c10/cuda headers only (ATen/cuda/CUDAContext.h needs cuBLAS headers this toolkit lacks).

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "residency_checks.h"

namespace mmreuse {
namespace {

constexpr int kThreads = 256;
constexpr unsigned long long kNoError = ~0ull;

inline int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

__global__ void find_out_of_range(const int64_t* __restrict__ ids, int64_t n, int64_t num_blocks,
                                  unsigned long long* __restrict__ first_bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (static_cast<uint64_t>(ids[i]) >= static_cast<uint64_t>(num_blocks)) {
      atomicMin(first_bad, static_cast<unsigned long long>(i));
    }
  }
}

__global__ void mark_kernel(uint32_t* __restrict__ words, const int64_t* __restrict__ ids,
                            int64_t n, const unsigned long long* __restrict__ first_bad) {
  if (*first_bad != kNoError) return;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t id = ids[i];
    atomicOr(words + (id >> 5), 1u << (id & 31));
  }
}

__global__ void evict_kernel(uint32_t* __restrict__ words, unsigned long long* __restrict__ gens,
                             const int64_t* __restrict__ ids, int64_t n,
                             const unsigned long long* __restrict__ first_bad) {
  if (*first_bad != kNoError) return;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t id = ids[i];
    atomicAnd(words + (id >> 5), ~(1u << (id & 31)));
    atomicAdd(gens + id, 1ull);
  }
}

__global__ void test_kernel(const uint32_t* __restrict__ words, const int64_t* __restrict__ ids,
                            int64_t n, bool* __restrict__ out,
                            const unsigned long long* __restrict__ first_bad) {
  if (*first_bad != kNoError) return;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t id = ids[i];
    out[i] = (words[id >> 5] >> (id & 31)) & 1u;
  }
}

__global__ void validate_kernel(const uint32_t* __restrict__ words,
                                const int64_t* __restrict__ gens, const int64_t* __restrict__ ids,
                                const int64_t* __restrict__ expected, int64_t n,
                                bool* __restrict__ out,
                                const unsigned long long* __restrict__ first_bad) {
  if (*first_bad != kNoError) return;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t id = ids[i];
    out[i] = ((words[id >> 5] >> (id & 31)) & 1u) && gens[id] == expected[i];
  }
}

// First non-resident position of the chain (n if all are resident).
__global__ void prefix_kernel(const uint32_t* __restrict__ words, const int64_t* __restrict__ ids,
                              int64_t n, unsigned long long* __restrict__ first_missing,
                              const unsigned long long* __restrict__ first_bad) {
  if (*first_bad != kNoError) return;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t id = ids[i];
    if (!((words[id >> 5] >> (id & 31)) & 1u)) {
      atomicMin(first_missing, static_cast<unsigned long long>(i));
    }
  }
}

__global__ void count_kernel(const uint32_t* __restrict__ words, int64_t n,
                             unsigned long long* __restrict__ total) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    local += __popc(words[i]);
  }
  if (local) atomicAdd(total, local);
}

void check_inputs(const char* op, const at::Tensor& bitmap, const at::Tensor& ids,
                  int64_t num_blocks) {
  TORCH_CHECK(bitmap.is_cuda() && ids.device() == bitmap.device(), op,
              ": bitmap and block_ids must be on the same CUDA device, got ", bitmap.device(),
              " and ", ids.device());
  TORCH_CHECK(bitmap.scalar_type() == at::kInt && bitmap.dim() == 1 && bitmap.is_contiguous(), op,
              ": bitmap must be a contiguous 1-D int32 tensor");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, op,
              ": block_ids must be a 1-D int64 tensor, got ", ids.scalar_type());
  TORCH_CHECK(fits_bitmap(num_blocks, bitmap.numel()), op, ": num_blocks=", num_blocks,
              " does not fit a bitmap of ", bitmap.numel(), " words");
}

// Launch the bounds check; returns the device flag the writing kernel must read.
at::Tensor launch_bounds_check(const at::Tensor& ids, int64_t num_blocks, cudaStream_t stream) {
  at::Tensor flag = at::full({1}, -1, ids.options());  // all ones = kNoError
  const int64_t n = ids.numel();
  if (n > 0) {
    find_out_of_range<<<blocks_for(n), kThreads, 0, stream>>>(
        ids.data_ptr<int64_t>(), n, num_blocks,
        reinterpret_cast<unsigned long long*>(flag.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return flag;
}

// Raise if the bounds check found an out-of-range id (synchronizes with the stream).
void raise_if_out_of_range(const char* op, const at::Tensor& flag, const at::Tensor& ids,
                           int64_t num_blocks) {
  const int64_t first_bad = flag.item<int64_t>();
  if (first_bad != -1) {
    const int64_t value = ids[first_bad].item<int64_t>();
    TORCH_CHECK_VALUE(false, "block_ids[", first_bad, "] = ", value, " is out of range [0, ",
                      num_blocks, ") (", op, ")");
  }
}

void residency_mark_cuda(at::Tensor& bitmap, const at::Tensor& block_ids, int64_t num_blocks) {
  check_inputs("residency_mark", bitmap, block_ids, num_blocks);
  const c10::cuda::CUDAGuard guard(bitmap.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor ids = block_ids.contiguous();
  const int64_t n = ids.numel();
  at::Tensor flag = launch_bounds_check(ids, num_blocks, stream);
  if (n > 0) {
    mark_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        reinterpret_cast<uint32_t*>(bitmap.data_ptr<int32_t>()), ids.data_ptr<int64_t>(), n,
        reinterpret_cast<const unsigned long long*>(flag.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  raise_if_out_of_range("residency_mark", flag, ids, num_blocks);
}

void residency_evict_cuda(at::Tensor& bitmap, at::Tensor& generations,
                          const at::Tensor& block_ids) {
  const int64_t num_blocks = generations.numel();
  check_inputs("residency_evict", bitmap, block_ids, num_blocks);
  TORCH_CHECK(generations.device() == bitmap.device() && generations.scalar_type() == at::kLong &&
                  generations.is_contiguous(),
              "residency_evict: generations must be a contiguous int64 tensor on ",
              bitmap.device());
  const c10::cuda::CUDAGuard guard(bitmap.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor ids = block_ids.contiguous();
  const int64_t n = ids.numel();
  at::Tensor flag = launch_bounds_check(ids, num_blocks, stream);
  if (n > 0) {
    evict_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        reinterpret_cast<uint32_t*>(bitmap.data_ptr<int32_t>()),
        reinterpret_cast<unsigned long long*>(generations.data_ptr<int64_t>()),
        ids.data_ptr<int64_t>(), n,
        reinterpret_cast<const unsigned long long*>(flag.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  raise_if_out_of_range("residency_evict", flag, ids, num_blocks);
}

at::Tensor residency_test_cuda(const at::Tensor& bitmap, const at::Tensor& block_ids,
                               int64_t num_blocks) {
  check_inputs("residency_test", bitmap, block_ids, num_blocks);
  const c10::cuda::CUDAGuard guard(bitmap.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor ids = block_ids.contiguous();
  const int64_t n = ids.numel();
  at::Tensor out = at::zeros({n}, ids.options().dtype(at::kBool));
  at::Tensor flag = launch_bounds_check(ids, num_blocks, stream);
  if (n > 0) {
    test_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        reinterpret_cast<const uint32_t*>(bitmap.data_ptr<int32_t>()), ids.data_ptr<int64_t>(), n,
        out.data_ptr<bool>(),
        reinterpret_cast<const unsigned long long*>(flag.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  raise_if_out_of_range("residency_test", flag, ids, num_blocks);
  return out;
}

at::Tensor residency_count_cuda(const at::Tensor& bitmap) {
  TORCH_CHECK(bitmap.is_cuda() && bitmap.scalar_type() == at::kInt && bitmap.dim() == 1 &&
                  bitmap.is_contiguous(),
              "residency_count: bitmap must be a contiguous 1-D int32 CUDA tensor");
  const c10::cuda::CUDAGuard guard(bitmap.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor total = at::zeros({}, bitmap.options().dtype(at::kLong));
  const int64_t n = bitmap.numel();
  if (n > 0) {
    count_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        reinterpret_cast<const uint32_t*>(bitmap.data_ptr<int32_t>()), n,
        reinterpret_cast<unsigned long long*>(total.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return total;
}

at::Tensor residency_prefix_cuda(const at::Tensor& bitmap, const at::Tensor& block_ids,
                                 int64_t num_blocks) {
  check_inputs("residency_prefix", bitmap, block_ids, num_blocks);
  const c10::cuda::CUDAGuard guard(bitmap.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor ids = block_ids.contiguous();
  const int64_t n = ids.numel();
  at::Tensor first_missing = at::full({}, n, ids.options());
  at::Tensor flag = launch_bounds_check(ids, num_blocks, stream);
  if (n > 0) {
    prefix_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        reinterpret_cast<const uint32_t*>(bitmap.data_ptr<int32_t>()), ids.data_ptr<int64_t>(), n,
        reinterpret_cast<unsigned long long*>(first_missing.data_ptr<int64_t>()),
        reinterpret_cast<const unsigned long long*>(flag.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  raise_if_out_of_range("residency_prefix", flag, ids, num_blocks);
  return first_missing;
}

at::Tensor residency_validate_cuda(const at::Tensor& bitmap, const at::Tensor& generations,
                                   const at::Tensor& block_ids, const at::Tensor& expected) {
  const int64_t num_blocks = generations.numel();
  check_inputs("residency_validate", bitmap, block_ids, num_blocks);
  TORCH_CHECK(generations.device() == bitmap.device() && generations.scalar_type() == at::kLong,
              "residency_validate: generations must be int64 on ", bitmap.device());
  TORCH_CHECK(expected.device() == bitmap.device() && expected.scalar_type() == at::kLong &&
                  expected.sizes() == block_ids.sizes(),
              "residency_validate: expected must be int64 with the shape of block_ids");
  const c10::cuda::CUDAGuard guard(bitmap.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor ids = block_ids.contiguous();
  const at::Tensor exp = expected.contiguous();
  const at::Tensor gen = generations.contiguous();
  const int64_t n = ids.numel();
  at::Tensor out = at::zeros({n}, ids.options().dtype(at::kBool));
  at::Tensor flag = launch_bounds_check(ids, num_blocks, stream);
  if (n > 0) {
    validate_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        reinterpret_cast<const uint32_t*>(bitmap.data_ptr<int32_t>()), gen.data_ptr<int64_t>(),
        ids.data_ptr<int64_t>(), exp.data_ptr<int64_t>(), n, out.data_ptr<bool>(),
        reinterpret_cast<const unsigned long long*>(flag.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  raise_if_out_of_range("residency_validate", flag, ids, num_blocks);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(mmreuse, CUDA, m) {
  m.impl("residency_mark", &residency_mark_cuda);
  m.impl("residency_evict", &residency_evict_cuda);
  m.impl("residency_test", &residency_test_cuda);
  m.impl("residency_count", &residency_count_cuda);
  m.impl("residency_prefix", &residency_prefix_cuda);
  m.impl("residency_validate", &residency_validate_cuda);
}

}  // namespace mmreuse
