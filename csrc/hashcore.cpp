// C++ fast path of mmreuse.hashing: vLLM's block-hash chain in one call.
//
// For each full block it writes exactly the bytes vLLM's hash function serializes
// for (parent_hash, tuple(block_tokens), extra_keys) -- pickle protocol 5 with
// CPython's memo (by object identity, emulated with identity keys computed in
// Python) or canonical CBOR -- and digests them with OpenSSL SHA-256 or XXH3-128.
// The extra keys follow vLLM's `_gen_mm_extra_hash_keys` walk literally, for the
// scheme encoded in `flags` (see mmreuse/hashing/hasher.py::_make_fast_spec).
// Anything it cannot write in one pickle frame makes it return None, and the
// Python reference path takes over. Token ids are read a chunk at a time and written
// eight at a time with AVX-512 VBMI2 where the CPU has it (checked at load; set_simd
// switches to the scalar writer, which tests compare against the reference).

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
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MMREUSE_X86 1
#endif

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
  // Pickle only: the key's bytes before its offset (or all of them, bare keys) when it is its
  // block's only extra key -- then no string is memoized before it (see write_extra).
  const char* head = nullptr;
  size_t head_n = 0;
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
    if (n == 32) {  // parent hashes and digests: a fixed-size copy, not a memmove call
      std::memcpy(p, src, 32);
    } else if (n == 16) {
      std::memcpy(p, src, 16);
    } else {
      std::memcpy(p, src, n);
    }
    p += n;
  }
};

inline void put_le(Out& b, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) b.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// One int as CPython's pickler writes it (protocol 5); returns the new end.
inline char* pickle_int(char* p, int64_t v) {
  if (static_cast<uint64_t>(v) <= 0x7fffffff) {
    // BININT1 / BININT2 / BININT without a data-dependent branch: token ids are random
    // across those ranges, and mispredictions cost more than the unconditional stores.
    const uint32_t u = static_cast<uint32_t>(v);
    const int cls = (u > 0xff) + (u > 0xffff);
    p[0] = "KMJ"[cls];
    p[1] = static_cast<char>(u);
    p[2] = static_cast<char>(u >> 8);
    p[3] = static_cast<char>(u >> 16);
    p[4] = static_cast<char>(u >> 24);
    return p + 2 + cls + (cls >> 1);  // 2, 3, 5 bytes
  }
  if (v >= INT32_MIN && v <= INT32_MAX) {
    const uint32_t u = static_cast<uint32_t>(static_cast<int32_t>(v));
    p[0] = 'J';
    std::memcpy(p + 1, &u, 4);  // little-endian, as x86-64 and aarch64 store it
    return p + 5;
  }
  // LONG1: minimal little-endian two's complement
  const uint64_t mag = v < 0 ? (~static_cast<uint64_t>(v) + 1) : static_cast<uint64_t>(v);
  const int nbits = 64 - __builtin_clzll(mag);
  int nbytes = nbits / 8 + 1;
  unsigned char tmp[9];
  for (int i = 0; i < nbytes; ++i)
    tmp[i] = i < 8 ? static_cast<unsigned char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff)
                   : (v < 0 ? 0xff : 0x00);
  if (v < 0 && nbytes > 1 && tmp[nbytes - 1] == 0xff && (tmp[nbytes - 2] & 0x80)) --nbytes;
  p[0] = '\x8a';
  p[1] = static_cast<char>(nbytes);
  std::memcpy(p + 2, tmp, nbytes);
  return p + 2 + nbytes;
}

inline char* pickle_ints_scalar(char* p, const int64_t* t, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p = pickle_int(p, t[i]);
  return p;
}

// A CBOR head (major type, argument) in its shortest form (canonical); returns the new end.
inline char* cbor_head(char* p, int major, uint64_t v) {
  const char m = static_cast<char>(major << 5);
  int n;
  if (v < 24) {
    *p = static_cast<char>(m | v);
    return p + 1;
  } else if (v <= 0xff) {
    *p = static_cast<char>(m | 24);
    n = 1;
  } else if (v <= 0xffff) {
    *p = static_cast<char>(m | 25);
    n = 2;
  } else if (v <= 0xffffffffULL) {
    *p = static_cast<char>(m | 26);
    n = 4;
  } else {
    *p = static_cast<char>(m | 27);
    n = 8;
  }
  for (int i = 0; i < n; ++i) p[1 + i] = static_cast<char>(v >> (8 * (n - 1 - i)));
  return p + 1 + n;
}

// One int as cbor2.dumps(canonical=True) writes it; returns the new end.
inline char* cbor_int(char* p, int64_t v) {
  if (static_cast<uint64_t>(v) <= 0xffffffffULL) {
    // Unsigned head without data-dependent branches (see pickle_int).
    const uint32_t u = static_cast<uint32_t>(v);
    const int cls = (u >= 24) + (u > 0xff) + (u > 0xffff);  // 0, 1, 2 or 3
    static constexpr int kBytes[4] = {0, 1, 2, 4};
    const int nbytes = kBytes[cls];
    const uint32_t be = __builtin_bswap32(
        static_cast<uint32_t>((static_cast<uint64_t>(u) << (8 * (4 - nbytes))) & 0xffffffffULL));
    p[0] = static_cast<char>(cls ? 0x17 + cls : u);
    std::memcpy(p + 1, &be, 4);
    return p + 1 + nbytes;
  }
  if (v >= 0) return cbor_head(p, 0, static_cast<uint64_t>(v));
  return cbor_head(p, 1, static_cast<uint64_t>(-1 - v));
}

inline char* cbor_ints_scalar(char* p, const int64_t* t, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p = cbor_int(p, t[i]);
  return p;
}

#ifdef MMREUSE_X86
// Eight token ids per step with AVX-512 VBMI2: each id becomes a 5-byte record -- a head byte
// and its 4 bytes (little-endian for pickle, big-endian for CBOR) -- by one two-source byte
// permute, and a compress keeps the bytes its encoding needs: pickle BININT1 / BININT2 / BININT
// (2, 3, 5 bytes), CBOR unsigned heads (1, 2, 3, 5 bytes). Ids the records cannot hold (pickle:
// outside [0, 2**31); CBOR: outside [0, 2**32)) take the scalar writer, eight at a time.
// Writes up to 64 bytes past the end it returns (the caller's buffer has that slack).
constexpr uint64_t repeat5(uint64_t bits) {
  uint64_t m = 0;
  for (int r = 0; r < 8; ++r) m |= bits << (5 * r);
  return m;
}
struct PermuteIndex {
  unsigned char b[64];
  constexpr explicit PermuteIndex(bool big_endian) : b{} {
    for (int j = 0; j < 40; ++j) {
      const int r = j / 5, k = j % 5;
      const int byte = big_endian ? 4 - k : k - 1;
      b[j] = static_cast<unsigned char>(k == 0 ? 64 + 4 * r : 4 * r + byte);  // 64+: the heads
    }
  }
};
constexpr PermuteIndex kPickleIndex{false}, kCborIndex{true};

template <bool kCbor>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2,bmi2,popcnt")))
char* write_ints_vbmi2(char* p, const int64_t* t, int64_t n) {
  constexpr auto scalar = kCbor ? cbor_ints_scalar : pickle_ints_scalar;
  const __m512i idx = _mm512_loadu_si512(kCbor ? kCborIndex.b : kPickleIndex.b);
  const __m512i limit = _mm512_set1_epi64(kCbor ? 0xffffffffLL : 0x7fffffffLL);
  const __m256i lim0 = _mm256_set1_epi32(23), lim1 = _mm256_set1_epi32(0xff),
                lim2 = _mm256_set1_epi32(0xffff);
  // pickle heads: 'K' (< 2**8), 'M' (< 2**16), 'J'; CBOR: the value itself (< 24), 0x18-0x1a.
  const __m256i h1 = _mm256_set1_epi32(kCbor ? 0x18 : 'K'),
                h2 = _mm256_set1_epi32(kCbor ? 0x19 : 'M'),
                h3 = _mm256_set1_epi32(kCbor ? 0x1a : 'J');
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m512i v = _mm512_loadu_si512(t + i);
    if (_mm512_cmple_epu64_mask(v, limit) != 0xff) {
      p = scalar(p, t + i, 8);
      continue;
    }
    const __m256i u = _mm512_cvtepi64_epi32(v);
    const __mmask8 k1 = _mm256_cmpgt_epu32_mask(u, lim1);
    const __mmask8 k2 = _mm256_cmpgt_epu32_mask(u, lim2);
    uint64_t keep;
    __m256i head;
    if constexpr (kCbor) {
      const __mmask8 k0 = _mm256_cmpgt_epu32_mask(u, lim0);
      head = _mm256_mask_mov_epi32(u, k0, h1);
      head = _mm256_mask_mov_epi32(head, k1, h2);
      head = _mm256_mask_mov_epi32(head, k2, h3);
      const uint64_t b12 = _pdep_u64(k2, repeat5(0b00010));
      keep = repeat5(0b00001) | _pdep_u64(k0, repeat5(0b10000)) |
             _pdep_u64(k1, repeat5(0b01000)) | b12 | (b12 << 1);
    } else {
      head = _mm256_mask_mov_epi32(h1, k1, h2);
      head = _mm256_mask_mov_epi32(head, k2, h3);
      const uint64_t b34 = _pdep_u64(k2, repeat5(0b01000));
      keep = repeat5(0b00011) | _pdep_u64(k1, repeat5(0b00100)) | b34 | (b34 << 1);
    }
    const __m512i rec = _mm512_permutex2var_epi8(_mm512_castsi256_si512(u), idx,
                                                 _mm512_castsi256_si512(head));
    _mm512_storeu_si512(p, _mm512_maskz_compress_epi8(keep, rec));
    p += _mm_popcnt_u64(keep);
  }
  return scalar(p, t + i, n - i);
}

bool detect_vbmi2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") &&
         __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("bmi2") &&
         __builtin_cpu_supports("popcnt");
}
const bool kHaveVbmi2 = detect_vbmi2();
#else
const bool kHaveVbmi2 = false;
#endif

// Whether token ids take the SIMD writer (tests switch it off to check the scalar one).
bool g_simd = kHaveVbmi2;

inline char* pickle_ints(char* p, const int64_t* t, int64_t n) {
#ifdef MMREUSE_X86
  if (g_simd) return write_ints_vbmi2<false>(p, t, n);
#endif
  return pickle_ints_scalar(p, t, n);
}

inline char* cbor_ints(char* p, const int64_t* t, int64_t n) {
#ifdef MMREUSE_X86
  if (g_simd) return write_ints_vbmi2<true>(p, t, n);
#endif
  return cbor_ints_scalar(p, t, n);
}

// CPython's _pickle.Pickler, protocol 5, for the types vLLM's keys use.
class PickleWriter {
 public:
  // The memo (identity key -> memo index) is the caller's, reused across blocks: no allocation
  // per block once it has grown.
  using Memo = std::vector<std::pair<long, uint32_t>>;
  PickleWriter(Out& b, Memo& memo) : b_(b), memo_(memo) { memo_.clear(); }

  void none() { b_.push_back('N'); }
  void raw(const char* p, size_t n) { b_.append(p, n); }

  void integer(int64_t v) { b_.p = pickle_int(b_.p, v); }
  void integers(const int64_t* t, int64_t n) { b_.p = pickle_ints(b_.p, t, n); }

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
  Memo& memo_;
  uint32_t next_ = 0;
};

// cbor2.dumps(obj, canonical=True) for the same types.
class CborWriter {
 public:
  explicit CborWriter(Out& b) : b_(b) {}
  void none() { b_.push_back('\xf6'); }
  void integer(int64_t v) { b_.p = cbor_int(b_.p, v); }
  void integers(const int64_t* t, int64_t n) { b_.p = cbor_ints(b_.p, t, n); }
  void str(const Str& s) {
    b_.p = cbor_head(b_.p, 3, static_cast<uint64_t>(s.n));
    b_.append(s.p, s.n);
  }
  void bytes(const char* p, size_t n) {
    b_.p = cbor_head(b_.p, 2, n);
    b_.append(p, n);
  }
  void tuple_begin(size_t n) { b_.p = cbor_head(b_.p, 4, n); }
  void tuple_end(size_t) {}

 private:
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
  if constexpr (std::is_same_v<W, PickleWriter>) {
    // The commonest key tuple -- one multimodal key, as in every block inside an image -- from
    // its pre-written head: the same bytes write_entry gives, as no string is memoized before
    // it in the block. Nothing after the extra keys reads the memo (ints and tuple ends only),
    // so the strings it memoizes need no record.
    if (entries.size() == 1 && entries[0].kind == Kind::kMM) {
      const MMItem& m = *entries[0].mm;
      w.raw(m.head, m.head_n);
      if (s.mm_key == MMKey::kBare) {
        w.raw("\x85\x94", 2);
      } else {
        w.integer(entries[0].rel);
        w.raw(s.mm_key == MMKey::kTagged ? "\x87\x94\x85\x94" : "\x86\x94\x85\x94", 4);
      }
      return;
    }
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
  w.integers(toks, bs);
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

// The common token id -- an exact int in [0, 2**30) -- read in a tight loop without a call or
// an error path. Writes items[from:to] to out until the first other item; returns its index
// (`to` when there is none). Everything else goes through read_tokens.
inline Py_ssize_t read_small_tokens(PyObject** items, Py_ssize_t from, Py_ssize_t to,
                                    int64_t* out) {
  Py_ssize_t i = from;
  for (; i < to; ++i) {
    PyObject* o = items[i];
    if (Py_TYPE(o) != &PyLong_Type) break;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact(reinterpret_cast<PyLongObject*>(o))) break;
    const int64_t v = PyUnstable_Long_CompactValue(reinterpret_cast<PyLongObject*>(o));
    if (v < 0) break;
    out[i - from] = v;
#else
    const Py_ssize_t size = Py_SIZE(o);  // 0 or 1 digit: [0, 2**30)
    if (static_cast<size_t>(size) > 1) break;
    out[i - from] = reinterpret_cast<PyLongObject*>(o)->ob_digit[0] & -static_cast<digit>(size);
#endif
  }
  return i;
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

// The digest of data as a new bytes object (written in place: no copy through a buffer).
PyObject* digest(int fn, const char* data, size_t size) {
  PyObject* h = PyBytes_FromStringAndSize(nullptr, fn <= 1 ? 32 : 16);
  if (h == nullptr) return nullptr;
  unsigned char* out = reinterpret_cast<unsigned char*>(PyBytes_AS_STRING(h));
  if (fn <= 1) {
    SHA256_CTX ctx;
    SHA256_Init(&ctx);
    SHA256_Update(&ctx, data, size);
    SHA256_Final(out, &ctx);
  } else {
    XXH128_canonicalFromHash(reinterpret_cast<XXH128_canonical_t*>(out), XXH3_128bits(data, size));
  }
  return h;
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
  // Tokens are read a chunk of whole blocks at a time (about kChunkTokens, in L1), by the
  // tight loop when they are all small ids, else block by block by read_tokens.
  constexpr Py_ssize_t kChunkTokens = 2048;
  const Py_ssize_t chunk_blocks = bs >= kChunkTokens ? 1 : kChunkTokens / bs;
  std::vector<int64_t> toks(static_cast<size_t>(chunk_blocks * bs + la));
  Py_ssize_t chunk_end = 0;  // first block past the current chunk
  bool chunk_small = false;
  int64_t chunk_start = 0;   // token index of toks[0]

  PyObject* result = PyList_New(nblocks);
  if (result == nullptr) return nullptr;
  // Upper bound of one block's serialization: 10 bytes per int, every string once, 48 per key.
  size_t strings = s.has_lora ? s.lora_name.n + s.lora_path.n : 0;
  strings += s.has_salt ? s.salt.n : 0;
  for (const auto& m : s.mm) strings += m.id.n;
  // + 64: the SIMD int writer stores whole 64-byte vectors.
  std::vector<char> buf(256 + 10 * static_cast<size_t>(bs + la) + strings +
                        48 * (s.mm.size() + 4) + 64);
  std::vector<Entry> entries;
  PickleWriter::Memo memo;
  // Pre-written heads of single-key blocks (see write_extra), each as write_entry writes it.
  std::vector<char> heads(s.mm.size() * 16 + strings + 16);
  if (!(fn == 1 || fn == 3)) {
    Out out{heads.data()};
    for (auto& m : s.mm) {
      const char* at = out.p;
      PickleWriter w(out, memo);
      if (s.mm_key == MMKey::kTagged) w.str(kTagMM);
      w.str(m.id);
      m.head = at;
      m.head_n = static_cast<size_t>(out.p - at);
    }
  }
  const char* prev = parent_p;  // the parent's bytes: the caller's, then each new hash's
  size_t prev_len = static_cast<size_t>(parent_n);
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
    if (b >= chunk_end) {
      chunk_end = b + chunk_blocks < nblocks ? b + chunk_blocks : nblocks;
      chunk_start = bstart;
      const Py_ssize_t stop = start + chunk_end * bs + la;
      chunk_small = read_small_tokens(items, bstart, stop, toks.data()) == stop;
    }
    const int64_t* bt;
    if (chunk_small) {
      bt = toks.data() + (bstart - chunk_start);
    } else {
      conv = read_tokens(items, bstart, bend + la, allow_any != 0, toks.data());
      if (conv <= 0) {
        Py_DECREF(result);
        if (conv < 0) return nullptr;
        Py_RETURN_NONE;
      }
      bt = toks.data();
    }
    Out out{buf.data()};
    if (cbor) {
      CborWriter w(out);
      write_block(w, prev, prev_len, bt, bs, s, entries, dig,
                  bt + bs, la);
    } else {
      out.append("\x80\x05\x95\0\0\0\0\0\0\0\0", 11);
      PickleWriter w(out, memo);
      write_block(w, prev, prev_len, bt, bs, s, entries, dig,
                  bt + bs, la);
      out.push_back('.');
      const uint64_t frame = static_cast<uint64_t>(out.p - buf.data()) - 11;
      if (frame >= 65536) {  // CPython would split frames here
        Py_DECREF(result);
        Py_RETURN_NONE;
      }
      for (int i = 0; i < 8; ++i) buf[3 + i] = static_cast<char>((frame >> (8 * i)) & 0xff);
    }
    PyObject* h = digest(fn, buf.data(), static_cast<size_t>(out.p - buf.data()));
    if (h == nullptr) {
      Py_DECREF(result);
      return nullptr;
    }
    PyList_SET_ITEM(result, b, h);
    prev = PyBytes_AS_STRING(h);
    prev_len = static_cast<size_t>(PyBytes_GET_SIZE(h));
  }
  return result;
}

PyObject* set_simd(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  const bool before = g_simd;
  g_simd = on != 0 && kHaveVbmi2;
  return PyBool_FromLong(before);
}

PyObject* simd_available(PyObject*, PyObject*) { return PyBool_FromLong(kHaveVbmi2); }

PyMethodDef kMethods[] = {
    {"hash_blocks", hash_blocks, METH_VARARGS,
     "hash_blocks(tokens, validate_from, allow_any, start, nblocks, block_size, lookahead, fn, "
     "flags, parent, mm, mm_idx, lora, salt, embeds) -> list[bytes] | None"},
    {"set_simd", set_simd, METH_O,
     "set_simd(on) -> bool: use the AVX-512 VBMI2 token writer where the CPU has it (default); "
     "returns the previous setting"},
    {"simd_available", simd_available, METH_NOARGS,
     "simd_available() -> bool: whether this CPU runs the AVX-512 VBMI2 token writer"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_hashcore",
                       "C++ fast path of mmreuse.hashing (see hasher.py).", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__hashcore(void) { return PyModule_Create(&kModule); }
