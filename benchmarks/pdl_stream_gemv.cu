// A decode GEMV that streams most of its weight into shared memory *before* waiting for its
// predecessor (griddepcontrol.wait), then reads the activations and finishes: the kernel form
// Pallas Triton cannot express (its pipeliner issues the activation loads with the weights').
// Probe code for benchmarks/ffi_step_probe.py (issue 5, session 14); not used by the engine.
//
// Same signature and output as the model's o projection (pallas_kernels.norm_matmul with
// partials=True, split 2): x [1, K] bf16, w [K, N] bf16 row-major, out [2, 1, N] float32, out[s]
// the sum over rows s*K/2 .. (s+1)*K/2 - 1. Grid (NBLK, 2): block (b, s) owns the columns of
// vectors [b * V / NBLK, (b + 1) * V / NBLK) (V = N / 8 vectors of 8 bf16, 16 bytes) of K chunk
// s; 32 * kMaxVec threads, thread t taking vector t % kMaxVec of rows t / kMaxVec (mod 32).
// NBLK = 64: 64 columns per block, 128 blocks; NBLK = 62: 124 blocks, which fit beside the
// decode attention's 8 (a block of ~220 KB of shared memory cannot share an SM with one).
// PRE_ROWS rows of the block's tile are requested with cp.async before the wait (kMaxVec * 16
// bytes of dynamic shared memory per row, at least the reduction's, plus 4 KB for x's chunk);
// the rest are read from global memory after it, 16 rows per thread at once.

#include <cuda_bf16.h>

#ifndef PRE_ROWS
#define PRE_ROWS 1536
#endif
#ifndef NBLK
#define NBLK 64
#endif
#ifndef KDIM
#define KDIM 4096
#endif
#ifndef NDIM
#define NDIM 4096
#endif

constexpr int kVecs = NDIM / 8;                          // 16-byte column vectors of a row
constexpr int kMaxVec = (kVecs + NBLK - 1) / NBLK;       // vectors per block, at most
constexpr int kChunk = KDIM / 2;                         // rows per block (split 2)
constexpr int kGroups = 32;                              // row groups
constexpr int kThreads = kGroups * kMaxVec;
constexpr int kRed = kGroups * kMaxVec * 8;              // reduction floats
constexpr int kTileVecs = (PRE_ROWS * kMaxVec * 4 > kRed ? PRE_ROWS * kMaxVec * 4 : kRed) / 4;
constexpr int kBatch = 16;  // tail rows per thread loaded at once (16 x 16 B in flight)

__device__ __forceinline__ void fma8(float* acc, uint4 w, float xr) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float2 f = __bfloat1622float2(h[j]);
    acc[2 * j] += xr * f.x;
    acc[2 * j + 1] += xr * f.y;
  }
}

extern "C" __global__ void __launch_bounds__(kThreads)
pdl_stream_gemv(const __nv_bfloat16* x, const __nv_bfloat16* __restrict__ w,
                float* __restrict__ out) {
  // dynamic shared memory: the staged tile [PRE_ROWS][kMaxVec] vectors (reused for the
  // reduction), then x's chunk [kChunk] bf16
  extern __shared__ uint4 smem[];
  uint4* tile = smem;
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem + kTileVecs);
  const int v0 = blockIdx.x * kVecs / NBLK, nvec = (blockIdx.x + 1) * kVecs / NBLK - v0;
  const int row0 = blockIdx.y * kChunk;
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  // 1. The weights: independent of every earlier kernel, requested before the wait.
  for (int i = threadIdx.x; i < PRE_ROWS * nvec; i += kThreads) {
    const int r = i / nvec, v = i - r * nvec;
    const uint4* src = wv + (size_t)(row0 + r) * kVecs + v0 + v;
    unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(tile + r * kMaxVec + v));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  // 2. Wait for the predecessor (the attention kernel writes x); a no-op without PDL. x is
  // then read around the L1 (ld.global.cg): the buffer may have held an earlier kernel's data.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const uint4* xv = reinterpret_cast<const uint4*>(x + row0);
  for (int i = threadIdx.x; i < kChunk / 8; i += kThreads)
    reinterpret_cast<uint4*>(xs)[i] = __ldcg(xv + i);
  const int c = threadIdx.x % kMaxVec, g = threadIdx.x / kMaxVec;
  const bool active = c < nvec;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  __syncthreads();  // xs written
  // 3. The rows not staged, straight from global memory, kBatch rows per thread in flight.
  if (active) {
    for (int r0 = PRE_ROWS + g; r0 < kChunk; r0 += kGroups * kBatch) {
      uint4 wr[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        int r = r0 + b * kGroups;
        if (r < kChunk) wr[b] = __ldg(wv + (size_t)(row0 + r) * kVecs + v0 + c);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        int r = r0 + b * kGroups;
        if (r < kChunk) fma8(acc, wr[b], __bfloat162float(xs[r]));
      }
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();  // the staged tile landed
  if (active) {
#pragma unroll 8
    for (int r = g; r < PRE_ROWS; r += kGroups)
      fma8(acc, tile[r * kMaxVec + c], __bfloat162float(xs[r]));
  }
  // 4. Sum the 32 row groups: [32][kMaxVec * 8] floats in the (now free) shared tile.
  __syncthreads();
  float* red = reinterpret_cast<float*>(tile);
#pragma unroll
  for (int j = 0; j < 8; ++j) red[g * kMaxVec * 8 + c * 8 + j] = acc[j];
  __syncthreads();
  if (threadIdx.x < nvec * 8) {
    float s = 0.f;
#pragma unroll 8
    for (int k = 0; k < kGroups; ++k) s += red[k * kMaxVec * 8 + threadIdx.x];
    out[blockIdx.y * NDIM + v0 * 8 + threadIdx.x] = s;
  }
  // 5. Let the next kernel launch (it waits for this one's completion before reading out).
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
