// The masked copy task (clustered-attention paper, appendix C.2).
#include <attnkit/tasks/copy.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "base/random.h"

namespace attnkit::tasks {

namespace {

// Streams of kernels::random: training batches, and the fixed seed of each
// split's evaluation set.
constexpr uint64_t kCopyTrainStream = 0x636f70797472;  // "copytr"
constexpr uint64_t kCopyEvalStream = 0x636f70796576;   // "copyev"
constexpr uint64_t kCopyEvalSeed = 2020;

constexpr int64_t kMaxLength = int64_t{1} << 20;

}  // namespace

int64_t CopyTask::masked_per_half(int64_t length) {
  return std::max<int64_t>(1, std::llround(0.2 * static_cast<double>(length)));
}

CopyTask::CopyTask(int64_t length) : length_(length) {
  TORCH_CHECK(length >= 2 && length <= kMaxLength, "task copy: length (symbols per half, "
              "--copy-length) must be in [2, ", kMaxLength, "] so that the halves can mask different "
              "positions, got ", length);
}

Batch CopyTask::generate(uint64_t generator_seed, int64_t count) const {
  auto generator = at::detail::createCPUGenerator(generator_seed);
  const auto masked = masked_per_half(length_);
  auto symbols = torch::randint(1, kSymbols + 1, {count, length_}, generator,
                                torch::TensorOptions().dtype(torch::kInt64));
  // First half: `masked` positions uniformly without replacement (the smallest
  // of `length` uniform keys); second half: as many among the others.
  auto keys = torch::rand({count, length_}, generator, torch::kFloat64);
  auto first = torch::zeros({count, length_}, torch::kBool)
                   .scatter_(1, keys.argsort(/*dim=*/1, /*descending=*/false).slice(1, 0, masked), true);
  keys = torch::rand({count, length_}, generator, torch::kFloat64).masked_fill(first, 2.0);
  auto second = torch::zeros({count, length_}, torch::kBool)
                    .scatter_(1, keys.argsort(/*dim=*/1, /*descending=*/false).slice(1, 0, masked), true);

  auto sep = torch::full({count, 1}, kSep, torch::kInt64);
  auto unmasked = torch::zeros({count, 1}, torch::kBool);
  auto mask = torch::cat({unmasked, first, unmasked, second}, 1);
  Batch out;
  out.target = torch::cat({sep, symbols, sep, symbols}, 1);
  out.input = out.target.masked_fill(mask, kMask);
  out.weight = mask.to(torch::kFloat32);
  return out;
}

Batch CopyTask::train_batch(uint64_t seed, int64_t step, int64_t batch, int64_t context) const {
  TORCH_CHECK(step >= 0, "copy train_batch: step must be >= 0, got ", step);
  TORCH_CHECK(batch >= 1, "copy train_batch: batch must be >= 1, got ", batch);
  return generate(kernels::random::bits(seed, kCopyTrainStream, static_cast<uint64_t>(step)),
                  batch);
}

std::vector<Batch> CopyTask::eval_batches(Split split, int64_t batch, int64_t context) const {
  TORCH_CHECK(batch >= 1, "copy eval_batches: batch must be >= 1, got ", batch);
  const auto all = generate(
      kernels::random::bits(kCopyEvalSeed, kCopyEvalStream, static_cast<uint64_t>(split)),
      kEvalSequences);
  std::vector<Batch> out;
  for (int64_t first = 0; first < kEvalSequences; first += batch) {
    const auto last = std::min(kEvalSequences, first + batch);
    out.push_back({all.input.slice(0, first, last), all.target.slice(0, first, last),
                   all.weight.slice(0, first, last)});
  }
  return out;
}

std::vector<int64_t> CopyTask::partners(int64_t context) const {
  std::vector<int64_t> partner(sequence_length(context), -1);
  for (int64_t i = 1; i <= length_; ++i) {
    partner[i] = i + length_ + 1;
    partner[i + length_ + 1] = i;
  }
  return partner;
}

}  // namespace attnkit::tasks
