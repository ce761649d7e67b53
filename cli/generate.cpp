// `attnkit generate`: samples a continuation of a prompt from a trained run
// (Transformer::generate with incremental decoding) and prints the text.
#include <attnkit/runtime.h>
#include <attnkit/train/trainer.h>

#include <ATen/Parallel.h>

#include <iostream>
#include <memory>

#include "commands.h"

namespace attnkit::cli {

namespace {

struct GenerateFlags {
  std::string run, prompt;
  int64_t tokens = 200, top_k = 0;
  double temperature = 1.0;
  uint64_t seed = 0;
  int threads = 0;
};

}  // namespace

void add_generate_command(CLI::App& app) {
  auto f = std::make_shared<GenerateFlags>();
  auto* cmd = app.add_subcommand("generate", "Continue a prompt with a trained language model (its newest checkpoint)");
  cmd->add_option("--run", f->run, "Run directory (attnkit train --out)")->required();
  cmd->add_option("--prompt", f->prompt, "Text to continue (mapped as the task maps its data)")->required();
  cmd->add_option("--tokens", f->tokens, "Tokens to generate")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--temperature", f->temperature, "Softmax temperature (0: greedy)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--top-k", f->top_k, "Sample among the k most likely tokens (0: all)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--seed", f->seed, "Sampling seed")->capture_default_str();
  cmd->add_option("--threads", f->threads, "Threads (default: all cores)")->check(CLI::NonNegativeNumber);
  cmd->callback([f] {
    if (f->threads > 0) {
      set_num_threads(f->threads);
      at::set_num_threads(f->threads);
    }
    auto run = train::load_run(f->run);
    if (run.model_options.architecture() != models::Architecture::decoder)
      throw CLI::ValidationError("--run", "'" + run.checkpoint + "' holds a model of architecture '" +
                                              models::to_string(run.model_options.architecture()) +
                                              "' (task '" + run.task->name() +
                                              "'); generate needs a decoder language model (task char-lm)");
    const auto prompt = run.task->encode(f->prompt);  // keeps a trailing separator
    if (prompt.numel() == 0)
      throw CLI::ValidationError("--prompt", "'" + f->prompt + "' has no character the model knows");
    const auto out = run.model->generate(prompt.reshape({1, -1}), models::GenerateOptions()
                                                                       .tokens(f->tokens)
                                                                       .temperature(f->temperature)
                                                                       .top_k(f->top_k)
                                                                       .seed(f->seed));
    std::cout << run.task->decode(out[0]) << "\n";
  });
}

}  // namespace attnkit::cli
