// The checkpoint container (CRC-32, every flipped bit and every truncation
// refused), atomic writes, run-directory listing and pruning, and the training
// state round trip: a tiny module with dropout and a buffer, trained, saved,
// restored into a fresh copy, trained on: bitwise the same as never stopping.
#include <attnkit/train/checkpoint.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "test_util.h"

namespace checkpoint_test {

namespace fs = std::filesystem;
using namespace attnkit::train;

namespace {

std::string temp_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() /
             ("attnkit_train_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void expect_refused(const std::string& bytes, const std::string& fragment) {
  try {
    decode_checkpoint(bytes, "ckpt-under-test");
    ADD_FAILURE() << "accepted; expected a refusal mentioning '" << fragment << "'";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("ckpt-under-test"), std::string::npos) << msg;
    EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
  }
}

}  // namespace

TEST(TrainCheckpoint, Crc32KnownValues) {
  // The standard check value of CRC-32/ISO-HDLC (zlib's crc32).
  const std::string nine = "123456789";
  EXPECT_EQ(crc32(nine.data(), nine.size()), 0xCBF43926u);
  EXPECT_EQ(crc32(nullptr, 0), 0u);
  // Incremental equals one-shot.
  EXPECT_EQ(crc32(nine.data() + 4, 5, crc32(nine.data(), 4)), 0xCBF43926u);
}

TEST(TrainCheckpoint, ContainerRoundTrip) {
  CheckpointFile file{R"({"step":3})", std::string("pay\0load", 8)};
  const auto bytes = encode_checkpoint(file);
  EXPECT_EQ(bytes.size(), kCheckpointPrefixBytes + file.header.size() + file.payload.size() + 4);
  EXPECT_EQ(bytes.substr(0, 8), "ATNKCKPT");
  const auto back = decode_checkpoint(bytes, "x");
  EXPECT_EQ(back.header, file.header);
  EXPECT_EQ(back.payload, file.payload);
}

TEST(TrainCheckpoint, EveryFlippedBitIsRefused) {
  const auto bytes = encode_checkpoint({R"({"step":12,"model":{}})", "0123456789abcdef"});
  for (std::size_t i = 0; i < bytes.size(); ++i)
    for (int bit = 0; bit < 8; ++bit) {
      auto bad = bytes;
      bad[i] = static_cast<char>(bad[i] ^ (1 << bit));
      EXPECT_THROW(decode_checkpoint(bad, "f"), std::runtime_error) << "byte " << i << " bit " << bit;
    }
  // The messages: a flipped payload bit is a CRC mismatch, a flipped magic bit
  // is not a checkpoint at all.
  auto payload_flip = bytes;
  payload_flip[bytes.size() - 6] ^= 0x10;
  expect_refused(payload_flip, "CRC-32 mismatch");
  auto magic_flip = bytes;
  magic_flip[0] ^= 0x01;
  expect_refused(magic_flip, "not an attnkit checkpoint");
}

TEST(TrainCheckpoint, EveryTruncationIsRefused) {
  const auto bytes = encode_checkpoint({R"({"step":1})", std::string(100, 'p')});
  for (std::size_t n = 0; n < bytes.size(); ++n)
    EXPECT_THROW(decode_checkpoint(bytes.substr(0, n), "f"), std::runtime_error) << n << " bytes";
  expect_refused(bytes.substr(0, bytes.size() - 1), "truncated");
  expect_refused(bytes.substr(0, 40), "truncated");
  expect_refused(bytes.substr(0, 10), "truncated");
  expect_refused(bytes + "x", "CRC-32 mismatch");  // trailing data
}

TEST(TrainCheckpoint, WrongVersionIsRefused) {
  // A well-formed container (valid CRC) of another format version.
  auto bytes = encode_checkpoint({"{}", "p"});
  bytes[8] = 7;
  const uint32_t crc = crc32(bytes.data(), bytes.size() - 4);
  for (int i = 0; i < 4; ++i) bytes[bytes.size() - 4 + i] = static_cast<char>((crc >> (8 * i)) & 0xFF);
  expect_refused(bytes, "format version 7");
}

TEST(TrainCheckpoint, AtomicWriteReplacesAndLeavesNoTemporaryFile) {
  const auto dir = temp_dir("atomic");
  const auto path = (fs::path(dir) / checkpoint_name(5)).string();
  write_checkpoint_file(path, {"{\"a\":1}", "first"});
  write_checkpoint_file(path, {"{\"a\":2}", "second"});
  EXPECT_EQ(read_checkpoint_file(path).payload, "second");
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    ++files;
    EXPECT_EQ(entry.path().filename().string(), "checkpoint-00000005.ckpt");
  }
  EXPECT_EQ(files, 1);
  // A directory that does not exist: the error names the call and the path; nothing created.
  try {
    write_file_atomically(dir + "/missing/x.ckpt", "bytes");
    ADD_FAILURE() << "wrote into a missing directory";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("missing"), std::string::npos) << e.what();
  }
  // A missing checkpoint is refused with its path.
  try {
    read_checkpoint_file(dir + "/none.ckpt");
    ADD_FAILURE() << "read a missing file";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("none.ckpt"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(TrainCheckpoint, ListAndPrune) {
  const auto dir = temp_dir("prune");
  for (int64_t step : {10, 200, 30, 4000})
    write_checkpoint_file((fs::path(dir) / checkpoint_name(step)).string(), {"{}", ""});
  std::ofstream(fs::path(dir) / "checkpoint-x.ckpt") << "not ours";
  std::ofstream(fs::path(dir) / "metrics.jsonl") << "{}\n";
  auto listed = list_checkpoints(dir);
  ASSERT_EQ(listed.size(), 4u);
  EXPECT_EQ(listed[0].step, 4000);
  EXPECT_EQ(listed[1].step, 200);
  EXPECT_EQ(listed[3].step, 10);
  const auto deleted = prune_checkpoints(dir, 2);
  EXPECT_EQ(deleted.size(), 2u);
  listed = list_checkpoints(dir);
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].step, 4000);
  EXPECT_EQ(listed[1].step, 200);
  EXPECT_TRUE(fs::exists(fs::path(dir) / "checkpoint-x.ckpt"));
  EXPECT_TRUE(fs::exists(fs::path(dir) / "metrics.jsonl"));
  EXPECT_TRUE(list_checkpoints(dir + "/absent").empty());
  fs::remove_all(dir);
}

// ---------------------------------------------------------------------------
// Training state
// ---------------------------------------------------------------------------

namespace {

/// Linear -> dropout -> linear, plus a step-counter buffer (as clustered
/// mechanisms keep one) that forward() advances.
struct TinyImpl : torch::nn::Module {
  explicit TinyImpl(int64_t hidden = 8) {
    a = register_module("a", torch::nn::Linear(4, hidden));
    b = register_module("b", torch::nn::Linear(hidden, 3));
    counter = register_buffer("counter", torch::zeros({1}, torch::kLong));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    counter.add_(1);
    auto h = torch::dropout(torch::relu(a->forward(x)), 0.3, is_training());
    return b->forward(h) * (1.0 + 1e-3 * counter.to(torch::kFloat));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::Tensor counter;
};
TORCH_MODULE(Tiny);

void train_steps(Tiny& model, torch::optim::Optimizer& opt, int64_t from, int64_t to) {
  for (int64_t s = from; s < to; ++s) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + s);  // data: a function of s
    auto x = torch::randn({5, 4}, gen);
    opt.zero_grad();
    auto loss = model->forward(x).pow(2).mean();
    loss.backward();
    opt.step();
  }
}

torch::optim::AdamW make_adamw(Tiny& model) {
  return torch::optim::AdamW(model->parameters(),
                             torch::optim::AdamWOptions(1e-2).weight_decay(0.1).betas({0.9, 0.95}));
}

void expect_bitwise_equal(Tiny& x, Tiny& y) {
  auto px = x->named_parameters(), py = y->named_parameters();
  for (const auto& item : px) EXPECT_TRUE(torch::equal(item.value(), py[item.key()])) << item.key();
  EXPECT_TRUE(torch::equal(x->counter, y->counter));
}

}  // namespace

TEST(TrainCheckpoint, TrainingStateResumesBitwise) {
  // Uninterrupted: 12 steps.
  torch::manual_seed(7);
  Tiny straight;
  auto opt_straight = make_adamw(straight);
  train_steps(straight, opt_straight, 0, 12);

  // Interrupted at 5: save, build a fresh model (other initial weights and
  // generator state), restore, train on.
  torch::manual_seed(7);
  Tiny first;
  auto opt_first = make_adamw(first);
  train_steps(first, opt_first, 0, 5);
  std::string tensors;
  const auto payload = save_training_state(*first, &opt_first, &tensors);

  torch::manual_seed(12345);
  Tiny resumed;
  auto opt_resumed = make_adamw(resumed);
  torch::randn({100});  // move the generator on
  load_training_state(payload, tensors, *resumed, &opt_resumed, /*restore_generator=*/true, "t");
  train_steps(resumed, opt_resumed, 5, 12);
  expect_bitwise_equal(straight, resumed);

  // Without the generator state dropout draws differently: the test can fail.
  torch::manual_seed(999);
  Tiny no_rng;
  auto opt_no_rng = make_adamw(no_rng);
  load_training_state(payload, tensors, *no_rng, &opt_no_rng, /*restore_generator=*/false, "t");
  train_steps(no_rng, opt_no_rng, 5, 12);
  EXPECT_FALSE(torch::equal(no_rng->a->weight, straight->a->weight));

  // Without the optimiser state the moments restart: different weights too.
  torch::manual_seed(7);
  Tiny no_opt;
  load_training_state(payload, tensors, *no_opt, nullptr, /*restore_generator=*/true, "t");
  auto opt_fresh = make_adamw(no_opt);
  train_steps(no_opt, opt_fresh, 5, 12);
  EXPECT_FALSE(torch::equal(no_opt->a->weight, straight->a->weight));
}

TEST(TrainCheckpoint, MismatchedModelIsRefusedAndUntouched) {
  torch::manual_seed(1);
  Tiny source(8);
  std::string tensors;
  const auto payload = save_training_state(*source, nullptr, &tensors);
  Tiny other(16);
  const auto before = other->a->weight.clone();
  try {
    load_training_state(payload, tensors, *other, nullptr, true, "run/checkpoint-00000003.ckpt");
    ADD_FAILURE() << "a model of another width was loaded";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("run/checkpoint-00000003.ckpt"), std::string::npos) << msg;
    EXPECT_NE(msg.find("a.weight"), std::string::npos) << msg;
  }
  EXPECT_TRUE(torch::equal(before, other->a->weight));
  // A payload that is not an archive.
  Tiny same(8);
  EXPECT_THROW(load_training_state("garbage", tensors, *same, nullptr, true, "t"), std::runtime_error);
}

// Found by fuzz/files_fuzz.cpp: a payload whose TorchScript code section is
// damaged (behind a valid CRC, i.e. a crafted file) made libtorch's loader
// throw torch::jit::ErrorReport, which is not a c10::Error, past the handler:
// the error named no file. Now every libtorch failure is a refusal naming it.
TEST(TrainCheckpoint, DamagedCodeInThePayloadIsRefusedNamingTheFile) {
  torch::manual_seed(1);
  Tiny source(8);
  auto opt = make_adamw(source);
  std::string tensors;
  std::string payload = save_training_state(*source, &opt, &tensors);
  // The archive stores its module code as plain text: damage the first class
  // declaration (same length, so the zip directory stays consistent).
  const auto at = payload.find("class Module(Module");
  ASSERT_NE(at, std::string::npos) << "no code section found in the payload";
  payload.replace(at + 19, 4, "\xd7\xc5\xf5\xdf");
  Tiny target(8);
  auto opt_target = make_adamw(target);
  try {
    load_training_state(payload, tensors, *target, &opt_target, true, "run/checkpoint-00000007.ckpt");
    ADD_FAILURE() << "a payload with damaged code was loaded";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("run/checkpoint-00000007.ckpt"), std::string::npos) << msg;
    EXPECT_NE(msg.find("not a readable torch archive"), std::string::npos) << msg;
  }
}

}  // namespace checkpoint_test
