// mmreuse._jsonscan: one pass over a JSON request body, with the GIL released, that says what
// decoding it would cost before anything is decoded (its values, its depth, its bytes that are
// not long plain strings) and where its long plain-ASCII strings are (inline media), so that the
// proxy can decode the rest and forward those as the bytes they already are (mmreuse.proxy.body).
//
// The scan reads strings as JSON does (a string starts at a quote outside one and ends at the next
// unescaped quote), and nothing else: it does not validate. A string is "plain" when every byte is
// printable ASCII (0x20-0x7e) other than the quote and the backslash: its raw bytes are then
// exactly its decoded text and exactly what a JSON encoder writes for it. An invalid body stays
// invalid when its plain strings are replaced by other plain strings, so the decoder still refuses
// it. Portable C++ (8-byte words, no intrinsics): the same code on every CPU.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

namespace mmreuse {
namespace {

constexpr uint64_t kOnes = 0x0101010101010101ULL;
constexpr uint64_t kHighs = 0x8080808080808080ULL;
constexpr Py_ssize_t kReleaseGilBytes = 64 << 10;  // smaller bodies are scanned holding it

// Whether any byte of `v` is zero (may also flag bytes above a zero one: callers re-check
// bytewise).
inline uint64_t HasZero(uint64_t v) { return (v - kOnes) & ~v & kHighs; }

// Whether any byte of `w` is not plain: a quote, a backslash, a byte under 0x20 or over 0x7e
// (non-zero when one is; false positives only next to a real one).
inline bool MayStop(uint64_t w) {
  const uint64_t quote = HasZero(w ^ (kOnes * '"'));
  const uint64_t backslash = HasZero(w ^ (kOnes * '\\'));
  const uint64_t control = (w - kOnes * 0x20) & ~w & kHighs;
  const uint64_t high = w & kHighs;
  const uint64_t del = HasZero(w ^ (kOnes * 0x7f));
  return (quote | backslash | control | high | del) != 0;
}

// Whether the `n` bytes at `s` are all plain (printable ASCII, no quote or backslash).
bool IsPlain(const unsigned char* s, Py_ssize_t n) {
  Py_ssize_t j = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t w;
    std::memcpy(&w, s + j, 8);
    if (MayStop(w)) break;
  }
  for (; j < n; ++j) {
    const unsigned char d = s[j];
    if (d < 0x20 || d > 0x7e || d == '"' || d == '\\') return false;
  }
  return true;
}

// The offset of the quote that ends the string whose contents start at `j`, or `n` if none: the
// next quote not escaped, i.e. not after an odd run of backslashes (memchr finds each quote).
Py_ssize_t StringEnd(const unsigned char* s, Py_ssize_t j, Py_ssize_t n) {
  while (j < n) {
    const void* hit = std::memchr(s + j, '"', static_cast<size_t>(n - j));
    if (hit == nullptr) return n;
    const Py_ssize_t q = static_cast<const unsigned char*>(hit) - s;
    Py_ssize_t slashes = 0;
    while (q - slashes - 1 >= j && s[q - slashes - 1] == '\\') ++slashes;
    if (slashes % 2 == 0) return q;
    j = q + 1;
  }
  return n;
}

// What a byte outside a string is to the scan.
enum ByteClass : unsigned char { kOther, kComma, kOpen, kClose, kQuote };

constexpr std::array<unsigned char, 256> MakeClasses() {
  std::array<unsigned char, 256> t{};
  t[','] = kComma;
  t['['] = kOpen;
  t['{'] = kOpen;
  t[']'] = kClose;
  t['}'] = kClose;
  t['"'] = kQuote;
  return t;
}
constexpr std::array<unsigned char, 256> kClass = MakeClasses();

struct Shape {
  Py_ssize_t values = 1;          // the root, then one per array element or object member
  Py_ssize_t depth = 0;           // the deepest nesting of arrays and objects
  Py_ssize_t text = 0;            // bytes outside the long plain strings (what a decoder decodes)
  std::vector<Py_ssize_t> spans;  // start, end of each long plain string's contents
};

void ScanBytes(const unsigned char* s, Py_ssize_t n, Py_ssize_t plain_min, Shape* out) {
  // Locals, not `out`'s fields: bytes may alias anything, so the compiler would reload those.
  Py_ssize_t values = 1, depth = 0, level = 0;
  Py_ssize_t skipped = 0;  // bytes of the long plain strings' contents
  Py_ssize_t i = 0;
  while (i < n) {
    switch (kClass[s[i]]) {
      case kQuote: {
        const Py_ssize_t start = i + 1;
        const Py_ssize_t end = StringEnd(s, start, n);
        if (end >= n) {  // unterminated: the decoder refuses the body
          i = n;
          continue;
        }
        if (end - start >= plain_min && IsPlain(s + start, end - start)) {
          out->spans.push_back(start);
          out->spans.push_back(end);
          skipped += end - start;
        }
        i = end + 1;
        continue;
      }
      case kComma:
        ++values;
        break;
      case kOpen:
        ++values;
        if (++level > depth) depth = level;
        break;
      case kClose:
        --level;
        break;
      default:  // whitespace, digits, literals: on to the next byte that is not one
        while (++i < n && kClass[s[i]] == kOther) {
        }
        continue;
    }
    ++i;
  }
  out->values = values;
  out->depth = depth;
  out->text = n - skipped;
}

// scan(body, plain_min) -> (values, depth, text_bytes, spans)
PyObject* Scan(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "scan(body, plain_min) takes 2 arguments");
    return nullptr;
  }
  const Py_ssize_t plain_min = PyLong_AsSsize_t(args[1]);
  if (plain_min == -1 && PyErr_Occurred()) return nullptr;
  if (plain_min < 1) {
    PyErr_Format(PyExc_ValueError, "plain_min must be >= 1, got %zd", plain_min);
    return nullptr;
  }
  Py_buffer view;
  if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) != 0) return nullptr;
  Shape shape;
  const auto* bytes = static_cast<const unsigned char*>(view.buf);
  if (view.len < kReleaseGilBytes) {  // microseconds: cheaper than handing the GIL over
    ScanBytes(bytes, view.len, plain_min, &shape);
  } else {
    Py_BEGIN_ALLOW_THREADS;
    ScanBytes(bytes, view.len, plain_min, &shape);
    Py_END_ALLOW_THREADS;
  }
  PyBuffer_Release(&view);
  PyObject* out = PyTuple_New(4);
  PyObject* spans = PyList_New(static_cast<Py_ssize_t>(shape.spans.size()));
  if (out == nullptr || spans == nullptr) {
    Py_XDECREF(out);
    Py_XDECREF(spans);
    return nullptr;
  }
  PyTuple_SET_ITEM(out, 3, spans);
  const Py_ssize_t counts[3] = {shape.values, shape.depth, shape.text};
  for (Py_ssize_t k = 0; k < 3; ++k) {
    PyObject* v = PyLong_FromSsize_t(counts[k]);
    if (v == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, k, v);
  }
  for (size_t k = 0; k < shape.spans.size(); ++k) {
    PyObject* v = PyLong_FromSsize_t(shape.spans[k]);
    if (v == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(spans, static_cast<Py_ssize_t>(k), v);
  }
  return out;
}

PyMethodDef kMethods[] = {
    {"scan", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Scan)), METH_FASTCALL,
     "scan(body, plain_min) -> (values, depth, text_bytes, spans): a JSON body's values (an "
     "object member counting as one), its deepest nesting, its bytes other than the contents of "
     "plain-ASCII strings of at least plain_min bytes, and those contents' [start, end) offsets, "
     "flat; with the GIL released (bodies of 64 KiB or more)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_jsonscan",
                       "the proxy's one pass over a request body before it is decoded", -1,
                       kMethods};

}  // namespace
}  // namespace mmreuse

PyMODINIT_FUNC PyInit__jsonscan(void) { return PyModule_Create(&mmreuse::kModule); }
