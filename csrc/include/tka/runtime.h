// The runtime the generated stubs call: argument parsing, tensor views through
// torch's DLPack exchange API, output allocation, lazily loaded kernels, launch.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>

#include "tka/driver.h"
#include "tka/targets.h"

namespace tka {

constexpr int kMaxDims = 6;
constexpr int kMaxDevices = 64;
// DType, kDTypes, kNumArchs and kArchs: generated from aot/targets.py
inline std::string_view dtype_view(DType d) { return kDTypes[d >= 0 && d < UNKNOWN ? d : UNKNOWN].torch_name; }
// torch's name, e.g. "torch.bfloat16"
inline const char* dtype_name(DType d) { return dtype_view(d).data(); }
// the shape table's name, e.g. "bfloat16"
inline std::string_view short_dtype_name(DType d) {
  return d >= 0 && d < UNKNOWN ? dtype_view(d).substr(6) : dtype_view(d);
}
inline int64_t dtype_bytes(DType d) { return d >= 0 && d < UNKNOWN ? kDTypes[d].bits / 8 : 1; }

// A non-owning view of a torch.Tensor argument (or an absent optional one).
struct TensorArg {
  bool present = false;
  void* data = nullptr;
  int ndim = 0;
  // valid below ndim (left uninitialised: zeroing them on every call costs more than the rest of a view)
  int64_t shape[kMaxDims];
  int64_t stride[kMaxDims];  // in elements
  DType dtype = UNKNOWN;
  int device = -1;  // CUDA ordinal; -1 for a non-CUDA tensor
  bool contiguous() const;
  int64_t numel() const;
};

// A list of tensor arguments (a TensorList parameter): items[0 .. size).
template <int N>
struct TensorListArg {
  int64_t size = 0;
  TensorArg items[N];
};

// Integer helpers for spec expressions (safe on zero divisors: they yield 0 and
// the spec's checks reject the argument).
inline int64_t ceil_div(int64_t a, int64_t b) { return b > 0 ? (a + b - 1) / b : 0; }
inline int64_t align_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
inline int64_t floordiv(int64_t a, int64_t b) { return b ? (a >= 0 ? a / b : -((-a + b - 1) / b)) : 0; }
inline int64_t floormod(int64_t a, int64_t b) { return a - floordiv(a, b) * b; }
inline int64_t truncdiv(int64_t a, int64_t b) { return b ? a / b : 0; }
inline int64_t truncmod(int64_t a, int64_t b) { return b ? a % b : 0; }

// ---- errors: each sets a Python exception naming the op; they return false/nullptr
bool type_error(const char* op, const char* fmt, ...);
bool value_error(const char* op, const char* fmt, ...);
bool runtime_error(const char* op, const char* fmt, ...);

// ---- arguments (METH_FASTCALL | METH_KEYWORDS)
// Fills values[i] (borrowed, nullptr when not given) for `n` parameters, of
// which the first `positional` may be passed by position and the first
// `required` must be given.  `interned` (n slots, nullptr at first; the stub's
// static array) receives the interned names on the first call with keywords:
// a keyword is matched by identity first, as CPython matches its own.
bool parse_args(const char* op, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
                const char* const* names, PyObject** interned, int n, int positional, int required,
                PyObject** values);
// A tensor argument.  A tensor subclass (other than the plain types given to set_torch_path)
// fails with no Python error set and marks the call for the torch path (below).
bool tensor_arg(const char* op, const char* name, PyObject* obj, bool optional, TensorArg* out);

// ---- the torch path: calls with tensor subclasses (fake and functional tensors under
// torch.export and other tracers, users' subclasses) go through the torch custom ops.
// set_torch_path(fn, base, plain): fn(qualname, args, kwargs) runs a call through them;
// tensors of a subclass of `base` other than the types in the tuple `plain` take that path.
bool set_torch_path(PyObject* fn, PyObject* base, PyObject* plain);
// After a stub body failed: the torch path's result when a subclass marked the call (the
// mark is cleared), else nullptr with the body's error left in place.
PyObject* torch_path_or_error(const char* qualname, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames);
// A list or tuple of at most `max_len` tensors into items[0 .. *size) (views of its
// elements, which the caller's sequence keeps alive).
bool tensor_list_arg(const char* op, const char* name, PyObject* obj, int max_len, TensorArg* items, int64_t* size);
bool int_arg(const char* op, const char* name, PyObject* obj, bool optional, int64_t* out, bool* is_none);
bool float_arg(const char* op, const char* name, PyObject* obj, bool optional, double* out, bool* is_none);
bool bool_arg(const char* op, const char* name, PyObject* obj, bool* out);
bool str_arg(const char* op, const char* name, PyObject* obj, std::initializer_list<const char*> choices,
             std::string_view* out);
// One of `choices` by name, or an int (an IntEnum member included) indexing them: the index.
bool enum_arg(const char* op, const char* name, PyObject* obj, std::initializer_list<const char*> choices,
              int64_t* out);
// A torch.dtype among `choices`: a TypeError for anything else, a ValueError for another dtype.
bool dtype_arg(const char* op, const char* name, PyObject* obj, std::initializer_list<DType> choices, DType* out);
// A tuple (or list) of `n` ints, or None where optional.
bool int_tuple_arg(const char* op, const char* name, PyObject* obj, bool optional, int n, int64_t* out, bool* is_none);
// A pre-quantized (data, sf) pair, or, with `plain`, a tensor in its place (sf absent).
bool quantized_arg(const char* op, const char* name, PyObject* obj, bool plain, TensorArg* data, TensorArg* sf);
bool check_dtype(const char* op, const char* name, const TensorArg& t, std::initializer_list<DType> allowed);
bool check_ndim(const char* op, const char* name, const TensorArg& t, int ndim);
// At least `ndim` dims (a tensor with leading dims).
bool check_min_ndim(const char* op, const char* name, const TensorArg& t, int ndim);
bool check_layout(const char* op, const char* name, const TensorArg& t, bool contiguous);
bool check_same_device(const char* op, const char* name, const TensorArg& t, int device);

// ---- outputs
struct OutSpec {
  DType dtype = UNKNOWN;
  int ndim = 0;
  int64_t shape[kMaxDims];  // set below ndim by the stub
  int64_t stride[kMaxDims];
  int64_t storage = -1;  // elements to allocate; -1: dense (derived from shape)
  bool skip = false;     // an optional output this call does not produce (returned as None)
};
// Holds a new reference to the output tensor until it is returned.
struct Output {
  PyObject* obj = nullptr;
  TensorArg t;
  Output() = default;
  Output(const Output&) = delete;
  ~Output() { Py_XDECREF(obj); }
  PyObject* release() { PyObject* o = obj; obj = nullptr; return o; }
  // the output, or None for a skipped optional one
  PyObject* release_or_none() {
    if (obj == nullptr) Py_RETURN_NONE;
    return release();
  }
};
constexpr int kMaxOutputs = 8;
// The `n` outputs of a call: each `given[i]` (borrowed; nullptr or None when not
// passed) is a caller's out= tensor, checked against specs[i]; the others are
// allocated on `device` for `stream` (the call's current_stream), together, in one
// allocation; a small one may be a recently freed allocation of an earlier call on the
// same device and stream.
bool make_outputs(const char* op, int n, const char* const* names, PyObject* const* given, const OutSpec* specs,
                  int device, void* stream, Output* outs);
void dense_strides(OutSpec* spec);
// Refuses a caller's out= tensor whose memory overlaps one of the `n_inputs` input tensors
// (outputs the call allocated cannot).
bool check_no_overlap(const char* op, int n, const char* const* names, PyObject* const* given, const Output* outs,
                      int n_inputs, const char* const* input_names, const TensorArg* const* inputs);
// Hands the output memory kept for reuse (see make_outputs) back to torch's allocator.
void release_kept_outputs();

// ---- kernels
struct Geometry {
  int64_t grid[3];
  int64_t block[3];
  int64_t dyn_smem;
  // Blocks per thread-block cluster along x, y, z; all 0 or 1: no clusters (the launch
  // then sets no cluster attribute).
  int64_t cluster[3];
};
// One prebuilt cubin: loaded on first use (thread-safe), once per process.
struct KernelEntry {
  const char* arch;
  const char* cubin;   // path relative to the package's kernels/ folder
  const char* sha256;  // the manifest's digest of the cubin (hex), checked before it is loaded
  const char* entry;
  bool pdl;  // waits for the previous grid itself: launched as its programmatic dependent
  bool cooperative;  // synchronizes its whole grid: launched cooperatively (every block resident)
  std::atomic<cu::CUkernel> kernel{nullptr};
  std::mutex lock;
  std::atomic<uint64_t> smem_set[kMaxDevices] = {};  // dynamic smem limit raised, per device (+1)
};
// The arch index (into kArchs) of a CUDA device, or -1 with an error set.
int device_arch(const char* op, int device);
// The streaming-multiprocessor count of a CUDA device (queried with its arch, once), or -1 with
// an error set.
int device_sm_count(const char* op, int device);
// The SM count a plan sizes a grid by: device_sm_count for a CUDA tensor's device, 132 (an
// H200's) for a tensor off CUDA, whose call only plans (argument checks, config lookup).
int plan_sm_count(const char* op, int device);
union ParamSlot;
// torch's current stream of `device` (nullptr, the legacy default stream, before any
// torch tensor was seen); a stub asks once per call, for its outputs and its launch.
bool current_stream(const char* op, int device, void** stream);
// Launches `entry` on `stream` (the call's current_stream); `slots` hold the kernel's
// `nparams` parameters in device order.
bool launch(const char* op, KernelEntry* entry, int device, void* stream, const Geometry& g, ParamSlot* slots,
            int nparams);
// Re-issues this thread's last launch `n` times with bare driver calls (the bench's
// baseline for host overhead): plain cuLaunchKernel, or with `dependent` the op's own
// launch (cuLaunchKernelEx as a programmatic dependent, for kernels that allow it).
bool replay_last_launch(int64_t n, bool dependent);
// "not prebuilt" error listing the prebuilt configs.
bool not_prebuilt(const char* op, const char* wanted, const char* prebuilt);

// Union slot a launcher converts each kernel parameter into.
union ParamSlot {
  void* ptr;
  int32_t i32;
  int64_t i64;
  float f32;
};
bool fits_int32(const char* op, const char* name, int64_t v);

// A static-config value as the stubs compare it with the prebuilt table.
struct ConfigValue {
  int64_t i = 0;
  std::string_view s;
  ConfigValue() = default;
  ConfigValue(DType d) : i(d), s(short_dtype_name(d)) {}
  ConfigValue(std::string_view v) : s(v) {}
  ConfigValue(const char* v) : s(v) {}
  template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
  ConfigValue(T v) : i(static_cast<int64_t>(v)) {}
  std::string show() const { return s.empty() ? std::to_string(i) : std::string(s); }
};

// Module setup (called from the module init).
void set_kernel_dir(const char* dir);
bool add_op(PyObject* parent_module, const char* module, PyMethodDef* def, const char* qualname_module);

}  // namespace tka
