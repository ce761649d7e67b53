// char-lm: the next-character task over the splits of a prepared directory
// (corpus.cpp), and masked-char, its masked counterpart.
#include <attnkit/tasks/char_lm.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>

#include "base/random.h"
#include "tasks/corpus.h"

namespace fs = std::filesystem;

namespace attnkit::tasks {

// ---------------------------------------------------------------------------
// The task
// ---------------------------------------------------------------------------

namespace {

// Stream of kernels::random for the char-lm training windows.
constexpr uint64_t kCharLmTrainStream = 0x636861726c6d; // "charlm"
// Streams of the masked-char windows and masks, and the fixed seed of its
// evaluation masks.
constexpr uint64_t kMaskedCharTrainStream = 0x6d63686172; // "mchar"
constexpr uint64_t kMaskedCharEvalStream = 0x6d63686576;  // "mchev"
constexpr uint64_t kMaskedCharEvalSeed = 2018;

torch::Tensor load_split(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "task char-lm: cannot open '", path.string(),
              "'; make the data with `attnkit data char-lm --input FILE... --out DIR`");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TORCH_CHECK(!text.empty(), "task char-lm: '", path.string(), "' is empty");
  auto ids = torch::empty({static_cast<int64_t>(text.size())}, torch::kUInt8);
  auto* out = ids.data_ptr<uint8_t>();
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == ' ') {
      out[i] = 0;
    } else {
      TORCH_CHECK(c >= 'a' && c <= 'z', "task char-lm: '", path.string(), "' has byte ",
                  static_cast<int>(static_cast<unsigned char>(c)), " at offset ", i,
                  ", outside the text8 alphabet (a-z and space); re-create it with "
                  "`attnkit data char-lm`");
      out[i] = static_cast<uint8_t>(c - 'a' + 1);
    }
  }
  return ids;
}

}  // namespace

CharLm::CharLm(const std::string& data_dir) {
  for (int s = 0; s < 3; ++s) ids_[s] = load_split(fs::path(data_dir) / kSplitFiles[s]);
}

const torch::Tensor& CharLm::split_ids(Split split) const { return ids_[static_cast<int>(split)]; }

Batch CharLm::train_batch(uint64_t seed, int64_t step, int64_t batch, int64_t context) const {
  const auto& ids = ids_[0];
  TORCH_CHECK(step >= 0, "char-lm train_batch: step must be >= 0, got ", step);
  TORCH_CHECK(batch >= 1, "char-lm train_batch: batch must be >= 1, got ", batch);
  TORCH_CHECK(context >= 1, "char-lm train_batch: context must be >= 1, got ", context);
  TORCH_CHECK(ids.numel() >= context + 1, "char-lm train_batch: context ", context,
              " needs windows of ", context + 1, " characters but train.txt has ", ids.numel());
  auto generator = at::detail::createCPUGenerator(
      kernels::random::bits(seed, kCharLmTrainStream, static_cast<uint64_t>(step)));
  auto offsets = torch::randint(0, ids.numel() - context, {batch, 1}, generator,
                                torch::TensorOptions().dtype(torch::kInt64));
  auto windows = torch::take(ids, offsets + torch::arange(context + 1, torch::kInt64)).to(torch::kInt64);
  Batch out;
  out.input = windows.slice(1, 0, context).contiguous();
  out.target = windows.slice(1, 1, context + 1).contiguous();
  out.weight = torch::ones({batch, context}, torch::kFloat32);
  return out;
}

std::vector<Batch> CharLm::eval_batches(Split split, int64_t batch, int64_t context) const {
  TORCH_CHECK(batch >= 1, "char-lm eval_batches: batch must be >= 1, got ", batch);
  TORCH_CHECK(context >= 1, "char-lm eval_batches: context must be >= 1, got ", context);
  const auto& ids = split_ids(split);
  const int64_t n = ids.numel();
  const int64_t windows = (n + context - 1) / context;
  // Targets: the split, padded. Inputs: the split shifted right by one behind a space.
  auto target = torch::zeros({windows * context}, torch::kInt64);
  auto input = torch::zeros({windows * context}, torch::kInt64);
  auto weight = torch::zeros({windows * context}, torch::kFloat32);
  target.slice(0, 0, n).copy_(ids);
  input.slice(0, 1, n).copy_(ids.slice(0, 0, n - 1));
  weight.slice(0, 0, n).fill_(1);
  target = target.view({windows, context});
  input = input.view({windows, context});
  weight = weight.view({windows, context});
  std::vector<Batch> out;
  for (int64_t first = 0; first < windows; first += batch) {
    const auto last = std::min(windows, first + batch);
    out.push_back({input.slice(0, first, last), target.slice(0, first, last),
                   weight.slice(0, first, last)});
  }
  return out;
}

torch::Tensor CharLm::encode(const std::string& text) const {
  // The normaliser trims a trailing separator, but in a prompt ("the ") it
  // says what comes next: an ASCII character other than a letter or digit at
  // the end (digits are spelled out as words) is kept as one space.
  auto normal = normalize_text(text);
  const unsigned char last = text.empty() ? 'a' : static_cast<unsigned char>(text.back());
  if (!normal.empty() && last < 0x80 && !std::isalnum(last)) normal += ' ';
  auto ids = torch::empty({static_cast<int64_t>(normal.size())}, torch::kInt64);
  auto* out = ids.data_ptr<int64_t>();
  for (size_t i = 0; i < normal.size(); ++i) out[i] = normal[i] == ' ' ? 0 : normal[i] - 'a' + 1;
  return ids;
}

std::string CharLm::decode(const torch::Tensor& tokens) const {
  TORCH_CHECK(tokens.defined() && !tokens.is_floating_point() && !tokens.is_complex(),
              "char-lm decode: tokens must be an integer tensor");
  auto flat = tokens.to(torch::kCPU, torch::kInt64).contiguous().view(-1);
  const auto* ids = flat.data_ptr<int64_t>();
  std::string text(static_cast<size_t>(flat.numel()), ' ');
  for (int64_t i = 0; i < flat.numel(); ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < 27, "char-lm decode: token ", i, " is ", ids[i],
                ", outside [0, 27)");
    if (ids[i] > 0) text[static_cast<size_t>(i)] = static_cast<char>('a' + ids[i] - 1);
  }
  return text;
}

// ---------------------------------------------------------------------------
// masked-char
// ---------------------------------------------------------------------------

namespace {

// Masks the first `real` positions' rows of `windows` (int64 (n, context)):
// per row, masked_per_window(real[r]) positions among the first real[r],
// chosen as the smallest of uniform keys (so uniformly, without replacement).
Batch mask_windows(const torch::Tensor& windows, const std::vector<int64_t>& real,
                   at::Generator& generator) {
  const int64_t rows = windows.size(0), context = windows.size(1);
  auto keys = torch::rand({rows, context}, generator, torch::kFloat64);
  auto* key = keys.data_ptr<double>();
  Batch out;
  out.target = windows;
  out.input = windows.clone();
  out.weight = torch::zeros({rows, context}, torch::kFloat32);
  auto* input = out.input.data_ptr<int64_t>();
  auto* weight = out.weight.data_ptr<float>();
  std::vector<int64_t> order(static_cast<size_t>(context));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = real[static_cast<size_t>(r)];
    const double* row_key = key + r * context;
    order.resize(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), int64_t{0});
    const auto m = MaskedCharLm::masked_per_window(n);
    std::partial_sort(order.begin(), order.begin() + m, order.end(),
                      [&](int64_t a, int64_t b) { return row_key[a] < row_key[b]; });
    for (int64_t i = 0; i < m; ++i) {
      input[r * context + order[static_cast<size_t>(i)]] = MaskedCharLm::kMask;
      weight[r * context + order[static_cast<size_t>(i)]] = 1;
    }
  }
  return out;
}

}  // namespace

int64_t MaskedCharLm::masked_per_window(int64_t n) {
  return std::max<int64_t>(1, std::llround(0.15 * static_cast<double>(n)));
}

Batch MaskedCharLm::train_batch(uint64_t seed, int64_t step, int64_t batch, int64_t context) const {
  const auto& ids = split_ids(Split::train);
  TORCH_CHECK(step >= 0, "masked-char train_batch: step must be >= 0, got ", step);
  TORCH_CHECK(batch >= 1, "masked-char train_batch: batch must be >= 1, got ", batch);
  TORCH_CHECK(context >= 1, "masked-char train_batch: context must be >= 1, got ", context);
  TORCH_CHECK(ids.numel() >= context, "masked-char train_batch: context ", context,
              " needs windows of ", context, " characters but train.txt has ", ids.numel());
  auto generator = at::detail::createCPUGenerator(
      kernels::random::bits(seed, kMaskedCharTrainStream, static_cast<uint64_t>(step)));
  auto offsets = torch::randint(0, ids.numel() - context + 1, {batch, 1}, generator,
                                torch::TensorOptions().dtype(torch::kInt64));
  auto windows = torch::take(ids, offsets + torch::arange(context, torch::kInt64)).to(torch::kInt64);
  return mask_windows(windows.contiguous(), std::vector<int64_t>(static_cast<size_t>(batch), context),
                      generator);
}

std::vector<Batch> MaskedCharLm::eval_batches(Split split, int64_t batch, int64_t context) const {
  TORCH_CHECK(batch >= 1, "masked-char eval_batches: batch must be >= 1, got ", batch);
  TORCH_CHECK(context >= 1, "masked-char eval_batches: context must be >= 1, got ", context);
  const auto& ids = split_ids(split);
  const int64_t n = ids.numel();
  const int64_t windows = (n + context - 1) / context;
  auto all = torch::zeros({windows * context}, torch::kInt64);
  all.slice(0, 0, n).copy_(ids);
  all = all.view({windows, context});
  std::vector<int64_t> real(static_cast<size_t>(windows), context);
  real.back() = n - (windows - 1) * context;
  auto generator = at::detail::createCPUGenerator(kernels::random::bits(
      kMaskedCharEvalSeed, kMaskedCharEvalStream, static_cast<uint64_t>(split)));
  const auto masked = mask_windows(all, real, generator);
  std::vector<Batch> out;
  for (int64_t first = 0; first < windows; first += batch) {
    const auto last = std::min(windows, first + batch);
    out.push_back({masked.input.slice(0, first, last), masked.target.slice(0, first, last),
                   masked.weight.slice(0, first, last)});
  }
  return out;
}

std::string MaskedCharLm::decode(const torch::Tensor& tokens) const {
  TORCH_CHECK(tokens.defined() && !tokens.is_floating_point() && !tokens.is_complex(),
              "masked-char decode: tokens must be an integer tensor");
  auto flat = tokens.to(torch::kCPU, torch::kInt64).contiguous().view(-1);
  const auto* ids = flat.data_ptr<int64_t>();
  std::string text(static_cast<size_t>(flat.numel()), ' ');
  for (int64_t i = 0; i < flat.numel(); ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] <= kMask, "masked-char decode: token ", i, " is ", ids[i],
                ", outside [0, ", kMask + 1, ")");
    if (ids[i] == kMask) {
      text[static_cast<size_t>(i)] = '_';
    } else if (ids[i] > 0) {
      text[static_cast<size_t>(i)] = static_cast<char>('a' + ids[i] - 1);
    }
  }
  return text;
}

}  // namespace attnkit::tasks
