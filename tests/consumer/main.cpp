// Links against an installed attnkit through find_package and checks that the
// exact op agrees with a plain libtorch composite. It also includes the
// public headers renamed to one stem per mechanism by their previous names,
// which forward for one release (CHANGELOG).
#include <attnkit/attnkit.h>
#include <attnkit/nn/agglomerative.h>
#include <attnkit/nn/clustered.h>
#include <attnkit/nn/linear.h>

#include <iostream>

int main() {
  torch::manual_seed(0);
  auto q = torch::randn({1, 2, 5, 8}), k = torch::randn({1, 2, 6, 8}), v = torch::randn({1, 2, 6, 4});
  auto out = attnkit::softmax_attention(q, k, v);
  auto expected = torch::softmax(torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(8.0), -1).matmul(v);
  const double err = (out - expected).abs().max().item<double>();
  std::cout << "attnkit " << attnkit::version() << " max error " << err << "\n";
  return err < 1e-5 ? 0 : 1;
}
