// The few CUDA driver API entry points the runtime uses, resolved at first use
// through dlopen("libcuda.so.1") + cuGetProcAddress.  Nothing links libcuda or
// cudart, so the extension imports on machines without a GPU or a driver.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tka::cu {

using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUlibrary = struct CUlib_st*;
using CUkernel = struct CUkern_st*;
using CUfunction = struct CUfunc_st*;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr int CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;
constexpr int CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2;
constexpr int CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4;
constexpr int CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6;

// cuda.h's CUlaunchAttribute and CUlaunchConfig (layouts fixed by the driver ABI).
struct CUlaunchAttribute {
  int id;
  char pad[8 - sizeof(int)];
  union {
    char bytes[64];
    int programmatic_stream_serialization_allowed;
    int cooperative;
    unsigned cluster_dim[3];  // clusterDim {x, y, z}
  } value;
};
struct CUlaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_mem_bytes;
  CUstream stream;
  CUlaunchAttribute* attrs;
  unsigned num_attrs;
};
static_assert(sizeof(CUlaunchAttribute) == 72 && sizeof(CUlaunchConfig) == 56, "CUDA driver ABI");

struct Driver {
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuLibraryLoadData)(CUlibrary*, const void*, void*, void*, unsigned int, void*, void*, unsigned int);
  CUresult (*cuLibraryGetKernel)(CUkernel*, CUlibrary, const char*);
  CUresult (*cuKernelSetAttribute)(int, int, CUkernel, CUdevice);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
  CUresult (*cuLaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);
  CUresult (*cuStreamIsCapturing)(CUstream, int*);  // status: 0 none, 1 active, 2 invalidated
};

// The resolved table, or nullptr with `error` set when no usable driver exists.
const Driver* driver(std::string* error);

// "CUDA_ERROR_X (message)" for a driver result code.
std::string describe(CUresult result);

}  // namespace tka::cu
