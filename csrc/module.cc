// The _C extension module: binds the generated op stubs (raw METH_FASTCALL
// functions: the generic pybind11 casters would cost more than the launch
// budget) into per-family submodules, and tells the runtime where the cubins are.
#include <dlfcn.h>
#include <pybind11/pybind11.h>

#include <string>
#include <string_view>

#include "tka/ops.h"
#include "tka/runtime.h"
#include "tka/sha256.h"

namespace py = pybind11;

static std::string package_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&package_dir), &info) == 0 || info.dli_fname == nullptr) return ".";
  std::string path = info.dli_fname;
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "tile_kernels_aot host extension: prebuilt-kernel launch stubs.";
  const std::string kernels = package_dir() + "/kernels";
  tka::set_kernel_dir(kernels.c_str());
  m.attr("kernel_dir") = kernels;
  m.def("_replay_last_launch", [](int64_t n, bool dependent) {
    if (!tka::replay_last_launch(n, dependent)) throw py::error_already_set();
  }, py::arg("n"), py::arg("dependent") = false,
  "Re-issue this thread's last kernel launch n times with bare driver calls (bench baseline): plain "
  "cuLaunchKernel, or with dependent=True cuLaunchKernelEx as a programmatic dependent, as the op launched it.");
  m.def("_sha256_hex", [](py::bytes data) {
    std::string_view bytes = data;
    return tka::sha256_hex(bytes.data(), bytes.size());
  }, py::arg("data"), "The runtime's SHA-256 of data as hex (the digest it checks each cubin with; for the tests).");
  m.def("_set_torch_path", [](py::object fn, py::object base, py::object plain) {
    if (!tka::set_torch_path(fn.ptr(), base.ptr(), plain.ptr())) throw py::error_already_set();
  }, py::arg("fn"), py::arg("base"), py::arg("plain"),
  "Hand calls whose tensors are subclasses of base (other than the types in plain) to "
  "fn(qualname, args, kwargs): the torch custom ops (tile_kernels_aot.custom_ops).");
  m.def("empty_cache", &tka::release_kept_outputs,
        "Hand the memory of freed outputs kept for reuse back to torch's caching allocator.");
  py::list families;
  for (int i = 0; tka::kOps[i].module != nullptr; ++i) {
    const tka::OpDef& op = tka::kOps[i];
    py::module_ sub;
    if (py::hasattr(m, op.module)) {
      sub = m.attr(op.module);
    } else {
      sub = py::module_::import("types").attr("ModuleType")(std::string("tile_kernels_aot._C.") + op.module);
      m.attr(op.module) = sub;
      families.append(op.module);
    }
    py::str public_module(std::string("tile_kernels_aot.") + op.module);
    PyObject* fn = PyCFunction_NewEx(op.def, nullptr, public_module.ptr());
    if (fn == nullptr) throw py::error_already_set();
    sub.attr(op.def->ml_name) = py::reinterpret_steal<py::object>(fn);
  }
  m.attr("families") = families;  // the public families with ops in this build
}
