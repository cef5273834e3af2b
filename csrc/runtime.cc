#include "tka/runtime.h"
#include "tka/host.h"
#include "tka/sha256.h"

#include <dlfcn.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "dlpack/dlpack.h"

namespace tka {

// ---------------------------------------------------------------- dtypes

static DType from_dl(DLDataType t) {
  if (t.lanes != 1) return UNKNOWN;
  for (int d = 0; d < UNKNOWN; ++d)
    if (kDTypes[d].dlpack_code == t.code && kDTypes[d].bits == t.bits) return static_cast<DType>(d);
  return UNKNOWN;
}

static DLDataType to_dl(DType d) {
  if (d < 0 || d >= UNKNOWN) return {kDLOpaqueHandle, 0, 0};
  return {kDTypes[d].dlpack_code, kDTypes[d].bits, 1};
}

bool TensorArg::contiguous() const {
  int64_t expected = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

int64_t TensorArg::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

// ---------------------------------------------------------------- errors

static bool set_error(PyObject* type, const char* op, const char* fmt, va_list ap) {
  char message[1024];
  vsnprintf(message, sizeof(message), fmt, ap);
  PyErr_Format(type, "%s: %s", op, message);
  return false;
}

bool type_error(const char* op, const char* fmt, ...) {
  va_list ap; va_start(ap, fmt); set_error(PyExc_TypeError, op, fmt, ap); va_end(ap); return false;
}
bool value_error(const char* op, const char* fmt, ...) {
  va_list ap; va_start(ap, fmt); set_error(PyExc_ValueError, op, fmt, ap); va_end(ap); return false;
}
bool arg_error(PyObject* type, const char* op, const char* arg, const char* fmt, ...) {
  char message[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(message, sizeof(message), fmt, ap);
  va_end(ap);
  PyErr_Format(type, "%s: %s %s", op, arg, message);
  return false;
}
bool runtime_error(const char* op, const char* fmt, ...) {
  va_list ap; va_start(ap, fmt); set_error(PyExc_RuntimeError, op, fmt, ap); va_end(ap); return false;
}

// ---------------------------------------------------------------- DLPack exchange API

namespace {

struct ApiCache {
  PyTypeObject* type;
  const DLPackExchangeAPI* api;
  bool subclass;  // a tensor subclass that takes the torch path
};
ApiCache g_api_cache[4] = {};

// set_torch_path's arguments (strong references, never released)
PyObject* g_torch_path = nullptr;
PyTypeObject* g_tensor_base = nullptr;
PyObject* g_plain_types = nullptr;  // a tuple
thread_local bool t_subclass_seen = false;

bool takes_torch_path(PyTypeObject* type) {
  if (g_torch_path == nullptr || !PyType_IsSubtype(type, g_tensor_base)) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(g_plain_types); ++i)
    if (reinterpret_cast<PyObject*>(type) == PyTuple_GET_ITEM(g_plain_types, i)) return false;
  return true;
}
std::atomic<const DLPackExchangeAPI*> g_api{nullptr};  // the last one seen: used to allocate outputs

// The exchange API of obj's type, or nullptr (no error set) if it has none; *subclass: the
// type takes the torch path.
const DLPackExchangeAPI* exchange_api(PyObject* obj, bool* subclass) {
  PyTypeObject* type = Py_TYPE(obj);
  for (auto& c : g_api_cache)
    if (c.type == type) {
      *subclass = c.subclass;
      return c.api;
    }
  *subclass = takes_torch_path(type);
  PyObject* capsule = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
  if (capsule == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  auto* api = static_cast<const DLPackExchangeAPI*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
  Py_DECREF(capsule);
  if (api == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  if (api->header.version.major != DLPACK_MAJOR_VERSION) return nullptr;
  for (auto& c : g_api_cache) {
    if (c.type == nullptr) {
      Py_INCREF(type);
      c.api = api;
      c.subclass = *subclass;
      c.type = type;
      break;
    }
  }
  g_api.store(api, std::memory_order_relaxed);
  return api;
}

void fill(const DLTensor& dl, TensorArg* t) {
  t->present = true;
  t->data = static_cast<char*>(dl.data) + dl.byte_offset;
  t->ndim = dl.ndim;
  t->dtype = from_dl(dl.dtype);
  t->device = dl.device.device_type == kDLCUDA ? dl.device.device_id : -1;
  int64_t expected = 1;
  for (int i = dl.ndim - 1; i >= 0; --i) {
    t->shape[i] = dl.shape[i];
    t->stride[i] = dl.strides ? dl.strides[i] : expected;
    expected *= dl.shape[i];
  }
}

}  // namespace

bool tensor_arg(const char* op, const char* name, PyObject* obj, bool optional, TensorArg* out) {
  if (obj == nullptr || obj == Py_None) {
    if (optional) {
      out->present = false;
      return true;
    }
    return type_error(op, "%s must be a torch.Tensor, got None", name);
  }
  bool subclass = false;
  const DLPackExchangeAPI* api = exchange_api(obj, &subclass);
  if (subclass) {
    t_subclass_seen = true;
    return false;
  }
  if (api == nullptr || api->dltensor_from_py_object_no_sync == nullptr)
    return type_error(op, "%s must be a torch.Tensor, got %s", name, Py_TYPE(obj)->tp_name);
  DLTensor dl;
  if (api->dltensor_from_py_object_no_sync(obj, &dl) != 0) {
    PyErr_Clear();
    return type_error(op, "%s: this tensor cannot be viewed through DLPack", name);
  }
  if (dl.ndim > kMaxDims) return value_error(op, "%s has %d dims; at most %d are supported", name, dl.ndim, kMaxDims);
  fill(dl, out);
  return true;
}

bool tensor_list_arg(const char* op, const char* name, PyObject* obj, int max_len, TensorArg* items, int64_t* size) {
  if (obj == nullptr || !(PyList_Check(obj) || PyTuple_Check(obj)))
    return type_error(op, "%s must be a list or tuple of torch.Tensor, got %s", name,
                      obj == nullptr ? "nothing" : Py_TYPE(obj)->tp_name);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
  if (n > max_len) return value_error(op, "%s has %zd tensors; at most %d are supported", name, n, max_len);
  PyObject** elements = PySequence_Fast_ITEMS(obj);
  for (Py_ssize_t k = 0; k < n; ++k)
    if (!tensor_arg(op, name, elements[k], false, &items[k])) return false;
  *size = n;
  return true;
}

bool set_torch_path(PyObject* fn, PyObject* base, PyObject* plain) {
  if (!PyCallable_Check(fn) || !PyType_Check(base) || !PyTuple_Check(plain))
    return type_error("set_torch_path", "expects (callable, type, tuple of types)");
  if (g_torch_path != nullptr) return true;  // once per process
  Py_INCREF(fn);
  Py_INCREF(base);
  Py_INCREF(plain);
  g_tensor_base = reinterpret_cast<PyTypeObject*>(base);
  g_plain_types = plain;
  for (auto& c : g_api_cache)  // types seen before: ask again
    if (c.type != nullptr) c.subclass = takes_torch_path(c.type);
  g_torch_path = fn;
  return true;
}

PyObject* torch_path_or_error(const char* qualname, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  if (!t_subclass_seen) return nullptr;
  t_subclass_seen = false;
  PyErr_Clear();
  PyObject* positional = PyTuple_New(nargs);
  PyObject* keywords = PyDict_New();
  PyObject* name = PyUnicode_FromString(qualname);
  PyObject* result = nullptr;
  if (positional != nullptr && keywords != nullptr && name != nullptr) {
    bool ok = true;
    for (Py_ssize_t i = 0; i < nargs; ++i) {
      Py_INCREF(args[i]);
      PyTuple_SET_ITEM(positional, i, args[i]);
    }
    const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nkw && ok; ++i) ok = PyDict_SetItem(keywords, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) == 0;
    if (ok) result = PyObject_CallFunctionObjArgs(g_torch_path, name, positional, keywords, nullptr);
  }
  Py_XDECREF(positional);
  Py_XDECREF(keywords);
  Py_XDECREF(name);
  return result;
}

// ---------------------------------------------------------------- scalar arguments

bool parse_args(const char* op, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
                const char* const* names, PyObject** interned, int n, int positional, int required,
                PyObject** values) {
  if (nargs > positional)
    return type_error(op, "takes at most %d positional arguments (%zd given)", positional, nargs);
  for (int i = 0; i < n; ++i) values[i] = i < nargs ? args[i] : nullptr;
  if (kwnames != nullptr) {
    // Interned once and kept (the last slot first, so a failure leaves slot 0 empty and is retried).
    for (int i = n - 1; n > 0 && interned[0] == nullptr && i >= 0; --i)
      if ((interned[i] = PyUnicode_InternFromString(names[i])) == nullptr) return false;
    Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; ++k) {
      PyObject* key = PyTuple_GET_ITEM(kwnames, k);
      int found = -1;
      for (int i = static_cast<int>(nargs); i < n; ++i)  // a keyword names a parameter after the positional ones
        if (key == interned[i]) { found = i; break; }
      for (int i = 0; found < 0 && i < nargs; ++i)  // (or repeats one: an error below)
        if (key == interned[i]) found = i;
      if (found < 0) {  // a keyword not interned (built at run time): compare the text
        const char* kname = PyUnicode_AsUTF8(key);
        if (kname == nullptr) return false;
        for (int i = 0; i < n; ++i)
          if (std::strcmp(kname, names[i]) == 0) { found = i; break; }
        if (found < 0) return type_error(op, "got an unexpected keyword argument '%s'", kname);
      }
      if (values[found] != nullptr) return type_error(op, "got multiple values for argument '%s'", names[found]);
      values[found] = args[nargs + k];
    }
  }
  for (int i = 0; i < required; ++i)
    if (values[i] == nullptr) return type_error(op, "missing required argument '%s'", names[i]);
  return true;
}

bool int_arg(const char* op, const char* name, PyObject* obj, bool optional, int64_t* out, bool* is_none) {
  if (obj == Py_None) {
    if (!optional) return type_error(op, "%s must be an int, got None", name);
    *is_none = true;
    *out = 0;
    return true;
  }
  if (is_none) *is_none = false;
  if (PyBool_Check(obj) || !PyLong_Check(obj)) {
    if (!PyIndex_Check(obj) || PyBool_Check(obj)) return type_error(op, "%s must be an int, got %s", name, Py_TYPE(obj)->tp_name);
  }
  long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return value_error(op, "%s is out of the int64 range", name);
  }
  *out = v;
  return true;
}

bool float_arg(const char* op, const char* name, PyObject* obj, bool optional, double* out, bool* is_none) {
  if (obj == Py_None) {
    if (!optional) return type_error(op, "%s must be a float, got None", name);
    *is_none = true;
    *out = 0;
    return true;
  }
  if (is_none) *is_none = false;
  if (PyBool_Check(obj) || !(PyFloat_Check(obj) || PyLong_Check(obj)))
    return type_error(op, "%s must be a float, got %s", name, Py_TYPE(obj)->tp_name);
  *out = PyFloat_AsDouble(obj);
  if (*out == -1.0 && PyErr_Occurred()) return false;
  return true;
}

bool bool_arg(const char* op, const char* name, PyObject* obj, bool* out) {
  if (obj == Py_True || obj == Py_False) {
    *out = obj == Py_True;
    return true;
  }
  if (PyLong_Check(obj)) {
    long v = PyLong_AsLong(obj);
    if (v == 0 || v == 1) {
      *out = v == 1;
      return true;
    }
  }
  return type_error(op, "%s must be a bool, got %s", name, Py_TYPE(obj)->tp_name);
}

static std::string choices_text(std::initializer_list<const char*> choices) {
  std::string text;
  for (const char* c : choices) text += std::string(text.empty() ? "" : ", ") + "'" + c + "'";
  return text;
}

bool str_arg(const char* op, const char* name, PyObject* obj, std::initializer_list<const char*> choices,
             std::string_view* out) {
  if (!PyUnicode_Check(obj))
    return type_error(op, "%s must be one of %s, got %s", name, choices_text(choices).c_str(), Py_TYPE(obj)->tp_name);
  Py_ssize_t size = 0;
  const char* s = PyUnicode_AsUTF8AndSize(obj, &size);
  if (s == nullptr) return false;
  std::string_view v(s, static_cast<size_t>(size));
  for (const char* c : choices)
    if (v == c) {
      *out = v;
      return true;
    }
  return value_error(op, "%s must be one of %s, got '%s'", name, choices_text(choices).c_str(), s);
}

bool enum_arg(const char* op, const char* name, PyObject* obj, std::initializer_list<const char*> choices,
              int64_t* out) {
  if (PyUnicode_Check(obj)) {
    std::string_view v;
    if (!str_arg(op, name, obj, choices, &v)) return false;
    int64_t i = 0;
    for (const char* c : choices) {
      if (v == c) break;
      ++i;
    }
    *out = i;
    return true;
  }
  if (PyBool_Check(obj) || !PyIndex_Check(obj))
    return type_error(op, "%s must be one of %s (or its enum member), got %s", name, choices_text(choices).c_str(),
                      Py_TYPE(obj)->tp_name);
  long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) PyErr_Clear();
  if (v < 0 || v >= static_cast<long long>(choices.size()))
    return value_error(op, "%s must be one of %s (or its enum member), got %lld", name, choices_text(choices).c_str(), v);
  *out = v;
  return true;
}

static std::string dtype_choices_text(std::initializer_list<DType> choices) {
  std::string text;
  for (DType d : choices) text += std::string(text.empty() ? "" : ", ") + dtype_name(d);
  return text;
}

bool dtype_arg(const char* op, const char* name, PyObject* obj, std::initializer_list<DType> choices, DType* out) {
  // torch.dtype objects are singletons: the ones seen are remembered (callers hold the GIL)
  static PyObject* seen[UNKNOWN + 1] = {};
  static DType seen_as[UNKNOWN + 1] = {};
  DType d = UNKNOWN;
  int k = 0;
  for (; k <= UNKNOWN && seen[k] != nullptr; ++k)
    if (seen[k] == obj) {
      d = seen_as[k];
      break;
    }
  if (d == UNKNOWN) {
    // a torch.dtype, told by its type's name (the runtime does not import torch)
    if (std::strcmp(Py_TYPE(obj)->tp_name, "torch.dtype") != 0)
      return type_error(op, "%s must be a torch.dtype (%s), got %s", name, dtype_choices_text(choices).c_str(),
                        Py_TYPE(obj)->tp_name);
    PyObject* text = PyObject_Str(obj);  // e.g. "torch.float32"
    if (text == nullptr) return false;
    const char* s = PyUnicode_AsUTF8(text);
    std::string shown = s != nullptr ? s : "?";
    Py_DECREF(text);
    if (s == nullptr) return false;
    for (int i = 0; i < UNKNOWN; ++i)
      if (dtype_view(static_cast<DType>(i)) == shown) d = static_cast<DType>(i);
    if (d != UNKNOWN && k <= UNKNOWN) {
      Py_INCREF(obj);
      seen[k] = obj;
      seen_as[k] = d;
    }
    if (d == UNKNOWN)
      return value_error(op, "%s must be one of %s, got %s", name, dtype_choices_text(choices).c_str(), shown.c_str());
  }
  for (DType c : choices)
    if (c == d) {
      *out = d;
      return true;
    }
  return value_error(op, "%s must be one of %s, got %s", name, dtype_choices_text(choices).c_str(), dtype_name(d));
}

bool int_tuple_arg(const char* op, const char* name, PyObject* obj, bool optional, int n, int64_t* out, bool* is_none) {
  if (obj == Py_None) {
    if (!optional) return type_error(op, "%s must be a tuple of %d ints, got None", name, n);
    *is_none = true;
    return true;
  }
  if (is_none) *is_none = false;
  if (!(PyTuple_Check(obj) || PyList_Check(obj)) || PySequence_Fast_GET_SIZE(obj) != n)
    return type_error(op, "%s must be a tuple of %d ints, got %s", name, n, Py_TYPE(obj)->tp_name);
  for (int i = 0; i < n; ++i)
    if (!int_arg(op, name, PySequence_Fast_GET_ITEM(obj, i), false, &out[i], nullptr)) return false;
  return true;
}

bool quantized_arg(const char* op, const char* name, PyObject* obj, bool plain, TensorArg* data, TensorArg* sf) {
  if (PyTuple_Check(obj)) {
    if (PyTuple_GET_SIZE(obj) != 2)
      return type_error(op, "%s must be a (data, sf) pair%s, got a tuple of %zd", name, plain ? " or a tensor" : "",
                        PyTuple_GET_SIZE(obj));
    if (!tensor_arg(op, name, PyTuple_GET_ITEM(obj, 0), false, data)) return false;
    if (tensor_arg(op, name, PyTuple_GET_ITEM(obj, 1), false, sf)) return true;
    // the sf's own name only on failure (no string built per call): ask again for the message
    PyErr_Clear();
    std::string sf_name = std::string(name) + "'s sf";
    return tensor_arg(op, sf_name.c_str(), PyTuple_GET_ITEM(obj, 1), false, sf);
  }
  if (!plain) return type_error(op, "%s must be a (data, sf) pair, got %s", name, Py_TYPE(obj)->tp_name);
  sf->present = false;
  return tensor_arg(op, name, obj, false, data);
}

bool check_dtype(const char* op, const char* name, const TensorArg& t, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype == d) return true;
  std::string expected;
  for (DType d : allowed) expected += std::string(expected.empty() ? "" : " or ") + dtype_name(d);
  return type_error(op, "%s must have dtype %s, got %s", name, expected.c_str(), dtype_name(t.dtype));
}

bool check_ndim(const char* op, const char* name, const TensorArg& t, int ndim) {
  if (t.ndim == ndim) return true;
  return value_error(op, "%s must be %d-D, got %d-D", name, ndim, t.ndim);
}

bool check_min_ndim(const char* op, const char* name, const TensorArg& t, int ndim) {
  if (t.ndim >= ndim) return true;
  return value_error(op, "%s must be at least %d-D, got %d-D", name, ndim, t.ndim);
}

bool check_layout(const char* op, const char* name, const TensorArg& t, bool contiguous) {
  if (contiguous ? t.contiguous() : (t.ndim == 0 || t.shape[t.ndim - 1] <= 1 || t.stride[t.ndim - 1] == 1))
    return true;
  return value_error(op, contiguous ? "%s must be contiguous" : "%s must have a unit stride in its last dim", name);
}

bool check_same_device(const char* op, const char* name, const TensorArg& t, int device) {
  if (t.device < 0) return value_error(op, "%s must be a CUDA tensor", name);
  if (t.device != device) return value_error(op, "%s is on cuda:%d, expected cuda:%d like the first tensor", name, t.device, device);
  return true;
}

bool fits_int32(const char* op, const char* name, int64_t v) {
  if (v >= INT32_MIN && v <= INT32_MAX) return true;
  return value_error(op, "%s = %lld does not fit the kernel's int32 parameter", name, static_cast<long long>(v));
}

// ---------------------------------------------------------------- outputs

void dense_strides(OutSpec* spec) {
  int64_t s = 1;
  for (int i = spec->ndim - 1; i >= 0; --i) {
    spec->stride[i] = s;
    s *= spec->shape[i];
  }
}

namespace {

// One allocation shared by all of a call's new outputs (one trip through torch's
// allocator instead of one per output); freed, or kept for reuse, when the last output dies.
struct SharedBlob {
  DLManagedTensorVersioned* managed;
  std::atomic<int> refs;
  int device;
  void* stream;   // the stream torch allocated it for (the call's current stream)
  int64_t bytes;
  bool reusable;  // false: made during a graph capture, or too large to keep
};

// Recently freed small blobs, kept for the next call on the same device and stream.
// torch's allocator costs about 2 us of host time per allocation and free on an H200
// host, as much as the launch itself; decode-sized calls take a kept blob instead.
// Reuse is ordered as torch orders its own: a blob only goes back to the stream it was
// allocated for, where every kernel that used it precedes the next one. Blobs made while
// the stream is being captured into a CUDA graph belong to the graph's pool and go back to
// torch, and a capturing stream never takes a kept blob. At most kKeptBlobs blobs of
// kMaxKeptBytes each are kept; empty_cache() hands them back to torch.
constexpr int kKeptBlobs = 8;
constexpr int64_t kMaxKeptBytes = int64_t{8} << 20;  // a decode call of hidden 7168 x 4 streams (7 MiB) fits

struct KeptBlobs {
  std::mutex lock;
  SharedBlob* blob[kKeptBlobs] = {};
  uint64_t used[kKeptBlobs] = {};  // when each was kept (the least recent is evicted)
  uint64_t clock = 0;
};
// Never destroyed: blobs still kept at exit are left to the process's end, after torch.
KeptBlobs& kept() {
  static KeptBlobs* k = new KeptBlobs();
  return *k;
}

void free_blob(SharedBlob* blob) {
  if (blob->managed->deleter) blob->managed->deleter(blob->managed);
  delete blob;
}

// A kept blob for `bytes` on this device and stream (at most twice as large), or nullptr.
SharedBlob* take_kept(int device, void* stream, int64_t bytes) {
  KeptBlobs& k = kept();
  std::lock_guard<std::mutex> guard(k.lock);
  int best = -1;
  for (int i = 0; i < kKeptBlobs; ++i) {
    SharedBlob* b = k.blob[i];
    if (b == nullptr || b->device != device || b->stream != stream || b->bytes < bytes || b->bytes > 2 * bytes) continue;
    if (best < 0 || b->bytes < k.blob[best]->bytes) best = i;
  }
  if (best < 0) return nullptr;
  SharedBlob* b = k.blob[best];
  k.blob[best] = nullptr;
  return b;
}

void release_blob(SharedBlob* blob) {
  if (!blob->reusable) return free_blob(blob);
  SharedBlob* evicted = nullptr;
  {
    KeptBlobs& k = kept();
    std::lock_guard<std::mutex> guard(k.lock);
    int slot = 0;
    for (int i = 0; i < kKeptBlobs; ++i) {
      if (k.blob[i] == nullptr) {
        slot = i;
        break;
      }
      if (k.used[i] < k.used[slot]) slot = i;
    }
    evicted = k.blob[slot];
    k.blob[slot] = blob;
    k.used[slot] = ++k.clock;
  }
  if (evicted != nullptr) free_blob(evicted);
}

// An output tensor: a strided view into the shared allocation.
struct OutputView {
  DLManagedTensorVersioned self;
  SharedBlob* blob;
  int64_t shape[kMaxDims];
  int64_t strides[kMaxDims];
};

void release_view(DLManagedTensorVersioned* self) {
  auto* view = reinterpret_cast<OutputView*>(self);
  SharedBlob* blob = view->blob;
  if (blob->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) release_blob(blob);
  delete view;
}

void set_alloc_error(void* op, const char* kind, const char* message) {
  PyErr_Format(PyExc_RuntimeError, "%s: output allocation failed: %s: %s", static_cast<const char*>(op), kind, message);
}

// Elements a view spans: the furthest element + 1 (0 when empty), unless the spec says.
int64_t storage_elements(const OutSpec& spec) {
  if (spec.storage >= 0) return spec.storage;
  int64_t n = 1;
  for (int i = 0; i < spec.ndim; ++i) {
    if (spec.shape[i] == 0) return 0;
    n += (spec.shape[i] - 1) * spec.stride[i];
  }
  return n;
}

bool check_given(const char* op, const char* name, PyObject* given, const OutSpec& spec, int device, Output* out) {
  if (!tensor_arg(op, name, given, false, &out->t)) return false;
  if (out->t.dtype != spec.dtype)
    return type_error(op, "%s must have dtype %s, got %s", name, dtype_name(spec.dtype), dtype_name(out->t.dtype));
  bool same = out->t.ndim == spec.ndim;
  for (int i = 0; same && i < spec.ndim; ++i) same = out->t.shape[i] == spec.shape[i];
  if (!same) {
    std::string expected = "(", got = "(";
    for (int i = 0; i < spec.ndim; ++i) expected += std::to_string(spec.shape[i]) + (i + 1 < spec.ndim ? ", " : "");
    for (int i = 0; i < out->t.ndim; ++i) got += std::to_string(out->t.shape[i]) + (i + 1 < out->t.ndim ? ", " : "");
    return value_error(op, "%s must have shape %s), got %s)", name, expected.c_str(), got.c_str());
  }
  for (int i = 0; i < spec.ndim; ++i)
    if (spec.shape[i] > 1 && out->t.stride[i] != spec.stride[i])
      return value_error(op, "%s must have the strides of the tensor the op returns (dim %d: %lld, got %lld)", name, i,
                         static_cast<long long>(spec.stride[i]), static_cast<long long>(out->t.stride[i]));
  if (!check_same_device(op, name, out->t, device)) return false;
  if (reinterpret_cast<uintptr_t>(out->t.data) % 16 != 0) return value_error(op, "%s must be 16-byte aligned", name);
  Py_INCREF(given);
  out->obj = given;
  return true;
}

}  // namespace

// The bytes [begin, end) a view spans (empty for an empty view).
static void byte_span(const TensorArg& t, uintptr_t* begin, uintptr_t* end) {
  int64_t last = 0;
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 0) {
      *begin = *end = 0;
      return;
    }
    last += (t.shape[i] - 1) * t.stride[i];
  }
  *begin = reinterpret_cast<uintptr_t>(t.data);
  *end = *begin + static_cast<uintptr_t>((last + 1) * dtype_bytes(t.dtype));
}

bool check_no_overlap(const char* op, int n, const char* const* names, PyObject* const* given, const Output* outs,
                      int n_inputs, const char* const* input_names, const TensorArg* const* inputs) {
  for (int i = 0; i < n; ++i) {
    if (given[i] == nullptr || given[i] == Py_None) continue;
    uintptr_t ob, oe;
    byte_span(outs[i].t, &ob, &oe);
    for (int j = 0; j < n_inputs && ob < oe; ++j) {
      if (!inputs[j]->present) continue;
      uintptr_t ib, ie;
      byte_span(*inputs[j], &ib, &ie);
      if (ib < ie && ob < ie && ib < oe)
        return value_error(op, "%s overlaps the memory of %s: the op does not work in place", names[i], input_names[j]);
    }
  }
  return true;
}

void release_kept_outputs() {
  SharedBlob* blobs[kKeptBlobs];
  {
    KeptBlobs& k = kept();
    std::lock_guard<std::mutex> guard(k.lock);
    for (int i = 0; i < kKeptBlobs; ++i) {
      blobs[i] = k.blob[i];
      k.blob[i] = nullptr;
    }
  }
  for (SharedBlob* b : blobs)
    if (b != nullptr) free_blob(b);
}

bool make_outputs(const char* op, int n, const char* const* names, PyObject* const* given, const OutSpec* specs,
                  int device, void* stream, Output* outs) {
  constexpr int64_t kAlign = 256;
  int64_t offsets[kMaxOutputs];
  int64_t total = 0;
  int fresh = 0;
  for (int i = 0; i < n; ++i) {
    if (!specs[i].skip && specs[i].dtype == UNKNOWN)
      return runtime_error(op, "internal error: the host side gave output %s no layout and did not skip it", names[i]);
    if (specs[i].skip) {
      if (given[i] != nullptr && given[i] != Py_None)
        return value_error(op, "%s= was given, but this call produces no %s", names[i], names[i]);
      continue;
    }
    if (given[i] != nullptr && given[i] != Py_None) {
      if (!check_given(op, names[i], given[i], specs[i], device, &outs[i])) return false;
      continue;
    }
    offsets[i] = total;
    total += align_up(storage_elements(specs[i]) * dtype_bytes(specs[i].dtype), kAlign);
    ++fresh;
  }
  if (fresh == 0) return true;
  const DLPackExchangeAPI* api = g_api.load(std::memory_order_relaxed);
  if (api == nullptr) return runtime_error(op, "no torch tensor seen yet to allocate outputs with");
  // The legacy default stream (nullptr) cannot be captured; any other stream is asked.
  bool reusable = total <= kMaxKeptBytes;
  if (reusable && stream != nullptr) {
    const cu::Driver* d = cu::driver(nullptr);
    int capture = 0;
    reusable = d != nullptr && d->cuStreamIsCapturing(static_cast<cu::CUstream>(stream), &capture) == cu::CUDA_SUCCESS &&
               capture == 0;
  }
  SharedBlob* blob = reusable ? take_kept(device, stream, total) : nullptr;
  if (blob != nullptr) {
    blob->refs.store(fresh, std::memory_order_relaxed);
  } else {
    DLTensor proto{};
    proto.device = {kDLCUDA, device};
    proto.dtype = {kDLUInt, 8, 1};
    proto.ndim = 1;
    proto.shape = &total;
    DLManagedTensorVersioned* managed = nullptr;
    if (api->managed_tensor_allocator(&proto, &managed, const_cast<char*>(op), set_alloc_error) != 0 || managed == nullptr) {
      if (!PyErr_Occurred()) runtime_error(op, "output allocation failed");
      return false;
    }
    blob = new SharedBlob{managed, {fresh}, device, stream, total, reusable};
  }
  DLManagedTensorVersioned* managed = blob->managed;
  int pending = fresh;  // views not handed to torch yet (each holds one reference)
  char* base = static_cast<char*>(managed->dl_tensor.data) + managed->dl_tensor.byte_offset;
  for (int i = 0; i < n; ++i) {
    if (specs[i].skip || (given[i] != nullptr && given[i] != Py_None)) continue;
    const OutSpec& spec = specs[i];
    auto* view = new OutputView();
    view->blob = blob;
    view->self.version = managed->version;
    view->self.flags = managed->flags;
    view->self.deleter = release_view;
    DLTensor& dl = view->self.dl_tensor;
    dl.data = base + offsets[i];
    dl.device = {kDLCUDA, device};
    dl.ndim = spec.ndim;
    dl.dtype = to_dl(spec.dtype);
    dl.byte_offset = 0;
    for (int d = 0; d < spec.ndim; ++d) {
      view->shape[d] = spec.shape[d];
      view->strides[d] = spec.stride[d];
    }
    dl.shape = view->shape;
    dl.strides = view->strides;
    Output& out = outs[i];
    out.t.present = true;
    out.t.data = dl.data;
    out.t.ndim = spec.ndim;
    out.t.dtype = spec.dtype;
    out.t.device = device;
    for (int d = 0; d < spec.ndim; ++d) {
      out.t.shape[d] = spec.shape[d];
      out.t.stride[d] = spec.stride[d];
    }
    PyObject* obj = nullptr;
    if (api->managed_tensor_to_py_object_no_sync(&view->self, reinterpret_cast<void**>(&obj)) != 0 || obj == nullptr) {
      // the views not made yet give their references back, then this one is released
      blob->refs.fetch_sub(pending - 1);
      release_view(&view->self);
      if (!PyErr_Occurred()) runtime_error(op, "cannot hand %s back to torch", names[i]);
      return false;
    }
    out.obj = obj;
    --pending;
  }
  return true;
}

// ---------------------------------------------------------------- devices and kernels

namespace {

std::string g_kernel_dir;
std::atomic<int> g_device_arch[kMaxDevices];  // 0: unknown, else arch index + 1
std::atomic<int> g_device_sms[kMaxDevices];   // streaming multiprocessors, set before g_device_arch
cu::CUcontext g_primary[kMaxDevices] = {};
std::mutex g_device_lock;

const cu::Driver* driver_or_error(const char* op) {
  std::string why;
  const cu::Driver* d = cu::driver(&why);
  if (d == nullptr) runtime_error(op, "%s", why.c_str());
  return d;
}

bool load_kernel(const char* op, KernelEntry* e) {
  std::lock_guard<std::mutex> guard(e->lock);
  if (e->kernel.load(std::memory_order_acquire) != nullptr) return true;
  const cu::Driver* d = driver_or_error(op);
  if (d == nullptr) return false;
  std::string path = g_kernel_dir + "/" + e->cubin;
  std::ifstream file(path, std::ios::binary);
  if (!file) return runtime_error(op, "cannot read %s (is the package installed completely?)", path.c_str());
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (sha256_hex(bytes.data(), bytes.size()) != e->sha256)
    return runtime_error(op, "%s does not match the manifest (its sha256 differs): the installed package is damaged; "
                         "reinstall it", path.c_str());
  // Kept for the life of the process, like the library loaded from it.
  auto* image = new std::vector<char>(std::move(bytes));
  cu::CUlibrary library = nullptr;
  cu::CUresult r = d->cuLibraryLoadData(&library, image->data(), nullptr, nullptr, 0, nullptr, nullptr, 0);
  if (r != cu::CUDA_SUCCESS) return runtime_error(op, "loading %s failed: %s", path.c_str(), cu::describe(r).c_str());
  cu::CUkernel kernel = nullptr;
  r = d->cuLibraryGetKernel(&kernel, library, e->entry);
  if (r != cu::CUDA_SUCCESS) return runtime_error(op, "kernel %s not found in %s: %s", e->entry, path.c_str(), cu::describe(r).c_str());
  e->kernel.store(kernel, std::memory_order_release);
  return true;
}

}  // namespace

void set_kernel_dir(const char* dir) { g_kernel_dir = dir; }

int device_sm_count(const char* op, int device) {
  // device_arch validates the ordinal and queries the device once, the SM count with it
  return device_arch(op, device) < 0 ? -1 : g_device_sms[device].load(std::memory_order_relaxed);
}

int plan_sm_count(const char* op, int device) { return device < 0 ? 132 : device_sm_count(op, device); }

int device_arch(const char* op, int device) {
  if (device < 0 || device >= kMaxDevices) {
    value_error(op, "inputs must be CUDA tensors (device ordinal %d)", device);
    return -1;
  }
  int cached = g_device_arch[device].load(std::memory_order_acquire);
  if (cached > 0) return cached - 1;
  const cu::Driver* d = driver_or_error(op);
  if (d == nullptr) return -1;
  std::lock_guard<std::mutex> guard(g_device_lock);
  cu::CUdevice dev = 0;
  int major = 0, minor = 0, sms = 0;
  cu::CUresult r = d->cuDeviceGet(&dev, device);
  if (r == cu::CUDA_SUCCESS) r = d->cuDeviceGetAttribute(&major, cu::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
  if (r == cu::CUDA_SUCCESS) r = d->cuDeviceGetAttribute(&minor, cu::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
  if (r == cu::CUDA_SUCCESS) r = d->cuDeviceGetAttribute(&sms, cu::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
  if (r == cu::CUDA_SUCCESS && g_primary[device] == nullptr) r = d->cuDevicePrimaryCtxRetain(&g_primary[device], dev);
  if (r != cu::CUDA_SUCCESS) {
    runtime_error(op, "cannot query cuda:%d: %s", device, cu::describe(r).c_str());
    return -1;
  }
  int arch = -1;
  for (int i = 0; i < kNumArchs; ++i)
    if (kArchs[i].major == major && kArchs[i].minor == minor) arch = i;
  if (arch < 0) {
    std::string built;
    for (const ArchInfo& a : kArchs)
      built += (built.empty() ? "" : ", ") + std::string(a.name) + " (" + std::to_string(a.major) + "." +
               std::to_string(a.minor) + ")";
    runtime_error(op, "cuda:%d has compute capability %d.%d; this build has kernels for %s only", device, major, minor,
                  built.c_str());
    return -1;
  }
  g_device_sms[device].store(sms, std::memory_order_relaxed);  // before the arch: a reader of it sees the count
  g_device_arch[device].store(arch + 1, std::memory_order_release);
  return arch;
}

namespace {
constexpr int kMaxParams = 128;  // 8-byte slots: 1 KB of the 4 KB CUDA allows; mhc_multilayer_recompute has 101
struct LastLaunch {
  KernelEntry* entry = nullptr;
  Geometry g{};
  ParamSlot slots[kMaxParams];
  int nparams = 0;
  void* stream = nullptr;
};
thread_local LastLaunch t_last;

// One launch of a loaded kernel. With `dependent`, a kernel that waits for the previous
// grid itself (griddepcontrol.wait before any memory access) is launched as that grid's
// programmatic dependent: its blocks may start while the previous grid drains, and in
// a CUDA graph the gap between the two shrinks. A kernel built for thread-block clusters
// gets its cluster shape as a launch attribute. A kernel that synchronizes its whole grid gets
// the cooperative attribute (the driver refuses the launch when its blocks cannot all be
// resident at once). Otherwise it launches plainly.
cu::CUresult issue(const cu::Driver* d, KernelEntry* e, const Geometry& g, cu::CUstream stream, void** params,
                   bool dependent) {
  auto f = reinterpret_cast<cu::CUfunction>(e->kernel.load(std::memory_order_relaxed));
  const bool clustered = g.cluster[0] > 1 || g.cluster[1] > 1 || g.cluster[2] > 1;
  const bool programmatic = dependent && e->pdl;
  if (!programmatic && !clustered && !e->cooperative)
    return d->cuLaunchKernel(f, static_cast<unsigned>(g.grid[0]), static_cast<unsigned>(g.grid[1]),
                             static_cast<unsigned>(g.grid[2]), static_cast<unsigned>(g.block[0]),
                             static_cast<unsigned>(g.block[1]), static_cast<unsigned>(g.block[2]),
                             static_cast<unsigned>(g.dyn_smem), stream, params, nullptr);
  cu::CUlaunchAttribute attrs[3]{};
  unsigned n = 0;
  if (programmatic) {
    attrs[n].id = cu::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[n++].value.programmatic_stream_serialization_allowed = 1;
  }
  if (clustered) {
    attrs[n].id = cu::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    for (int i = 0; i < 3; ++i) attrs[n].value.cluster_dim[i] = static_cast<unsigned>(g.cluster[i] > 1 ? g.cluster[i] : 1);
    ++n;
  }
  if (e->cooperative) {
    attrs[n].id = cu::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attrs[n++].value.cooperative = 1;
  }
  cu::CUlaunchConfig config{static_cast<unsigned>(g.grid[0]),  static_cast<unsigned>(g.grid[1]),
                            static_cast<unsigned>(g.grid[2]),  static_cast<unsigned>(g.block[0]),
                            static_cast<unsigned>(g.block[1]), static_cast<unsigned>(g.block[2]),
                            static_cast<unsigned>(g.dyn_smem), stream, attrs, n};
  return d->cuLaunchKernelEx(&config, f, params, nullptr);
}
}  // namespace

bool current_stream(const char* op, int device, void** stream) {
  *stream = nullptr;
  const DLPackExchangeAPI* api = g_api.load(std::memory_order_relaxed);
  if (api != nullptr && api->current_work_stream(kDLCUDA, device, stream) != 0) {
    if (!PyErr_Occurred()) runtime_error(op, "cannot get the current CUDA stream");
    return false;
  }
  return true;
}

bool launch(const char* op, KernelEntry* e, int device, void* stream, const Geometry& g, ParamSlot* slots, int nparams) {
  if (nparams > kMaxParams) return runtime_error(op, "kernel has %d parameters; at most %d are supported", nparams, kMaxParams);
  void* params[kMaxParams];
  for (int i = 0; i < nparams; ++i) params[i] = &slots[i];
  for (int i = 0; i < 3; ++i)
    if (g.grid[i] == 0) return true;  // nothing to do
  if (g.grid[0] < 0 || g.grid[0] > INT32_MAX || g.grid[1] < 0 || g.grid[1] > 65535 || g.grid[2] < 0 || g.grid[2] > 65535)
    return value_error(op, "the input is too large for one launch (grid %lld x %lld x %lld)",
                       static_cast<long long>(g.grid[0]), static_cast<long long>(g.grid[1]), static_cast<long long>(g.grid[2]));
  const cu::Driver* d = driver_or_error(op);
  if (d == nullptr) return false;
  if (e->kernel.load(std::memory_order_acquire) == nullptr && !load_kernel(op, e)) return false;
  cu::CUkernel kernel = e->kernel.load(std::memory_order_relaxed);
  // The launch needs the tensor's device's primary context current on this thread;
  // whatever was current is restored afterwards (torch's idea of the current device
  // follows the current context).
  cu::CUcontext previous = nullptr;
  d->cuCtxGetCurrent(&previous);
  const bool switched = previous != g_primary[device];
  if (switched) d->cuCtxSetCurrent(g_primary[device]);
  struct Restore {
    const cu::Driver* d;
    cu::CUcontext ctx;
    bool on;
    ~Restore() { if (on) d->cuCtxSetCurrent(ctx); }
  } restore{d, previous, switched && previous != nullptr};
  if (g.dyn_smem > 48 * 1024 && e->smem_set[device].load(std::memory_order_relaxed) < static_cast<uint64_t>(g.dyn_smem) + 1) {
    cu::CUresult r = d->cuKernelSetAttribute(cu::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, static_cast<int>(g.dyn_smem),
                                             kernel, device);
    if (r != cu::CUDA_SUCCESS) return runtime_error(op, "cannot raise the shared memory limit: %s", cu::describe(r).c_str());
    e->smem_set[device].store(static_cast<uint64_t>(g.dyn_smem) + 1, std::memory_order_relaxed);
  }
  cu::CUresult r = issue(d, e, g, static_cast<cu::CUstream>(stream), params, true);
  if (r != cu::CUDA_SUCCESS) return runtime_error(op, "launch failed: %s", cu::describe(r).c_str());
  t_last.entry = e;
  t_last.g = g;
  t_last.nparams = nparams;
  t_last.stream = stream;
  for (int i = 0; i < nparams; ++i) t_last.slots[i] = slots[i];
  return true;
}

bool replay_last_launch(int64_t n, bool dependent) {
  const char* op = "_replay_last_launch";
  if (t_last.entry == nullptr) return runtime_error(op, "no launch on this thread yet");
  const cu::Driver* d = driver_or_error(op);
  if (d == nullptr) return false;
  void* params[kMaxParams];
  for (int i = 0; i < t_last.nparams; ++i) params[i] = &t_last.slots[i];
  const Geometry& g = t_last.g;
  for (int64_t k = 0; k < n; ++k) {
    cu::CUresult r = issue(d, t_last.entry, g, static_cast<cu::CUstream>(t_last.stream), params, dependent);
    if (r != cu::CUDA_SUCCESS) return runtime_error(op, "launch failed: %s", cu::describe(r).c_str());
  }
  return true;
}

bool not_prebuilt(const char* op, const char* wanted, const char* prebuilt) {
  return value_error(op,
                     "no prebuilt kernel for %s. Prebuilt: %s. To add a configuration, list it in a shape table and "
                     "build your own wheel: python -m aot build --table FILE (see the README).",
                     wanted, prebuilt[0] ? prebuilt : "(none in this build)");
}

}  // namespace tka
