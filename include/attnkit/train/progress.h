// What a training run shows and records: a live progress line on a terminal
// (or one plain line per log interval otherwise) and RUN/metrics.jsonl.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace attnkit::train {

/// "45s", "3m05s", "2h07m"; "?" for a negative or non-finite value.
std::string format_duration(double seconds);

/// One progress report.
struct ProgressLine {
  int64_t step = 0, total = 0;
  double loss = 0;              ///< nats per scored position (training, this interval)
  std::string metric_name;      ///< "bpc" or "accuracy"
  double metric = 0;
  double lr = 0;
  double tokens_per_s = 0;
  double eta_seconds = -1;      ///< < 0: unknown
};

/// "step 120/1000  loss 1.6021  bpc 2.3113  lr 3.00e-04  12.3k tok/s  ETA 1m23s",
/// with a 20-character bar "[#####...............]" in front when `bar` is set.
std::string format_progress(const ProgressLine& line, bool bar);

/// Prints progress to a stream. Live (a terminal): one line redrawn in place
/// ("\r" + line + erase to end of line), at most 10 times a second unless
/// forced; messages clear it first. Plain: only forced lines, one per line.
class ProgressPrinter {
 public:
  ProgressPrinter(std::FILE* out, bool live);
  ~ProgressPrinter();
  bool live() const { return live_; }
  /// Live: redraw (throttled unless `force`). Plain: print when `force`.
  void show(const ProgressLine& line, bool force);
  /// A message on a line of its own (a live line is cleared and redrawn after).
  void message(const std::string& text);
  /// Ends a live line with a newline.
  void finish();

 private:
  std::FILE* out_;
  bool live_;
  bool drawn_ = false;
  double last_draw_ = -1;
  std::string last_line_;
};

/// Appends one JSON object per line to a file (RUN/metrics.jsonl), flushed
/// after every line.
class MetricsLog {
 public:
  explicit MetricsLog(const std::string& path);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void append(const std::string& json_object);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

/// Keeps the lines of the JSON-lines file at `path` whose "step" is <= `step`
/// (a resumed run repeats the steps after its checkpoint), rewriting the file
/// atomically when anything is dropped. Returns the number of lines dropped;
/// an absent file drops none. Lines that are not JSON objects with a "step"
/// (e.g. torn by a crash) are dropped.
int64_t trim_metrics(const std::string& path, int64_t step);

}  // namespace attnkit::train
