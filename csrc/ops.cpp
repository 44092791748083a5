// The mmreuse torch extension: the one TORCH_LIBRARY schema block, and the module init.
//
// Residency of a Prefill instance's KV blocks: `bitmap` is int32 words, bit (id % 32) of word
// (id / 32) set while block `id` holds valid KV; `generations` is int64 per block, bumped on
// every eviction so that a block id reused for new content never satisfies an older proof.
// Every op bounds-checks its block ids first and writes nothing when one is out of range.
// CPU kernels: residency_cpu.cpp; CUDA kernels: cuda/residency_cuda.cu.

#include <Python.h>
#include <torch/library.h>

// The module holds no functions: importing it registers the ops. The block-hash tables live in
// the torch-free extension mmreuse._index (index_table.cpp).
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "mmreuse's torch ops (torch.ops.mmreuse)",
                            -1, nullptr};
  return PyModule_Create(&def);
}

TORCH_LIBRARY(mmreuse, m) {
  // Set the residency bits of block_ids (duplicates are fine).
  m.def("residency_mark(Tensor(a!) bitmap, Tensor block_ids, int num_blocks) -> ()");
  // Clear the residency bits of block_ids and bump their generations (once per occurrence).
  m.def("residency_evict(Tensor(a!) bitmap, Tensor(b!) generations, Tensor block_ids) -> ()");
  // Bool mask: is each of block_ids resident?
  m.def("residency_test(Tensor bitmap, Tensor block_ids, int num_blocks) -> Tensor");
  // Number of resident blocks (int64 scalar).
  m.def("residency_count(Tensor bitmap) -> Tensor");
  // Length of the leading run of resident blocks in the ordered chain block_ids (int64 scalar).
  m.def("residency_prefix(Tensor bitmap, Tensor block_ids, int num_blocks) -> Tensor");
  // Bool mask: is each of block_ids resident with generation == expected?
  m.def(
      "residency_validate(Tensor bitmap, Tensor generations, Tensor block_ids, "
      "Tensor expected) -> Tensor");
}
