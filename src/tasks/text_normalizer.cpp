// The UTF-8 (or Latin-1) normaliser to the text8 alphabet: TextNormalizer and
// normalize_text (the rules are in include/attnkit/tasks/char_lm.h).
#include <attnkit/tasks/char_lm.h>

#include <cstdint>
#include <string>
#include <utility>

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

}  // namespace attnkit::tasks
