// mmreuse._index: the hash tables of BlockIndex and RemoteKVIndex, as a plain CPython extension
// (no torch: `import mmreuse.events` must not load libtorch).
//
// Open addressing over two numpy arrays that Python owns (keys: uint64 event ids; vals: int64,
// -1 empty, -2 deleted), so that walking a 2,048-hash chain costs ~15 ns a hash instead of a
// Python dict's ~45. Block hashes become keys by mmreuse.blockhash's one rule (`event_id` here,
// `to_event_id` there; a property test holds them equal): bytes or bytearray of >= 8 bytes by
// their low 64 bits, big-endian; an int (not a bool) in [0, 2**64) as it is; anything else is
// refused with mmreuse.errors' InvalidArgument (wrong value) or InvalidArgumentType (wrong type),
// worded as Python words it.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace mmreuse {
namespace {

constexpr int64_t kEmpty = -1;
constexpr int64_t kDeleted = -2;
constexpr Py_ssize_t kMaxRepr = 80;  // validate.show's cut
constexpr Py_ssize_t kMinDigestBytes = 8;

PyObject* g_invalid_argument = nullptr;       // mmreuse.errors.InvalidArgument
PyObject* g_invalid_argument_type = nullptr;  // mmreuse.errors.InvalidArgumentType

// An owned PyObject reference, released on scope exit.
class Ref {
 public:
  explicit Ref(PyObject* p = nullptr) : p_(p) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() { Py_XDECREF(p_); }
  PyObject* get() const { return p_; }
  PyObject* release() {
    PyObject* p = p_;
    p_ = nullptr;
    return p;
  }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  PyObject* p_;
};

// type(value).__name__, as Python's messages show it.
std::string TypeName(PyObject* value) {
  Ref name(PyObject_GetAttrString(reinterpret_cast<PyObject*>(Py_TYPE(value)), "__name__"));
  const char* s = name && PyUnicode_Check(name.get()) ? PyUnicode_AsUTF8(name.get()) : nullptr;
  if (s == nullptr) {
    PyErr_Clear();
    return Py_TYPE(value)->tp_name;
  }
  return s;
}

// validate.show: repr(value), cut to 80 characters (a hostile __repr__ gives "<type>").
std::string Show(PyObject* value) {
  Ref text(PyObject_Repr(value));
  if (!text) {
    PyErr_Clear();
    return "<" + TypeName(value) + ">";
  }
  Py_ssize_t len = PyUnicode_GetLength(text.get());
  if (len > kMaxRepr) {
    Ref head(PyUnicode_Substring(text.get(), 0, kMaxRepr - 3));
    Ref cut(head ? PyUnicode_FromFormat("%U...", head.get()) : nullptr);
    if (!cut) {
      PyErr_Clear();
      return "<repr>";
    }
    const char* s = PyUnicode_AsUTF8(cut.get());
    if (s == nullptr) {
      PyErr_Clear();
      return "<repr>";
    }
    return s;
  }
  Py_ssize_t size = 0;
  const char* s = PyUnicode_AsUTF8AndSize(text.get(), &size);
  if (s == nullptr) {
    PyErr_Clear();
    return "<repr>";
  }
  return std::string(s, static_cast<size_t>(size));
}

// Raise `type` with a UTF-8 message (it may hold any character a repr shows).
std::nullptr_t Raise(PyObject* type, const std::string& msg) {
  Ref text(PyUnicode_DecodeUTF8(msg.data(), static_cast<Py_ssize_t>(msg.size()), "replace"));
  if (text) PyErr_SetObject(type, text.get());
  return nullptr;
}

// validate.fail_value: "{field} must be {what}, got {show(value)}".
[[gnu::cold, gnu::noinline]] std::nullptr_t FailValue(const std::string& field, const char* what,
                                                      PyObject* value) {
  return Raise(g_invalid_argument, field + " must be " + what + ", got " + Show(value));
}

// validate.fail_type: "{field} must be {expected}, got {type name} {show(value)}".
[[gnu::cold, gnu::noinline]] std::nullptr_t FailType(const std::string& field, const char* expected,
                                                     PyObject* value) {
  return Raise(g_invalid_argument_type,
               field + " must be " + expected + ", got " + TypeName(value) + " " + Show(value));
}

// The field an error names: `name` alone (index < 0) or `name[index]`.
[[gnu::cold, gnu::noinline]] std::string Field(const char* name, Py_ssize_t index) {
  if (index < 0) return name;
  return std::string(name) + "[" + std::to_string(index) + "]";
}

// The low 64 bits, big-endian, of a digest of >= 8 bytes.
inline uint64_t LowBits(const char* data, Py_ssize_t len) {
  const unsigned char* b = reinterpret_cast<const unsigned char*>(data) + len - 8;
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | b[i];
  return v;
}

// KeyOf for an int (not a bool).
inline bool IntKey(PyObject* h, const char* name, Py_ssize_t index, uint64_t* key) {
#if PY_VERSION_HEX < 0x030C0000
  // CPython 3.11: read a non-negative value of <= 64 bits straight from its 30-bit digits
  // (PyLong_AsUnsignedLongLong goes through _PyLong_AsByteArray, ~25 ns).
  const Py_ssize_t size = Py_SIZE(h);
  const digit* d = reinterpret_cast<PyLongObject*>(h)->ob_digit;
  if (size >= 0 && size <= 3 && (size < 3 || d[2] < (1u << (64 - 2 * PyLong_SHIFT)))) {
    uint64_t v = 0;
    for (Py_ssize_t i = size - 1; i >= 0; --i) v = (v << PyLong_SHIFT) | d[i];
    *key = v;
    return true;
  }
#endif
  const unsigned long long v = PyLong_AsUnsignedLongLong(h);  // negative / too big: Overflow
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return false;
    PyErr_Clear();
    FailValue(Field(name, index), "an event id in [0, 2**64)", h);
    return false;
  }
  *key = v;
  return true;
}

// mmreuse.blockhash.to_event_id in C. `index` < 0 names the field `name`, else `name[index]`.
inline bool KeyOf(PyObject* h, const char* name, Py_ssize_t index, uint64_t* key) {
  if (PyLong_CheckExact(h)) return IntKey(h, name, index, key);  // the common cases first
  const bool is_bytes = PyBytes_Check(h);
  if (is_bytes || PyByteArray_Check(h)) {
    const Py_ssize_t len = is_bytes ? PyBytes_GET_SIZE(h) : PyByteArray_GET_SIZE(h);
    if (len < kMinDigestBytes) {
      FailValue(Field(name, index), "a block hash of >= 8 bytes", h);
      return false;
    }
    *key = LowBits(is_bytes ? PyBytes_AS_STRING(h) : PyByteArray_AS_STRING(h), len);
    return true;
  }
  if (!PyLong_Check(h) || PyBool_Check(h)) {
    FailType(Field(name, index), "a block hash (bytes) or a 64-bit int event id", h);
    return false;
  }
  return IntKey(h, name, index, key);  // an int subclass
}

// A Py_buffer over an 8-byte integer array, released on scope exit.
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (view_.obj != nullptr) PyBuffer_Release(&view_);
  }

  // A writable C-contiguous array of int64 (is_signed) or uint64; raises naming `field`.
  bool Get(PyObject* obj, const char* field, bool is_signed) {
    const char* what =
        is_signed ? "a writable contiguous int64 array" : "a writable contiguous uint64 array";
    if (PyObject_GetBuffer(obj, &view_, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
      view_.obj = nullptr;
      PyErr_Clear();
      FailType(field, what, obj);
      return false;
    }
    if (view_.itemsize != 8 || !IntFormat(view_.format, is_signed)) {
      FailType(field, what, obj);
      return false;
    }
    return true;
  }
  void* data() const { return view_.buf; }
  Py_ssize_t items() const { return view_.len / 8; }

 private:
  // struct-module codes of an 8-byte integer, in native or little-endian order.
  static bool IntFormat(const char* fmt, bool is_signed) {
    if (fmt == nullptr) return false;
    if (*fmt == '@' || *fmt == '=' || *fmt == '<') ++fmt;
    if (fmt[0] == '\0' || fmt[1] != '\0') return false;
    return is_signed ? (fmt[0] == 'l' || fmt[0] == 'q') : (fmt[0] == 'L' || fmt[0] == 'Q');
  }

  Py_buffer view_{};
};

// One table: the keys and vals arrays of a HashTable.
class Table {
 public:
  bool Open(PyObject* k, PyObject* v, const char* kname = "keys", const char* vname = "vals") {
    if (!kbuf_.Get(k, kname, false) || !vbuf_.Get(v, vname, true)) return false;
    const Py_ssize_t cap = kbuf_.items();
    if (cap == 0 || (cap & (cap - 1)) != 0 || vbuf_.items() != cap) {
      PyErr_Format(g_invalid_argument,
                   "%s and %s must be arrays of one power-of-two length, got %zd and %zd", kname,
                   vname, cap, vbuf_.items());
      return false;
    }
    keys = static_cast<uint64_t*>(kbuf_.data());
    vals = static_cast<int64_t*>(vbuf_.data());
    mask = static_cast<uint64_t>(cap) - 1;
    return true;
  }

  static uint64_t Slot(uint64_t key) { return (key * 0x9E3779B97F4A7C15ull) >> 17; }

  // Index of key's slot, or -1; also the first slot an insert could take (the first tombstone
  // on the probe path, else the empty slot that ends it; -1 if the table is full).
  int64_t Probe(uint64_t key, int64_t* free_slot) const {
    *free_slot = -1;
    for (uint64_t i = Slot(key) & mask, n = 0; n <= mask; i = (i + 1) & mask, ++n) {
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
  int64_t Find(uint64_t key) const {
    for (uint64_t i = Slot(key) & mask, n = 0; n <= mask; i = (i + 1) & mask, ++n) {
      const int64_t v = vals[i];
      if (v == kEmpty) return -1;
      if (v != kDeleted && keys[i] == key) return static_cast<int64_t>(i);
    }
    return -1;
  }

  uint64_t* keys = nullptr;
  int64_t* vals = nullptr;
  uint64_t mask = 0;

 private:
  Buffer kbuf_, vbuf_;
};

// A list or tuple's items, borrowed (the sequence is held by the caller's arguments).
class Items {
 public:
  bool Open(PyObject* seq, const char* field) {
    if (PyList_Check(seq)) {
      items_ = PySequence_Fast_ITEMS(seq);
      size_ = PyList_GET_SIZE(seq);
      return true;
    }
    if (PyTuple_Check(seq)) {
      items_ = PySequence_Fast_ITEMS(seq);
      size_ = PyTuple_GET_SIZE(seq);
      return true;
    }
    FailType(field, "a list or tuple", seq);
    return false;
  }
  Py_ssize_t size() const { return size_; }
  PyObject* operator[](Py_ssize_t i) const { return items_[i]; }

 private:
  PyObject** items_ = nullptr;
  Py_ssize_t size_ = 0;
};

// Keys on the stack for small batches, else on the heap.
class KeyBuffer {
 public:
  explicit KeyBuffer(Py_ssize_t n) {
    if (n > kStack) {
      heap_.resize(static_cast<size_t>(n));
      data_ = heap_.data();
    }
  }
  uint64_t& operator[](Py_ssize_t i) { return data_[i]; }

 private:
  static constexpr Py_ssize_t kStack = 64;
  uint64_t stack_[kStack];
  std::vector<uint64_t> heap_;
  uint64_t* data_ = stack_;
};

// The keys of every hash in `items`, validated before any change (a batch is whole or nothing).
bool KeysOf(const Items& items, const char* name, KeyBuffer& keys) {
  for (Py_ssize_t i = 0; i < items.size(); ++i) {
    if (!KeyOf(items[i], name, i, &keys[i])) return false;
  }
  return true;
}

bool CheckArgs(const char* fn, Py_ssize_t nargs, Py_ssize_t want) {
  if (nargs == want) return true;
  PyErr_Format(g_invalid_argument_type, "%s takes %zd arguments, got %zd", fn, want, nargs);
  return false;
}

// An exact int (not a bool) in [lo, hi], as validate.check_int words it; the field is `name`
// (index < 0) or `name[index]`, built only for an error.
bool IntArg(PyObject* obj, const char* name, Py_ssize_t index, long long lo, long long hi,
            long long* out) {
  if (!PyLong_Check(obj) || PyBool_Check(obj)) {
    FailType(Field(name, index), "an int", obj);
    return false;
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (v == -1 && PyErr_Occurred()) return false;
  if (overflow != 0 || v < lo || v > hi) {
    Raise(g_invalid_argument, Field(name, index) + " must be in [" + std::to_string(lo) + ", " +
                                  std::to_string(hi) + "], got " + Show(obj));
    return false;
  }
  *out = v;
  return true;
}

PyObject* TableFull() {
  PyErr_SetString(PyExc_RuntimeError, "hash table is full (HashTable reserves room first)");
  return nullptr;
}

// ---- entry points ---------------------------------------------------------------------------

// event_id(h) -> int: the table key of one block hash (mmreuse.blockhash.to_event_id in C).
PyObject* EventId(PyObject*, PyObject* h) {
  uint64_t key;
  if (!KeyOf(h, "block_hash", -1, &key)) return nullptr;
  return PyLong_FromUnsignedLongLong(key);
}

// The `field` argument of event_ids / check_event_ids (args[1] when given), as UTF-8.
bool FieldArg(const char* fn, PyObject* const* args, Py_ssize_t nargs, const char** field) {
  if (nargs < 1 || nargs > 2) {
    PyErr_Format(PyExc_TypeError, "%s() takes 1 or 2 arguments (%zd given)", fn, nargs);
    return false;
  }
  *field = "block_hashes";
  if (nargs == 2) {
    *field = PyUnicode_Check(args[1]) ? PyUnicode_AsUTF8(args[1]) : nullptr;
    if (*field == nullptr) {
      if (!PyErr_Occurred()) FailType("field", "a str", args[1]);
      return false;
    }
  }
  return true;
}

// event_ids(block_hashes, field="block_hashes") -> list[int]: `event_id` of each hash of a list
// or tuple, naming the index of a refused one (`block_hashes[3]`), like blockhash.to_event_ids.
PyObject* EventIds(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  const char* field;
  if (!FieldArg("event_ids", args, nargs, &field)) return nullptr;
  Items items;
  if (!items.Open(args[0], field)) return nullptr;
  const Py_ssize_t n = items.size();
  std::vector<uint64_t> keys(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!KeyOf(items[i], field, i, &keys[static_cast<size_t>(i)])) return nullptr;
  }
  Ref out(PyList_New(n));
  if (!out) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = PyLong_FromUnsignedLongLong(keys[static_cast<size_t>(i)]);
    if (v == nullptr) return nullptr;
    PyList_SET_ITEM(out.get(), i, v);
  }
  return out.release();
}

// check_event_ids(block_hashes, field="block_hashes") -> None: event_ids' check alone, for a
// caller that keeps the hashes (plan_admission): no key is built or boxed.
PyObject* CheckEventIds(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  const char* field;
  if (!FieldArg("check_event_ids", args, nargs, &field)) return nullptr;
  Items items;
  if (!items.Open(args[0], field)) return nullptr;
  uint64_t key;
  for (Py_ssize_t i = 0; i < items.size(); ++i) {
    if (!KeyOf(items[i], field, i, &key)) return nullptr;
  }
  Py_RETURN_NONE;
}

// table_put_many(keys, vals, key_list, val_list) -> keys inserted (the rest updated).
PyObject* TablePutMany(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!CheckArgs("table_put_many", nargs, 4)) return nullptr;
  Table t;
  if (!t.Open(args[0], args[1])) return nullptr;
  Items key_items, val_items;
  if (!key_items.Open(args[2], "key_list") || !val_items.Open(args[3], "val_list")) return nullptr;
  const Py_ssize_t n = key_items.size();
  if (val_items.size() != n) {
    PyErr_Format(g_invalid_argument, "val_list has %zd values for %zd keys", val_items.size(), n);
    return nullptr;
  }
  KeyBuffer keys(n);
  if (!KeysOf(key_items, "key_list", keys)) return nullptr;
  std::vector<int64_t> vals(static_cast<size_t>(n));
  for (Py_ssize_t j = 0; j < n; ++j) {  // a value < 0 would read as an empty or deleted slot
    long long v;
    if (!IntArg(val_items[j], "val_list", j, 0, INT64_MAX, &v)) return nullptr;
    vals[static_cast<size_t>(j)] = v;
  }
  Py_ssize_t inserted = 0;
  for (Py_ssize_t j = 0; j < n; ++j) {
    int64_t free_slot;
    const int64_t at = t.Probe(keys[j], &free_slot);
    if (at >= 0) {
      t.vals[at] = vals[static_cast<size_t>(j)];
      continue;
    }
    if (free_slot < 0) return TableFull();
    t.keys[free_slot] = keys[j];
    t.vals[free_slot] = vals[static_cast<size_t>(j)];
    ++inserted;
  }
  return PyLong_FromSsize_t(inserted);
}

// table_del_many(keys, vals, key_list) -> keys deleted.
PyObject* TableDelMany(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!CheckArgs("table_del_many", nargs, 3)) return nullptr;
  Table t;
  if (!t.Open(args[0], args[1])) return nullptr;
  Items key_items;
  if (!key_items.Open(args[2], "key_list")) return nullptr;
  KeyBuffer keys(key_items.size());
  if (!KeysOf(key_items, "key_list", keys)) return nullptr;
  Py_ssize_t deleted = 0;
  for (Py_ssize_t j = 0; j < key_items.size(); ++j) {
    const int64_t i = t.Find(keys[j]);
    if (i >= 0) {
      t.vals[i] = kDeleted;
      ++deleted;
    }
  }
  return PyLong_FromSsize_t(deleted);
}

// table_add(keys, vals, hashes, delta) -> (new_slots, added, removed): add delta to each hash's
// value, inserting it (delta > 0) or deleting it when the value reaches <= 0.
PyObject* TableAdd(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!CheckArgs("table_add", nargs, 4)) return nullptr;
  Items items;
  if (!items.Open(args[2], "block_hashes")) return nullptr;
  long long delta;
  // bounded so that no count can overflow int64 before 2**31 batches
  if (!IntArg(args[3], "delta", -1, -(1LL << 32), 1LL << 32, &delta)) return nullptr;
  Table t;
  if (!t.Open(args[0], args[1])) return nullptr;
  const Py_ssize_t n = items.size();
  KeyBuffer keys(n);
  if (!KeysOf(items, "block_hashes", keys)) return nullptr;
  Py_ssize_t new_slots = 0, added = 0, removed = 0;
  for (Py_ssize_t j = 0; j < n; ++j) {
    const uint64_t key = keys[j];
    int64_t free_slot;
    const int64_t at = t.Probe(key, &free_slot);
    if (at >= 0) {
      t.vals[at] += delta;
      if (t.vals[at] <= 0) {
        t.vals[at] = kDeleted;
        ++removed;
      }
    } else if (delta > 0) {
      if (free_slot < 0) return TableFull();
      if (t.vals[free_slot] == kEmpty) ++new_slots;
      t.keys[free_slot] = key;
      t.vals[free_slot] = delta;
      ++added;
    }
  }
  return Py_BuildValue("nnn", new_slots, added, removed);
}

// table_rehash(old_keys, old_vals, new_keys, new_vals) -> live entries copied into the new
// arrays (fresh: all empty); raises if they have no room (the new arrays are then scratch).
PyObject* TableRehash(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!CheckArgs("table_rehash", nargs, 4)) return nullptr;
  Table from, to;
  if (!from.Open(args[0], args[1], "old_keys", "old_vals")) return nullptr;
  if (!to.Open(args[2], args[3], "new_keys", "new_vals")) return nullptr;
  uint64_t live = 0;
  for (uint64_t i = 0; i <= from.mask; ++i) {
    const int64_t val = from.vals[i];
    if (val < 0) continue;
    const uint64_t key = from.keys[i];
    uint64_t j = Table::Slot(key) & to.mask, n = 0;
    for (; n <= to.mask && to.vals[j] != kEmpty; ++n) j = (j + 1) & to.mask;
    if (n > to.mask) {  // bounded: a full target must not spin forever
      PyErr_Format(g_invalid_argument, "new_vals has no empty slot left after %llu entries",
                   static_cast<unsigned long long>(live));
      return nullptr;
    }
    to.keys[j] = key;
    to.vals[j] = val;
    ++live;
  }
  return PyLong_FromUnsignedLongLong(live);
}

// table_get(keys, vals, block_hash) -> int | None.
PyObject* TableGet(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!CheckArgs("table_get", nargs, 3)) return nullptr;
  uint64_t key;
  if (!KeyOf(args[2], "block_hash", -1, &key)) return nullptr;
  Table t;
  if (!t.Open(args[0], args[1])) return nullptr;
  const int64_t i = t.Find(key);
  if (i < 0) Py_RETURN_NONE;
  return PyLong_FromLongLong(t.vals[i]);
}

// chain_prefix(keys, vals, block_hashes, out) -> int: the values of the leading hashes found,
// written into the int64 array out (at least as long as block_hashes). Every hash is validated,
// those after the first miss too.
PyObject* ChainPrefix(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!CheckArgs("chain_prefix", nargs, 4)) return nullptr;
  Items items;
  if (!items.Open(args[2], "block_hashes")) return nullptr;
  Table t;
  if (!t.Open(args[0], args[1])) return nullptr;
  Buffer out;
  if (!out.Get(args[3], "out", true)) return nullptr;
  const Py_ssize_t n = items.size();
  if (out.items() < n) {
    PyErr_Format(g_invalid_argument, "out has %zd slots for %zd block_hashes", out.items(), n);
    return nullptr;
  }
  int64_t* dst = static_cast<int64_t*>(out.data());
  Py_ssize_t found = 0;
  uint64_t key;
  for (; found < n; ++found) {
    if (!KeyOf(items[found], "block_hashes", found, &key)) return nullptr;
    const int64_t i = t.Find(key);
    if (i < 0) break;
    dst[found] = t.vals[i];
  }
  for (Py_ssize_t rest = found + 1; rest < n; ++rest) {
    if (!KeyOf(items[rest], "block_hashes", rest, &key)) return nullptr;
  }
  return PyLong_FromSsize_t(found);
}

PyMethodDef kMethods[] = {
    {"event_id", EventId, METH_O,
     "event_id(block_hash) -> int: the table key of a block hash (blockhash.to_event_id in C)"},
    {"event_ids", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(EventIds)),
     METH_FASTCALL,
     "event_ids(block_hashes, field='block_hashes') -> list[int]: event_id of each hash of a "
     "list or tuple, naming the index of a refused one"},
    {"check_event_ids", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(CheckEventIds)),
     METH_FASTCALL,
     "check_event_ids(block_hashes, field='block_hashes') -> None: event_ids' check alone"},
    {"table_put_many", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(TablePutMany)),
     METH_FASTCALL, "table_put_many(keys, vals, key_list, val_list) -> inserted"},
    {"table_del_many", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(TableDelMany)),
     METH_FASTCALL, "table_del_many(keys, vals, key_list) -> deleted"},
    {"table_add", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(TableAdd)),
     METH_FASTCALL, "table_add(keys, vals, block_hashes, delta) -> (new_slots, added, removed)"},
    {"table_rehash", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(TableRehash)),
     METH_FASTCALL, "table_rehash(old_keys, old_vals, new_keys, new_vals) -> live"},
    {"table_get", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(TableGet)),
     METH_FASTCALL, "table_get(keys, vals, block_hash) -> int | None"},
    {"chain_prefix", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ChainPrefix)),
     METH_FASTCALL,
     "chain_prefix(keys, vals, block_hashes, out) -> int: the values of the leading hashes "
     "found, written into the int64 array out"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_index",
                       "mmreuse's open-addressing block-hash tables (plain CPython, no torch)", -1,
                       kMethods};

}  // namespace
}  // namespace mmreuse

PyMODINIT_FUNC PyInit__index(void) {
  using mmreuse::Ref;
  Ref errors(PyImport_ImportModule("mmreuse.errors"));
  if (!errors) return nullptr;
  Ref invalid(PyObject_GetAttrString(errors.get(), "InvalidArgument"));
  Ref invalid_type(invalid ? PyObject_GetAttrString(errors.get(), "InvalidArgumentType") : nullptr);
  if (!invalid_type) return nullptr;
  Ref module(PyModule_Create(&mmreuse::kModule));
  if (!module) return nullptr;
  Py_XSETREF(mmreuse::g_invalid_argument, invalid.release());  // kept for the process
  Py_XSETREF(mmreuse::g_invalid_argument_type, invalid_type.release());
  return module.release();
}
