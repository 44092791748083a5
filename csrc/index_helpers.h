// Hash tables of BlockIndex and RemoteKVIndex for the hot paths: open addressing over two numpy arrays that
// Python owns (keys: uint64 event ids; vals: int64 block ids, -1 empty, -2 deleted), so that
// walking a 2,048-hash chain costs ~15 ns a hash instead of a Python dict's ~45.
#pragma once

#include <Python.h>

namespace mmreuse {

// table_put(keys, vals, key, block_id) -> bool: True if the key is new (needs a free slot)
PyObject* table_put(PyObject* self, PyObject* args);
// table_del(keys, vals, key) -> bool
PyObject* table_del(PyObject* self, PyObject* args);
// table_put_many(keys, vals, key_list, block_id_list) -> keys inserted (the rest updated);
// the table must have room for them all
PyObject* table_put_many(PyObject* self, PyObject* args);
// table_del_many(keys, vals, key_list) -> keys deleted
PyObject* table_del_many(PyObject* self, PyObject* args);
// table_add(keys, vals, hashes, delta) -> (new_slots, added, removed): add delta to each hash's
// value, inserting it (delta > 0) or deleting it when the value reaches <= 0. All hashes are
// validated before any change. The table must have room for len(hashes) new slots.
PyObject* table_add(PyObject* self, PyObject* args);
// table_rehash(old_keys, old_vals, new_keys, new_vals) -> live entries copied
PyObject* table_rehash(PyObject* self, PyObject* args);
// table_get(keys, vals, hash) -> int | None
PyObject* table_get(PyObject* self, PyObject* args);
// chain_prefix(keys, vals, hashes, out) -> int: block ids of the leading hashes found, written
// into the int64 buffer out. A hash is an int event id in [0, 2**64) or digest bytes (keyed by
// their low 64 bits, big-endian, as vLLM's KV events publish them).
PyObject* chain_prefix(PyObject* self, PyObject* args);

}  // namespace mmreuse
