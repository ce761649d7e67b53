// Progress line, metrics.jsonl.
#include <attnkit/train/checkpoint.h>
#include <attnkit/train/clock.h>
#include <attnkit/train/progress.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace attnkit::train {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(std::llround(seconds));
  char text[48];
  if (s < 60)
    std::snprintf(text, sizeof(text), "%llds", static_cast<long long>(s));
  else if (s < 3600)
    std::snprintf(text, sizeof(text), "%lldm%02llds", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  else
    std::snprintf(text, sizeof(text), "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>((s % 3600) / 60));
  return text;
}

namespace {

std::string format_rate(double tokens_per_s) {
  char text[32];
  if (tokens_per_s >= 1e6)
    std::snprintf(text, sizeof(text), "%.2fM", tokens_per_s / 1e6);
  else if (tokens_per_s >= 1e3)
    std::snprintf(text, sizeof(text), "%.1fk", tokens_per_s / 1e3);
  else
    std::snprintf(text, sizeof(text), "%.0f", tokens_per_s);
  return text;
}

}  // namespace

std::string format_progress(const ProgressLine& line, bool bar) {
  std::ostringstream s;
  if (bar) {
    constexpr int kWidth = 20;
    const double fraction =
        line.total > 0 ? std::min(1.0, static_cast<double>(line.step) / static_cast<double>(line.total)) : 0.0;
    const int filled = static_cast<int>(fraction * kWidth);
    s << '[' << std::string(filled, '#') << std::string(kWidth - filled, '.') << "] ";
  }
  char numbers[160];
  std::snprintf(numbers, sizeof(numbers), "step %lld/%lld  loss %.4f  %s %.4f  lr %.2e  %s tok/s",
                static_cast<long long>(line.step), static_cast<long long>(line.total), line.loss,
                line.metric_name.c_str(), line.metric, line.lr,
                format_rate(line.tokens_per_s).c_str());
  s << numbers << "  ETA " << format_duration(line.eta_seconds);
  return s.str();
}

ProgressPrinter::ProgressPrinter(std::FILE* out, bool live) : out_(out), live_(live) {}

ProgressPrinter::~ProgressPrinter() { finish(); }

void ProgressPrinter::show(const ProgressLine& line, bool force) {
  if (!live_) {
    if (force) {
      std::fprintf(out_, "%s\n", format_progress(line, false).c_str());
      std::fflush(out_);
    }
    return;
  }
  const double now = steady_seconds();
  if (!force && drawn_ && now - last_draw_ < 0.1) return;
  last_line_ = format_progress(line, true);
  std::fprintf(out_, "\r%s\x1b[K", last_line_.c_str());
  std::fflush(out_);
  drawn_ = true;
  last_draw_ = now;
}

void ProgressPrinter::message(const std::string& text) {
  if (live_ && drawn_) {
    std::fprintf(out_, "\r\x1b[K%s\n%s", text.c_str(), last_line_.c_str());
  } else {
    std::fprintf(out_, "%s\n", text.c_str());
  }
  std::fflush(out_);
}

void ProgressPrinter::finish() {
  if (live_ && drawn_) {
    std::fprintf(out_, "\n");
    std::fflush(out_);
  }
  drawn_ = false;
}

MetricsLog::MetricsLog(const std::string& path) : path_(path) {
  file_ = std::fopen(path.c_str(), "a");
  if (file_ == nullptr)
    throw std::runtime_error("cannot open '" + path + "' for appending: " + std::strerror(errno));
}

MetricsLog::~MetricsLog() {
  if (file_ != nullptr) std::fclose(file_);
}

void MetricsLog::append(const std::string& json_object) {
  if (std::fprintf(file_, "%s\n", json_object.c_str()) < 0 || std::fflush(file_) != 0)
    throw std::runtime_error("cannot append to '" + path_ + "': " + std::strerror(errno));
}

int64_t trim_metrics(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return 0;
  std::string line, kept;
  int64_t dropped = 0;
  while (std::getline(in, line)) {
    bool keep = false;
    try {
      const auto j = nlohmann::json::parse(line);
      keep = j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
             j["step"].get<int64_t>() <= step;
    } catch (const nlohmann::json::exception&) {
      keep = false;
    }
    if (keep)
      kept += line + "\n";
    else
      ++dropped;
  }
  if (dropped > 0) write_file_atomically(path, kept);
  return dropped;
}

}  // namespace attnkit::train
