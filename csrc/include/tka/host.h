// What an op folder's host.h builds on: tensor views, output specs, the integer helpers, and
// the check macros.
//
// A host.h implements, for each public function `F` of its folder, in namespace
// `tka::<family>_<folder>::F` (next to the generated `Args`, `Outs` and `OutSpecs` there, and
// the folder's `Config`, `Constants` and `KernelArgs` one level up; see docs/adding-an-op.md):
//
//   bool plan(const char* op, const Args& a, Plan& p, Config& c);  // dims, checks, static config
//   void outputs(const Args& a, const Plan& p, OutSpecs& s);       // shapes, dtypes, strides
//   bool needs_launch(const Plan& p);                              // false: empty input
//   bool kernel_args(const char* op, const Args& a, const Plan& p, const Constants& k, const Outs& o,
//                    KernelArgs& ka);                               // the kernel's parameters
//
// An op whose schema sets `launches` launches its kernel several times per call, in order:
//   int64_t launches(const Plan& p);                               // how many (>= 1)
//   bool kernel_args(..., KernelArgs& ka, int64_t launch);         // launch `launch`'s parameters
//
// An op whose schema sets `prologue` launches other kernels first, on the call's stream, after
// its kernel_args (e.g. another folder's op through that op's generated `run`, in its args.h):
//   bool prologue(const char* op, const Args& a, const Plan& p, const Outs& o, int device, void* stream);
// An op's `scratch` buffers follow its outputs in `OutSpecs` (set by `outputs`) and `Outs`.
//
// `Plan` is the host's own struct (its dims). Every function that can fail sets a Python
// exception through the macros below and returns false; nothing has been launched then.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "tka/runtime.h"

namespace tka {

// "<op>: <arg> <message>" as a ValueError (or TypeError); returns false.
bool arg_error(PyObject* type, const char* op, const char* arg, const char* fmt, ...);

// A dense (row-major) output of `dtype` and `shape`.
inline void dense_output(OutSpec& s, DType dtype, std::initializer_list<int64_t> shape) {
  s.dtype = dtype;
  s.ndim = static_cast<int>(shape.size());
  int d = 0;
  for (int64_t extent : shape) s.shape[d++] = extent;
  dense_strides(&s);
}

// An output view with explicit element strides over `storage` allocated elements.
inline void strided_output(OutSpec& s, DType dtype, std::initializer_list<int64_t> shape,
                           std::initializer_list<int64_t> strides, int64_t storage) {
  dense_output(s, dtype, shape);
  int d = 0;
  for (int64_t stride : strides) s.stride[d++] = stride;
  s.storage = storage;
}

inline bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// `set(k, v)` where it compiles (the build's KernelArgs has the field it sets), else nothing.
template <class K, class V, class F>
inline auto set_if_present(K& k, V v, F set, int) -> decltype(set(k, v)) { set(k, v); }
template <class K, class V, class F>
inline void set_if_present(K&, V, F, long) {}

// `ka.FIELD = value` when the build's KernelArgs has FIELD: TileLang keeps a parameter only in
// the configs that use it (e.g. a later launch's scratch), and a build may lack those configs.
#define TKA_SET_IF_PRESENT(ka, FIELD, value) \
  ::tka::set_if_present((ka), (value), [](auto& args, auto v) -> decltype(void(args.FIELD = v)) { args.FIELD = v; }, 0)

}  // namespace tka

// In a host function with `const char* op` in scope: raise ValueError (TKA_CHECK) or TypeError
// (TKA_CHECK_TYPE) "<op>: <arg> <printf message>" and return false unless `cond` holds.
#define TKA_CHECK(cond, arg, ...) \
  do {                            \
    if (!(cond)) return ::tka::arg_error(PyExc_ValueError, op, arg, __VA_ARGS__); \
  } while (0)
#define TKA_CHECK_TYPE(cond, arg, ...) \
  do {                                 \
    if (!(cond)) return ::tka::arg_error(PyExc_TypeError, op, arg, __VA_ARGS__); \
  } while (0)
