// What a kernel on the SMs can stream at the norms' size (128 MiB an array), against the
// driver's device-to-device copy: is the gap between our Pallas Triton streams (~3.6-3.8 TB/s)
// and the 128 MiB copy (~4.07 TB/s) a limit of SM kernels, or of the access pattern?
//
//   nvcc -O3 -arch=sm_90a -o /tmp/sm_stream bench/experiments/sm_stream.cu && /tmp/sm_stream
//
// Variants, each moving k arrays in and j out (1->1 a copy, 2->2 the norm forward, 3->1 the
// norm backward's mix), timed round-robin over 8 distinct buffer sets, median of the rounds:
//   memcpy      cudaMemcpyAsync, one per array
//   tile U T    one block per contiguous tile of T threads x U 16-byte vectors (Triton's shape:
//               a [rows, 4096] bf16 block with 4 warps is U = 4 * rows, T = 128); all U loads of
//               a thread are issued before its first store
//   grid U B T  B blocks of T threads striding over the arrays, U vectors in flight a thread
// Output: one line per variant (name, ms, GB/s counting bytes read and written), and the table
// sorted by speed at the end.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e = (x);                                                          \
    if (e != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

constexpr size_t kBytes = size_t(16384) * 4096 * 2;  // one (16384, 4096) bf16 array
constexpr size_t kVecs = kBytes / sizeof(uint4);
constexpr int kSets = 8;
constexpr int kMaxIn = 3, kMaxOut = 2;

struct Arrays {
  const uint4* in[kMaxIn];
  uint4* out[kMaxOut];
};

// Sums the inputs as 32-bit words (not meaningful arithmetic, but every input is consumed and
// nothing is optimized away); each output gets the same vector.
__device__ __forceinline__ uint4 combine(uint4 a, uint4 b) {
  return make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
}

template <int K, int J, int U>
__global__ void tile_kernel(Arrays a) {
  size_t base = size_t(blockIdx.x) * blockDim.x * U + threadIdx.x;
  uint4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) v[u] = a.in[0][base + size_t(u) * blockDim.x];
#pragma unroll
  for (int k = 1; k < K; ++k)
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = combine(v[u], a.in[k][base + size_t(u) * blockDim.x]);
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int u = 0; u < U; ++u) a.out[j][base + size_t(u) * blockDim.x] = v[u];
}

template <int K, int J, int U>
__global__ void grid_kernel(Arrays a) {
  size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t base = size_t(blockIdx.x) * blockDim.x + threadIdx.x; base < kVecs;
       base += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      size_t i = base + u * stride;
      if (i < kVecs) v[u] = a.in[0][i];
    }
#pragma unroll
    for (int k = 1; k < K; ++k)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        size_t i = base + u * stride;
        if (i < kVecs) v[u] = combine(v[u], a.in[k][i]);
      }
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        size_t i = base + u * stride;
        if (i < kVecs) a.out[j][i] = v[u];
      }
  }
}

struct Variant {
  std::string name;
  int k, j;
  std::function<void(const Arrays&, cudaStream_t)> launch;
  std::vector<float> ms;  // per round: mean over the sets
};

template <int K, int J, int U>
void add_tile(std::vector<Variant>& vs, int threads) {
  size_t per_block = size_t(threads) * U;
  if (kVecs % per_block) return;
  int blocks = int(kVecs / per_block);
  vs.push_back({"tile U" + std::to_string(U) + " T" + std::to_string(threads), K, J,
                [=](const Arrays& a, cudaStream_t s) {
                  tile_kernel<K, J, U><<<blocks, threads, 0, s>>>(a);
                }});
}

template <int K, int J, int U>
void add_grid(std::vector<Variant>& vs, int blocks, int threads) {
  vs.push_back({"grid U" + std::to_string(U) + " B" + std::to_string(blocks) + " T" +
                    std::to_string(threads),
                K, J, [=](const Arrays& a, cudaStream_t s) {
                  grid_kernel<K, J, U><<<blocks, threads, 0, s>>>(a);
                }});
}

template <int K, int J>
void add_family(std::vector<Variant>& vs, int sms) {
  if (K == J) {
    vs.push_back({"memcpy", K, J, [](const Arrays& a, cudaStream_t s) {
                    for (int j = 0; j < J; ++j)
                      CHECK(cudaMemcpyAsync(a.out[j], a.in[j], kBytes, cudaMemcpyDeviceToDevice, s));
                  }});
  }
  for (int t : {128, 256}) {
    add_tile<K, J, 4>(vs, t);
    add_tile<K, J, 8>(vs, t);
    add_tile<K, J, 16>(vs, t);
  }
  for (int per_sm : {4, 8, 16}) {
    add_grid<K, J, 2>(vs, sms * per_sm, 256);
    add_grid<K, J, 4>(vs, sms * per_sm, 256);
    add_grid<K, J, 8>(vs, sms * per_sm, 256);
  }
  add_grid<K, J, 2>(vs, sms * 2, 1024);
}

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int sms = prop.multiProcessorCount;
  std::printf("%s, %d SMs, L2 %d MiB\n", prop.name, sms, prop.l2CacheSize >> 20);

  std::vector<Arrays> sets(kSets);
  for (auto& s : sets) {
    for (int k = 0; k < kMaxIn; ++k) {
      uint4* p;
      CHECK(cudaMalloc(&p, kBytes));
      CHECK(cudaMemset(p, k + 1, kBytes));
      s.in[k] = p;
    }
    for (int j = 0; j < kMaxOut; ++j) CHECK(cudaMalloc(&s.out[j], kBytes));
  }

  std::vector<Variant> vs;
  size_t first21 = 0, first31 = 0;
  add_family<1, 1>(vs, sms);
  first21 = vs.size();
  add_family<2, 2>(vs, sms);
  first31 = vs.size();
  add_family<3, 1>(vs, sms);

  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  const int rounds = 11, calls = 2;  // each timing: calls x kSets launches
  for (auto& v : vs)                 // warm-up (and a first check that every variant launches)
    for (int s = 0; s < kSets; ++s) v.launch(sets[s], stream);
  CHECK(cudaStreamSynchronize(stream));
  CHECK(cudaGetLastError());
  std::mt19937 rng(0);
  std::vector<size_t> order(vs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  for (int r = 0; r < rounds; ++r) {
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t i : order) {
      auto& v = vs[i];
      CHECK(cudaEventRecord(start, stream));
      for (int c = 0; c < calls; ++c)
        for (int s = 0; s < kSets; ++s) v.launch(sets[s], stream);
      CHECK(cudaEventRecord(stop, stream));
      CHECK(cudaEventSynchronize(stop));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, start, stop));
      v.ms.push_back(ms / (calls * kSets));
    }
  }
  CHECK(cudaGetLastError());

  auto report = [&](size_t lo, size_t hi, const char* title) {
    std::vector<std::pair<double, size_t>> rows;
    for (size_t i = lo; i < hi; ++i) {
      auto m = vs[i].ms;
      std::sort(m.begin(), m.end());
      double med = m[m.size() / 2];
      rows.push_back({double(vs[i].k + vs[i].j) * kBytes / (med * 1e-3) / 1e9, i});
    }
    std::sort(rows.rbegin(), rows.rend());
    std::printf("\n== %s (GB/s counting bytes read and written; median of %d rounds)\n", title,
                rounds);
    for (auto& [gbps, i] : rows) {
      auto m = vs[i].ms;
      std::sort(m.begin(), m.end());
      std::printf("%-24s %8.4f ms %6.0f GB/s  (rounds %.4f-%.4f)\n", vs[i].name.c_str(),
                  m[m.size() / 2], gbps, m.front(), m.back());
    }
  };
  report(0, first21, "1->1");
  report(first21, first31, "2->2");
  report(first31, vs.size(), "3->1");
  return 0;
}
