// CPU kernels of the residency ops (schemas in ops.cpp).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "residency_checks.h"

namespace mmreuse {
namespace {

void check_inputs(const char* op, const at::Tensor& bitmap, const at::Tensor& ids,
                  int64_t num_blocks) {
  TORCH_CHECK(bitmap.scalar_type() == at::kInt && bitmap.dim() == 1 && bitmap.is_contiguous(), op,
              ": bitmap must be a contiguous 1-D int32 tensor, got ", bitmap.scalar_type(),
              " of shape ", bitmap.sizes());
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, op,
              ": block_ids must be a 1-D int64 tensor, got ", ids.scalar_type(), " of shape ",
              ids.sizes());
  TORCH_CHECK(fits_bitmap(num_blocks, bitmap.numel()), op, ": num_blocks=", num_blocks,
              " does not fit a bitmap of ", bitmap.numel(), " words");
  TORCH_CHECK(bitmap.device() == ids.device(), op, ": bitmap on ", bitmap.device(),
              " but block_ids on ", ids.device());
}

// Every tensor of an op on the bitmap's device (a CPU kernel never reads another device's).
void check_device(const char* op, const at::Tensor& bitmap, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device() == bitmap.device(), op, ": bitmap on ", bitmap.device(), " but ", name,
              " on ", t.device());
}

// Raise (before any write) if an id is outside [0, num_blocks).
void check_bounds(const char* op, const int64_t* ids, int64_t n, int64_t num_blocks) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(static_cast<uint64_t>(ids[i]) < static_cast<uint64_t>(num_blocks),
                      "block_ids[", i, "] = ", ids[i], " is out of range [0, ", num_blocks, ") (",
                      op, ")");
  }
}

inline bool bit(const int32_t* words, int64_t id) {
  return (static_cast<uint32_t>(words[id >> 5]) >> (id & 31)) & 1u;
}

void residency_mark_cpu(at::Tensor& bitmap, const at::Tensor& block_ids, int64_t num_blocks) {
  check_inputs("residency_mark", bitmap, block_ids, num_blocks);
  const at::Tensor ids = block_ids.contiguous();
  const int64_t* p = ids.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  check_bounds("residency_mark", p, n, num_blocks);
  uint32_t* words = reinterpret_cast<uint32_t*>(bitmap.data_ptr<int32_t>());
  for (int64_t i = 0; i < n; ++i) words[p[i] >> 5] |= 1u << (p[i] & 31);
}

void residency_evict_cpu(at::Tensor& bitmap, at::Tensor& generations, const at::Tensor& block_ids) {
  const int64_t num_blocks = generations.numel();
  check_inputs("residency_evict", bitmap, block_ids, num_blocks);
  check_device("residency_evict", bitmap, generations, "generations");
  TORCH_CHECK(generations.scalar_type() == at::kLong && generations.dim() == 1 &&
                  generations.is_contiguous(),
              "residency_evict: generations must be a contiguous 1-D int64 tensor");
  const at::Tensor ids = block_ids.contiguous();
  const int64_t* p = ids.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  check_bounds("residency_evict", p, n, num_blocks);
  uint32_t* words = reinterpret_cast<uint32_t*>(bitmap.data_ptr<int32_t>());
  int64_t* gens = generations.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    words[p[i] >> 5] &= ~(1u << (p[i] & 31));
    gens[p[i]] += 1;
  }
}

at::Tensor residency_test_cpu(const at::Tensor& bitmap, const at::Tensor& block_ids,
                              int64_t num_blocks) {
  check_inputs("residency_test", bitmap, block_ids, num_blocks);
  const at::Tensor ids = block_ids.contiguous();
  const int64_t* p = ids.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  check_bounds("residency_test", p, n, num_blocks);
  at::Tensor out = at::empty({n}, ids.options().dtype(at::kBool));
  bool* o = out.data_ptr<bool>();
  const int32_t* words = bitmap.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) o[i] = bit(words, p[i]);
  return out;
}

at::Tensor residency_count_cpu(const at::Tensor& bitmap) {
  TORCH_CHECK(bitmap.scalar_type() == at::kInt && bitmap.dim() == 1 && bitmap.is_contiguous(),
              "residency_count: bitmap must be a contiguous 1-D int32 tensor");
  const uint32_t* words = reinterpret_cast<const uint32_t*>(bitmap.data_ptr<int32_t>());
  int64_t total = 0;
  for (int64_t i = 0; i < bitmap.numel(); ++i) total += __builtin_popcount(words[i]);
  return at::scalar_tensor(total, bitmap.options().dtype(at::kLong));
}

at::Tensor residency_prefix_cpu(const at::Tensor& bitmap, const at::Tensor& block_ids,
                                int64_t num_blocks) {
  check_inputs("residency_prefix", bitmap, block_ids, num_blocks);
  const at::Tensor ids = block_ids.contiguous();
  const int64_t* p = ids.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  check_bounds("residency_prefix", p, n, num_blocks);
  const int32_t* words = bitmap.data_ptr<int32_t>();
  int64_t k = 0;
  while (k < n && bit(words, p[k])) ++k;
  return at::scalar_tensor(k, bitmap.options().dtype(at::kLong));
}

at::Tensor residency_validate_cpu(const at::Tensor& bitmap, const at::Tensor& generations,
                                  const at::Tensor& block_ids, const at::Tensor& expected) {
  const int64_t num_blocks = generations.numel();
  check_inputs("residency_validate", bitmap, block_ids, num_blocks);
  check_device("residency_validate", bitmap, generations, "generations");
  check_device("residency_validate", bitmap, expected, "expected");
  TORCH_CHECK(generations.scalar_type() == at::kLong && generations.dim() == 1,
              "residency_validate: generations must be a 1-D int64 tensor");
  TORCH_CHECK(expected.scalar_type() == at::kLong && expected.sizes() == block_ids.sizes(),
              "residency_validate: expected must be int64 with the shape of block_ids, got ",
              expected.scalar_type(), " of shape ", expected.sizes());
  const at::Tensor ids = block_ids.contiguous();
  const at::Tensor exp = expected.contiguous();
  const at::Tensor gen = generations.contiguous();
  const int64_t* p = ids.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  check_bounds("residency_validate", p, n, num_blocks);
  at::Tensor out = at::empty({n}, ids.options().dtype(at::kBool));
  bool* o = out.data_ptr<bool>();
  const int32_t* words = bitmap.data_ptr<int32_t>();
  const int64_t* g = gen.data_ptr<int64_t>();
  const int64_t* e = exp.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) o[i] = bit(words, p[i]) && g[p[i]] == e[i];
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(mmreuse, CPU, m) {
  m.impl("residency_mark", &residency_mark_cpu);
  m.impl("residency_evict", &residency_evict_cpu);
  m.impl("residency_test", &residency_test_cpu);
  m.impl("residency_count", &residency_count_cpu);
  m.impl("residency_prefix", &residency_prefix_cpu);
  m.impl("residency_validate", &residency_validate_cpu);
}

}  // namespace mmreuse
