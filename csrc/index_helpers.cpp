// Open-addressing hash table helpers of BlockIndex (see index_helpers.h).

#include "index_helpers.h"

#include <cstdint>
#include <vector>

namespace mmreuse {
namespace {

constexpr int64_t kEmpty = -1;
constexpr int64_t kDeleted = -2;

struct Table {
  Py_buffer kbuf{}, vbuf{};
  uint64_t* keys = nullptr;
  int64_t* vals = nullptr;
  uint64_t mask = 0;
  bool ok = false;

  Table(PyObject* k, PyObject* v) {
    if (PyObject_GetBuffer(k, &kbuf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return;
    if (PyObject_GetBuffer(v, &vbuf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
      PyBuffer_Release(&kbuf);
      kbuf.obj = nullptr;
      return;
    }
    const Py_ssize_t cap = kbuf.len / 8;
    if (cap == 0 || (cap & (cap - 1)) != 0 || vbuf.len != kbuf.len) {
      PyErr_SetString(PyExc_ValueError, "table arrays must be equal, power-of-two sized, 8-byte");
      return;
    }
    keys = static_cast<uint64_t*>(kbuf.buf);
    vals = static_cast<int64_t*>(vbuf.buf);
    mask = static_cast<uint64_t>(cap) - 1;
    ok = true;
  }
  ~Table() {
    if (kbuf.obj) PyBuffer_Release(&kbuf);
    if (vbuf.obj) PyBuffer_Release(&vbuf);
  }
  static uint64_t slot(uint64_t key) { return (key * 0x9E3779B97F4A7C15ull) >> 17; }

  // Index of key's slot, or -1; with `free_slot`, also the first slot an insert could take
  // (the first tombstone on the probe path, else the empty slot that ends it; -1 if full).
  int64_t probe(uint64_t key, int64_t* free_slot) const {
    *free_slot = -1;
    for (uint64_t i = slot(key) & mask, n = 0; n <= mask; i = (i + 1) & mask, ++n) {
      const int64_t v = vals[i];
      if (v == kEmpty) {
        if (*free_slot < 0) *free_slot = static_cast<int64_t>(i);
        return -1;
      }
      if (v == kDeleted) {
        if (*free_slot < 0) *free_slot = static_cast<int64_t>(i);
        continue;
      }
      if (keys[i] == key) return static_cast<int64_t>(i);
    }
    return -1;
  }

  // Index of key's slot, or -1 (the lookup hot path: no insert bookkeeping).
  int64_t find(uint64_t key) const {
    for (uint64_t i = slot(key) & mask, n = 0; n <= mask; i = (i + 1) & mask, ++n) {
      const int64_t v = vals[i];
      if (v == kEmpty) return -1;
      if (v != kDeleted && keys[i] == key) return static_cast<int64_t>(i);
    }
    return -1;
  }
};

bool key_of(PyObject* h, Py_ssize_t index, uint64_t* key) {
  if (PyBytes_Check(h)) {
    const Py_ssize_t len = PyBytes_Size(h);
    if (len < 8) {
      PyErr_Format(PyExc_ValueError, "block_hashes[%zd] must be a block hash of >= 8 bytes",
                   index);
      return false;
    }
    const unsigned char* b =
        reinterpret_cast<const unsigned char*>(PyBytes_AsString(h)) + len - 8;
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | b[i];
    *key = v;
    return true;
  }
  if (PyLong_Check(h) && !PyBool_Check(h)) {
#if PY_VERSION_HEX < 0x030C0000
    // CPython 3.11: read a non-negative value of <= 64 bits straight from its 30-bit digits.
    const Py_ssize_t size = Py_SIZE(h);
    const digit* d = reinterpret_cast<PyLongObject*>(h)->ob_digit;
    if (size >= 0 && size <= 3 && (size < 3 || d[2] < (1u << (64 - 2 * PyLong_SHIFT)))) {
      uint64_t v = 0;
      for (Py_ssize_t i = size - 1; i >= 0; --i) v = (v << PyLong_SHIFT) | d[i];
      *key = v;
      return true;
    }
#endif
    // PyLong_AsUnsignedLongLong goes through _PyLong_AsByteArray (~25 ns); the mask form
    // reads the digits directly, so range-check by sign and bit length first.
    // vLLM <= 0.10.1 published Python's signed builtin hash(): accept [-2**63, 0) as the
    // two's complement (the mask read gives exactly that).
    const int sign = _PyLong_Sign(h);
    const size_t bits = _PyLong_NumBits(h);
    if (sign >= 0 ? bits > 64 : bits > 64 || (bits == 64 && PyLong_AsLongLong(h) == -1 &&
                                              PyErr_Occurred())) {
      PyErr_Clear();
      PyErr_Format(PyExc_ValueError,
                   "block_hashes[%zd] must be a 64-bit event id in [-2**63, 2**64), got %R", index,
                   h);
      return false;
    }
    *key = PyLong_AsUnsignedLongLongMask(h);
    return true;
  }
  PyErr_Format(PyExc_ValueError, "block_hashes[%zd] must be bytes or a 64-bit int event id, got %R",
               index, h);
  return false;
}

}  // namespace

PyObject* table_put(PyObject*, PyObject* args) {
  PyObject *k, *v;
  unsigned long long key;
  long long block;
  if (!PyArg_ParseTuple(args, "OOKL", &k, &v, &key, &block)) return nullptr;
  Table t(k, v);
  if (!t.ok) return nullptr;
  int64_t free_slot;
  const int64_t at = t.probe(key, &free_slot);
  if (at >= 0) {
    t.vals[at] = block;
    Py_RETURN_FALSE;
  }
  if (free_slot < 0) {
    PyErr_SetString(PyExc_RuntimeError, "BlockIndex table is full");
    return nullptr;
  }
  t.keys[free_slot] = key;
  t.vals[free_slot] = block;
  Py_RETURN_TRUE;
}

PyObject* table_del(PyObject*, PyObject* args) {
  PyObject *k, *v;
  unsigned long long key;
  if (!PyArg_ParseTuple(args, "OOK", &k, &v, &key)) return nullptr;
  Table t(k, v);
  if (!t.ok) return nullptr;
  const int64_t i = t.find(key);
  if (i < 0) Py_RETURN_FALSE;
  t.vals[i] = kDeleted;
  Py_RETURN_TRUE;
}

namespace {

// The uint64 keys of a list of Python ints (event ids as the tables store them).
bool int_keys(PyObject* list, std::vector<uint64_t>& out) {
  if (!PyList_Check(list)) {
    PyErr_SetString(PyExc_TypeError, "keys must be a list of ints");
    return false;
  }
  const Py_ssize_t n = PyList_Size(list);
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const unsigned long long v = PyLong_AsUnsignedLongLong(PyList_GetItem(list, i));
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return false;
    out[i] = v;
  }
  return true;
}

}  // namespace

PyObject* table_put_many(PyObject*, PyObject* args) {
  PyObject *k, *v, *key_list, *val_list;
  if (!PyArg_ParseTuple(args, "OOOO", &k, &v, &key_list, &val_list)) return nullptr;
  Table t(k, v);
  if (!t.ok) return nullptr;
  std::vector<uint64_t> keys;
  if (!int_keys(key_list, keys)) return nullptr;
  if (!PyList_Check(val_list) || PyList_Size(val_list) != static_cast<Py_ssize_t>(keys.size())) {
    PyErr_SetString(PyExc_ValueError, "vals must be a list as long as keys");
    return nullptr;
  }
  Py_ssize_t inserted = 0;
  for (size_t j = 0; j < keys.size(); ++j) {
    const long long val = PyLong_AsLongLong(PyList_GetItem(val_list, static_cast<Py_ssize_t>(j)));
    if (val == -1 && PyErr_Occurred()) return nullptr;
    int64_t free_slot;
    const int64_t at = t.probe(keys[j], &free_slot);
    if (at >= 0) {
      t.vals[at] = val;
      continue;
    }
    if (free_slot < 0) {
      PyErr_SetString(PyExc_RuntimeError, "hash table is full");
      return nullptr;
    }
    t.keys[free_slot] = keys[j];
    t.vals[free_slot] = val;
    ++inserted;
  }
  return PyLong_FromSsize_t(inserted);
}

PyObject* table_del_many(PyObject*, PyObject* args) {
  PyObject *k, *v, *key_list;
  if (!PyArg_ParseTuple(args, "OOO", &k, &v, &key_list)) return nullptr;
  Table t(k, v);
  if (!t.ok) return nullptr;
  std::vector<uint64_t> keys;
  if (!int_keys(key_list, keys)) return nullptr;
  Py_ssize_t deleted = 0;
  for (const uint64_t key : keys) {
    const int64_t i = t.find(key);
    if (i >= 0) {
      t.vals[i] = kDeleted;
      ++deleted;
    }
  }
  return PyLong_FromSsize_t(deleted);
}

PyObject* table_add(PyObject*, PyObject* args) {
  PyObject *k, *v, *hashes;
  long long delta;
  if (!PyArg_ParseTuple(args, "OOOL", &k, &v, &hashes, &delta)) return nullptr;
  const bool is_list = PyList_Check(hashes);
  if (!is_list && !PyTuple_Check(hashes)) {
    PyErr_SetString(PyExc_TypeError, "hashes must be a list or tuple");
    return nullptr;
  }
  Table t(k, v);
  if (!t.ok) return nullptr;
  const Py_ssize_t n = is_list ? PyList_Size(hashes) : PyTuple_Size(hashes);
  // Validate every hash first: a batch is applied whole or not at all.
  uint64_t stack_keys[64];
  uint64_t* keys = n <= 64 ? stack_keys : static_cast<uint64_t*>(PyMem_Malloc(n * sizeof(uint64_t)));
  if (keys == nullptr) return PyErr_NoMemory();
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* h = is_list ? PyList_GetItem(hashes, i) : PyTuple_GetItem(hashes, i);
    if (!key_of(h, i, &keys[i])) {
      if (keys != stack_keys) PyMem_Free(keys);
      return nullptr;
    }
  }
  Py_ssize_t new_slots = 0, added = 0, removed = 0;
  for (Py_ssize_t j = 0; j < n; ++j) {
    const uint64_t key = keys[j];
    int64_t free_slot;
    const int64_t at = t.probe(key, &free_slot);
    if (at >= 0) {
      t.vals[at] += delta;
      if (t.vals[at] <= 0) {
        t.vals[at] = kDeleted;
        ++removed;
      }
    } else if (delta > 0) {
      if (free_slot < 0) {
        if (keys != stack_keys) PyMem_Free(keys);
        PyErr_SetString(PyExc_RuntimeError, "hash table is full");
        return nullptr;
      }
      if (t.vals[free_slot] == kEmpty) ++new_slots;
      t.keys[free_slot] = key;
      t.vals[free_slot] = delta;
      ++added;
    }
  }
  if (keys != stack_keys) PyMem_Free(keys);
  return Py_BuildValue("nnn", new_slots, added, removed);
}

PyObject* table_rehash(PyObject*, PyObject* args) {
  PyObject *ok, *ov, *nk, *nv;
  if (!PyArg_ParseTuple(args, "OOOO", &ok, &ov, &nk, &nv)) return nullptr;
  Table from(ok, ov);
  if (!from.ok) return nullptr;
  Table to(nk, nv);
  if (!to.ok) return nullptr;
  Py_ssize_t live = 0;
  for (uint64_t i = 0; i <= from.mask; ++i) {
    const int64_t val = from.vals[i];
    if (val < 0) continue;
    const uint64_t key = from.keys[i];
    uint64_t j = Table::slot(key) & to.mask;
    while (to.vals[j] != kEmpty) j = (j + 1) & to.mask;
    to.keys[j] = key;
    to.vals[j] = val;
    ++live;
  }
  return PyLong_FromSsize_t(live);
}

PyObject* table_get(PyObject*, PyObject* args) {
  PyObject *k, *v, *h;
  if (!PyArg_ParseTuple(args, "OOO", &k, &v, &h)) return nullptr;
  Table t(k, v);
  if (!t.ok) return nullptr;
  uint64_t key;
  if (!key_of(h, 0, &key)) return nullptr;
  const int64_t i = t.find(key);
  if (i < 0) Py_RETURN_NONE;
  return PyLong_FromLongLong(t.vals[i]);
}

PyObject* chain_prefix(PyObject*, PyObject* args) {
  PyObject *k, *v, *hashes, *out;
  if (!PyArg_ParseTuple(args, "OOOO", &k, &v, &hashes, &out)) return nullptr;
  const bool is_list = PyList_Check(hashes);
  if (!is_list && !PyTuple_Check(hashes)) {
    PyErr_SetString(PyExc_TypeError, "hashes must be a list or tuple");
    return nullptr;
  }
  Table t(k, v);
  if (!t.ok) return nullptr;
  Py_buffer view;
  if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return nullptr;
  const Py_ssize_t n = is_list ? PyList_Size(hashes) : PyTuple_Size(hashes);
  if (view.len < n * static_cast<Py_ssize_t>(sizeof(int64_t))) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_ValueError, "out is smaller than hashes");
    return nullptr;
  }
  int64_t* dst = static_cast<int64_t*>(view.buf);
  Py_ssize_t found = 0;
  for (; found < n; ++found) {
    PyObject* h = is_list ? PyList_GetItem(hashes, found) : PyTuple_GetItem(hashes, found);
    uint64_t key;
    if (!key_of(h, found, &key)) {
      PyBuffer_Release(&view);
      return nullptr;
    }
    const int64_t i = t.find(key);
    if (i < 0) break;
    dst[found] = t.vals[i];
  }
  PyBuffer_Release(&view);
  return PyLong_FromSsize_t(found);
}

}  // namespace mmreuse
