// C++ fast path of mmreuse.hashing: vLLM's block-hash chain in one call.
//
// For each full block it writes exactly the bytes vLLM's hash function serializes
// for (parent_hash, tuple(block_tokens), extra_keys) -- pickle protocol 5 with
// CPython's memo (by object identity, emulated with identity keys, see identity_key)
// or canonical CBOR -- and digests them with OpenSSL SHA-256 or XXH3-128.
// The extra keys follow vLLM's `_gen_mm_extra_hash_keys` walk literally.
//
// Python sees three things (mmreuse/hashing/hasher.py):
// - HashSpec: one hasher's configuration (hash function, block size, lookahead, NONE_HASH, the
//   scheme's key shapes, by name), validated once when the BlockHasher is built;
// - HashSpec.request(mm, lora, salt) -> RequestKeys: one request's extra-key material, parsed
//   and pre-serialized once per request (None where only the reference path can hash it);
// - RequestKeys.hash_blocks(tokens, prior, validate_from, embeds): the hashes of the full
//   blocks after `prior`, the token ids read from a list of ints or, in place, from an int32 /
//   int64 buffer (vLLM 0.34's TokenBuffer; see TokenSource).
// The name tables below are the only mapping from scheme names to the ids used here; the module
// exports them (HASH_FUNCTIONS, MM_KEYS, ...) with the size limits, so Python never restates them.
// Anything it cannot write in one pickle frame makes hash_blocks return None, and the Python
// reference path takes over. Token ids are read a chunk at a time and written eight at a time
// with AVX-512 VBMI2 where the CPU has it (checked at load; set_simd switches to the scalar
// writer, which tests compare against the reference).
//
// Build with MMREUSE_DEBUG=1 (setup.py) for -O0 -g and MMREUSE_DCHECK bound checks on every
// write into the output buffers.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

// SHA256_Init/Update/Final: OpenSSL 3's low-level API (deprecated, still shipped) costs ~90 ns for
// a 112-byte block here; SHA256() and EVP_Digest go through EVP and cost ~300-350 ns.
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/sha.h>

#define XXH_INLINE_ALL
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "third_party/xxhash/xxhash.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MMREUSE_X86 1
#endif

// Debug-build invariant check: aborts with the condition and its place; a no-op in release.
#ifdef MMREUSE_DEBUG
#define MMREUSE_DCHECK(cond) \
  ((cond) ? static_cast<void>(0) : mmreuse_dcheck_failed(#cond, __FILE__, __LINE__))
[[noreturn]] static void mmreuse_dcheck_failed(const char* cond, const char* file, int line) {
  std::fprintf(stderr, "mmreuse._hashcore: MMREUSE_DCHECK(%s) failed at %s:%d\n", cond, file, line);
  std::abort();
}
constexpr bool kDebugBuild = true;
#else
#define MMREUSE_DCHECK(cond) static_cast<void>(0)
constexpr bool kDebugBuild = false;
#endif

namespace {

// ---- limits and name tables (exported to Python) ----------------------------------------------

// Pickle frames are split at 64 KiB; the fast path writes one frame, so larger blocks go the
// reference way (vLLM's edge vectors include a 20,000-token block).
constexpr int64_t kMaxBlockTokens = 4096;
constexpr int64_t kMaxLookahead = 4096;
// Identifier / LoRA / salt UTF-8 bytes of one request beyond which a block could exceed a frame.
constexpr size_t kMaxKeyBytes = 16384;
// NONE_HASH and parent hashes: digests (16 / 32 bytes) or os.urandom(32).
constexpr Py_ssize_t kMaxParentBytes = 64;
// The most bytes one int64 takes: pickle LONG1 (2 + 8), CBOR head (1 + 8); the writers store up
// to that many even for shorter encodings.
constexpr size_t kMaxIntBytes = 10;
// The SIMD token writer stores whole 64-byte vectors.
constexpr size_t kSimdSlack = 64;

enum class Fn { kSha256 = 0, kSha256Cbor = 1, kXxhash = 2, kXxhashCbor = 3 };
enum class MMKey { kTagged = 0, kPair = 1, kBare = 2 };
enum class LoraKey { kTagged = 0, kName = 1, kIntId = 2 };
enum class EmbedsKey { kTagged = 0, kBare = 1, kRaw = 2, kNone = 3 };  // kNone: Python None

// Index = the enum value above (ids never leave this file; Python passes and reads names).
constexpr const char* kHashFns[] = {"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"};
constexpr const char* kMMKeys[] = {"tagged", "pair", "bare"};
constexpr const char* kMMBounds[] = {"exclusive", "inclusive"};
constexpr const char* kLoraKeys[] = {"tagged", "name", "int_id"};
constexpr const char* kSaltKeys[] = {"tagged", "bare"};
constexpr const char* kEmbedsKeys[] = {"tagged", "bare", "raw"};
constexpr const char* kIncrementalMM[] = {"window", "last"};
template <size_t N>
constexpr int count(const char* const (&)[N]) {
  return static_cast<int>(N);
}

inline bool is_cbor(Fn f) { return f == Fn::kSha256Cbor || f == Fn::kXxhashCbor; }
inline bool is_sha(Fn f) { return f == Fn::kSha256 || f == Fn::kSha256Cbor; }

// mmreuse.errors.InvalidArgument / InvalidArgumentType (set at import).
PyObject* g_invalid_argument = nullptr;
PyObject* g_invalid_argument_type = nullptr;

// ---- owned references -------------------------------------------------------------------------

// One owned PyObject reference, released when it goes out of scope.
class PyRef {
 public:
  PyRef() = default;
  explicit PyRef(PyObject* o) : o_(o) {}  // steals o (may be null)
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  PyRef(PyRef&& other) noexcept : o_(other.release()) {}
  PyRef& operator=(PyRef&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  ~PyRef() { Py_XDECREF(o_); }
  static PyRef borrow(PyObject* o) {
    Py_XINCREF(o);
    return PyRef(o);
  }
  PyObject* get() const { return o_; }
  explicit operator bool() const { return o_ != nullptr; }
  PyObject* release() {
    PyObject* o = o_;
    o_ = nullptr;
    return o;
  }
  void reset(PyObject* o = nullptr) {
    PyObject* old = o_;
    o_ = o;
    Py_XDECREF(old);
  }

 private:
  PyObject* o_ = nullptr;
};

// ---- argument checks (never trust the caller) ---------------------------------------------

// An exact int (never a bool) in [lo, hi], else InvalidArgument(Type) naming `field`.
bool get_int(const char* field, PyObject* v, int64_t lo, int64_t hi, int64_t* out) {
  if (!PyLong_Check(v) || PyBool_Check(v)) {
    PyErr_Format(g_invalid_argument_type, "%s must be an int, got %s %R", field,
                 Py_TYPE(v)->tp_name, v);
    return false;
  }
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (x == -1 && PyErr_Occurred()) return false;
  if (overflow != 0 || x < lo || x > hi) {
    PyErr_Format(g_invalid_argument, "%s must be in [%lld, %lld], got %R", field,
                 static_cast<long long>(lo), static_cast<long long>(hi), v);
    return false;
  }
  *out = x;
  return true;
}

// The index of str `v` in `names` (or `none_index` for None where that is >= 0), else -1 with
// InvalidArgument(Type) set.
template <size_t N>
int get_name(const char* field, PyObject* v, const char* const (&names)[N], int none_index = -1) {
  if (v == Py_None && none_index >= 0) return none_index;
  if (!PyUnicode_Check(v)) {
    PyErr_Format(g_invalid_argument_type, "%s must be a str, got %s %R", field, Py_TYPE(v)->tp_name,
                 v);
    return -1;
  }
  for (size_t i = 0; i < N; ++i) {
    if (PyUnicode_CompareWithASCIIString(v, names[i]) == 0) return static_cast<int>(i);
  }
  std::string accepted = none_index >= 0 ? "None" : "";
  for (size_t i = 0; i < N; ++i) {
    if (!accepted.empty()) accepted += ", ";
    accepted += '\'';
    accepted += names[i];
    accepted += '\'';
  }
  PyErr_Format(g_invalid_argument, "%s must be one of (%s), got %R", field, accepted.c_str(), v);
  return -1;
}

// ---- serialization ------------------------------------------------------------------------

// Identity keys of vLLM's literal tag strings (see identity_key for the others).
constexpr long kKeyMM = 1, kKeyLora = 2, kKeySalt = 3, kKeyEmbeds = 4;
constexpr long kKeyEmpty = 99, kKeyLatin1 = 100, kKeyFirstFresh = 1000;

struct Str {
  const char* p = nullptr;
  Py_ssize_t n = 0;
  long key = 0;  // equal for two strings iff vLLM's pickler sees one object
};

const Str kTagMM{"mm", 2, kKeyMM};
const Str kTagLora{"lora", 4, kKeyLora};
const Str kTagSalt{"cache_salt", 10, kKeySalt};
const Str kTagEmbeds{"prompt_embeds", 13, kKeyEmbeds};

// Pickle memoizes by object identity. In vLLM every request string is a fresh object (msgspec
// decodes each) except CPython's cached empty and one-Latin-1-character strings; the literal
// tags are code constants. `fresh` counts the fresh strings of one request.
long identity_key(PyObject* s, long& fresh) {
  const Py_ssize_t len = PyUnicode_GET_LENGTH(s);
  if (len == 0) return kKeyEmpty;
  if (len == 1) {
    const Py_UCS4 c = PyUnicode_READ_CHAR(s, 0);
    if (c < 256) return kKeyLatin1 + static_cast<long>(c);
  }
  return kKeyFirstFresh + ++fresh;
}

// An output cursor into a buffer sized in advance (see block_bound): no checks per byte in
// release builds; debug builds check every write against `end`.
struct Out {
  char* p;
  const char* end;
  void need([[maybe_unused]] size_t n) const {
    MMREUSE_DCHECK(p <= end && static_cast<size_t>(end - p) >= n);
  }
  void push_back(char c) {
    need(1);
    *p++ = c;
  }
  void append(const char* src, size_t n) {
    need(n);
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

// One int as CPython's pickler writes it (protocol 5); returns the new end. Stores up to
// kMaxIntBytes bytes at p.
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
  MMREUSE_DCHECK(nbytes <= 8);
  p[0] = '\x8a';
  p[1] = static_cast<char>(nbytes);
  std::memcpy(p + 2, tmp, nbytes);
  return p + 2 + nbytes;
}

inline char* pickle_ints_scalar(char* p, [[maybe_unused]] const char* end, const int64_t* t,
                                int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    MMREUSE_DCHECK(p <= end && static_cast<size_t>(end - p) >= kMaxIntBytes);
    p = pickle_int(p, t[i]);
  }
  return p;
}

// A CBOR head (major type, argument) in its shortest form (canonical); returns the new end.
// Stores up to 9 bytes at p.
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

// One int as cbor2.dumps(canonical=True) writes it; returns the new end. Stores up to 9 bytes.
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

inline char* cbor_ints_scalar(char* p, [[maybe_unused]] const char* end, const int64_t* t,
                              int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    MMREUSE_DCHECK(p <= end && static_cast<size_t>(end - p) >= kMaxIntBytes);
    p = cbor_int(p, t[i]);
  }
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
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2,bmi2,popcnt"))) char*
write_ints_vbmi2(char* p, const char* end, const int64_t* t, int64_t n) {
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
      p = scalar(p, end, t + i, 8);
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
      keep = repeat5(0b00001) | _pdep_u64(k0, repeat5(0b10000)) | _pdep_u64(k1, repeat5(0b01000)) |
             b12 | (b12 << 1);
    } else {
      head = _mm256_mask_mov_epi32(h1, k1, h2);
      head = _mm256_mask_mov_epi32(head, k2, h3);
      const uint64_t b34 = _pdep_u64(k2, repeat5(0b01000));
      keep = repeat5(0b00011) | _pdep_u64(k1, repeat5(0b00100)) | b34 | (b34 << 1);
    }
    const __m512i rec =
        _mm512_permutex2var_epi8(_mm512_castsi256_si512(u), idx, _mm512_castsi256_si512(head));
    MMREUSE_DCHECK(p <= end && static_cast<size_t>(end - p) >= kSimdSlack);
    _mm512_storeu_si512(p, _mm512_maskz_compress_epi8(keep, rec));
    p += _mm_popcnt_u64(keep);
  }
  return scalar(p, end, t + i, n - i);
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

inline char* pickle_ints(char* p, const char* end, const int64_t* t, int64_t n) {
#ifdef MMREUSE_X86
  if (g_simd) return write_ints_vbmi2<false>(p, end, t, n);
#endif
  return pickle_ints_scalar(p, end, t, n);
}

inline char* cbor_ints(char* p, const char* end, const int64_t* t, int64_t n) {
#ifdef MMREUSE_X86
  if (g_simd) return write_ints_vbmi2<true>(p, end, t, n);
#endif
  return cbor_ints_scalar(p, end, t, n);
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

  void integer(int64_t v) {
    b_.need(kMaxIntBytes);
    b_.p = pickle_int(b_.p, v);
  }
  void integers(const int64_t* t, int64_t n) { b_.p = pickle_ints(b_.p, b_.end, t, n); }

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
    b_.append(s.p, static_cast<size_t>(s.n));
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
  void integer(int64_t v) {
    b_.need(kMaxIntBytes);
    b_.p = cbor_int(b_.p, v);
  }
  void integers(const int64_t* t, int64_t n) { b_.p = cbor_ints(b_.p, b_.end, t, n); }
  void str(const Str& s) {
    head(3, static_cast<uint64_t>(s.n));
    b_.append(s.p, static_cast<size_t>(s.n));
  }
  void bytes(const char* p, size_t n) {
    head(2, n);
    b_.append(p, n);
  }
  void tuple_begin(size_t n) { head(4, n); }
  void tuple_end(size_t) {}

 private:
  void head(int major, uint64_t v) {
    b_.need(9);
    b_.p = cbor_head(b_.p, major, v);
  }
  Out& b_;
};

// ---- one hasher's configuration (HashSpec) ----------------------------------------------------

struct Config {
  Fn fn = Fn::kSha256;
  int64_t block_size = 16;
  int64_t lookahead = 0;
  MMKey mm_key = MMKey::kTagged;
  bool inclusive = false;  // mm_bounds == "inclusive"
  LoraKey lora_key = LoraKey::kTagged;
  bool salt_tagged = true;
  EmbedsKey embeds_key = EmbedsKey::kTagged;
  bool incremental_last = false;  // incremental_mm == "last"
  bool allow_any = false;         // allow_any_token_id
};

struct HashSpecObject {
  PyObject_HEAD Config cfg;
  PyObject* none_hash;  // owned bytes
};

// ---- one request's extra keys (RequestKeys) ---------------------------------------------------

struct MMItem {
  Str id;
  int64_t offset;
  int64_t end;
  // Pickle only: the key's bytes before its offset (or all of them, bare keys) when it is its
  // block's only extra key -- then no string is memoized before it (see write_extra).
  const char* head = nullptr;
  size_t head_n = 0;
};

struct Keys {
  std::vector<MMItem> mm;
  std::vector<char> heads;  // the MMItem heads
  std::vector<PyRef> strs;  // the str objects whose UTF-8 the Strs point into
  bool has_lora = false;
  Str lora_name, lora_path;
  int64_t lora_int_id = 0;
  bool has_salt = false;
  Str salt;
  size_t key_bytes = 0;  // UTF-8 bytes of every string above
};

struct RequestKeysObject {
  PyObject_HEAD PyObject* spec;  // owned HashSpecObject
  Keys* keys;                    // owned
};

enum class Kind { kLora, kMM, kSalt, kEmbeds };
struct Entry {
  Kind kind;
  const MMItem* mm;
  int64_t rel;
};

// vLLM's _gen_mm_extra_hash_keys + generate_block_hash_extra_keys ordering.
Py_ssize_t extra_entries(const Config& c, const Keys& k, int64_t start, int64_t end, Py_ssize_t idx,
                         bool has_embeds, std::vector<Entry>& out) {
  out.clear();
  if (k.has_lora) out.push_back({Kind::kLora, nullptr, 0});
  const Py_ssize_t n = static_cast<Py_ssize_t>(k.mm.size());
  if (n > 0) {
    const int64_t last_end = k.mm[n - 1].end;
    const bool done = c.inclusive ? (last_end < start) : (last_end <= start);
    if (!done) {
      if (idx < 0) idx += n;
      MMREUSE_DCHECK(idx >= 0);
      while (idx < n) {
        const MMItem& m = k.mm[idx];
        if (end > m.offset) {
          const bool passed = c.inclusive ? (start > m.end) : (start >= m.end);
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
  if (start == 0 && k.has_salt) out.push_back({Kind::kSalt, nullptr, 0});
  if (has_embeds) out.push_back({Kind::kEmbeds, nullptr, 0});
  return idx;
}

// Where a call starting at token `start` begins its mm scan: vLLM's get_mm_features_in_window
// (first item ending after start) or, for the older schemes, the last item (`curr_mm_idx = -1`).
Py_ssize_t initial_mm_idx(const Config& c, const Keys& k, int64_t start) {
  if (start == 0 || k.mm.empty()) return 0;
  if (c.incremental_last) return -1;
  if (k.mm.back().end <= start) return 0;
  const auto it = std::upper_bound(k.mm.begin(), k.mm.end(), start,
                                   [](int64_t s, const MMItem& m) { return s < m.end; });
  return static_cast<Py_ssize_t>(it - k.mm.begin());
}

template <class W>
void write_entry(W& w, const Config& c, const Keys& k, const Entry& e, const char* embeds_digest) {
  switch (e.kind) {
    case Kind::kLora:
      if (c.lora_key == LoraKey::kTagged) {
        w.tuple_begin(3);
        w.str(kTagLora);
        w.str(k.lora_name);
        w.str(k.lora_path);
        w.tuple_end(3);
      } else if (c.lora_key == LoraKey::kName) {
        w.str(k.lora_name);
      } else {
        w.integer(k.lora_int_id);
      }
      break;
    case Kind::kMM:
      if (c.mm_key == MMKey::kTagged) {
        w.tuple_begin(3);
        w.str(kTagMM);
        w.str(e.mm->id);
        w.integer(e.rel);
        w.tuple_end(3);
      } else if (c.mm_key == MMKey::kPair) {
        w.tuple_begin(2);
        w.str(e.mm->id);
        w.integer(e.rel);
        w.tuple_end(2);
      } else {
        w.str(e.mm->id);
      }
      break;
    case Kind::kSalt:
      if (c.salt_tagged) {
        w.tuple_begin(2);
        w.str(kTagSalt);
        w.str(k.salt);
        w.tuple_end(2);
      } else {
        w.str(k.salt);
      }
      break;
    case Kind::kEmbeds:
      if (c.embeds_key == EmbedsKey::kTagged) {
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
void write_extra(W& w, const Config& c, const Keys& k, const std::vector<Entry>& entries,
                 const char* digest) {
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
      if (c.mm_key == MMKey::kBare) {
        w.raw("\x85\x94", 2);
      } else {
        w.integer(entries[0].rel);
        w.raw(c.mm_key == MMKey::kTagged ? "\x87\x94\x85\x94" : "\x86\x94\x85\x94", 4);
      }
      return;
    }
  }
  w.tuple_begin(entries.size());
  for (const auto& e : entries) write_entry(w, c, k, e, digest);
  w.tuple_end(entries.size());
}

// Serialize (parent, tuple(tokens[b:b+bs]), extra) -- vLLM's hash_block_tokens input.
template <class W>
void write_block(W& w, const Config& c, const Keys& k, const char* parent, size_t parent_len,
                 const int64_t* toks, const std::vector<Entry>& entries, const char* digest) {
  const int64_t bs = c.block_size, la = c.lookahead;
  w.tuple_begin(3);
  w.bytes(parent, parent_len);
  w.tuple_begin(static_cast<size_t>(bs));
  w.integers(toks, bs);
  w.tuple_end(static_cast<size_t>(bs));
  if (la == 0) {
    write_extra(w, c, k, entries, digest);
  } else {
    w.tuple_begin(static_cast<size_t>(1 + la));
    write_extra(w, c, k, entries, digest);
    for (int64_t i = 0; i < la; ++i) w.integer(toks[bs + i]);
    w.tuple_end(static_cast<size_t>(1 + la));
  }
  w.tuple_end(3);
}

// Upper bound of one block's serialization (pickle or CBOR), with every size already bounded
// by HashSpec / request(): block_size, lookahead <= 4096, key bytes <= kMaxKeyBytes, parent
// <= kMaxParentBytes, so the sum cannot overflow.
size_t block_bound(const Config& c, const Keys& k) {
  constexpr size_t kContainer = 16;  // a tuple's opening and closing opcodes / a CBOR head
  constexpr size_t kStrHead = 16;    // a str or bytes header, its memo put or get
  const size_t ints = static_cast<size_t>(c.block_size + c.lookahead);
  // Items overlapping one block (lookahead included): each has length >= 1 and none overlap,
  // so at most ints of them, plus one ending at the block start (inclusive bounds).
  const size_t items = std::min(k.mm.size(), ints + 2);
  const size_t entry = kContainer + 2 * kStrHead + 2 + kMaxIntBytes;  // ("mm", id, off), no id
  return 12                                                           // frame header, STOP
         + 3 * kContainer                                  // the outer, token and lookahead tuples
         + kStrHead + kMaxParentBytes                      // parent
         + kMaxIntBytes * ints                             // tokens and lookahead tokens
         + kContainer                                      // the extra-keys tuple
         + items * entry + k.key_bytes                     // mm keys, each string at most once
         + (kContainer + 3 * kStrHead + 4 + kMaxIntBytes)  // LoRA key, tag
         + (kContainer + 2 * kStrHead + 10)                // salt key, tag
         + (kContainer + 2 * kStrHead + 13 + 32)           // embeds key, tag
         + kSimdSlack;
}

// ---- token ids: a list of ints or a buffer of int32 / int64 -----------------------------------

// The common list item -- an exact int in [0, 2**30) -- read in a tight loop without a call or
// an error path. Writes items[from:to] to out until the first other item; returns its index
// (`to` when there is none). Everything else goes through read_list_tokens.
inline Py_ssize_t read_small_list(PyObject* const* items, Py_ssize_t from, Py_ssize_t to,
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

// The value of an exact int that fits in 60 bits, read without a call.
inline bool small_int(PyObject* o, int64_t* v) {
#if PY_VERSION_HEX >= 0x030C0000
  if (!PyUnstable_Long_IsCompact(reinterpret_cast<PyLongObject*>(o))) return false;
  *v = PyUnstable_Long_CompactValue(reinterpret_cast<PyLongObject*>(o));
  return true;
#else
  const Py_ssize_t size = Py_SIZE(o);
  const digit* d = reinterpret_cast<PyLongObject*>(o)->ob_digit;
  if (size == 0)
    *v = 0;
  else if (size == 1)
    *v = d[0];
  else if (size == 2)
    *v = static_cast<int64_t>(d[0]) | (static_cast<int64_t>(d[1]) << PyLong_SHIFT);
  else if (size == -1)
    *v = -static_cast<int64_t>(d[0]);
  else
    return false;
  return true;
#endif
}

// The end of the error for a token id below 0 (or beyond int64) where the spec allows none.
constexpr const char kAllowAnyHint[] =
    "(pass allow_any_token_id=True to hash what vLLM's hasher would)";

// Read list items[from:to] (exact ints; [0, 2**63-1] unless allow_any) into out (may be null:
// validate only). Returns 1 ok, 0 when a valid token does not fit int64, -1 with an exception set.
int read_list_tokens(PyObject* const* items, Py_ssize_t from, Py_ssize_t to, bool allow_any,
                     int64_t* out) {
  int ok = 1;
  for (Py_ssize_t i = from; i < to; ++i) {
    PyObject* item = items[i];
    if (!PyLong_CheckExact(item)) {
      PyErr_Format(g_invalid_argument_type, "tokens[%zd] must be an int token id, got %s %R", i,
                   Py_TYPE(item)->tp_name, item);
      return -1;
    }
    int64_t v;
    int overflow = 0;
    if (!small_int(item, &v)) {
      v = PyLong_AsLongLongAndOverflow(item, &overflow);
      if (v == -1 && PyErr_Occurred()) return -1;
    }
    if (!allow_any && (overflow != 0 || v < 0)) {
      PyErr_Format(g_invalid_argument, "tokens[%zd] must be a token id in [0, 2**63-1], got %R %s",
                   i, item, kAllowAnyHint);
      return -1;
    }
    if (overflow != 0) ok = 0;
    if (out != nullptr) out[i - from] = v;
  }
  return ok;
}

// One element of a buffer of T (the buffer need not be aligned for T).
template <class T>
inline int64_t load(const char* data, Py_ssize_t i) {
  T v;
  std::memcpy(&v, data + i * static_cast<Py_ssize_t>(sizeof(T)), sizeof(T));
  return static_cast<int64_t>(v);
}

// A buffer's ids [from, to) into out until the first negative one; returns its index (`to` when
// there is none). Branch-free over the chunk (it vectorizes), then a scan only where one is below
// 0. Every int32 / int64 fits the writers' int64.
template <class T>
Py_ssize_t read_small_buffer(const char* data, Py_ssize_t from, Py_ssize_t to, int64_t* out) {
  int64_t any = 0;
  for (Py_ssize_t i = from; i < to; ++i) {
    const int64_t v = load<T>(data, i);
    out[i - from] = v;
    any |= v;
  }
  if (any >= 0) return to;
  Py_ssize_t i = from;
  while (i < to && out[i - from] >= 0) ++i;
  return i;
}

// A buffer's ids [from, to) into out (may be null: validate only), each >= 0 unless allow_any.
// Returns 1 ok, -1 with an exception set (never 0: every id fits int64).
template <class T>
int read_buffer_tokens(const char* data, Py_ssize_t from, Py_ssize_t to, bool allow_any,
                       int64_t* out) {
  for (Py_ssize_t i = from; i < to; ++i) {
    const int64_t v = load<T>(data, i);
    if (!allow_any && v < 0) {
      PyErr_Format(g_invalid_argument,
                   "tokens[%zd] must be a token id in [0, 2**63-1], got %lld %s", i,
                   static_cast<long long>(v), kAllowAnyHint);
      return -1;
    }
    if (out != nullptr) out[i - from] = v;
  }
  return 1;
}

constexpr const char kTokensExpected[] =
    "tokens must be a list of int token ids or a 1-D C-contiguous buffer of signed 32- or 64-bit "
    "ints (array.array 'i' / 'l' / 'q', vLLM's TokenBuffer, numpy int32 / int64)";

// The element size of a buffer format that is one native-order signed int of 4 or 8 bytes
// ('i', 'l', 'q', optionally after '@', '=' or the host's byte-order prefix), else 0.
Py_ssize_t int_format_size(const char* format) {
  if (format == nullptr) return 0;  // unsigned bytes
  const bool little = PY_LITTLE_ENDIAN != 0;
  bool standard = false;  // '=', '<', '>', '!': standard sizes ('l' is 4 bytes)
  if (*format == '@') {
    ++format;
  } else if (*format == '=' || *format == (little ? '<' : '>') || (!little && *format == '!')) {
    standard = true;
    ++format;
  }
  if (format[0] == '\0' || format[1] != '\0') return 0;
  switch (format[0]) {
    case 'i':
      return standard ? 4 : static_cast<Py_ssize_t>(sizeof(int));
    case 'l':
      return standard ? 4 : static_cast<Py_ssize_t>(sizeof(long));
    case 'q':
      return 8;
    default:
      return 0;
  }
}

// Where hash_blocks reads its token ids from: a list of ints (vLLM up to 0.33's
// Request._all_token_ids) or any object exporting a 1-D C-contiguous buffer of signed 32- or
// 64-bit ints (0.34's TokenBuffer, array.array, numpy), read in place through the buffer
// protocol and released with the source, on every path. The block loop sees one interface:
// - read_small(from, to, out): the ids it can take without a check -- a list's exact ints in
//   [0, 2**30), a buffer's ids >= 0 -- into out until the first other one; returns its index.
// - read(from, to, allow_any, out): every id, checked (out may be null: validate only); 1 ok,
//   0 when a valid id does not fit int64 (a list's big int), -1 with an exception set.
// A list is read through its item array: the caller must not run Python code between open()
// and the last read (see hash_blocks_impl). A held buffer cannot be resized by its exporter.
class TokenSource {
 public:
  TokenSource() = default;
  TokenSource(const TokenSource&) = delete;
  TokenSource& operator=(const TokenSource&) = delete;
  ~TokenSource() {
    if (held_) PyBuffer_Release(&view_);
  }

  // `obj` is borrowed (the caller keeps it alive). False with InvalidArgumentType set for
  // anything else, naming its type and buffer format.
  bool open(PyObject* obj) {
    if (PyList_Check(obj)) {
      kind_ = Kind::kList;
      items_ = PySequence_Fast_ITEMS(obj);
      n_ = PyList_GET_SIZE(obj);
      return true;
    }
    if (!PyObject_CheckBuffer(obj)) {
      PyErr_Format(g_invalid_argument_type, "%s, got %s", kTokensExpected, Py_TYPE(obj)->tp_name);
      return false;
    }
    // PyBUF_ND: the exporter refuses unless it is C-contiguous (no strides to follow).
    if (PyObject_GetBuffer(obj, &view_, PyBUF_ND | PyBUF_FORMAT) < 0) return refuse(obj);
    held_ = true;
    const Py_ssize_t itemsize = int_format_size(view_.format);
    if (view_.ndim != 1 || view_.shape == nullptr || itemsize == 0 || itemsize != view_.itemsize ||
        view_.len != view_.shape[0] * itemsize) {
      PyErr_Format(g_invalid_argument_type, "%s, got %s of format '%s' (itemsize %zd, ndim %d)",
                   kTokensExpected, Py_TYPE(obj)->tp_name,
                   view_.format != nullptr ? view_.format : "B", view_.itemsize, view_.ndim);
      return false;
    }
    kind_ = itemsize == 4 ? Kind::kInt32 : Kind::kInt64;
    data_ = static_cast<const char*>(view_.buf);
    n_ = view_.shape[0];
    return true;
  }

  Py_ssize_t size() const { return n_; }

  Py_ssize_t read_small(Py_ssize_t from, Py_ssize_t to, int64_t* out) const {
    switch (kind_) {
      case Kind::kList:
        return read_small_list(items_, from, to, out);
      case Kind::kInt32:
        return read_small_buffer<int32_t>(data_, from, to, out);
      case Kind::kInt64:
        return read_small_buffer<int64_t>(data_, from, to, out);
    }
    return from;
  }

  int read(Py_ssize_t from, Py_ssize_t to, bool allow_any, int64_t* out) const {
    switch (kind_) {
      case Kind::kList:
        return read_list_tokens(items_, from, to, allow_any, out);
      case Kind::kInt32:
        return read_buffer_tokens<int32_t>(data_, from, to, allow_any, out);
      case Kind::kInt64:
        return read_buffer_tokens<int64_t>(data_, from, to, allow_any, out);
    }
    return -1;
  }

 private:
  enum class Kind { kList, kInt32, kInt64 };

  // A buffer the exporter would not give as C-contiguous (BufferError, or numpy's ValueError):
  // asked again with strides, only to name its format in the error. Other errors propagate.
  bool refuse(PyObject* obj) {
    if (!PyErr_ExceptionMatches(PyExc_BufferError) && !PyErr_ExceptionMatches(PyExc_ValueError))
      return false;
    PyErr_Clear();
    Py_buffer any;
    if (PyObject_GetBuffer(obj, &any, PyBUF_RECORDS_RO) < 0) {
      PyErr_Clear();
      PyErr_Format(g_invalid_argument_type, "%s, got %s whose buffer is not C-contiguous",
                   kTokensExpected, Py_TYPE(obj)->tp_name);
      return false;
    }
    PyErr_Format(g_invalid_argument_type,
                 "%s, got %s of format '%s' (ndim %d) that is not C-contiguous", kTokensExpected,
                 Py_TYPE(obj)->tp_name, any.format != nullptr ? any.format : "B", any.ndim);
    PyBuffer_Release(&any);
    return false;
  }

  Kind kind_ = Kind::kList;
  PyObject* const* items_ = nullptr;
  const char* data_ = nullptr;
  Py_ssize_t n_ = 0;
  Py_buffer view_{};
  bool held_ = false;
};

// The digest of data as a new bytes object (written in place: no copy through a buffer).
PyObject* digest(Fn fn, const char* data, size_t size) {
  PyObject* h = PyBytes_FromStringAndSize(nullptr, is_sha(fn) ? 32 : 16);
  if (h == nullptr) return nullptr;
  unsigned char* out = reinterpret_cast<unsigned char*>(PyBytes_AS_STRING(h));
  if (is_sha(fn)) {
    SHA256_CTX ctx;
    SHA256_Init(&ctx);
    SHA256_Update(&ctx, data, size);
    SHA256_Final(out, &ctx);
  } else {
    XXH128_canonicalFromHash(reinterpret_cast<XXH128_canonical_t*>(out), XXH3_128bits(data, size));
  }
  return h;
}

// A parent hash: bytes of 1..kMaxParentBytes bytes.
bool check_parent(const char* field, PyObject* v) {
  if (!PyBytes_Check(v)) {
    PyErr_Format(g_invalid_argument_type, "%s must be bytes, got %s %R", field, Py_TYPE(v)->tp_name,
                 v);
    return false;
  }
  const Py_ssize_t n = PyBytes_GET_SIZE(v);
  if (n < 1 || n > kMaxParentBytes) {
    PyErr_Format(g_invalid_argument, "%s must be 1 to %zd bytes, got %zd bytes", field,
                 kMaxParentBytes, n);
    return false;
  }
  return true;
}

// The hashes of the full blocks of `tokens` after `prior` (see kHashBlocksDoc). Errors raise;
// None means "the reference path must hash this".
PyObject* hash_blocks_impl(RequestKeysObject* self, PyObject* tokens_obj, PyObject* prior,
                           PyObject* validate_obj, PyObject* embeds) {
  const HashSpecObject* spec = reinterpret_cast<const HashSpecObject*>(self->spec);
  const Config& c = spec->cfg;
  const Keys& k = *self->keys;
  const int64_t bs = c.block_size, la = c.lookahead;
  MMREUSE_DCHECK(bs >= 1 && bs <= kMaxBlockTokens && la >= 0 && la <= kMaxLookahead);

  // The inputs are only read, and nothing below runs Python code before it is done with them:
  // errors format them, then return, and no object the cyclic GC tracks is allocated (on
  // CPython 3.11 that can run a collection, whose finalizers could change a list) until the
  // result list, built last. So a list's items, `prior` and `embeds` stay put.
  TokenSource src;
  if (!src.open(tokens_obj)) return nullptr;
  const Py_ssize_t ntok = src.size();

  // The chain so far: start after prior's blocks, from its last hash (or NONE_HASH).
  Py_ssize_t nprior = 0;
  PyObject* parent_obj = spec->none_hash;
  if (prior != Py_None) {
    if (!PyList_Check(prior)) {
      PyErr_Format(g_invalid_argument_type, "prior must be a list of block hashes or None, got %s",
                   Py_TYPE(prior)->tp_name);
      return nullptr;
    }
    nprior = PyList_GET_SIZE(prior);
    if (nprior > 0) {
      parent_obj = PyList_GET_ITEM(prior, nprior - 1);
      if (!check_parent("prior[-1]", parent_obj)) return nullptr;
    }
  }
  if (nprior > ntok / bs) {  // also keeps nprior * bs from overflowing
    PyErr_Format(g_invalid_argument,
                 "prior has %zd block hashes but tokens has only %zd tokens (block_size %lld)",
                 nprior, ntok, static_cast<long long>(bs));
    return nullptr;
  }
  const Py_ssize_t start = nprior * bs;
  const Py_ssize_t nblocks = ntok - la > start ? (ntok - la - start) / bs : 0;
  const Py_ssize_t hi = start + nblocks * bs + (nblocks ? la : 0);
  MMREUSE_DCHECK(hi <= ntok);

  int64_t validate_from = 0;
  if (validate_obj != nullptr && !get_int("validate_from", validate_obj, 0, ntok, &validate_from))
    return nullptr;

  const bool has_embeds = embeds != nullptr && embeds != Py_None;
  if (has_embeds) {
    if (c.embeds_key != EmbedsKey::kTagged && c.embeds_key != EmbedsKey::kBare) {
      PyErr_Format(g_invalid_argument,
                   "embeds given but this HashSpec's embeds_key (%s) has no per-block digest",
                   c.embeds_key == EmbedsKey::kRaw ? "'raw'" : "None");
      return nullptr;
    }
    if (!PyList_Check(embeds) || PyList_GET_SIZE(embeds) != nblocks) {
      PyErr_Format(g_invalid_argument_type,
                   "embeds must be a list with one digest per block (%zd), got %R", nblocks,
                   embeds);
      return nullptr;
    }
    for (Py_ssize_t b = 0; b < nblocks; ++b) {
      PyObject* d = PyList_GET_ITEM(embeds, b);
      if (!PyBytes_Check(d) || PyBytes_GET_SIZE(d) != 32) {
        PyErr_Format(g_invalid_argument_type, "embeds[%zd] must be a 32-byte digest, got %R", b, d);
        return nullptr;
      }
    }
  }

  // Tokens outside the hashed range are validated here; those inside, as each block reads them.
  const bool allow_any = c.allow_any;
  int conv = src.read(std::min<Py_ssize_t>(validate_from, start), start, allow_any, nullptr);
  if (conv == 1) conv = src.read(std::max<Py_ssize_t>(hi, validate_from), ntok, allow_any, nullptr);
  if (conv < 0) return nullptr;
  if (conv == 0) Py_RETURN_NONE;  // a huge int: the reference path writes LONG1 / bignums

  std::vector<PyRef> hashes;  // bytes objects, not tracked by the GC
  hashes.reserve(static_cast<size_t>(nblocks));
  // Tokens are read a chunk of whole blocks at a time (about kChunkTokens, in L1), by
  // read_small when they are all ids it takes unchecked, else block by block by read.
  constexpr Py_ssize_t kChunkTokens = 2048;
  const Py_ssize_t chunk_blocks = bs >= kChunkTokens ? 1 : kChunkTokens / bs;
  std::vector<int64_t> toks(static_cast<size_t>(chunk_blocks * bs + la));
  Py_ssize_t chunk_end = 0;  // first block past the current chunk
  bool chunk_small = false;
  int64_t chunk_start = 0;  // token index of toks[0]

  std::vector<char> buf(block_bound(c, k));
  const char* const buf_end = buf.data() + buf.size();
  std::vector<Entry> entries;
  PickleWriter::Memo memo;
  const char* prev = PyBytes_AS_STRING(parent_obj);  // the caller's, then each new hash's
  size_t prev_len = static_cast<size_t>(PyBytes_GET_SIZE(parent_obj));
  const bool cbor = is_cbor(c.fn);
  Py_ssize_t mm_idx = initial_mm_idx(c, k, start);

  for (Py_ssize_t b = 0; b < nblocks; ++b) {
    const int64_t bstart = start + b * bs;
    const int64_t bend = bstart + bs;
    const char* dig = has_embeds ? PyBytes_AS_STRING(PyList_GET_ITEM(embeds, b)) : nullptr;
    if (la == 0) {
      mm_idx = extra_entries(c, k, bstart, bend, mm_idx, has_embeds, entries);
    } else {
      mm_idx = extra_entries(c, k, bstart, bend + la, mm_idx, has_embeds, entries);
      while (mm_idx > 0 && k.mm[mm_idx - 1].end > bend) --mm_idx;
    }
    if (b >= chunk_end) {
      chunk_end = b + chunk_blocks < nblocks ? b + chunk_blocks : nblocks;
      chunk_start = bstart;
      const Py_ssize_t stop = start + chunk_end * bs + la;
      MMREUSE_DCHECK(stop <= ntok && static_cast<size_t>(stop - bstart) <= toks.size());
      chunk_small = src.read_small(bstart, stop, toks.data()) == stop;
    }
    const int64_t* bt;
    if (chunk_small) {
      bt = toks.data() + (bstart - chunk_start);
    } else {
      conv = src.read(bstart, bend + la, allow_any, toks.data());
      if (conv < 0) return nullptr;
      if (conv == 0) Py_RETURN_NONE;
      bt = toks.data();
    }
    Out out{buf.data(), buf_end};
    if (cbor) {
      CborWriter w(out);
      write_block(w, c, k, prev, prev_len, bt, entries, dig);
    } else {
      out.append("\x80\x05\x95\0\0\0\0\0\0\0\0", 11);
      PickleWriter w(out, memo);
      write_block(w, c, k, prev, prev_len, bt, entries, dig);
      out.push_back('.');
      const uint64_t frame = static_cast<uint64_t>(out.p - buf.data()) - 11;
      if (frame >= 65536) Py_RETURN_NONE;  // CPython would split frames here
      for (int i = 0; i < 8; ++i) buf[3 + i] = static_cast<char>((frame >> (8 * i)) & 0xff);
    }
    MMREUSE_DCHECK(out.p <= buf_end);
    PyObject* h = digest(c.fn, buf.data(), static_cast<size_t>(out.p - buf.data()));
    if (h == nullptr) return nullptr;
    hashes.emplace_back(h);
    prev = PyBytes_AS_STRING(h);
    prev_len = static_cast<size_t>(PyBytes_GET_SIZE(h));
  }
  PyObject* result = PyList_New(nblocks);  // no input is read after this
  if (result == nullptr) return nullptr;
  for (Py_ssize_t b = 0; b < nblocks; ++b) PyList_SET_ITEM(result, b, hashes[b].release());
  return result;
}

// C++ exceptions (std::bad_alloc, std::length_error) never cross into Python.
template <class F>
PyObject* guarded(F&& f) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_RuntimeError, "mmreuse._hashcore: %s", e.what());
    return nullptr;
  }
}

PyObject* keys_hash_blocks(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1 || nargs > 4) {
    PyErr_Format(PyExc_TypeError,
                 "hash_blocks(tokens, prior=None, validate_from=0, embeds=None) takes 1 to 4 "
                 "positional arguments, got %zd",
                 nargs);
    return nullptr;
  }
  return guarded([&] {
    return hash_blocks_impl(reinterpret_cast<RequestKeysObject*>(self), args[0],
                            nargs > 1 ? args[1] : Py_None, nargs > 2 ? args[2] : nullptr,
                            nargs > 3 ? args[3] : nullptr);
  });
}

void keys_dealloc(PyObject* o) {
  RequestKeysObject* self = reinterpret_cast<RequestKeysObject*>(o);
  PyTypeObject* tp = Py_TYPE(o);
  delete self->keys;
  Py_XDECREF(self->spec);
  tp->tp_free(o);
  Py_DECREF(tp);
}

PyObject* keys_num_mm(PyObject* o, void*) {
  return PyLong_FromSsize_t(
      static_cast<Py_ssize_t>(reinterpret_cast<RequestKeysObject*>(o)->keys->mm.size()));
}
PyObject* keys_spec(PyObject* o, void*) {
  return Py_NewRef(reinterpret_cast<RequestKeysObject*>(o)->spec);
}

constexpr const char kHashBlocksDoc[] =
    "hash_blocks(tokens, prior=None, validate_from=0, embeds=None, /) -> list[bytes] | None\n\n"
    "The hashes of the full blocks of `tokens` after the block hashes `prior` (None or a list:\n"
    "the chain continues from its last hash, else from NONE_HASH). `tokens` is a list of ints or\n"
    "a 1-D C-contiguous buffer of signed 32- / 64-bit ints (array.array 'i' / 'l' / 'q', vLLM's\n"
    "TokenBuffer, numpy int32 / int64), read in place. Tokens from `validate_from` on are\n"
    "checked; `embeds` is one 32-byte prompt-embeds digest per new block. None: only the\n"
    "reference path can hash this (an id beyond int64, a pickle frame over 64 KiB).";

PyMethodDef kKeysMethods[] = {
    {"hash_blocks", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(keys_hash_blocks)),
     METH_FASTCALL, kHashBlocksDoc},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef kKeysGetSet[] = {
    {"num_mm", keys_num_mm, nullptr, "number of multimodal occurrences", nullptr},
    {"spec", keys_spec, nullptr, "the HashSpec these keys were built for", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyType_Slot kKeysSlots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(keys_dealloc)},
    {Py_tp_methods, kKeysMethods},
    {Py_tp_getset, kKeysGetSet},
    {Py_tp_doc,
     const_cast<char*>("One request's extra-key material for one HashSpec (HashSpec.request).")},
    {0, nullptr}};

PyType_Spec kKeysSpec = {"mmreuse._hashcore.RequestKeys", sizeof(RequestKeysObject), 0,
                         Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, kKeysSlots};

PyTypeObject* g_keys_type = nullptr;

// A str's UTF-8 as a Str with its identity key; false (no exception) for lone surrogates.
bool take_str(Keys& k, PyObject* s, long& fresh, Str& out) {
  Py_ssize_t n;
  const char* p = PyUnicode_AsUTF8AndSize(s, &n);  // cached in s, which k.strs keeps alive
  if (p == nullptr) {
    PyErr_Clear();  // UnicodeEncodeError: pickle uses surrogatepass, leave it to the reference
    return false;
  }
  k.strs.push_back(PyRef::borrow(s));
  out.p = p;
  out.n = n;
  out.key = identity_key(s, fresh);
  k.key_bytes += static_cast<size_t>(n);
  return true;
}

bool check_str(const char* field, PyObject* v) {
  if (PyUnicode_Check(v)) return true;
  PyErr_Format(g_invalid_argument_type, "%s must be a str, got %s %R", field, Py_TYPE(v)->tp_name,
               v);
  return false;
}

PyObject* interned_identifier = nullptr;
PyObject* interned_offset = nullptr;
PyObject* interned_length = nullptr;

// Parse mm / lora / salt into k. Returns 1 ok, 0 for "reference path only", -1 with an error.
int parse_keys(const Config& c, PyObject* mm_obj, PyObject* lora, PyObject* salt, Keys& k) {
  long fresh = 0;
  // A tuple copy: attribute lookups below may run Python code, which must not resize it.
  PyRef mm(PySequence_Tuple(mm_obj));
  if (!mm) {
    PyErr_Clear();
    PyErr_Format(g_invalid_argument_type, "mm must be a sequence of MMOccurrence, got %s",
                 Py_TYPE(mm_obj)->tp_name);
    return -1;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(mm.get());
  k.mm.reserve(static_cast<size_t>(n));
  int64_t prev_end = 0;
  char field[48];
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyTuple_GET_ITEM(mm.get(), i);
    PyRef ident(PyObject_GetAttr(item, interned_identifier));
    PyRef offset(ident ? PyObject_GetAttr(item, interned_offset) : nullptr);
    PyRef length(offset ? PyObject_GetAttr(item, interned_length) : nullptr);
    if (!length) {
      PyErr_Clear();
      PyErr_Format(g_invalid_argument_type,
                   "mm[%zd] must be an MMOccurrence (identifier, offset, length), got %s", i,
                   Py_TYPE(item)->tp_name);
      return -1;
    }
    MMItem m;
    std::snprintf(field, sizeof field, "mm[%zd].identifier", i);
    if (!check_str(field, ident.get())) return -1;
    int64_t off, len;
    std::snprintf(field, sizeof field, "mm[%zd].offset", i);
    if (!get_int(field, offset.get(), 0, INT64_MAX / 2, &off)) return -1;
    std::snprintf(field, sizeof field, "mm[%zd].length", i);
    if (!get_int(field, length.get(), 1, INT64_MAX / 2, &len)) return -1;
    if (off < prev_end) {
      PyErr_Format(g_invalid_argument,
                   "mm[%zd] offset %lld is before the end %lld of mm[%zd]: occurrences must be "
                   "sorted by offset and non-overlapping",
                   i, static_cast<long long>(off), static_cast<long long>(prev_end), i - 1);
      return -1;
    }
    m.offset = off;
    m.end = off + len;  // both <= INT64_MAX / 2: no overflow
    prev_end = m.end;
    if (!take_str(k, ident.get(), fresh, m.id)) return 0;
    k.mm.push_back(m);
  }
  if (lora != Py_None) {
    k.has_lora = true;
    if (c.lora_key == LoraKey::kIntId) {
      if (!get_int("lora", lora, 1, INT64_MAX, &k.lora_int_id)) return -1;
    } else {
      if (!PyTuple_Check(lora) || PyTuple_GET_SIZE(lora) != 2) {
        PyErr_Format(g_invalid_argument_type, "lora must be a (name, path) tuple, got %R", lora);
        return -1;
      }
      PyObject* name = PyTuple_GET_ITEM(lora, 0);
      PyObject* path = PyTuple_GET_ITEM(lora, 1);
      if (!check_str("lora[0] (name)", name) || !check_str("lora[1] (path)", path)) return -1;
      if (!take_str(k, name, fresh, k.lora_name)) return 0;
      if (!take_str(k, path, fresh, k.lora_path)) return 0;
    }
  }
  if (salt != Py_None) {
    if (!check_str("salt", salt)) return -1;
    if (PyUnicode_GET_LENGTH(salt) > 0) {  // "" is falsy in vLLM: no key
      k.has_salt = true;
      if (!take_str(k, salt, fresh, k.salt)) return 0;
    }
  }
  if (k.key_bytes > kMaxKeyBytes) return 0;  // a block could exceed one pickle frame

  if (!is_cbor(c.fn)) {
    // Pre-written pickle heads of single-key blocks (see write_extra), as write_entry writes
    // them: the "mm" tag (5 bytes), the identifier's header and memo put (6) and its bytes.
    k.heads.resize(k.mm.size() * 16 + k.key_bytes);
    Out out{k.heads.data(), k.heads.data() + k.heads.size()};
    PickleWriter::Memo memo;
    std::vector<size_t> at(k.mm.size());
    for (size_t i = 0; i < k.mm.size(); ++i) {
      at[i] = static_cast<size_t>(out.p - k.heads.data());
      PickleWriter w(out, memo);
      if (c.mm_key == MMKey::kTagged) w.str(kTagMM);
      w.str(k.mm[i].id);
      k.mm[i].head_n = static_cast<size_t>(out.p - k.heads.data()) - at[i];
    }
    for (size_t i = 0; i < k.mm.size(); ++i) k.mm[i].head = k.heads.data() + at[i];
  }
  return 1;
}

// ---- HashSpec ---------------------------------------------------------------------------------

void spec_dealloc(PyObject* o) {
  HashSpecObject* self = reinterpret_cast<HashSpecObject*>(o);
  PyTypeObject* tp = Py_TYPE(o);
  Py_XDECREF(self->none_hash);
  tp->tp_free(o);
  Py_DECREF(tp);
}

PyObject* spec_new_impl(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"hash_fn",    "block_size",     "lookahead",          "none_hash",
                                 "mm_key",     "mm_bounds",      "lora_key",           "salt_key",
                                 "embeds_key", "incremental_mm", "allow_any_token_id", nullptr};
  PyObject *fn = nullptr, *bs = nullptr, *la = nullptr, *none_hash = nullptr;
  PyObject* named[7] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  if (!PyArg_ParseTupleAndKeywords(
          args, kwargs, "OOOO|$OOOOOOO:HashSpec", const_cast<char**>(kwlist), &fn, &bs, &la,
          &none_hash, &named[0], &named[1], &named[2], &named[3], &named[4], &named[5], &named[6]))
    return nullptr;
  for (int i = 0; i < 7; ++i) {
    if (named[i] == nullptr) {
      PyErr_Format(PyExc_TypeError, "HashSpec() missing required keyword argument '%s'",
                   kwlist[4 + i]);
      return nullptr;
    }
  }
  Config cfg;
  const int fn_id = get_name("hash_fn", fn, kHashFns);
  if (fn_id < 0) return nullptr;
  cfg.fn = static_cast<Fn>(fn_id);
  if (!get_int("block_size", bs, 1, kMaxBlockTokens, &cfg.block_size)) return nullptr;
  if (!get_int("lookahead", la, 0, kMaxLookahead, &cfg.lookahead)) return nullptr;
  if (!check_parent("none_hash", none_hash)) return nullptr;
  const int mm_key = get_name("mm_key", named[0], kMMKeys);
  const int bounds = mm_key < 0 ? -1 : get_name("mm_bounds", named[1], kMMBounds);
  const int lora_key = bounds < 0 ? -1 : get_name("lora_key", named[2], kLoraKeys);
  const int salt_key = lora_key < 0 ? -1 : get_name("salt_key", named[3], kSaltKeys);
  const int embeds_key = salt_key < 0 ? -1
                                      : get_name("embeds_key", named[4], kEmbedsKeys,
                                                 static_cast<int>(EmbedsKey::kNone));
  const int incremental =
      embeds_key < 0 ? -1 : get_name("incremental_mm", named[5], kIncrementalMM);
  if (incremental < 0) return nullptr;
  if (!PyBool_Check(named[6])) {
    PyErr_Format(g_invalid_argument_type, "allow_any_token_id must be a bool, got %s %R",
                 Py_TYPE(named[6])->tp_name, named[6]);
    return nullptr;
  }
  cfg.mm_key = static_cast<MMKey>(mm_key);
  cfg.inclusive = bounds == 1;
  cfg.lora_key = static_cast<LoraKey>(lora_key);
  cfg.salt_tagged = salt_key == 0;
  cfg.embeds_key = static_cast<EmbedsKey>(embeds_key);
  cfg.incremental_last = incremental == 1;
  cfg.allow_any = named[6] == Py_True;

  PyRef self(type->tp_alloc(type, 0));
  if (!self) return nullptr;
  HashSpecObject* s = reinterpret_cast<HashSpecObject*>(self.get());
  s->cfg = cfg;
  s->none_hash = Py_NewRef(none_hash);
  return self.release();
}

PyObject* spec_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  return guarded([&] { return spec_new_impl(type, args, kwargs); });
}

PyObject* spec_request(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "request(mm, lora, salt) takes 3 positional arguments, got %zd",
                 nargs);
    return nullptr;
  }
  return guarded([&]() -> PyObject* {
    const Config& c = reinterpret_cast<HashSpecObject*>(self)->cfg;
    std::unique_ptr<Keys> keys(new Keys);
    const int ok = parse_keys(c, args[0], args[1], args[2], *keys);
    if (ok < 0) return nullptr;
    if (ok == 0) Py_RETURN_NONE;
    PyRef obj(g_keys_type->tp_alloc(g_keys_type, 0));
    if (!obj) return nullptr;
    RequestKeysObject* r = reinterpret_cast<RequestKeysObject*>(obj.get());
    r->spec = Py_NewRef(self);
    r->keys = keys.release();
    return obj.release();
  });
}

template <size_t N>
PyObject* name_of(const char* const (&names)[N], int i) {
  return PyUnicode_FromString(names[i]);
}
HashSpecObject* as_spec(PyObject* o) { return reinterpret_cast<HashSpecObject*>(o); }
PyObject* spec_hash_fn(PyObject* o, void*) {
  return name_of(kHashFns, static_cast<int>(as_spec(o)->cfg.fn));
}
PyObject* spec_block_size(PyObject* o, void*) {
  return PyLong_FromLongLong(as_spec(o)->cfg.block_size);
}
PyObject* spec_lookahead(PyObject* o, void*) {
  return PyLong_FromLongLong(as_spec(o)->cfg.lookahead);
}
PyObject* spec_none_hash(PyObject* o, void*) { return Py_NewRef(as_spec(o)->none_hash); }
PyObject* spec_mm_key(PyObject* o, void*) {
  return name_of(kMMKeys, static_cast<int>(as_spec(o)->cfg.mm_key));
}
PyObject* spec_mm_bounds(PyObject* o, void*) {
  return name_of(kMMBounds, as_spec(o)->cfg.inclusive ? 1 : 0);
}
PyObject* spec_lora_key(PyObject* o, void*) {
  return name_of(kLoraKeys, static_cast<int>(as_spec(o)->cfg.lora_key));
}
PyObject* spec_salt_key(PyObject* o, void*) {
  return name_of(kSaltKeys, as_spec(o)->cfg.salt_tagged ? 0 : 1);
}
PyObject* spec_embeds_key(PyObject* o, void*) {
  const EmbedsKey e = as_spec(o)->cfg.embeds_key;
  if (e == EmbedsKey::kNone) Py_RETURN_NONE;
  return name_of(kEmbedsKeys, static_cast<int>(e));
}
PyObject* spec_incremental_mm(PyObject* o, void*) {
  return name_of(kIncrementalMM, as_spec(o)->cfg.incremental_last ? 1 : 0);
}
PyObject* spec_allow_any(PyObject* o, void*) { return PyBool_FromLong(as_spec(o)->cfg.allow_any); }

PyGetSetDef kSpecGetSet[] = {{"hash_fn", spec_hash_fn, nullptr, nullptr, nullptr},
                             {"block_size", spec_block_size, nullptr, nullptr, nullptr},
                             {"lookahead", spec_lookahead, nullptr, nullptr, nullptr},
                             {"none_hash", spec_none_hash, nullptr, nullptr, nullptr},
                             {"mm_key", spec_mm_key, nullptr, nullptr, nullptr},
                             {"mm_bounds", spec_mm_bounds, nullptr, nullptr, nullptr},
                             {"lora_key", spec_lora_key, nullptr, nullptr, nullptr},
                             {"salt_key", spec_salt_key, nullptr, nullptr, nullptr},
                             {"embeds_key", spec_embeds_key, nullptr, nullptr, nullptr},
                             {"incremental_mm", spec_incremental_mm, nullptr, nullptr, nullptr},
                             {"allow_any_token_id", spec_allow_any, nullptr, nullptr, nullptr},
                             {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMethodDef kSpecMethods[] = {
    {"request", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(spec_request)),
     METH_FASTCALL,
     "request(mm, lora, salt, /) -> RequestKeys | None\n\n"
     "One request's keys: `mm` a sequence of MMOccurrence-like objects (identifier, offset,\n"
     "length; sorted, non-overlapping), `lora` None, the int id (lora_key 'int_id') or a\n"
     "(name, path) tuple of str, `salt` None or a str ('' is no key). None: only the reference\n"
     "path can hash them (lone surrogates, more than MAX_KEY_BYTES of strings)."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot kSpecSlots[] = {
    {Py_tp_new, reinterpret_cast<void*>(spec_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(spec_dealloc)},
    {Py_tp_methods, kSpecMethods},
    {Py_tp_getset, kSpecGetSet},
    {Py_tp_doc,
     const_cast<char*>("HashSpec(hash_fn, block_size, lookahead, none_hash, *, mm_key, mm_bounds, "
                       "lora_key, salt_key, embeds_key, incremental_mm, allow_any_token_id)\n\n"
                       "One BlockHasher's configuration, validated once; the key shapes by the "
                       "names of HashScheme's fields (tables: HASH_FUNCTIONS, MM_KEYS, ...).")},
    {0, nullptr}};

PyType_Spec kSpecSpec = {"mmreuse._hashcore.HashSpec", sizeof(HashSpecObject), 0,
                         Py_TPFLAGS_DEFAULT, kSpecSlots};

// ---- module -------------------------------------------------------------------------------

PyObject* set_simd(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  const bool before = g_simd;
  g_simd = on != 0 && kHaveVbmi2;
  return PyBool_FromLong(before);
}

PyObject* simd_available(PyObject*, PyObject*) { return PyBool_FromLong(kHaveVbmi2); }

PyMethodDef kMethods[] = {
    {"set_simd", set_simd, METH_O,
     "set_simd(on) -> bool: use the AVX-512 VBMI2 token writer where the CPU has it (default); "
     "returns the previous setting"},
    {"simd_available", simd_available, METH_NOARGS,
     "simd_available() -> bool: whether this CPU runs the AVX-512 VBMI2 token writer"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT,
                       "_hashcore",
                       "C++ fast path of mmreuse.hashing (see hasher.py).",
                       -1,
                       kMethods,
                       nullptr,
                       nullptr,
                       nullptr,
                       nullptr};

template <size_t N>
PyObject* names_tuple(const char* const (&names)[N]) {
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(N));
  if (t == nullptr) return nullptr;
  for (size_t i = 0; i < N; ++i) {
    PyObject* s = PyUnicode_FromString(names[i]);
    if (s == nullptr) {
      Py_DECREF(t);
      return nullptr;
    }
    PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), s);
  }
  return t;
}

// PyModule_AddObject that always consumes `value` (it may be null: then it fails).
bool add(PyObject* m, const char* name, PyObject* value) {
  PyRef v(value);
  if (!v) return false;
  if (PyModule_AddObject(m, name, v.get()) < 0) return false;
  v.release();
  return true;
}

PyObject* init_module() {
  PyRef errors(PyImport_ImportModule("mmreuse.errors"));
  if (!errors) return nullptr;
  PyRef invalid(PyObject_GetAttrString(errors.get(), "InvalidArgument"));
  PyRef invalid_type(PyObject_GetAttrString(errors.get(), "InvalidArgumentType"));
  if (!invalid || !invalid_type) return nullptr;
  interned_identifier = PyUnicode_InternFromString("identifier");
  interned_offset = PyUnicode_InternFromString("offset");
  interned_length = PyUnicode_InternFromString("length");
  if (!interned_identifier || !interned_offset || !interned_length) return nullptr;

  PyRef m(PyModule_Create(&kModule));
  if (!m) return nullptr;
  PyRef spec_type(PyType_FromSpec(&kSpecSpec));
  PyRef keys_type(PyType_FromSpec(&kKeysSpec));
  if (!spec_type || !keys_type) return nullptr;
  if (!add(m.get(), "HashSpec", Py_NewRef(spec_type.get())) ||
      !add(m.get(), "RequestKeys", Py_NewRef(keys_type.get())) ||
      !add(m.get(), "HASH_FUNCTIONS", names_tuple(kHashFns)) ||
      !add(m.get(), "MM_KEYS", names_tuple(kMMKeys)) ||
      !add(m.get(), "MM_BOUNDS", names_tuple(kMMBounds)) ||
      !add(m.get(), "LORA_KEYS", names_tuple(kLoraKeys)) ||
      !add(m.get(), "SALT_KEYS", names_tuple(kSaltKeys)) ||
      !add(m.get(), "EMBEDS_KEYS", names_tuple(kEmbedsKeys)) ||
      !add(m.get(), "INCREMENTAL_MM", names_tuple(kIncrementalMM)) ||
      !add(m.get(), "MAX_BLOCK_TOKENS", PyLong_FromLongLong(kMaxBlockTokens)) ||
      !add(m.get(), "MAX_LOOKAHEAD", PyLong_FromLongLong(kMaxLookahead)) ||
      !add(m.get(), "MAX_KEY_BYTES", PyLong_FromSize_t(kMaxKeyBytes)) ||
      !add(m.get(), "DEBUG_BUILD", PyBool_FromLong(kDebugBuild)))
    return nullptr;
  static_assert(count(kHashFns) == 4 && count(kEmbedsKeys) == 3, "tables match the enums");
  // The module keeps the types alive; these globals borrow them.
  g_keys_type = reinterpret_cast<PyTypeObject*>(keys_type.get());
  g_invalid_argument = invalid.release();
  g_invalid_argument_type = invalid_type.release();
  return m.release();
}

}  // namespace

PyMODINIT_FUNC PyInit__hashcore(void) { return init_module(); }
