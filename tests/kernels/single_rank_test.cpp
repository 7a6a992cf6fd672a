// Every overlapped operation in a runtime alone (world size 1: no peers, every flag local),
// so that the unit suite exercises the code paths the multi-process tests run at scale.
#include "tests/kernels/overlap_test_util.h"
#include "tests/runtime/test_util.h"

namespace caravan::kernels {
namespace {

class SingleRankOverlapTest : public ::testing::Test {
 protected:
  Runtime rt_{RuntimeOptions{.cpu_workers = 1}};
};

TEST_F(SingleRankOverlapTest, EveryOperationAndVariantMatchesTheReference) {
  for (OverlapVariant v : kAllVariants) {
    test::check_all_gather_gemm(v, 2);
    test::check_gemm_reduce_scatter(v, 2);
    test::check_gemm_all_scatter(v, 2);
  }
  test::check_collectives(2);
}

TEST_F(SingleRankOverlapTest, TensorParallelLayerMatchesTheReference) {
  for (OverlapVariant v : {OverlapVariant::bulk_synchronous, OverlapVariant::fused_sequential}) test::check_tp_layer(v, 2);
  test::check_tp_layer(OverlapVariant::bulk_synchronous, 1, /*grouped=*/true);
}

// Null buffers and layer weights of the wrong size are refused by name before anything runs
// (they were read past their ends, or dereferenced, inside the operation).
TEST_F(SingleRankOverlapTest, NullBuffersAndMisshapenWeightsAreRefused) {
  SymmetricHeap heap = SymmetricHeap::current();
  AllGather gather(heap, 4, 8, GatherMode::push);
  CARAVAN_EXPECT_ERROR(gather.run(nullptr), Errc::invalid_argument, "AllGather::run: mine is null");
  AllGatherGemm ag(heap, 4, 8, 8, OverlapVariant::bulk_synchronous);
  CARAVAN_EXPECT_ERROR(ag.set_weights(nullptr), Errc::invalid_argument, "AllGatherGemm::set_weights: b is null");
  LowLatencyAllGather ll(heap, 64);
  std::vector<std::byte> in(64);
  CARAVAN_EXPECT_ERROR(ll.run(in.data(), nullptr), Errc::invalid_argument, "LowLatencyAllGather::run: out is null");
  CARAVAN_EXPECT_ERROR(LowLatencyAllGather(heap, ~std::size_t{0}), Errc::invalid_argument, "at most 2^40");
  TpLayerShape shape{.tokens = 8, .hidden = 64, .heads = 2, .ffn = 128};
  TensorParallelLayer layer(heap, shape, OverlapVariant::bulk_synchronous);
  TpLayerWeights w = random_layer_weights(shape, 3);
  w.up.pop_back();
  CARAVAN_EXPECT_ERROR(layer.set_weights(w), Errc::invalid_argument,
                       "TensorParallelLayer::set_weights: up has 8191 values; the layer's shape needs 8192");
}

TEST_F(SingleRankOverlapTest, VariantNamesParse) {
  for (OverlapVariant v : kAllVariants) EXPECT_EQ(parse_variant(to_string(v)), v);
  EXPECT_EQ(parse_variant("bulk"), OverlapVariant::bulk_synchronous);
  CARAVAN_EXPECT_ERROR(parse_variant("eager"), Errc::invalid_argument, "overlap variant 'eager': expected");
}

}  // namespace
}  // namespace caravan::kernels
