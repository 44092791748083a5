// The mmreuse torch extension: the one TORCH_LIBRARY schema block, and the module init.
//
// Residency of a Prefill instance's KV blocks: `bitmap` is int32 words, bit (id % 32) of word
// (id / 32) set while block `id` holds valid KV; `generations` is int64 per block, bumped on
// every eviction so that a block id reused for new content never satisfies an older proof.
// Every op bounds-checks its block ids first and writes nothing when one is out of range.
// CPU kernels: residency_cpu.cpp; CUDA kernels: cuda/residency_cuda.cu.

#include <Python.h>
#include <torch/library.h>

#include "index_helpers.h"

extern "C" PyObject* PyInit__C(void) {
  static PyMethodDef methods[] = {
      {"table_put", mmreuse::table_put, METH_VARARGS,
       "table_put(keys, vals, key, block_id) -> bool: insert (True) or update (False)"},
      {"table_del", mmreuse::table_del, METH_VARARGS, "table_del(keys, vals, key) -> bool"},
      {"table_put_many", mmreuse::table_put_many, METH_VARARGS,
       "table_put_many(keys, vals, key_list, val_list) -> inserted"},
      {"table_del_many", mmreuse::table_del_many, METH_VARARGS,
       "table_del_many(keys, vals, key_list) -> deleted"},
      {"table_add", mmreuse::table_add, METH_VARARGS,
       "table_add(keys, vals, hashes, delta) -> (new_slots, added, removed)"},
      {"table_rehash", mmreuse::table_rehash, METH_VARARGS,
       "table_rehash(old_keys, old_vals, new_keys, new_vals) -> live"},
      {"table_get", mmreuse::table_get, METH_VARARGS, "table_get(keys, vals, hash) -> int | None"},
      {"chain_prefix", mmreuse::chain_prefix, METH_VARARGS,
       "chain_prefix(keys, vals, hashes, out) -> int: block ids of the leading hashes found, "
       "written into the int64 buffer out; returns how many"},
      {nullptr, nullptr, 0, nullptr}};
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C",
                            "mmreuse's torch ops (torch.ops.mmreuse) and index helpers", -1,
                            methods};
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
