// An XLA FFI call that launches a chain of precompiled kernels with programmatic dependent
// launch (PDL): the launch path XLA (jax 0.11.2) does not give Pallas Triton kernels.
// Probe code for benchmarks/pdl_ffi_probe.py (issue 5); not used by the engine.
//
// Build (the probe does it on the GPU machine):
//   g++ -O2 -shared -fPIC -std=c++17 -I$(jax ffi include dir) -I/usr/local/cuda/include \
//       pdl_ffi_launch.cc -o libpdl_ffi_launch.so -L/usr/local/cuda/lib64/stubs -lcuda
//
// Python loads cubins with jaxinfer_pdl_load_kernel (ctypes) and calls the FFI target
// "jaxinfer_pdl_chain" with:
//   operands: any buffers; results: any buffers (buffer b < n_args is operand b, else result
//             b - n_args);
//   kernels   [L] int64: the kernel id of each launch, in stream order;
//   grids     [3L] int64: grid x, y, z of each launch;
//   nparams   [L] int64: how many buffer parameters each launch takes;
//   params    [sum nparams] int64: the buffer index of each parameter, launch by launch;
//   pdl       int64: 1 = every launch after the first may start before its predecessor ends
//             (the kernels wait with griddepcontrol.wait before reading what it wrote);
//             2 = the first launch too (its predecessor is whatever XLA ran before the call).
// Each kernel also gets `extra_params` null pointers after its buffers (Triton's scratch
// pointers).

#include <cuda.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Kernel {
  CUfunction fn;
  unsigned threads;
  unsigned shared;
  int extra_params;
};

std::mutex mu;
std::vector<Kernel> kernels;

std::string CuError(CUresult r) {
  const char* s = nullptr;
  cuGetErrorString(r, &s);
  return s ? s : "unknown CUDA error";
}

ffi::Error Chain(void* stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                 ffi::Span<const int64_t> ids, ffi::Span<const int64_t> grids,
                 ffi::Span<const int64_t> nparams, ffi::Span<const int64_t> params,
                 int64_t pdl) {
  std::vector<void*> buffers;  // device pointers: operands, then results
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return ffi::Error::InvalidArgument("operand is not a buffer");
    buffers.push_back(b->untyped_data());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return ffi::Error::InvalidArgument("result is not a buffer");
    buffers.push_back((*b)->untyped_data());
  }
  if (grids.size() != 3 * ids.size() || nparams.size() != ids.size())
    return ffi::Error::InvalidArgument("grids must hold 3 entries and nparams 1 per launch");
  size_t p = 0;
  for (size_t l = 0; l < ids.size(); ++l) {
    Kernel k;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (ids[l] < 0 || ids[l] >= static_cast<int64_t>(kernels.size()))
        return ffi::Error::InvalidArgument("unknown kernel id");
      k = kernels[ids[l]];
    }
    std::vector<void*> ptrs;  // the values the parameters point at
    for (int64_t i = 0; i < nparams[l]; ++i, ++p) {
      if (p >= params.size() || params[p] < 0 || params[p] >= static_cast<int64_t>(buffers.size()))
        return ffi::Error::InvalidArgument("parameter index out of range");
      ptrs.push_back(buffers[params[p]]);
    }
    for (int i = 0; i < k.extra_params; ++i) ptrs.push_back(nullptr);
    std::vector<void*> kparams;
    for (auto& v : ptrs) kparams.push_back(&v);

    CUlaunchConfig cfg = {};
    cfg.gridDimX = grids[3 * l];
    cfg.gridDimY = grids[3 * l + 1];
    cfg.gridDimZ = grids[3 * l + 2];
    cfg.blockDimX = k.threads;
    cfg.blockDimY = 1;
    cfg.blockDimZ = 1;
    cfg.sharedMemBytes = k.shared;
    cfg.hStream = static_cast<CUstream>(stream);
    CUlaunchAttribute attr = {};
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    if (pdl == 2 || (pdl == 1 && l > 0)) {
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
    }
    CUresult r = cuLaunchKernelEx(&cfg, k.fn, kparams.data(), nullptr);
    if (r != CUDA_SUCCESS)
      return ffi::Error::Internal("cuLaunchKernelEx: " + CuError(r));
  }
  return ffi::Error::Success();
}

}  // namespace

// Loads a cubin into the primary context of device `device` and returns the kernel's id, or
// -1 (the message in err, err_len bytes).
extern "C" int64_t jaxinfer_pdl_load_kernel(const void* cubin, const char* name, int device,
                                            unsigned threads, unsigned shared,
                                            int extra_params, char* err, int err_len) {
  auto fail = [&](const std::string& what, CUresult r) -> int64_t {
    std::string m = what + ": " + CuError(r);
    snprintf(err, err_len, "%s", m.c_str());
    return -1;
  };
  CUresult r = cuInit(0);
  if (r != CUDA_SUCCESS) return fail("cuInit", r);
  CUdevice dev;
  if ((r = cuDeviceGet(&dev, device)) != CUDA_SUCCESS) return fail("cuDeviceGet", r);
  CUcontext ctx;
  if ((r = cuDevicePrimaryCtxRetain(&ctx, dev)) != CUDA_SUCCESS)
    return fail("cuDevicePrimaryCtxRetain", r);
  if ((r = cuCtxPushCurrent(ctx)) != CUDA_SUCCESS) return fail("cuCtxPushCurrent", r);
  CUmodule mod;
  CUfunction fn;
  r = cuModuleLoadData(&mod, cubin);
  if (r == CUDA_SUCCESS) r = cuModuleGetFunction(&fn, mod, name);
  if (r == CUDA_SUCCESS && shared > 48 * 1024)
    r = cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared);
  CUcontext popped;
  cuCtxPopCurrent(&popped);
  if (r != CUDA_SUCCESS) return fail("loading the cubin", r);
  std::lock_guard<std::mutex> lock(mu);
  kernels.push_back({fn, threads, shared, extra_params});
  return static_cast<int64_t>(kernels.size()) - 1;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPdlChain, Chain,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("kernels")
                                  .Attr<ffi::Span<const int64_t>>("grids")
                                  .Attr<ffi::Span<const int64_t>>("nparams")
                                  .Attr<ffi::Span<const int64_t>>("params")
                                  .Attr<int64_t>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});
