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

#include <cstdint>
#include <cstring>
#include <vector>

namespace mmreuse {
namespace {

constexpr uint64_t kOnes = 0x0101010101010101ULL;
constexpr uint64_t kHighs = 0x8080808080808080ULL;

// Whether any byte of `v` is zero (may also flag bytes above a zero one: callers re-check
// bytewise).
inline uint64_t HasZero(uint64_t v) { return (v - kOnes) & ~v & kHighs; }

// Whether any byte of `w` may end a plain run: a quote, a backslash, a byte under 0x20 or over
// 0x7e (non-zero when one does; false positives only next to a real one).
inline bool MayStop(uint64_t w) {
  const uint64_t quote = HasZero(w ^ (kOnes * '"'));
  const uint64_t backslash = HasZero(w ^ (kOnes * '\\'));
  const uint64_t control = (w - kOnes * 0x20) & ~w & kHighs;
  const uint64_t high = w & kHighs;
  const uint64_t del = HasZero(w ^ (kOnes * 0x7f));
  return (quote | backslash | control | high | del) != 0;
}

struct Shape {
  Py_ssize_t values = 1;          // the root, then one per array element or object member
  Py_ssize_t depth = 0;           // the deepest nesting of arrays and objects
  Py_ssize_t text = 0;            // bytes outside the long plain strings (what a decoder decodes)
  std::vector<Py_ssize_t> spans;  // start, end of each long plain string's contents
};

void ScanBytes(const unsigned char* s, Py_ssize_t n, Py_ssize_t plain_min, Shape* out) {
  Py_ssize_t level = 0;
  Py_ssize_t skipped = 0;  // bytes of the long plain strings' contents
  Py_ssize_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    if (c == '"') {
      const Py_ssize_t start = i + 1;
      Py_ssize_t j = start;
      bool plain = true;
      while (j < n) {
        if (plain && j + 8 <= n) {
          uint64_t w;
          std::memcpy(&w, s + j, 8);
          if (!MayStop(w)) {
            j += 8;
            continue;
          }
        }
        const unsigned char d = s[j];
        if (d == '"') break;
        if (d == '\\') {
          plain = false;
          j += 2;  // the escaped byte cannot end the string
          continue;
        }
        if (d < 0x20 || d > 0x7e) plain = false;
        ++j;
      }
      if (j >= n) break;  // unterminated: the decoder refuses the body
      if (plain && j - start >= plain_min) {
        out->spans.push_back(start);
        out->spans.push_back(j);
        skipped += j - start;
      }
      i = j + 1;
      continue;
    }
    switch (c) {
      case ',':
        ++out->values;
        break;
      case '[':
      case '{':
        ++out->values;
        if (++level > out->depth) out->depth = level;
        break;
      case ']':
      case '}':
        --level;
        break;
      default:
        break;
    }
    ++i;
  }
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
  Py_BEGIN_ALLOW_THREADS;
  ScanBytes(static_cast<const unsigned char*>(view.buf), view.len, plain_min, &shape);
  Py_END_ALLOW_THREADS;
  PyBuffer_Release(&view);
  PyObject* spans = PyList_New(static_cast<Py_ssize_t>(shape.spans.size()));
  if (spans == nullptr) return nullptr;
  for (size_t k = 0; k < shape.spans.size(); ++k) {
    PyObject* v = PyLong_FromSsize_t(shape.spans[k]);
    if (v == nullptr) {
      Py_DECREF(spans);
      return nullptr;
    }
    PyList_SET_ITEM(spans, static_cast<Py_ssize_t>(k), v);
  }
  return Py_BuildValue("(nnnN)", shape.values, shape.depth, shape.text, spans);
}

PyMethodDef kMethods[] = {
    {"scan", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Scan)), METH_FASTCALL,
     "scan(body, plain_min) -> (values, depth, text_bytes, spans): a JSON body's values (an "
     "object member counting as one), its deepest nesting, its bytes other than the contents of "
     "plain-ASCII strings of at least plain_min bytes, and those contents' [start, end) offsets, "
     "flat; with the GIL released"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_jsonscan",
                       "the proxy's one pass over a request body before it is decoded", -1,
                       kMethods};

}  // namespace
}  // namespace mmreuse

PyMODINIT_FUNC PyInit__jsonscan(void) { return PyModule_Create(&mmreuse::kModule); }
