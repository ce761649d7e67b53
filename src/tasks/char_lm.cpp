// char-lm: text normalisation to the text8 alphabet, the data preparation
// behind `attnkit data char-lm`, and the next-character task over its splits.
#include <attnkit/runtime.h>
#include <attnkit/tasks/char_lm.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>
#include <sstream>

#include "base/durable_file.h"
#include "base/random.h"

namespace fs = std::filesystem;

namespace attnkit::tasks {

NormalizeCounts& NormalizeCounts::operator+=(const NormalizeCounts& other) {
  kept += other.kept;
  mapped += other.mapped;
  dropped += other.dropped;
  non_ascii_dropped += other.non_ascii_dropped;
  latin1_bytes += other.latin1_bytes;
  output += other.output;
  return *this;
}

namespace {

// The letters of U+00C0..U+00FF (nullptr: not a letter, dropped).
const char* const kLatin1Letters[64] = {
    "a", "a", "a", "a", "a", "a", "ae", "c",     // À Á Â Ã Ä Å Æ Ç
    "e", "e", "e", "e", "i", "i", "i", "i",      // È É Ê Ë Ì Í Î Ï
    "d", "n", "o", "o", "o", "o", "o", nullptr,  // Ð Ñ Ò Ó Ô Õ Ö ×
    "o", "u", "u", "u", "u", "y", "th", "ss",    // Ø Ù Ú Û Ü Ý Þ ß
    "a", "a", "a", "a", "a", "a", "ae", "c",     // à á â ã ä å æ ç
    "e", "e", "e", "e", "i", "i", "i", "i",      // è é ê ë ì í î ï
    "d", "n", "o", "o", "o", "o", "o", nullptr,  // ð ñ ò ó ô õ ö ÷
    "o", "u", "u", "u", "u", "y", "th", "y",     // ø ù ú û ü ý þ ÿ
};

const char* const kDigitWords[10] = {"zero", "one", "two",   "three", "four",
                                     "five", "six", "seven", "eight", "nine"};

// Letters for a character that normalisation maps (not a-z itself), or nullptr.
const char* folded(uint32_t code) {
  if (code >= 0xC0 && code <= 0xFF) return kLatin1Letters[code - 0xC0];
  switch (code) {
    case 0x152: case 0x153: return "oe";  // Œ œ
    case 0x160: case 0x161: return "s";   // Š š
    case 0x17D: case 0x17E: return "z";   // Ž ž
    case 0x178: return "y";               // Ÿ
    default: return nullptr;
  }
}

// Bytes of the UTF-8 sequence a lead byte starts (0: not a lead byte).
int sequence_length(unsigned char lead) {
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

// Whether `byte` may follow the bytes so far (lead, then size - 1 continuation
// bytes): rejects overlong forms, surrogates and code points above U+10FFFF.
bool continues(const unsigned char* so_far, int size, unsigned char byte) {
  if (byte < 0x80 || byte > 0xBF) return false;
  if (size != 1) return true;
  switch (so_far[0]) {
    case 0xE0: return byte >= 0xA0;
    case 0xED: return byte <= 0x9F;
    case 0xF0: return byte >= 0x90;
    case 0xF4: return byte <= 0x8F;
    default: return true;
  }
}

uint32_t decode_utf8(const unsigned char* bytes, int size) {
  if (size == 2) return (bytes[0] & 0x1Fu) << 6 | (bytes[1] & 0x3Fu);
  if (size == 3) return (bytes[0] & 0x0Fu) << 12 | (bytes[1] & 0x3Fu) << 6 | (bytes[2] & 0x3Fu);
  return (bytes[0] & 0x07u) << 18 | (bytes[1] & 0x3Fu) << 12 | (bytes[2] & 0x3Fu) << 6 |
         (bytes[3] & 0x3Fu);
}

constexpr size_t kFlushBytes = 1 << 16;

}  // namespace

TextNormalizer::TextNormalizer(Sink sink) : sink_(std::move(sink)) {}

void TextNormalizer::letters(const char* text) {
  if (space_pending_ && counts_.output > 0) {
    buffer_.push_back(' ');
    ++counts_.output;
  }
  space_pending_ = false;
  for (; *text; ++text) {
    buffer_.push_back(*text);
    ++counts_.output;
  }
  if (buffer_.size() >= kFlushBytes) flush();
}

void TextNormalizer::character(uint32_t code) {
  if (code >= 'a' && code <= 'z') {
    ++counts_.kept;
    const char letter[2] = {static_cast<char>(code), 0};
    letters(letter);
  } else if (code >= 'A' && code <= 'Z') {
    ++counts_.mapped;
    const char letter[2] = {static_cast<char>(code - 'A' + 'a'), 0};
    letters(letter);
  } else if (code >= '0' && code <= '9') {
    ++counts_.mapped;
    space_pending_ = true;  // a digit is a word of its own
    letters(kDigitWords[code - '0']);
    space_pending_ = true;
  } else if (const char* base = folded(code)) {
    ++counts_.mapped;
    letters(base);
  } else {
    ++counts_.dropped;
    if (code >= 0x80) ++counts_.non_ascii_dropped;
    space_pending_ = true;
  }
}

void TextNormalizer::feed(const char* data, size_t size) {
  for (size_t i = 0; i < size; ++i) {
    const auto byte = static_cast<unsigned char>(data[i]);
    if (pending_size_ > 0) {
      if (continues(pending_, pending_size_, byte)) {
        pending_[pending_size_++] = byte;
        if (pending_size_ == sequence_length(pending_[0])) {
          character(decode_utf8(pending_, pending_size_));
          pending_size_ = 0;
        }
        continue;
      }
      // Not UTF-8 after all: the bytes so far are Latin-1; `byte` starts afresh.
      for (int j = 0; j < pending_size_; ++j) {
        ++counts_.latin1_bytes;
        character(pending_[j]);
      }
      pending_size_ = 0;
    }
    if (byte < 0x80) {
      character(byte);
    } else if (sequence_length(byte) > 0) {
      pending_[0] = byte;
      pending_size_ = 1;
    } else {
      ++counts_.latin1_bytes;
      character(byte);
    }
  }
}

void TextNormalizer::end_document() {
  for (int j = 0; j < pending_size_; ++j) {
    ++counts_.latin1_bytes;
    character(pending_[j]);
  }
  pending_size_ = 0;
  space_pending_ = true;
}

void TextNormalizer::finish() {
  end_document();
  flush();
}

void TextNormalizer::flush() {
  if (!buffer_.empty()) sink_(buffer_.data(), buffer_.size());
  buffer_.clear();
}

std::string normalize_text(const std::string& text, NormalizeCounts* counts) {
  std::string out;
  TextNormalizer normalizer([&](const char* data, size_t size) { out.append(data, size); });
  normalizer.feed(text.data(), text.size());
  normalizer.finish();
  if (counts) *counts = normalizer.counts();
  return out;
}

// ---------------------------------------------------------------------------
// prepare_char_lm
// ---------------------------------------------------------------------------

namespace {

const char* const kSplitFiles[3] = {"train.txt", "valid.txt", "test.txt"};

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(c));
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// Streams every input through `normalizer`, in order, in 1 MiB reads.
void normalize_files(const std::vector<std::string>& inputs, TextNormalizer& normalizer) {
  std::vector<char> chunk(1 << 20);
  for (const auto& path : inputs) {
    std::ifstream in(path, std::ios::binary);
    TORCH_CHECK(in, "data char-lm: cannot open input '", path, "'");
    while (in) {
      in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
      normalizer.feed(chunk.data(), static_cast<size_t>(in.gcount()));
    }
    TORCH_CHECK(in.eof(), "data char-lm: reading input '", path, "' failed");
    normalizer.end_document();
  }
  normalizer.finish();
}

}  // namespace

CharLmReport prepare_char_lm(const std::vector<std::string>& inputs, const std::string& out_dir,
                             bool force) {
  TORCH_CHECK(!inputs.empty(), "data char-lm: no input files (--input FILE...)");
  TORCH_CHECK(!out_dir.empty(), "data char-lm: no output directory (--out DIR)");
  CharLmReport report;
  report.inputs = inputs;
  report.out_dir = out_dir;
  for (const auto& path : inputs) {
    std::error_code error;
    TORCH_CHECK(fs::is_regular_file(path, error), "data char-lm: input '", path,
                "' does not exist or is not a file");
    const auto bytes = fs::file_size(path, error);
    TORCH_CHECK(!error, "data char-lm: cannot read the size of input '", path, "': ",
                error.message());
    TORCH_CHECK(bytes > 0, "data char-lm: input '", path, "' is empty");
    report.input_bytes += static_cast<int64_t>(bytes);
  }
  const fs::path dir(out_dir);
  if (fs::exists(dir)) {
    TORCH_CHECK(fs::is_directory(dir), "data char-lm: output '", out_dir,
                "' exists and is not a directory");
    for (const char* name : {"train.txt", "valid.txt", "test.txt", "meta.json"}) {
      TORCH_CHECK(force || !fs::exists(dir / name), "data char-lm: '", (dir / name).string(),
                  "' exists; pass --force to overwrite the data in '", out_dir, "'");
    }
  }

  // Pass 1: how long is the text?
  TextNormalizer counter([](const char*, size_t) {});
  normalize_files(inputs, counter);
  const int64_t n = counter.counts().output;
  TORCH_CHECK(n > 0, "data char-lm: the inputs hold no letters or digits (", report.input_bytes,
              " bytes)");
  const int64_t cuts[4] = {0, n * 9 / 10, n * 19 / 20, n};
  TORCH_CHECK(cuts[1] > 0 && cuts[2] > cuts[1] && cuts[3] > cuts[2], "data char-lm: the text is ",
              n, " characters after normalisation, too short for three non-empty splits (90/5/5); "
              "give at least 20");

  // Pass 2: write the splits.
  fs::create_directories(dir);
  // The splits and meta.json replace a previous preparation together, and
  // durably (base/durable_file.h); nothing is replaced if anything fails.
  attnkit::base::DurableFiles files;
  std::size_t streams[3];
  for (int s = 0; s < 3; ++s) streams[s] = files.open((dir / kSplitFiles[s]).string());
  int64_t position = 0;
  int split = 0;
  TextNormalizer writer([&](const char* data, size_t size) {
    while (size > 0) {
      while (split < 3 && position == cuts[split + 1]) ++split;
      TORCH_CHECK(split < 3, "data char-lm: the inputs grew while being read");
      const auto take = std::min<int64_t>(static_cast<int64_t>(size), cuts[split + 1] - position);
      files.write(streams[split], std::string_view(data, static_cast<size_t>(take)));
      data += take;
      size -= static_cast<size_t>(take);
      position += take;
    }
  });
  normalize_files(inputs, writer);
  TORCH_CHECK(position == n, "data char-lm: the inputs changed while being read (", n,
              " characters, then ", position, ")");
  report.counts = writer.counts();
  report.train = cuts[1];
  report.valid = cuts[2] - cuts[1];
  report.test = cuts[3] - cuts[2];

  std::ostringstream meta;
  const auto& c = report.counts;
  meta << "{\n  \"format\": \"text8: lowercase a-z and single spaces\",\n"
       << "  \"alphabet\": \" abcdefghijklmnopqrstuvwxyz\",\n"
       << "  \"attnkit_version\": " << json_string(attnkit::version()) << ",\n"
       << "  \"sources\": [";
  for (size_t i = 0; i < inputs.size(); ++i) {
    meta << (i ? ", " : "") << "{\"path\": " << json_string(inputs[i])
         << ", \"bytes\": " << fs::file_size(inputs[i]) << "}";
  }
  meta << "],\n  \"input_bytes\": " << report.input_bytes << ",\n"
       << "  \"characters\": " << n << ",\n  \"splits\": {";
  const int64_t sizes[3] = {report.train, report.valid, report.test};
  const char* names[3] = {"train", "valid", "test"};
  for (int s = 0; s < 3; ++s) {
    meta << (s ? ", " : "") << "\"" << names[s] << "\": {\"file\": \"" << kSplitFiles[s]
         << "\", \"offset\": " << cuts[s] << ", \"characters\": " << sizes[s] << "}";
  }
  meta << "},\n  \"mapping\": {\"kept\": " << c.kept << ", \"mapped\": " << c.mapped
       << ", \"dropped\": " << c.dropped << ", \"non_ascii_dropped\": " << c.non_ascii_dropped
       << ", \"latin1_bytes\": " << c.latin1_bytes << "}\n}\n";
  files.write(files.open((dir / "meta.json").string()), meta.str());
  files.commit();
  return report;
}

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
