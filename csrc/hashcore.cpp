// C++ fast path of mmreuse.hashing: vLLM's block-hash chain in one call.
//
// For each full block it writes exactly the bytes vLLM's hash function serializes
// for (parent_hash, tuple(block_tokens), extra_keys) -- pickle protocol 5 with
// CPython's memo (by object identity, emulated with identity keys computed in
// Python) or canonical CBOR -- and digests them with OpenSSL SHA-256 or XXH3-128.
// The extra keys follow vLLM's `_gen_mm_extra_hash_keys` walk literally, for the
// scheme encoded in `flags` (see mmreuse/hashing/hasher.py::_make_fast_spec).
// Anything it cannot write in one pickle frame makes it return None, and the
// Python reference path takes over.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

// SHA256_Init/Update/Final: OpenSSL 3's low-level API (deprecated, still shipped) costs ~90 ns for
// a 112-byte block here; SHA256() and EVP_Digest go through EVP and cost ~300-350 ns.
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/sha.h>

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace {

// Identity keys of vLLM's literal tag strings (see _identity_key for the others).
constexpr long kKeyMM = 1, kKeyLora = 2, kKeySalt = 3, kKeyEmbeds = 4;

struct Str {
  const char* p = nullptr;
  Py_ssize_t n = 0;
  long key = 0;
};

const Str kTagMM{"mm", 2, kKeyMM};
const Str kTagLora{"lora", 4, kKeyLora};
const Str kTagSalt{"cache_salt", 10, kKeySalt};
const Str kTagEmbeds{"prompt_embeds", 13, kKeyEmbeds};

struct MMItem {
  Str id;
  int64_t offset;
  int64_t end;
};

enum class MMKey { kTagged = 0, kPair = 1, kBare = 2 };
enum class LoraKey { kTagged = 0, kName = 1, kIntId = 2 };

struct Spec {
  int fn = 0;  // 0 sha256, 1 sha256_cbor, 2 xxhash, 3 xxhash_cbor
  MMKey mm_key = MMKey::kTagged;
  bool inclusive = false;
  LoraKey lora_key = LoraKey::kTagged;
  bool salt_tagged = true;
  bool embeds_tagged = true;
  std::vector<MMItem> mm;
  bool has_lora = false;
  Str lora_name, lora_path;
  int64_t lora_int_id = 0;
  bool has_salt = false;
  Str salt;
};

// An output cursor into a buffer sized in advance (see block_bound): no checks per byte.
struct Out {
  char* p;
  void push_back(char c) { *p++ = c; }
  void append(const char* src, size_t n) {
    std::memcpy(p, src, n);
    p += n;
  }
};

inline void put_le(Out& b, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) b.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline void put_be(Out& b, uint64_t v, int n) {
  for (int i = n - 1; i >= 0; --i) b.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// CPython's _pickle.Pickler, protocol 5, for the types vLLM's keys use.
class PickleWriter {
 public:
  explicit PickleWriter(Out& b) : b_(b) {}

  void none() { b_.push_back('N'); }

  void integer(int64_t v) {
    if (static_cast<uint64_t>(v) <= 0x7fffffff) {
      // BININT1 / BININT2 / BININT without a data-dependent branch: token ids are random
      // across those ranges, and mispredictions cost more than the unconditional stores.
      const uint32_t u = static_cast<uint32_t>(v);
      const int cls = (u > 0xff) + (u > 0xffff);
      char* p = b_.p;  // a local: stores through char* would otherwise reload b_.p each time
      p[0] = "KMJ"[cls];
      p[1] = static_cast<char>(u);
      p[2] = static_cast<char>(u >> 8);
      p[3] = static_cast<char>(u >> 16);
      p[4] = static_cast<char>(u >> 24);
      b_.p = p + 2 + cls + (cls >> 1);  // 2, 3, 5 bytes
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      b_.push_back('J');
      put_le(b_, static_cast<uint64_t>(static_cast<uint32_t>(static_cast<int32_t>(v))), 4);
    } else {  // LONG1: minimal little-endian two's complement
      uint64_t mag = v < 0 ? (~static_cast<uint64_t>(v) + 1) : static_cast<uint64_t>(v);
      int nbits = 64 - __builtin_clzll(mag);
      int nbytes = nbits / 8 + 1;
      unsigned char tmp[9];
      for (int i = 0; i < nbytes; ++i)
        tmp[i] = i < 8 ? static_cast<unsigned char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff)
                       : (v < 0 ? 0xff : 0x00);
      if (v < 0 && nbytes > 1 && tmp[nbytes - 1] == 0xff && (tmp[nbytes - 2] & 0x80)) --nbytes;
      b_.push_back('\x8a');
      b_.push_back(static_cast<char>(nbytes));
      b_.append(reinterpret_cast<const char*>(tmp), nbytes);
    }
  }

  void str(const Str& s) {
    for (const auto& m : memo_) {
      if (m.first == s.key) {
        get(m.second);
        return;
      }
    }
    if (s.n <= 0xff) {
      b_.push_back('\x8c');
      b_.push_back(static_cast<char>(s.n));
    } else {
      b_.push_back('X');
      put_le(b_, static_cast<uint64_t>(s.n), 4);
    }
    b_.append(s.p, s.n);
    memo_.emplace_back(s.key, next_);
    memoize();
  }

  void bytes(const char* p, size_t n) {
    if (n <= 0xff) {
      b_.push_back('C');
      b_.push_back(static_cast<char>(n));
    } else {
      b_.push_back('B');
      put_le(b_, n, 4);
    }
    b_.append(p, n);
    memoize();
  }

  void tuple_begin(size_t n) {
    if (n > 3) b_.push_back('(');
  }
  void tuple_end(size_t n) {
    if (n == 0) {
      b_.push_back(')');
      return;
    }
    b_.push_back(n <= 3 ? "\x85\x86\x87"[n - 1] : 't');
    memoize();
  }

 private:
  void memoize() {
    b_.push_back('\x94');
    ++next_;
  }
  void get(uint32_t i) {
    if (i < 256) {
      b_.push_back('h');
      b_.push_back(static_cast<char>(i));
    } else {
      b_.push_back('j');
      put_le(b_, i, 4);
    }
  }
  Out& b_;
  std::vector<std::pair<long, uint32_t>> memo_;
  uint32_t next_ = 0;
};

// cbor2.dumps(obj, canonical=True) for the same types.
class CborWriter {
 public:
  explicit CborWriter(Out& b) : b_(b) {}
  void none() { b_.push_back('\xf6'); }
  void integer(int64_t v) {
    if (static_cast<uint64_t>(v) <= 0xffffffffULL) {
      // Unsigned head without data-dependent branches (see PickleWriter::integer).
      const uint32_t u = static_cast<uint32_t>(v);
      const int cls = (u >= 24) + (u > 0xff) + (u > 0xffff);  // 0, 1, 2 or 3
      static constexpr int kBytes[4] = {0, 1, 2, 4};
      const int nbytes = kBytes[cls];
      const uint32_t be = __builtin_bswap32(
          static_cast<uint32_t>((static_cast<uint64_t>(u) << (8 * (4 - nbytes))) & 0xffffffffULL));
      char* p = b_.p;
      p[0] = static_cast<char>(cls ? 0x17 + cls : u);
      std::memcpy(p + 1, &be, 4);
      b_.p = p + 1 + nbytes;
    } else if (v >= 0) {
      head(0, static_cast<uint64_t>(v));
    } else {
      head(1, static_cast<uint64_t>(-1 - v));
    }
  }
  void str(const Str& s) {
    head(3, static_cast<uint64_t>(s.n));
    b_.append(s.p, s.n);
  }
  void bytes(const char* p, size_t n) {
    head(2, n);
    b_.append(p, n);
  }
  void tuple_begin(size_t n) { head(4, n); }
  void tuple_end(size_t) {}

 private:
  void head(int major, uint64_t v) {
    const char m = static_cast<char>(major << 5);
    if (v < 24) {
      b_.push_back(static_cast<char>(m | v));
    } else if (v <= 0xff) {
      b_.push_back(m | 24);
      put_be(b_, v, 1);
    } else if (v <= 0xffff) {
      b_.push_back(m | 25);
      put_be(b_, v, 2);
    } else if (v <= 0xffffffffULL) {
      b_.push_back(m | 26);
      put_be(b_, v, 4);
    } else {
      b_.push_back(m | 27);
      put_be(b_, v, 8);
    }
  }
  Out& b_;
};

enum class Kind { kLora, kMM, kSalt, kEmbeds };
struct Entry {
  Kind kind;
  const MMItem* mm;
  int64_t rel;
};

// vLLM's _gen_mm_extra_hash_keys + generate_block_hash_extra_keys ordering.
Py_ssize_t extra_entries(const Spec& s, int64_t start, int64_t end, Py_ssize_t idx, bool has_embeds,
                         std::vector<Entry>& out) {
  out.clear();
  if (s.has_lora) out.push_back({Kind::kLora, nullptr, 0});
  const Py_ssize_t n = static_cast<Py_ssize_t>(s.mm.size());
  if (n > 0) {
    const int64_t last_end = s.mm[n - 1].end;
    const bool done = s.inclusive ? (last_end < start) : (last_end <= start);
    if (!done) {
      if (idx < 0) idx += n;
      while (idx < n) {
        const MMItem& m = s.mm[idx];
        if (end > m.offset) {
          const bool passed = s.inclusive ? (start > m.end) : (start >= m.end);
          if (passed) {
            ++idx;
            continue;
          }
          out.push_back({Kind::kMM, &m, m.offset - start});
          if (end >= m.end)
            ++idx;
          else
            break;
        } else {
          break;
        }
      }
    }
  }
  if (start == 0 && s.has_salt) out.push_back({Kind::kSalt, nullptr, 0});
  if (has_embeds) out.push_back({Kind::kEmbeds, nullptr, 0});
  return idx;
}

template <class W>
void write_entry(W& w, const Spec& s, const Entry& e, const char* embeds_digest) {
  switch (e.kind) {
    case Kind::kLora:
      if (s.lora_key == LoraKey::kTagged) {
        w.tuple_begin(3);
        w.str(kTagLora);
        w.str(s.lora_name);
        w.str(s.lora_path);
        w.tuple_end(3);
      } else if (s.lora_key == LoraKey::kName) {
        w.str(s.lora_name);
      } else {
        w.integer(s.lora_int_id);
      }
      break;
    case Kind::kMM:
      if (s.mm_key == MMKey::kTagged) {
        w.tuple_begin(3);
        w.str(kTagMM);
        w.str(e.mm->id);
        w.integer(e.rel);
        w.tuple_end(3);
      } else if (s.mm_key == MMKey::kPair) {
        w.tuple_begin(2);
        w.str(e.mm->id);
        w.integer(e.rel);
        w.tuple_end(2);
      } else {
        w.str(e.mm->id);
      }
      break;
    case Kind::kSalt:
      if (s.salt_tagged) {
        w.tuple_begin(2);
        w.str(kTagSalt);
        w.str(s.salt);
        w.tuple_end(2);
      } else {
        w.str(s.salt);
      }
      break;
    case Kind::kEmbeds:
      if (s.embeds_tagged) {
        w.tuple_begin(2);
        w.str(kTagEmbeds);
        w.bytes(embeds_digest, 32);
        w.tuple_end(2);
      } else {
        w.bytes(embeds_digest, 32);
      }
      break;
  }
}

template <class W>
void write_extra(W& w, const Spec& s, const std::vector<Entry>& entries, const char* digest) {
  if (entries.empty()) {
    w.none();
    return;
  }
  w.tuple_begin(entries.size());
  for (const auto& e : entries) write_entry(w, s, e, digest);
  w.tuple_end(entries.size());
}

// Serialize (parent, tuple(tokens[b:b+bs]), extra) -- vLLM's hash_block_tokens input.
template <class W>
void write_block(W& w, const char* parent, size_t parent_len, const int64_t* toks, int64_t bs,
                 const Spec& s, const std::vector<Entry>& entries, const char* digest,
                 const int64_t* look, int64_t la) {
  w.tuple_begin(3);
  w.bytes(parent, parent_len);
  w.tuple_begin(static_cast<size_t>(bs));
  for (int64_t i = 0; i < bs; ++i) w.integer(toks[i]);
  w.tuple_end(static_cast<size_t>(bs));
  if (la == 0) {
    write_extra(w, s, entries, digest);
  } else {
    w.tuple_begin(static_cast<size_t>(1 + la));
    write_extra(w, s, entries, digest);
    for (int64_t i = 0; i < la; ++i) w.integer(look[i]);
    w.tuple_end(static_cast<size_t>(1 + la));
  }
  w.tuple_end(3);
}

bool parse_str(PyObject* bytes_obj, PyObject* key_obj, Str& out) {
  char* p;
  Py_ssize_t n;
  if (PyBytes_AsStringAndSize(bytes_obj, &p, &n) < 0) return false;
  out.p = p;
  out.n = n;
  out.key = PyLong_AsLong(key_obj);
  return !(out.key == -1 && PyErr_Occurred());
}

bool parse_spec(PyObject* mm, PyObject* lora, PyObject* salt, Spec& s) {
  if (!PyTuple_Check(mm)) {
    PyErr_SetString(PyExc_TypeError, "mm must be a tuple");
    return false;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(mm);
  s.mm.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = PyTuple_GET_ITEM(mm, i);
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4) {
      PyErr_SetString(PyExc_TypeError, "mm items must be (bytes, key, offset, length)");
      return false;
    }
    if (!parse_str(PyTuple_GET_ITEM(t, 0), PyTuple_GET_ITEM(t, 1), s.mm[i].id)) return false;
    s.mm[i].offset = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 2));
    s.mm[i].end = s.mm[i].offset + PyLong_AsLongLong(PyTuple_GET_ITEM(t, 3));
    if (PyErr_Occurred()) return false;
  }
  if (lora != Py_None) {
    if (!PyTuple_Check(lora) || PyTuple_GET_SIZE(lora) != 5) {
      PyErr_SetString(PyExc_TypeError, "lora must be (name, key, path, key, int_id)");
      return false;
    }
    s.has_lora = true;
    if (!parse_str(PyTuple_GET_ITEM(lora, 0), PyTuple_GET_ITEM(lora, 1), s.lora_name)) return false;
    if (!parse_str(PyTuple_GET_ITEM(lora, 2), PyTuple_GET_ITEM(lora, 3), s.lora_path)) return false;
    s.lora_int_id = PyLong_AsLongLong(PyTuple_GET_ITEM(lora, 4));
    if (PyErr_Occurred()) return false;
  }
  if (salt != Py_None) {
    if (!PyTuple_Check(salt) || PyTuple_GET_SIZE(salt) != 2) {
      PyErr_SetString(PyExc_TypeError, "salt must be (bytes, key)");
      return false;
    }
    s.has_salt = true;
    if (!parse_str(PyTuple_GET_ITEM(salt, 0), PyTuple_GET_ITEM(salt, 1), s.salt)) return false;
  }
  return true;
}

// The value of an exact int that fits in 60 bits, read without a call (the common token id).
inline bool small_int(PyObject* o, int64_t* v) {
#if PY_VERSION_HEX >= 0x030C0000
  if (!PyUnstable_Long_IsCompact(reinterpret_cast<PyLongObject*>(o))) return false;
  *v = PyUnstable_Long_CompactValue(reinterpret_cast<PyLongObject*>(o));
  return true;
#else
  const Py_ssize_t size = Py_SIZE(o);
  const digit* d = reinterpret_cast<PyLongObject*>(o)->ob_digit;
  if (size == 0) *v = 0;
  else if (size == 1) *v = d[0];
  else if (size == 2) *v = static_cast<int64_t>(d[0]) | (static_cast<int64_t>(d[1]) << PyLong_SHIFT);
  else if (size == -1) *v = -static_cast<int64_t>(d[0]);
  else return false;
  return true;
#endif
}

// Read tokens items[from:to] (exact ints; [0, 2**63-1] unless allow_any) into out (may be null:
// validate only). Returns 1 ok, 0 when a valid token does not fit int64, -1 with an exception set.
int read_tokens(PyObject** items, Py_ssize_t from, Py_ssize_t to, bool allow_any, int64_t* out) {
  int ok = 1;
  for (Py_ssize_t i = from; i < to; ++i) {
    PyObject* item = items[i];
    if (!PyLong_CheckExact(item)) {
      PyErr_Format(PyExc_ValueError, "tokens[%zd] must be an int token id, got %R", i, item);
      return -1;
    }
    int64_t v;
    int overflow = 0;
    if (!small_int(item, &v)) {
      v = PyLong_AsLongLongAndOverflow(item, &overflow);
      if (v == -1 && PyErr_Occurred()) return -1;
    }
    if (!allow_any && (overflow != 0 || v < 0)) {
      PyErr_Format(PyExc_ValueError,
                   "tokens[%zd] must be a token id in [0, 2**63-1], got %R (pass "
                   "allow_any_token_id=True to hash what vLLM's hasher would)",
                   i, item);
      return -1;
    }
    if (overflow != 0) ok = 0;
    if (out != nullptr) out[i - from] = v;
  }
  return ok;
}

void digest(int fn, const char* data, size_t size, unsigned char* out, size_t* out_len) {
  if (fn <= 1) {
    SHA256_CTX ctx;
    SHA256_Init(&ctx);
    SHA256_Update(&ctx, data, size);
    SHA256_Final(out, &ctx);
    *out_len = 32;
  } else {
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(data, size));
    std::memcpy(out, c.digest, 16);
    *out_len = 16;
  }
}

PyObject* hash_blocks(PyObject*, PyObject* args) {
  PyObject *tokens_obj, *parent_obj, *mm, *lora, *salt, *embeds;
  Py_ssize_t validate_from, start, nblocks, bs, la, mm_idx;
  int allow_any, fn, flags;
  if (!PyArg_ParseTuple(args, "OnpnnnniiOOnOOO", &tokens_obj, &validate_from, &allow_any, &start,
                        &nblocks, &bs, &la, &fn, &flags, &parent_obj, &mm, &mm_idx, &lora, &salt,
                        &embeds))
    return nullptr;
  Spec s;
  s.fn = fn;
  s.mm_key = static_cast<MMKey>(flags & 3);
  s.inclusive = (flags & 4) != 0;
  s.lora_key = static_cast<LoraKey>((flags >> 3) & 3);
  s.salt_tagged = (flags & 32) != 0;
  s.embeds_tagged = (flags & 64) != 0;
  if (!parse_spec(mm, lora, salt, s)) return nullptr;
  const bool has_embeds = embeds != Py_None;
  if (has_embeds && (!PyList_Check(embeds) || PyList_GET_SIZE(embeds) != nblocks)) {
    PyErr_SetString(PyExc_TypeError, "embeds must be a list with one digest per block");
    return nullptr;
  }
  char* parent_p;
  Py_ssize_t parent_n;
  if (PyBytes_AsStringAndSize(parent_obj, &parent_p, &parent_n) < 0) return nullptr;

  if (!PyList_Check(tokens_obj)) {
    PyErr_SetString(PyExc_TypeError, "tokens must be a list");
    return nullptr;
  }
  // The list is only read, and nothing here runs Python code, so its items stay put.
  PyObject** items = PySequence_Fast_ITEMS(tokens_obj);
  const Py_ssize_t ntok = PyList_GET_SIZE(tokens_obj);
  const Py_ssize_t lo = start, hi = start + nblocks * bs + (nblocks ? la : 0);
  if (hi > ntok || lo < 0) {
    PyErr_SetString(PyExc_ValueError, "block range outside tokens");
    return nullptr;
  }
  // Tokens outside the hashed range are validated here; those inside, as each block reads them.
  int conv = read_tokens(items, validate_from < lo ? validate_from : lo, lo, allow_any != 0, nullptr);
  if (conv == 1) conv = read_tokens(items, hi > validate_from ? hi : validate_from, ntok,
                                    allow_any != 0, nullptr);
  if (conv < 0) return nullptr;
  if (conv == 0) Py_RETURN_NONE;  // a huge int: the reference path writes LONG1 / bignums
  std::vector<int64_t> toks(static_cast<size_t>(bs + la));

  PyObject* result = PyList_New(nblocks);
  if (result == nullptr) return nullptr;
  // Upper bound of one block's serialization: 10 bytes per int, every string once, 48 per key.
  size_t strings = s.has_lora ? s.lora_name.n + s.lora_path.n : 0;
  strings += s.has_salt ? s.salt.n : 0;
  for (const auto& m : s.mm) strings += m.id.n;
  std::vector<char> buf(256 + 10 * static_cast<size_t>(bs + la) + strings + 48 * (s.mm.size() + 4));
  std::vector<Entry> entries;
  unsigned char prev[32];
  size_t prev_len = static_cast<size_t>(parent_n);
  std::memcpy(prev, parent_p, prev_len);
  const bool cbor = fn == 1 || fn == 3;

  for (Py_ssize_t b = 0; b < nblocks; ++b) {
    const int64_t bstart = start + b * bs;
    const int64_t bend = bstart + bs;
    const char* dig = nullptr;
    if (has_embeds) {
      PyObject* d = PyList_GET_ITEM(embeds, b);
      if (!PyBytes_Check(d) || PyBytes_GET_SIZE(d) != 32) {
        Py_DECREF(result);
        PyErr_SetString(PyExc_TypeError, "embeds digests must be 32-byte bytes");
        return nullptr;
      }
      dig = PyBytes_AS_STRING(d);
    }
    if (la == 0) {
      mm_idx = extra_entries(s, bstart, bend, mm_idx, has_embeds, entries);
    } else {
      mm_idx = extra_entries(s, bstart, bend + la, mm_idx, has_embeds, entries);
      while (mm_idx > 0 && s.mm[mm_idx - 1].end > bend) --mm_idx;
    }
    conv = read_tokens(items, bstart, bend + la, allow_any != 0, toks.data());
    if (conv <= 0) {
      Py_DECREF(result);
      if (conv < 0) return nullptr;
      Py_RETURN_NONE;
    }
    const int64_t* bt = toks.data();
    Out out{buf.data()};
    if (cbor) {
      CborWriter w(out);
      write_block(w, reinterpret_cast<const char*>(prev), prev_len, bt, bs, s, entries, dig,
                  bt + bs, la);
    } else {
      out.append("\x80\x05\x95\0\0\0\0\0\0\0\0", 11);
      PickleWriter w(out);
      write_block(w, reinterpret_cast<const char*>(prev), prev_len, bt, bs, s, entries, dig,
                  bt + bs, la);
      out.push_back('.');
      const uint64_t frame = static_cast<uint64_t>(out.p - buf.data()) - 11;
      if (frame >= 65536) {  // CPython would split frames here
        Py_DECREF(result);
        Py_RETURN_NONE;
      }
      for (int i = 0; i < 8; ++i) buf[3 + i] = static_cast<char>((frame >> (8 * i)) & 0xff);
    }
    digest(fn, buf.data(), static_cast<size_t>(out.p - buf.data()), prev, &prev_len);
    PyObject* h = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(prev), prev_len);
    if (h == nullptr) {
      Py_DECREF(result);
      return nullptr;
    }
    PyList_SET_ITEM(result, b, h);
  }
  return result;
}

PyMethodDef kMethods[] = {
    {"hash_blocks", hash_blocks, METH_VARARGS,
     "hash_blocks(tokens, validate_from, allow_any, start, nblocks, block_size, lookahead, fn, "
     "flags, parent, mm, mm_idx, lora, salt, embeds) -> list[bytes] | None"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_hashcore",
                       "C++ fast path of mmreuse.hashing (see hasher.py).", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__hashcore(void) { return PyModule_Create(&kModule); }
