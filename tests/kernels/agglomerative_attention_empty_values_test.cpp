// Agglomerative attention with M = 0 (issue 15: the float32 backward returned
// uninitialised memory as the gradient of cr). With no value features the
// average a is empty, so the op passes avg = nullptr (an empty tensor's data):
// the forward must still save the denominators the backward reads.
#include <attnkit/ops.h>

#include "kernels/agglomerative_attention.h"
#include "ops/binding.h"
#include "test_util.h"

#include <limits>

namespace attnkit::testing::agglomerative_attention_empty_values_test {
namespace {

TEST(AgglomerativeEmptyValues, ForwardSavesDenominatorsWithoutAverages) {
  const int64_t N = 2, H = 3, L = 5, S = 7;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto cq = torch::rand({N, H, L}, f32()), cr = torch::rand({N, H, S}, f32());
  auto v = torch::empty({N, H, S, 0}, f32());
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    const int64_t rows = kernels::agglomerative_saved_rows(causal, L);
    auto out = torch::empty({N, H, L, 0}, f32());
    auto den = torch::full({N, H, rows}, nan, f32());  // what uninitialised memory may hold
    kernels::AgglomerativeBackwardParams p;
    detail::bind(p.cq, p.cq_stride, cq);
    detail::bind(p.cr, p.cr_stride, cr);
    detail::bind(p.v, p.v_stride, v);
    detail::bind(p.out, p.out_stride, out);
    p.avg = nullptr;  // torch::empty({N, H, rows, 0}).data_ptr<float>()
    p.den = den.data_ptr<float>();
    p.N = N, p.H = H, p.L = L, p.S = S, p.M = 0;
    p.causal = causal;
    kernels::agglomerative_forward(p);
    // The unclipped denominators: the sum of cr (full) or its prefix sums (causal; L < S,
    // so query i reads keys t <= i + S - L).
    auto expected = causal ? cr.cumsum(2).narrow(2, S - L, L) : cr.sum(2, /*keepdim=*/true);
    EXPECT_LT(rel_err(den, expected), 1e-6);

    // The backward on those: every gradient is exactly zero.
    auto dout = torch::empty({N, H, L, 0}, f32());
    auto dcq = torch::full({N, H, L}, nan, f32()), dcr = torch::full({N, H, S}, nan, f32());
    auto dv = torch::empty({N, H, S, 0}, f32());
    detail::bind(p.dout, p.dout_stride, dout);
    detail::bind(p.dcq, p.dcq_stride, dcq);
    detail::bind(p.dcr, p.dcr_stride, dcr);
    detail::bind(p.dv, p.dv_stride, dv);
    kernels::agglomerative_backward(p);
    EXPECT_TRUE(dcr.eq(0).all().item<bool>()) << dcr;
    EXPECT_TRUE(dcq.eq(0).all().item<bool>()) << dcq;
  }
}

TEST(AgglomerativeEmptyValues, OpGradientsAreZerosAsInFloat64) {
  for (bool causal : {false, true})
    for (int64_t L : {0, 1, 5, 9}) {
      SCOPED_TRACE(std::string(causal ? "causal" : "full") + " L " + std::to_string(L));
      auto cq = torch::rand({2, 3, L}, f64()), cr = torch::rand({2, 3, 7}, f64());
      auto v = torch::empty({2, 3, 7, 0}, f64());
      const auto o = AgglomerativeAttentionFuncOptions().causal(causal);
      for (auto dtype : {torch::kDouble, torch::kFloat}) {
        auto a = cq.to(dtype).detach().requires_grad_(true);
        auto b = cr.to(dtype).detach().requires_grad_(true);
        auto c = v.to(dtype).detach().requires_grad_(true);
        auto out = agglomerative_attention(a, b, c, o);
        EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 3, L, 0}));
        out.sum().backward();
        EXPECT_TRUE(b.grad().eq(0).all().item<bool>()) << c10::toString(dtype) << b.grad();
        EXPECT_TRUE(a.grad().eq(0).all().item<bool>()) << c10::toString(dtype) << a.grad();
        EXPECT_EQ(c.grad().sizes(), c.sizes());
      }
    }
}

}  // namespace
}  // namespace attnkit::testing::agglomerative_attention_empty_values_test
