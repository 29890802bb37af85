// The routed experts' products as one batched CUTLASS GEMM over a contiguous, tile-aligned row
// layout (Hopper, sm_90a), behind a C ABI that model_runtime/kernels/expert_gemm.py loads and builds
// (CUTLASS 4.7.0 headers).
//
// Each expert's rows start on a multiple of the tile's M, so every M tile belongs to one expert;
// `tile_expert[m]` names it (-1 past the last). The kernel is CUTLASS's TMA warp-specialised GEMM
// with problem (rows, N, K, E): A and D have a static zero batch stride (their TMA descriptors drop
// the batch mode, so one descriptor serves every expert), B is the weights [E, N, K], and the tile
// scheduler enumerates only the M x N tiles, taking each tile's batch index (its expert) from the
// table. Unlike the pointer-array grouped kernel, no tensor-map is rewritten when a CTA moves to
// another expert. Each output is still the wgmma K order with float32 accumulators and one rounding:
// torch._grouped_mm's numbers bit for bit.

#include <cstdint>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/sm90_tile_scheduler.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

namespace pse {
using namespace cute;
using Sm90Params = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params;
using Sm90Scheduler = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

struct ExpertTiles {};  // the scheduler's tag

// The persistent scheduler over M x N tiles in N-fastest order (so the trailing tiles past the last
// expert come last in every CTA's sequence), with each tile's L index read from `tile_expert`.
class ExpertTileScheduler
    : public cutlass::gemm::kernel::detail::StaticPersistentTileScheduler<ExpertTileScheduler> {
  using Base = cutlass::gemm::kernel::detail::StaticPersistentTileScheduler<ExpertTileScheduler>;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;
  using RasterOrder = typename Sm90Params::RasterOrder;
  using RasterOrderOptions = typename Sm90Params::RasterOrderOptions;
  static constexpr bool IsDynamicPersistent = false;
  using Pipeline = typename Sm90Scheduler::Pipeline;
  using PipelineStorage = typename Sm90Scheduler::PipelineStorage;
  using ThrottlePipeline = typename Sm90Scheduler::ThrottlePipeline;
  using ThrottlePipelineStorage = typename Sm90Scheduler::ThrottlePipelineStorage;
  using CLCResponse = typename Sm90Scheduler::CLCResponse;
  using SharedStorage = typename Sm90Scheduler::SharedStorage;

  struct Arguments {
    int max_swizzle_size = 1;
    RasterOrderOptions raster_order = RasterOrderOptions::AlongN;
    const int32_t* tile_expert = nullptr;
  };
  struct Params : Sm90Params {
    const int32_t* tile_expert = nullptr;
  };

  template <class Shape4>
  static CUTLASS_HOST_DEVICE auto one_batch(Shape4 const& s) {
    return make_shape(get<0>(s), get<1>(s), get<2>(s), 1);
  }
  static typename Base::Arguments base_arguments() {
    typename Base::Arguments a;
    a.max_swizzle_size = 1;
    a.raster_order = RasterOrderOptions::AlongN;
    return a;
  }

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL shape, TileShape tile, ClusterShape cluster,
                                        cutlass::KernelHardwareInfo const& hw, Arguments const& args,
                                        void* workspace = nullptr, uint32_t subtile = 1, uint32_t kalign = 1) {
    Params p;
    static_cast<Sm90Params&>(p) =
        Base::to_underlying_arguments(one_batch(shape), tile, cluster, hw, base_arguments(), workspace, subtile, kalign);
    p.tile_expert = args.tile_expert;
    return p;
  }
  static CUTLASS_HOST_DEVICE bool can_implement(Arguments const& args, cutlass::KernelHardwareInfo const&) {
    return args.tile_expert != nullptr;
  }
  template <class ProblemShape, class ElementAccumulator>
  static size_t get_workspace_size(Arguments const&, ProblemShape, cutlass::KernelHardwareInfo const&, uint32_t,
                                   const uint32_t = 1, uint32_t = 1) {
    return 0;
  }
  template <class ProblemShape, class ElementAccumulator>
  static cutlass::Status initialize_workspace(Arguments const&, void*, cudaStream_t, ProblemShape,
                                              cutlass::KernelHardwareInfo const&, uint32_t, const uint32_t = 1,
                                              uint32_t = 1, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShapeMNKL, class BlockShape, class ClusterShape>
  static CUTLASS_HOST_DEVICE dim3 get_grid_shape(Params const& params, ProblemShapeMNKL shape, BlockShape cta,
                                                 ClusterShape cluster, cutlass::KernelHardwareInfo hw,
                                                 Arguments const&, bool = true) {
    typename Base::Arguments a;
    a.max_swizzle_size = 1;
    a.raster_order = RasterOrderOptions::AlongN;
    return Base::get_grid_shape(params, one_batch(shape), cta, cluster, hw, a);
  }

  // The base's (m, n) from a linear index, as the plain persistent scheduler computes it.
  static CUTLASS_DEVICE cute::tuple<int32_t, int32_t> get_work_idx_m_and_n(
      uint64_t blk, cutlass::FastDivmodU64Pow2 const& major, cutlass::FastDivmodU64Pow2 const& minor,
      cutlass::FastDivmodU64 const& blk_major, int32_t log_swizzle, RasterOrder raster) {
    return Sm90Scheduler::get_work_idx_m_and_n(blk, major, minor, blk_major, log_swizzle, raster);
  }

  CUTLASS_HOST_DEVICE ExpertTileScheduler() {}
  CUTLASS_DEVICE explicit ExpertTileScheduler(Params const& p) : Base(p), tile_expert_(p.tile_expert) {}

  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return with_expert(Base::get_current_work()); }
  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return get_current_work();
  }
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    Base::advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }
  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work, TileSchedulerPipeline&, TileSchedulerPipelineState) {
    return fetch_next_work(work);
  }

 private:
  CUTLASS_DEVICE WorkTileInfo with_expert(WorkTileInfo work) const {
    if (!work.is_valid()) return work;
    int32_t expert = tile_expert_[work.M_idx];
    if (expert < 0) return WorkTileInfo::invalid_work_tile();
    work.L_idx = expert;
    return work;
  }
  const int32_t* tile_expert_ = nullptr;
};
}  // namespace pse

namespace cutlass::gemm::kernel::detail {
template <class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<pse::ExpertTiles, arch::Sm90, TileShape, ClusterShape, Stages> {
  using Scheduler = pse::ExpertTileScheduler;
};
}  // namespace cutlass::gemm::kernel::detail

namespace pse {
// 128x128 tiles, K in steps of 64, two consumer warp groups on alternate tiles (one's epilogue
// overlaps the other's products), a cluster of two N tiles sharing their A tile by multicast (they
// share an M tile, so an expert). The fastest of the configurations tried on an H200 for both
// products of the 35B-A3B shape (docs/moe.md).
using Tile = Shape<_128, _128, _64>;
using Cluster = Shape<_1, _2, _1>;
using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
constexpr int kAbiVersion = 1;  // bump with any change to the C functions below

using Elem = cutlass::bfloat16_t;
constexpr int kAlign = 16 / sizeof(Elem);
using StrideA = Stride<int64_t, _1, _0>;        // rows x K, one for every expert
using StrideB = Stride<int64_t, _1, int64_t>;   // N x K per expert
using StrideD = Stride<int64_t, _1, _0>;        // rows x N

struct Gemm {
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, cutlass::epilogue::collective::EpilogueTileAuto,
      float, float, void, StrideD, kAlign, Elem, StrideD, kAlign, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Elem, float, void, float>>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elem, StrideA, kAlign, Elem, StrideB, kAlign, float, Tile,
      Cluster, cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi, ExpertTiles>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr int kTileM = size<0>(Tile{});
};

template <class G>
typename G::Adapter::Arguments arguments(const void* a, const void* b, void* d, const int32_t* tile_expert,
                                         int rows, int k, int n, int experts, int sm_count, int device) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  typename G::Adapter::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {rows, n, k, experts},
      {static_cast<const Elem*>(a), StrideA{int64_t(k), _1{}, _0{}}, static_cast<const Elem*>(b),
       StrideB{int64_t(k), _1{}, int64_t(n) * k}},
      {{}, nullptr, StrideD{int64_t(n), _1{}, _0{}}, static_cast<Elem*>(d), StrideD{int64_t(n), _1{}, _0{}}},
      hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.scheduler.tile_expert = tile_expert;
  return args;
}
}  // namespace pse

extern "C" {

int pse_abi_version() { return pse::kAbiVersion; }

// Rows of one tile: every expert's rows start on a multiple of it.
int pse_tile_rows() { return pse::Gemm::kTileM; }

size_t pse_workspace_bytes(int rows, int k, int n, int experts, int sm_count, int device) {
  int32_t dummy = 0;
  auto args = pse::arguments<pse::Gemm>(nullptr, nullptr, nullptr, &dummy, rows, k, n, experts, sm_count, device);
  return pse::Gemm::Adapter::get_workspace_size(args);
}

// D[rows of tile m] = A[rows of tile m] x B[tile_expert[m]]^T on `stream`; rows a multiple of
// pse_tile_rows(). 0 on success; 1000/1001 for a short workspace / unaligned rows, 2000/3000/4000 +
// a cutlass::Status from can_implement/initialize/run, or a negated cudaError_t.
int pse_expert_mm(const void* a, const void* b, void* d, const int32_t* tile_expert, int rows, int k, int n,
                  int experts, void* workspace, size_t workspace_bytes, int sm_count, int device,
                  cudaStream_t stream) {
  using G = pse::Gemm;
  if (rows % G::kTileM != 0) return 1001;
  auto args = pse::arguments<G>(a, b, d, tile_expert, rows, k, n, experts, sm_count, device);
  if (workspace_bytes < G::Adapter::get_workspace_size(args)) return 1000;
  G::Adapter gemm;
  cutlass::Status s = gemm.can_implement(args);
  if (s != cutlass::Status::kSuccess) return 2000 + int(s);
  s = gemm.initialize(args, workspace, stream);
  if (s != cutlass::Status::kSuccess) return 3000 + int(s);
  s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess) return 4000 + int(s);
  cudaError_t launched = cudaGetLastError();
  return launched == cudaSuccess ? 0 : -int(launched);
}
}
