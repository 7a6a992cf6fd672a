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

TEST_F(SingleRankOverlapTest, VariantNamesParse) {
  for (OverlapVariant v : kAllVariants) EXPECT_EQ(parse_variant(to_string(v)), v);
  EXPECT_EQ(parse_variant("bulk"), OverlapVariant::bulk_synchronous);
  CARAVAN_EXPECT_ERROR(parse_variant("eager"), Errc::invalid_argument, "overlap variant 'eager': expected");
}

}  // namespace
}  // namespace caravan::kernels
