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
constexpr int kAbiVersion = 2;  // bump with any change to the C functions below

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

// ---- gate/up with silu(gate) * up in the epilogue ---------------------------------------------
//
// The weights stay [E, 2I, K] (every gate row, then every up row). B is read through a
// hierarchical N mode (64, 2, I/64) with strides (K, I K, 64 K): N tile t holds gate rows
// [64t, 64t + 64) then up rows [64t, 64t + 64), so one TMA box brings a tile's gate and up rows
// and every thread holds gate column j and up column j of its rows. The epilogue writes
// h[:, 64t + j] = bf16(bf16(silu(bf16(gate))) * bf16(up)), ATen's rounding (F.silu then the
// product, each in float32 and rounded; expf and an IEEE division, as nvcc builds ATen).
constexpr int kPairCols = 64;  // gate (and up) columns of one N tile

// The CollectiveBuilder's mainloop (built for a flat B) with B read through the pairs layout: its
// own TMA for B, the tiled view of B that goes with it, and the producer loop that issues it; the
// consumer side (pipelines, wgmma, K order) is the base's.
template <class Base>
struct PairedBMainloop : Base {
  using typename Base::Arguments;
  using InternalElementA = typename Base::InternalElementA;
  using InternalElementB = typename Base::InternalElementB;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;

  template <class N>
  static CUTLASS_HOST_DEVICE auto pairs_shape(N n) {  // (64, 2, I/64): static within a tile
    return make_shape(Int<kPairCols>{}, _2{}, int(n) / (2 * kPairCols));
  }
  template <class N, class K>
  static CUTLASS_HOST_DEVICE auto pairs_stride(N n, K k) {  // gate row j, up row j: I K apart
    return make_stride(int64_t(k), int64_t(n) / 2 * k, int64_t(kPairCols) * k);
  }
  using PairsLayoutB = decltype(make_layout(make_shape(pairs_shape(0), int(0), int(0)),
                                            make_stride(pairs_stride(0, 0), _1{}, int64_t(0))));
  using TMA_BP = decltype(make_tma_copy_B_sm90(
      typename Base::GmemTiledCopyB{}, make_tensor(static_cast<InternalElementB const*>(nullptr), PairsLayoutB{}),
      typename Base::SmemLayoutB{}(_, _, cute::Int<0>{}), typename Base::TileShape{}, ClusterShape{}));

  struct Params : Base::Params {
    TMA_BP tma_load_bp;  // the base's tma_load_b reads B flat and is never issued
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    Params params{Base::to_underlying_arguments(problem_shape, args, workspace), {}};
    auto ptr_B = reinterpret_cast<InternalElementB const*>(args.ptr_B);
    Tensor tensor_b = make_tensor(ptr_B, make_layout(make_shape(pairs_shape(N), int(K), int(L)),
                                                     make_stride(pairs_stride(N, K), _1{}, int64_t(N) * K)));
    params.tma_load_bp = make_tma_copy_B_sm90(typename Base::GmemTiledCopyB{}, tensor_b,
                                              typename Base::SmemLayoutB{}(_, _, cute::Int<0>{}),
                                              typename Base::TileShape{}, ClusterShape{});
    return params;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    return N % (2 * kPairCols) == 0 && Base::can_implement(problem_shape, args);
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_load_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_bp.get_tma_descriptor());
  }

  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& params) const {
    using X = Underscore;
    auto [M, N, K, L] = problem_shape_MNKL;
    Tensor mA_mkl = params.tma_load_a.get_tma_tensor(make_shape(M, K, L));
    Tensor mB_nkl = params.tma_load_bp.get_tma_tensor(make_shape(pairs_shape(N), int(K), int(L)));
    Tensor gA_mkl = local_tile(mA_mkl, typename Base::TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});
    Tensor gB_nkl = local_tile(mB_nkl, typename Base::TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});
    return cute::make_tuple(gA_mkl, gB_nkl);
  }

  // The producer: one elected thread issues, per K tile, the A tile (shared with the cluster's
  // other N tile by multicast) and this tile's gate and up rows of B, onto the stage's barrier.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState stage, cute::tuple<TensorA, TensorB> const& inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile, int k_tiles, int,
                           uint32_t block_rank_in_cluster, typename Base::TensorStorage& smem) {
    static_assert(size<0>(ClusterShape{}) == 1, "B is not multicast: one M tile a cluster");
    if (!cute::elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(smem.smem_A.data()), typename Base::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(smem.smem_B.data()), typename Base::SmemLayoutB{});
    uint32_t cluster_n = block_rank_in_cluster / size<0>(ClusterShape{});
    auto tma_a = params.tma_load_a.get_slice(cluster_n);
    auto tma_b = params.tma_load_bp.get_slice(0);
    auto [m, n, k, l] = blk_coord;
    Tensor tAgA = tma_a.partition_S(get<0>(inputs)(_, _, m, _, l));
    Tensor tAsA = tma_a.partition_D(sA);
    Tensor tBgB = tma_b.partition_S(get<1>(inputs)(_, _, n, _, l));
    Tensor tBsB = tma_b.partition_D(sB);
    uint16_t to_cluster = 0;  // A goes to every CTA of the cluster (all share the M tile)
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < size<1>(ClusterShape{}); ++j) to_cluster |= uint16_t(1) << j;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tiles > 0; --k_tiles, ++k_tile, ++stage) {
      pipeline.producer_acquire(stage);
      auto* barrier = pipeline.producer_get_barrier(stage);
      copy(params.tma_load_a.with(*barrier, to_cluster), tAgA(_, _, _, *k_tile), tAsA(_, _, _, stage.index()));
      copy(params.tma_load_bp.with(*barrier, 0), tBgB(_, _, _, *k_tile), tBsB(_, _, _, stage.index()));
    }
  }
};

// Writes silu(gate) * up of the tile's 64 pairs; D is [rows, N / 2] with row stride N / 2.
struct SiluPairsEpilogue {
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementOutput = Elem;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using ElementC = void;
  using ElementD = Elem;
  using StrideC = pse::StrideD;
  using StrideD = pse::StrideD;
  struct ThreadEpilogueOp {};
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  struct SharedStorage {};
  using TensorStorage = SharedStorage;
  struct Arguments {
    Elem* ptr_D = nullptr;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) { return args; }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ptr_D != nullptr && reinterpret_cast<uintptr_t>(args.ptr_D) % 4 == 0;  // the paired stores
  }

  CUTLASS_HOST_DEVICE SiluPairsEpilogue(Params const& params, SharedStorage const& = SharedStorage()) : params(params) {}
  CUTLASS_DEVICE bool is_source_needed() { return false; }

  static CUTLASS_DEVICE float silu_times(float gate_acc, float up_acc) {
    float g = float(Elem(gate_acc));                 // the product's output, rounded
    float u = float(Elem(up_acc));
    float s = float(Elem(g / (1.0f + expf(-g))));    // F.silu in float32, rounded
    return s * u;                                    // the product, rounded by the caller
  }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK, BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators, TiledMma tiled_mma, ResidueMNK,
                                 int thread_idx, char*) {
    static_assert(size<0>(BlockShapeMNK{}) == 128 && size<1>(BlockShapeMNK{}) == 2 * kPairCols, "128 x 128 tiles");
    // One warp group's wgmma accumulators of a 128 x 128 tile: ((2 columns, 2 row halves, 16 column
    // groups of 8), 2 row blocks of 64, 1); column group g + 8 is column group g's column + 64.
    static_assert(cute::is_same_v<cute::remove_cvref_t<decltype(shape(accumulators))>,
                                  Shape<Shape<_2, _2, _16>, _2, _1>>, "the wgmma accumulator layout assumed below");
    auto M = get<0>(problem_shape_mnkl);
    int64_t half = int64_t(get<1>(problem_shape_mnkl)) / 2;
    auto m_coord = get<0>(blk_coord_mnkl);
    auto n_coord = get<1>(blk_coord_mnkl);
    // The tile's output columns twice over (gate half, up half: the same addresses), partitioned as
    // the accumulators are, so element i's address is its pair's output.
    Tensor gD = make_tensor(make_gmem_ptr(params.ptr_D + int64_t(m_coord) * 128 * half + int64_t(n_coord) * kPairCols),
                            make_layout(make_shape(Int<128>{}, make_shape(Int<kPairCols>{}, _2{})),
                                        make_stride(half, make_stride(_1{}, _0{}))));
    Tensor cD = make_identity_tensor(make_shape(Int<128>{}, Int<128>{}));
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor tCgD = thr_mma.partition_C(gD);
    Tensor tCcD = thr_mma.partition_C(cD);
    int rows_left = int(M) - int(m_coord) * 128;
    CUTLASS_PRAGMA_UNROLL
    for (int mb = 0; mb < 2; ++mb) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int g = 0; g < 8; ++g) {
          auto gate0 = make_coord(make_coord(0, r, g), mb, 0);
          auto gate1 = make_coord(make_coord(1, r, g), mb, 0);
          auto up0 = make_coord(make_coord(0, r, g + 8), mb, 0);
          auto up1 = make_coord(make_coord(1, r, g + 8), mb, 0);
          if (get<0>(tCcD(gate0)) < rows_left) {
            Elem out0 = Elem(silu_times(accumulators(gate0), accumulators(up0)));
            Elem out1 = Elem(silu_times(accumulators(gate1), accumulators(up1)));
            // gate1 is gate0's right neighbour at an even column (check_silu_layout): one 32-bit store.
            uint32_t both = uint32_t(out0.raw()) | (uint32_t(out1.raw()) << 16);
            *reinterpret_cast<uint32_t*>(&tCgD(gate0)) = both;
          }
        }
      }
    }
  }

 private:
  Params params;
};

struct GemmSiluPairs {
  using Epi = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<SiluPairsEpilogue>;
  using BuiltMain = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elem, StrideA, kAlign, Elem, StrideB, kAlign, float, Tile,
      Cluster, cutlass::gemm::collective::StageCountAutoCarveout<0>, KernelSchedule>::CollectiveOp;
  using Main = PairedBMainloop<BuiltMain>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi, ExpertTiles>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr int kTileM = size<0>(Tile{});
};

// G's arguments over the tile-aligned layout: A [rows, k] for every expert, B [experts, n, k] (the
// pairs kernel's mainloop reads it as pairs itself), the epilogue's own.
template <class G>
typename G::Adapter::Arguments arguments(const void* a, const void* b, typename G::Kernel::EpilogueArguments epilogue,
                                         const int32_t* tile_expert, int rows, int k, int n, int experts, int sm_count,
                                         int device) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  typename G::Adapter::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {rows, n, k, experts},
      {static_cast<const Elem*>(a), StrideA{int64_t(k), _1{}, _0{}}, static_cast<const Elem*>(b),
       StrideB{int64_t(k), _1{}, int64_t(n) * k}},
      epilogue,
      hw};
  args.scheduler.tile_expert = tile_expert;
  return args;
}

// D = the product, rounded: alpha 1, no C.
typename Gemm::Kernel::EpilogueArguments product_epilogue(void* d, int n) {
  typename Gemm::Kernel::EpilogueArguments e{{}, nullptr, StrideD{int64_t(n), _1{}, _0{}}, static_cast<Elem*>(d),
                                             StrideD{int64_t(n), _1{}, _0{}}};
  e.thread.alpha = 1.0f;
  e.thread.beta = 0.0f;
  return e;
}
// Host-side checks of the layout facts the SiLU kernel rests on (no GPU needed): 0 if they hold.
// 1: for every thread of the warp group, accumulator (v0, v1, g + 8, mb) sits 64 columns right of
//    (v0, v1, g, mb) on the same row, and the 128 threads cover the 128 x 128 tile once;
// 4: (1, v1, g, mb) is (0, v1, g, mb)'s right neighbour, at an even column (one 32-bit store);
// 2: row n' of N tile t of B's pairs view is weight row 64 t + n' (gate) for n' < 64 and
//    I + 64 t + n' - 64 (up) after, for every K column.
inline int check_silu_layout() {
  using TiledMma = typename GemmSiluPairs::Main::TiledMma;
  static_assert(size(TiledMma{}) == 128, "one warp group a tile");
  int seen[128][128] = {};
  for (int thread = 0; thread < 128; ++thread) {
    auto tC = TiledMma{}.get_thread_slice(thread).partition_C(make_identity_tensor(make_shape(Int<128>{}, Int<128>{})));
    for (int i = 0; i < size(tC); ++i) ++seen[get<0>(tC(i))][get<1>(tC(i))];
    for (int mb = 0; mb < 2; ++mb)
      for (int r = 0; r < 2; ++r)
        for (int g = 0; g < 8; ++g)
          for (int v = 0; v < 2; ++v) {
            auto gate = tC(make_coord(make_coord(v, r, g), mb, 0));
            auto up = tC(make_coord(make_coord(v, r, g + 8), mb, 0));
            if (get<0>(up) != get<0>(gate) || get<1>(up) != get<1>(gate) + kPairCols || get<1>(gate) >= kPairCols) return 1;
            auto left = tC(make_coord(make_coord(0, r, g), mb, 0));
            if (v == 1 && (get<0>(gate) != get<0>(left) || get<1>(gate) != get<1>(left) + 1 || get<1>(left) % 2 != 0))
              return 4;
          }
  }
  for (auto& row : seen)
    for (int count : row)
      if (count != 1) return 2;
  constexpr int K = 192, I = 256, N = 2 * I;
  using Main = typename GemmSiluPairs::Main;
  auto pairs = make_layout(make_shape(Main::pairs_shape(N), K, 1), make_stride(Main::pairs_stride(N, K), _1{}, int64_t(N) * K));
  Tensor tiles = local_tile(make_tensor(counting_iterator<int64_t>(0), pairs), Tile{}, make_coord(_, _, _), Step<X, _1, _1>{});
  for (int t = 0; t < N / 128; ++t)
    for (int row = 0; row < 128; ++row)
      for (int k = 0; k < K; ++k) {
        int64_t want = (row < kPairCols ? kPairCols * t + row : I + kPairCols * t + row - kPairCols) * int64_t(K) + k;
        if (tiles(row, k % 64, t, k / 64, 0) != want) return 3;
      }
  return 0;
}

// Runs G on `stream`: 0 on success; 1000/1001 for a short workspace / unaligned rows,
// 2000/3000/4000 + a cutlass::Status from can_implement/initialize/run, or a negated cudaError_t.
template <class G>
int run(typename G::Adapter::Arguments const& args, int rows, void* workspace, size_t workspace_bytes,
        cudaStream_t stream) {
  if (rows % G::kTileM != 0) return 1001;
  if (workspace_bytes < G::Adapter::get_workspace_size(args)) return 1000;
  typename G::Adapter gemm;
  cutlass::Status s = gemm.can_implement(args);
  if (s != cutlass::Status::kSuccess) return 2000 + int(s);
  s = gemm.initialize(args, workspace, stream);
  if (s != cutlass::Status::kSuccess) return 3000 + int(s);
  s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess) return 4000 + int(s);
  cudaError_t launched = cudaGetLastError();
  return launched == cudaSuccess ? 0 : -int(launched);
}
}  // namespace pse

extern "C" {

int pse_abi_version() { return pse::kAbiVersion; }

// The SiLU kernel's layout facts, checked on the host (pse::check_silu_layout): 0 if they hold.
int pse_check_silu_layout() { return pse::check_silu_layout(); }

// Rows of one tile: every expert's rows start on a multiple of it.
int pse_tile_rows() { return pse::Gemm::kTileM; }

size_t pse_workspace_bytes(int rows, int k, int n, int experts, int sm_count, int device) {
  int32_t dummy = 0;
  auto args = pse::arguments<pse::Gemm>(nullptr, nullptr, pse::product_epilogue(nullptr, n), &dummy, rows, k, n,
                                        experts, sm_count, device);
  return pse::Gemm::Adapter::get_workspace_size(args);
}

// D[rows of tile m] = A[rows of tile m] x B[tile_expert[m]]^T on `stream`; rows a multiple of
// pse_tile_rows(). Status codes: pse::run.
int pse_expert_mm(const void* a, const void* b, void* d, const int32_t* tile_expert, int rows, int k, int n,
                  int experts, void* workspace, size_t workspace_bytes, int sm_count, int device,
                  cudaStream_t stream) {
  auto args = pse::arguments<pse::Gemm>(a, b, pse::product_epilogue(d, n), tile_expert, rows, k, n, experts, sm_count,
                                        device);
  return pse::run<pse::Gemm>(args, rows, workspace, workspace_bytes, stream);
}

size_t pse_expert_mm_silu_workspace_bytes(int rows, int k, int n, int experts, int sm_count, int device) {
  int32_t dummy = 0;
  auto args = pse::arguments<pse::GemmSiluPairs>(nullptr, nullptr, {nullptr}, &dummy, rows, k, n, experts, sm_count,
                                                 device);
  return pse::GemmSiluPairs::Adapter::get_workspace_size(args);
}

// H[rows of tile m, :] = silu(X W_gate^T) * (X W_up^T) for the expert tile_expert[m], where
// B = [E, n, k] holds every expert's n / 2 gate rows then its n / 2 up rows and H is [rows, n / 2];
// n a multiple of 128. Status codes: pse::run.
int pse_expert_mm_silu(const void* a, const void* b, void* h, const int32_t* tile_expert, int rows, int k, int n,
                       int experts, void* workspace, size_t workspace_bytes, int sm_count, int device,
                       cudaStream_t stream) {
  auto args = pse::arguments<pse::GemmSiluPairs>(a, b, {static_cast<pse::Elem*>(h)}, tile_expert, rows, k, n, experts,
                                                 sm_count, device);
  return pse::run<pse::GemmSiluPairs>(args, rows, workspace, workspace_bytes, stream);
}
}
