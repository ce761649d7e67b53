// The Python bridge's class torch.classes.attnkit.Module (src/bindings/modules.cpp)
// as TorchScript saves and loads it: __getstate__ gives (kind, settings, tensor
// names, tensors), __setstate__ rebuilds the module around the saved tensors.
// A saved file is data: a state that does not fit the module its settings
// build is refused, naming what is wrong, and loading keeps torch's random
// stream. (tests/python/test_export.py covers whole models through files.)
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <torch/custom_class.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "test_util.h"

namespace attnkit::module_state_test {
namespace {

using testing::expect_error;

c10::ClassTypePtr module_class() {
  auto type = torch::getCustomClass("__torch__.torch.classes.attnkit.Module");
  if (!type) throw std::runtime_error("torch.classes.attnkit.Module is not registered (libattnkit not loaded?)");
  return type;
}

/// A new object of the class from `state`, as torch.jit.load makes one.
c10::IValue from_state(const c10::IValue& state) {
  auto type = module_class();
  auto object = c10::ivalue::Object::create(c10::StrongTypePtr(type->compilation_unit(), type), type->numAttributes());
  type->getMethod("__setstate__")({object, state});
  return object;
}

c10::IValue state_of(const c10::IValue& object) { return module_class()->getMethod("__getstate__")({object}); }

/// The state of a Linear(3, 2) with the given names and tensors.
c10::IValue linear_state(std::vector<std::string> names, std::vector<at::Tensor> tensors) {
  return c10::ivalue::Tuple::create({c10::IValue(std::string("Linear")),
                                     c10::IValue(std::string(R"({"in_features": 3, "out_features": 2})")),
                                     c10::IValue(c10::List<std::string>(names)),
                                     c10::IValue(c10::List<at::Tensor>(tensors))});
}

std::vector<at::Tensor> tensors_of(const c10::IValue& state) {
  return state.toTupleRef().elements()[3].toTensorVector();
}

TEST(ModuleState, RoundTripSharesTheSavedStorageAndKeepsTheRandomStream) {
  const at::Tensor w = torch::randn({2, 3}), b = torch::randn({2});
  torch::manual_seed(5);
  const at::Tensor expected = torch::rand({4});
  torch::manual_seed(5);
  const auto object = from_state(linear_state({"weight", "bias"}, {w, b}));
  EXPECT_TRUE(torch::equal(torch::rand({4}), expected)) << "building the module moved the random stream";
  const auto tensors = tensors_of(state_of(object));
  ASSERT_EQ(tensors.size(), 2u);
  EXPECT_EQ(tensors[0].data_ptr(), w.data_ptr());  // the saved storage itself, not a copy
  EXPECT_EQ(tensors[1].data_ptr(), b.data_ptr());
  // Inference only: the module's tensors take no gradients.
  EXPECT_FALSE(tensors[0].requires_grad());
  EXPECT_FALSE(tensors[1].requires_grad());
}

TEST(ModuleState, RefusesStatesThatDoNotFitTheModule) {
  const at::Tensor w = torch::randn({2, 3}), b = torch::randn({2});
  expect_error([&] { from_state(linear_state({"weight", "weight"}, {w, w})); }, {"names tensor 'weight' twice"});
  expect_error([&] { from_state(linear_state({"weight", "gain"}, {w, b})); },
               {"a tensor 'gain'", "built from its settings lacks"});
  expect_error([&] { from_state(linear_state({"weight"}, {w})); }, {"has 1 tensors", "has 2"});
  expect_error([&] { from_state(linear_state({"weight", "bias"}, {w})); }, {"2 tensor names for 1 tensors"});
  expect_error([&] { from_state(linear_state({"weight", "bias"}, {torch::randn({3, 2}), b})); },
               {"saved tensor 'weight'", "shape [3, 2]", "the module's is [2, 3]"});
  expect_error(
      [&] {
        from_state(c10::ivalue::Tuple::create({c10::IValue(std::string("Linear")), c10::IValue(std::string("{}")),
                                               c10::IValue(c10::List<std::string>()),
                                               c10::IValue(c10::List<at::Tensor>())}));
      },
      {"Linear: '", "_features' is required"});
}

TEST(ModuleState, ALoadedModuleRefusesTrainingWithAutograd) {
  const auto object = from_state(linear_state({"weight", "bias"}, {torch::randn({2, 3}), torch::randn({2})}));
  auto call = [&](bool training) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow("attnkit::module_forward", "");
    std::vector<c10::IValue> stack{object, torch::randn({4, 3}), c10::IValue(), c10::IValue(), c10::IValue(),
                            c10::IValue(false), c10::IValue(int64_t{0}), c10::IValue(training),
                                   c10::IValue(int64_t{0})};
    op.callBoxed(&stack);
    return stack.at(0).toTensorVector().at(0);
  };
  EXPECT_EQ(call(false).sizes(), (std::vector<int64_t>{4, 2}));
  expect_error([&] { call(true); }, {"loaded from a saved file", "inference only", "load_state_dict"});
  torch::NoGradGuard no_grad;
  EXPECT_EQ(call(true).sizes(), (std::vector<int64_t>{4, 2}));  // training mode without autograd: allowed
}

}  // namespace
}  // namespace attnkit::module_state_test
