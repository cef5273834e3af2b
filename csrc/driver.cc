#include "tka/driver.h"

#include <dlfcn.h>

#include <mutex>
#include <type_traits>

namespace tka::cu {
namespace {

using GetProcAddress = CUresult (*)(const char*, void**, int, uint64_t, int*);

Driver g_driver;
std::string g_error;
bool g_ok = false;
std::once_flag g_once;

void load() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    g_error = std::string("cannot load the CUDA driver (libcuda.so.1): ") + (why ? why : "unknown error");
    return;
  }
  auto get_proc = reinterpret_cast<GetProcAddress>(dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    g_error = "the CUDA driver is too old: cuGetProcAddress_v2 is missing (a driver for CUDA 13.0 or newer is needed)";
    return;
  }
  bool ok = true;
  auto resolve = [&](const char* name, auto& fn) {
    void* p = nullptr;
    int status = 0;
    // 12000: the ABI version of the entry points as declared in driver.h.
    if (get_proc(name, &p, 12000, 0, &status) != CUDA_SUCCESS || p == nullptr) {
      if (ok) g_error = std::string("the CUDA driver lacks ") + name;
      ok = false;
      return;
    }
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
  };
  resolve("cuInit", g_driver.cuInit);
  resolve("cuGetErrorName", g_driver.cuGetErrorName);
  resolve("cuGetErrorString", g_driver.cuGetErrorString);
  resolve("cuDeviceGet", g_driver.cuDeviceGet);
  resolve("cuDeviceGetAttribute", g_driver.cuDeviceGetAttribute);
  resolve("cuDevicePrimaryCtxRetain", g_driver.cuDevicePrimaryCtxRetain);
  resolve("cuCtxGetCurrent", g_driver.cuCtxGetCurrent);
  resolve("cuCtxSetCurrent", g_driver.cuCtxSetCurrent);
  resolve("cuLibraryLoadData", g_driver.cuLibraryLoadData);
  resolve("cuLibraryGetKernel", g_driver.cuLibraryGetKernel);
  resolve("cuKernelSetAttribute", g_driver.cuKernelSetAttribute);
  resolve("cuLaunchKernel", g_driver.cuLaunchKernel);
  resolve("cuLaunchKernelEx", g_driver.cuLaunchKernelEx);
  resolve("cuStreamIsCapturing", g_driver.cuStreamIsCapturing);
  if (!ok) return;
  CUresult r = g_driver.cuInit(0);
  if (r != CUDA_SUCCESS) {
    g_error = "cuInit failed: " + describe(r);
    return;
  }
  g_ok = true;
}

}  // namespace

const Driver* driver(std::string* error) {
  std::call_once(g_once, load);
  if (!g_ok) {
    if (error) *error = g_error;
    return nullptr;
  }
  return &g_driver;
}

std::string describe(CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (g_ok) {
    g_driver.cuGetErrorName(result, &name);
    g_driver.cuGetErrorString(result, &text);
  }
  std::string s = name ? name : ("CUresult " + std::to_string(result));
  if (text) s += std::string(" (") + text + ")";
  return s;
}

}  // namespace tka::cu
