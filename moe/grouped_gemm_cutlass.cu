// The device-scheduled grouped GEMM of the experts op for CUDA GPUs from SM80 up (A100, L40S,
// RTX 30xx/40xx/50xx; docs/moe.md): CUTLASS 2.x GemmGrouped with GroupScheduleMode::kDeviceOnly,
// bf16 operands, fp32 accumulation. The group sizes stay on the device: a one-block setup
// kernel turns the int32 offsets into problem sizes, pointers and leading dimensions, and the
// grouped kernel's threadblocks walk the problems themselves, with a grid sized from the
// device's occupancy only. So nothing here reads the device on the host, and the launches
// can be captured in a CUDA graph. One tile configuration per operand layout (three in all)
// keeps nvcc's time on this file bounded; the headers come from the nvidia-cutlass wheel.
#include <cuda_runtime.h>

#include <mutex>

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/device/gemm_grouped.h>
#include <cutlass/gemm/kernel/default_gemm_grouped.h>
#include "moe/grouped_gemm_kernels.h"

namespace titan::moe_detail {
namespace {

using bf16 = cutlass::bfloat16_t;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;
constexpr int kAlign = 8;  // 16 bytes of bf16: N and K must be multiples of 8

// 128x128x32 threadblock tiles, 64x64 warp tiles, SM80 bf16 tensor-core MMA, 4 stages.
template <class LayoutA, class LayoutB>
using Kernel = typename cutlass::gemm::kernel::DefaultGemmGrouped<
    bf16, LayoutA, cutlass::ComplexTransform::kNone, kAlign, bf16, LayoutB,
    cutlass::ComplexTransform::kNone, kAlign, bf16, RowMajor, float,
    cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, cutlass::gemm::GemmShape<128, 128, 32>,
    cutlass::gemm::GemmShape<64, 64, 32>, cutlass::gemm::GemmShape<16, 8, 16>,
    cutlass::epilogue::thread::LinearCombination<bf16, kAlign, float, float>,
    cutlass::gemm::threadblock::GemmBatchedIdentityThreadblockSwizzle, 4,
    cutlass::gemm::kernel::GroupScheduleMode::kDeviceOnly>::GemmKernel;

template <class LayoutA, class LayoutB>
using Grouped = cutlass::gemm::device::GemmGrouped<Kernel<LayoutA, LayoutB>>;

// The device-side argument arrays, carved out of one workspace buffer.
struct Arrays {
  cutlass::gemm::GemmCoord* sizes;
  bf16 **a, **b, **d;
  int64_t *lda, *ldb, *ldd;
};

__host__ __device__ inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

__host__ __device__ inline Arrays carve(void* ws, int64_t E) {
  char* p = static_cast<char*>(ws);
  Arrays r;
  r.sizes = reinterpret_cast<cutlass::gemm::GemmCoord*>(p);
  p += round16(E * static_cast<int64_t>(sizeof(cutlass::gemm::GemmCoord)));
  r.a = reinterpret_cast<bf16**>(p);
  r.b = r.a + E;
  r.d = r.b + E;
  r.lda = reinterpret_cast<int64_t*>(r.d + E);
  r.ldb = r.lda + E;
  r.ldd = r.ldb + E;
  return r;
}

// One thread per group: group g's problem from offs (see grouped_gemm_kernels.h for the forms).
__global__ void setup_groups(GroupedGemmArgs args, Arrays r) {
  const int64_t E = args.E, N = args.N, K = args.K;
  for (int64_t g = blockIdx.x * blockDim.x + threadIdx.x; g < E; g += gridDim.x * blockDim.x) {
    const int64_t start = g == 0 ? 0 : args.offs[g - 1], end = args.offs[g];
    const int m = static_cast<int>(end > start ? end - start : 0);
    const bf16* a = static_cast<const bf16*>(args.a);
    const bf16* b = static_cast<const bf16*>(args.b);
    bf16* out = static_cast<bf16*>(args.out);
    switch (args.form) {
      case GemmForm::NT:  // (m, K) row-major . (K, N) column-major (= b[g] (N, K) row-major)
        r.sizes[g] = cutlass::gemm::GemmCoord(m, static_cast<int>(N), static_cast<int>(K));
        r.a[g] = const_cast<bf16*>(a + start * K);
        r.b[g] = const_cast<bf16*>(b + g * N * K);
        r.d[g] = out + start * N;
        r.lda[g] = K;
        r.ldb[g] = K;
        r.ldd[g] = N;
        break;
      case GemmForm::NN:  // (m, N) row-major . b[g] (N, K) row-major
        r.sizes[g] = cutlass::gemm::GemmCoord(m, static_cast<int>(K), static_cast<int>(N));
        r.a[g] = const_cast<bf16*>(a + start * N);
        r.b[g] = const_cast<bf16*>(b + g * N * K);
        r.d[g] = out + start * K;
        r.lda[g] = N;
        r.ldb[g] = K;
        r.ldd[g] = K;
        break;
      case GemmForm::TN:  // (N, m) column-major (= a_g row-major) . b_g (m, K) row-major
        r.sizes[g] = cutlass::gemm::GemmCoord(static_cast<int>(N), static_cast<int>(K), m);
        r.a[g] = const_cast<bf16*>(a + start * N);
        r.b[g] = const_cast<bf16*>(b + start * K);
        r.d[g] = out + g * N * K;
        r.lda[g] = N;
        r.ldb[g] = K;
        r.ldd[g] = K;
        break;
    }
  }
}

// Threadblocks of one full wave on the current device, per kernel type (cached: the device
// attributes and occupancy are host queries, not synchronizations).
template <class G>
int wave_blocks() {
  static std::mutex mu;
  static int cached[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  std::lock_guard<std::mutex> lock(mu);
  if (cached[dev] == 0) cached[dev] = G::sufficient();
  return cached[dev];
}

template <class G>
const char* run_grouped(const GroupedGemmArgs& args, const Arrays& r) {
  using LA = typename G::LayoutA;
  using LB = typename G::LayoutB;
  using LC = typename G::LayoutC;
  const int blocks = wave_blocks<G>();
  if (blocks <= 0) return "CUTLASS grouped GEMM: no threadblock fits on this device";
  typename G::EpilogueOutputOp::Params epilogue(1.0f, 0.0f);  // beta 0: C is never read
  typename G::Arguments arguments(
      r.sizes, static_cast<int>(args.E), blocks, epilogue, r.a, r.b, r.d, r.d,
      reinterpret_cast<typename LA::Stride::LongIndex*>(r.lda),
      reinterpret_cast<typename LB::Stride::LongIndex*>(r.ldb),
      reinterpret_cast<typename LC::Stride::LongIndex*>(r.ldd),
      reinterpret_cast<typename LC::Stride::LongIndex*>(r.ldd));
  G gemm;
  auto stream = static_cast<cudaStream_t>(args.stream);
  if (gemm.initialize(arguments, nullptr, stream) != cutlass::Status::kSuccess)
    return "CUTLASS grouped GEMM: initialize failed (shared memory attribute)";
  if (gemm.run(stream) != cutlass::Status::kSuccess)
    return "CUTLASS grouped GEMM: launch failed";
  return nullptr;
}

}  // namespace

int64_t grouped_gemm_workspace_bytes(int64_t E) {
  return round16(E * static_cast<int64_t>(sizeof(cutlass::gemm::GemmCoord))) + 6 * E * 8;
}

const char* cutlass_grouped_gemm_bf16(const GroupedGemmArgs& args) {
  if (args.E <= 0) return nullptr;
  if (args.N % kAlign != 0 || args.K % kAlign != 0)
    return "CUTLASS grouped GEMM: N and K must be multiples of 8";
  Arrays r = carve(args.workspace, args.E);
  auto stream = static_cast<cudaStream_t>(args.stream);
  const int threads = 128;
  const int grid = static_cast<int>((args.E + threads - 1) / threads);
  setup_groups<<<grid, threads, 0, stream>>>(args, r);
  if (cudaGetLastError() != cudaSuccess) return "CUTLASS grouped GEMM: setup launch failed";
  switch (args.form) {
    case GemmForm::NT:
      return run_grouped<Grouped<RowMajor, ColumnMajor>>(args, r);
    case GemmForm::NN:
      return run_grouped<Grouped<RowMajor, RowMajor>>(args, r);
    case GemmForm::TN:
      return run_grouped<Grouped<ColumnMajor, RowMajor>>(args, r);
  }
  return "CUTLASS grouped GEMM: unknown form";
}

}  // namespace titan::moe_detail
